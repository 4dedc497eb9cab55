#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <stdexcept>

#include "cc/runtime/compression/compression.h"

namespace perseus {

int64_t TopkCount(int64_t n, double ratio) {
  return std::max<int64_t>(1, std::min<int64_t>(n, static_cast<int64_t>(std::ceil(ratio * n))));
}

namespace {

// Top-k with error feedback, one tensor: acc = gradient * prescale +
// residual; this rank sends the k entries of acc largest in magnitude
// (index, value; the value optionally float16 times the gradient scale),
// keeps everything it did not send (including float16 rounding) as the next
// residual, and sums what every rank sent into a dense output.
class Topk : public Compressor {
 public:
  explicit Topk(const CompressionContext& c) : c_(c) {}
  bool Allreduce(int stream, DataPlane& plane, StreamScratch& scratch, const Response& r,
                 std::vector<std::shared_ptr<Request>>& requests) override;

 private:
  CompressionContext c_;
};

bool Topk::Allreduce(int stream, DataPlane& plane, StreamScratch& scratch, const Response& r,
                     std::vector<std::shared_ptr<Request>>& requests) {
  Request& q = *requests[0];
  const CompressionSettings& options = *c_.settings;
  const TensorMeta& m = r.metas[0];
  const size_t n = static_cast<size_t>(NumElements(m.shape));
  const size_t k = static_cast<size_t>(TopkCount(NumElements(m.shape), options.topk_ratio));
  Residuals::State& st = c_.residuals->For(m);
  std::vector<int32_t>& idx = scratch.index;
  const float pre = static_cast<float>(m.prescale);
  const float* in = static_cast<const float*>(q.input);
  const bool half = options.topk_fp16;
  const float scale = static_cast<float>(options.gradient_scale);
  const size_t value_bytes = half ? 2 : 4;
  const size_t record = k * (4 + value_bytes);
  std::vector<char> send(record);
  {
    TimelineSpan span(*c_.timeline, 1 + stream, "top-k select", "compression");
    // The residual becomes acc in place; what is sent leaves it below.
    float* acc = st.residual.data();
    for (size_t e = 0; e < n; ++e) acc[e] = in[e] * pre + acc[e];
    // Candidates: elements at least as large as a threshold taken from an
    // evenly spaced sample, set low enough that the candidates almost
    // always hold k or more; the exact top k is then chosen among them
    // (an element below the threshold can never beat k candidates). Too
    // few candidates: retry with every element.
    float threshold = 0.0f;
    const size_t samples = std::min<size_t>(n, 16384);
    if (k < n && samples >= 256) {
      std::vector<float> sample(samples);
      for (size_t j = 0; j < samples; ++j) sample[j] = std::fabs(acc[j * (n / samples)]);
      const double want = static_cast<double>(k) / n * samples * 1.5 + 16;
      const size_t at = std::min(samples - 1, static_cast<size_t>(want));
      std::nth_element(sample.begin(), sample.begin() + static_cast<std::ptrdiff_t>(at),
                       sample.end(), std::greater<float>());
      threshold = sample[at];
    }
    for (int attempt = 0; attempt < 2; ++attempt) {
      idx.clear();
      for (size_t e = 0; e < n; ++e) {
        if (std::fabs(acc[e]) >= threshold) idx.push_back(static_cast<int32_t>(e));
      }
      if (idx.size() >= k) break;
      threshold = 0.0f;  // |x| >= 0 holds for every element but NaN
    }
    if (idx.size() < k) throw std::runtime_error("top-k: tensor holds NaN");
    // Largest magnitude first; ties to the lower index (the numpy model's order).
    std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k - 1), idx.end(),
                     [acc](int32_t a, int32_t b) {
                       const float fa = std::fabs(acc[a]), fb = std::fabs(acc[b]);
                       return fa > fb || (fa == fb && a < b);
                     });
    std::sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k));
    int32_t* send_idx = reinterpret_cast<int32_t*>(send.data());
    char* values = send.data() + k * 4;
    for (size_t j = 0; j < k; ++j) {
      const int32_t e = idx[j];
      send_idx[j] = e;
      float sent = acc[e];
      if (half) {
        uint16_t h;
        FloatToHalfScaled(&acc[e], &h, 1, scale);
        HalfToFloatScaled(&h, &sent, 1, 1.0f / scale);
        std::memcpy(values + 2 * j, &h, 2);
      } else {
        std::memcpy(values + 4 * j, &sent, 4);
      }
      acc[e] -= sent;
    }
  }
  std::vector<char> all(record * static_cast<size_t>(c_.size));
  {
    TimelineSpan ring(*c_.timeline, 1 + stream, "gloo allgather (top-k)", "communication");
    c_.world->Allgatherv(stream, send.data(), all.data(),
                         std::vector<size_t>(static_cast<size_t>(c_.size), record));
  }
  const double post = PostScale(m, c_.size);
  float* out = static_cast<float*>(q.output);
  if (n) std::memset(out, 0, n * sizeof(float));
  for (int rank = 0; rank < c_.size; ++rank) {
    const char* at = all.data() + record * static_cast<size_t>(rank);
    const int32_t* got_idx = reinterpret_cast<const int32_t*>(at);
    const char* values = at + k * 4;
    for (size_t j = 0; j < k; ++j) {
      float v;
      if (half) {
        uint16_t h;
        std::memcpy(&h, values + 2 * j, 2);
        HalfToFloatScaled(&h, &v, 1, 1.0f / scale);
      } else {
        std::memcpy(&v, values + 4 * j, 4);
      }
      out[got_idx[j]] += v;
    }
  }
  ScaleBuffer(out, DataType::kFloat32, n, post);
  return true;
}

}  // namespace

std::unique_ptr<Compressor> MakeTopkCompressor(const CompressionContext& context) {
  return std::unique_ptr<Compressor>(new Topk(context));
}

}  // namespace perseus
