#include <cstring>

#include "cc/runtime/compression/compression.h"
#include "cc/runtime/fusion.h"

namespace perseus {
namespace {

// float32 in, float16 on the wire: each input is multiplied by prescale *
// gradient_scale while it is converted into the bucket, the bucket is summed
// in float16 (F16C), and the sum is converted back multiplied by
// postscale / gradient_scale (and 1/size for an average). The scale keeps
// small gradients out of float16's subnormal range.
class Fp16 : public Compressor {
 public:
  explicit Fp16(const CompressionContext& c) : c_(c) {}
  bool Allreduce(int stream, StreamScratch& scratch, const Response& r,
                 std::vector<std::shared_ptr<Request>>& requests) override;

 private:
  CompressionContext c_;
};

bool Fp16::Allreduce(int stream, StreamScratch& scratch, const Response& r,
                     std::vector<std::shared_ptr<Request>>& requests) {
  const InitOptions& options = *c_.options;
  const TensorMeta& m0 = r.metas[0];
  size_t total = 0;
  for (auto& q : requests) total += static_cast<size_t>(NumElements(q->meta.shape));
  const bool carrier = r.carrier_vote >= 0;
  std::vector<uint16_t>& half = scratch.half;
  const size_t extras = ExtraSlots(r);
  if (half.size() < total + extras) half.resize(total + extras);
  const float in_scale = static_cast<float>(m0.prescale * options.gradient_scale);
  size_t offset = 0;
  {
    TimelineSpan pack(*c_.timeline, 1 + stream, "fp16 compress", "compression");
    for (auto& q : requests) {
      size_t n = static_cast<size_t>(NumElements(q->meta.shape));
      FloatToHalfScaled(static_cast<const float*>(q->input), half.data() + offset, n, in_scale);
      offset += n;
    }
  }
  if (carrier) {
    WriteExtras(reinterpret_cast<char*>(half.data() + total), DataType::kFloat16, r, options.rank);
  }
  {
    c_.allreduce(stream, half.data(), total + extras, DataType::kFloat16,
                 GetReduceFn(DataType::kFloat16, ReduceOp::kSum), 0);
  }
  const char* extra_at = reinterpret_cast<const char*>(half.data() + total);
  if (carrier && !Deliver(r, ReadOutcome(extra_at, DataType::kFloat16, r))) return false;
  const double post = PostScale(m0, options.size);
  const float out_scale = static_cast<float>(post / options.gradient_scale);
  offset = 0;
  TimelineSpan unpack(*c_.timeline, 1 + stream, "fp16 decompress", "compression");
  for (auto& q : requests) {
    size_t n = static_cast<size_t>(NumElements(q->meta.shape));
    HalfToFloatScaled(half.data() + offset, static_cast<float*>(q->output), n, out_scale);
    offset += n;
  }
  return true;
}

}  // namespace

std::unique_ptr<Compressor> MakeFp16Compressor(const CompressionContext& context) {
  return std::unique_ptr<Compressor>(new Fp16(context));
}

}  // namespace perseus
