#include <cstring>

#include "cc/runtime/compression/compression.h"

namespace perseus {

Residuals::State& Residuals::For(const TensorMeta& m) {
  std::lock_guard<std::mutex> lock(mu_);
  State& st = states_[m.name];
  const size_t n = static_cast<size_t>(NumElements(m.shape));
  if (st.residual.size() != n) {  // first use, or the tensor changed shape
    st.residual.assign(n, 0.0f);
    st.steps = 0;
  }
  return st;
}

void Residuals::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  states_.clear();
}

namespace {

// float32 only. Each tensor sends every N-th element from a phase that
// rotates with its steps, plus the momentum-decayed residual of the steps
// that did not send it; the sent elements of all tensors are packed and
// reduced as one buffer.
class Downsample : public Compressor {
 public:
  explicit Downsample(const CompressionContext& c) : c_(c) {}

  bool Allreduce(int stream, DataPlane& plane, StreamScratch& scratch, const Response& r,
                 std::vector<std::shared_ptr<Request>>& requests) override {
    const CompressionSettings& options = *c_.settings;
    const TensorMeta& m0 = r.metas[0];
    const size_t esize = sizeof(float);
    const size_t N = static_cast<size_t>(options.downsample_n_elements);
    const float momentum = static_cast<float>(options.gradient_momentum);
    const float pre = static_cast<float>(m0.prescale);
    auto sent_count = [N](size_t n, size_t phase) {
      return n > phase ? (n - phase + N - 1) / N : 0;
    };
    std::vector<Residuals::State*> states;
    std::vector<size_t> phases;
    size_t total = 0;
    for (auto& q : requests) {
      states.push_back(&c_.residuals->For(q->meta));
      phases.push_back(static_cast<size_t>(states.back()->steps % static_cast<int64_t>(N)));
      total += sent_count(static_cast<size_t>(NumElements(q->meta.shape)), phases.back());
    }
    std::vector<char>& buf = scratch.fusion;
    const size_t slots = total + r.envelope.slots();
    if (buf.size() < slots * esize) buf.resize(slots * esize);
    float* packed = reinterpret_cast<float*>(buf.data());
    {
      TimelineSpan pack(*c_.timeline, 1 + stream, "downsample pack", "memory");
      size_t at = 0;
      for (size_t i = 0; i < requests.size(); ++i) {
        const size_t n = static_cast<size_t>(NumElements(requests[i]->meta.shape));
        const float* in = static_cast<const float*>(requests[i]->input);
        const float* res = states[i]->residual.data();
        for (size_t e = phases[i]; e < n; e += N) packed[at++] = in[e] * pre + momentum * res[e];
      }
    }
    if (!r.envelope.Around(buf.data(), total, DataType::kFloat32, c_.rank, nullptr, stream,
                           [&](size_t count) {
                             c_.allreduce(stream, plane, buf.data(), count, DataType::kFloat32,
                                          m0.reduce_op, 0);
                           })) {
      return false;  // voted down: outputs and residuals untouched
    }
    ScaleBuffer(buf.data(), DataType::kFloat32, total, PostScale(m0, c_.size));
    size_t at = 0;
    for (size_t i = 0; i < requests.size(); ++i) {
      // Everything not sent this step stays in the residual (decayed by the
      // momentum); what was sent leaves it. Unsent outputs are zero.
      const size_t n = static_cast<size_t>(NumElements(requests[i]->meta.shape));
      const float* in = static_cast<const float*>(requests[i]->input);
      float* out = static_cast<float*>(requests[i]->output);
      float* res = states[i]->residual.data();
      for (size_t e = 0; e < n; ++e) res[e] = in[e] * pre + momentum * res[e];
      if (n) std::memset(out, 0, n * sizeof(float));
      for (size_t e = phases[i]; e < n; e += N) {
        out[e] = packed[at++];
        res[e] = 0;
      }
      ++states[i]->steps;
    }
    return true;
  }

 private:
  CompressionContext c_;
};

}  // namespace

std::unique_ptr<Compressor> MakeDownsampleCompressor(const CompressionContext& context) {
  return std::unique_ptr<Compressor>(new Downsample(context));
}

}  // namespace perseus
