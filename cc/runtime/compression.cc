// Compressed allreduces: fp16 with the gradient scale, and top-k with error
// feedback; the per-tensor residuals of top-k and downsampling.
#include "cc/runtime/runtime.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>

#include "cc/core/reduce.h"
#include "cc/rendezvous/store_client.h"
#include "cc/runtime/fusion.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/shm_transport.h"

namespace perseus {
Runtime::SparseState& Runtime::SparseFor(const TensorMeta& m) {
  std::lock_guard<std::mutex> lock(sparse_mu_);
  SparseState& st = sparse_[m.name];
  const size_t n = static_cast<size_t>(NumElements(m.shape));
  if (st.residual.size() != n) {  // first use, or the tensor changed shape
    st.residual.assign(n, 0.0f);
    st.steps = 0;
  }
  return st;
}

int64_t Runtime::TopkCount(int64_t n) const {
  return std::max<int64_t>(
      1, std::min<int64_t>(n, static_cast<int64_t>(std::ceil(options_.topk_ratio * n))));
}

// Top-k with error feedback, one tensor: acc = gradient * prescale +
// residual; this rank sends the k entries of acc largest in magnitude
// (index, value; the value optionally float16 times the gradient scale),
// keeps everything it did not send (including float16 rounding) as the next
// residual, and sums what every rank sent into a dense output.
bool Runtime::ExecuteTopk(int stream, const Response& r, Request& q) {
  const TensorMeta& m = r.metas[0];
  const size_t n = static_cast<size_t>(NumElements(m.shape));
  const size_t k = static_cast<size_t>(TopkCount(NumElements(m.shape)));
  SparseState& st = SparseFor(m);
  std::vector<int32_t>& idx = streams_[stream]->index;
  const float pre = static_cast<float>(m.prescale);
  const float* in = static_cast<const float*>(q.input);
  const bool half = options_.topk_fp16;
  const float scale = static_cast<float>(options_.gradient_scale);
  const size_t value_bytes = half ? 2 : 4;
  const size_t record = k * (4 + value_bytes);
  std::vector<char> send(record);
  {
    TimelineSpan span(timeline_, 1 + stream, "top-k select", "compression");
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
  std::vector<char> all(record * static_cast<size_t>(options_.size));
  {
    TimelineSpan ring(timeline_, 1 + stream, "gloo allgather (top-k)", "communication");
    transport_->Allgatherv(stream, send.data(), all.data(),
                         std::vector<size_t>(static_cast<size_t>(options_.size), record));
  }
  const double post =
      m.postscale * (m.reduce_op == ReduceOp::kAverage ? 1.0 / options_.size : 1.0);
  float* out = static_cast<float*>(q.output);
  if (n) std::memset(out, 0, n * sizeof(float));
  for (int rank = 0; rank < options_.size; ++rank) {
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

// float32 in, float16 on the wire: each input is multiplied by prescale *
// gradient_scale while it is converted into the bucket, the bucket is summed
// in float16 (F16C), and the sum is converted back multiplied by
// postscale / gradient_scale (and 1/size for an average). The scale keeps
// small gradients out of float16's subnormal range.
bool Runtime::ExecuteCompressedAllreduce(int stream, const Response& r,
                                         std::vector<std::shared_ptr<Request>>& requests) {
  const TensorMeta& m0 = r.metas[0];
  size_t total = 0;
  for (auto& q : requests) total += static_cast<size_t>(NumElements(q->meta.shape));
  const bool carrier = r.carrier_vote >= 0;
  std::vector<uint16_t>& half = streams_[stream]->half_buffer;
  const size_t extras = ExtraSlots(r);
  if (half.size() < total + extras) half.resize(total + extras);
  const float in_scale = static_cast<float>(m0.prescale * options_.gradient_scale);
  size_t offset = 0;
  {
    TimelineSpan pack(timeline_, 1 + stream, "fp16 compress", "compression");
    for (auto& q : requests) {
      size_t n = static_cast<size_t>(NumElements(q->meta.shape));
      FloatToHalfScaled(static_cast<const float*>(q->input), half.data() + offset, n, in_scale);
      offset += n;
    }
  }
  if (carrier) {
    WriteExtras(reinterpret_cast<char*>(half.data() + total), DataType::kFloat16, r, options_.rank);
  }
  {
    AllreduceBuffer(stream, half.data(), total + extras, DataType::kFloat16,
                    GetReduceFn(DataType::kFloat16, ReduceOp::kSum));
  }
  const char* extra_at = reinterpret_cast<const char*>(half.data() + total);
  if (carrier && !Deliver(r, ReadOutcome(extra_at, DataType::kFloat16, r))) return false;
  const double post =
      m0.postscale * (m0.reduce_op == ReduceOp::kAverage ? 1.0 / options_.size : 1.0);
  const float out_scale = static_cast<float>(post / options_.gradient_scale);
  offset = 0;
  TimelineSpan unpack(timeline_, 1 + stream, "fp16 decompress", "compression");
  for (auto& q : requests) {
    size_t n = static_cast<size_t>(NumElements(q->meta.shape));
    HalfToFloatScaled(half.data() + offset, static_cast<float*>(q->output), n, out_scale);
    offset += n;
  }
  return true;
}

}  // namespace perseus
