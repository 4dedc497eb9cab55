#include <cstring>
#include <vector>

#include "cc/runtime/compression/compression.h"

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
  bool Allreduce(int stream, DataPlane& plane, StreamScratch& scratch, const Response& r,
                 std::vector<std::shared_ptr<Request>>& requests) override;

 private:
  CompressionContext c_;
};

bool Fp16::Allreduce(int stream, DataPlane& plane, StreamScratch&, const Response& r,
                     std::vector<std::shared_ptr<Request>>& requests) {
  const CompressionSettings& options = *c_.settings;
  const TensorMeta& m0 = r.metas[0];
  size_t total = 0;
  for (auto& q : requests) total += static_cast<size_t>(NumElements(q->meta.shape));
  const size_t extras = r.envelope.slots();
  uint16_t* half =
      static_cast<uint16_t*>(plane.Buffer(stream, PlaneBuffer::kHalf, 2 * (total + extras)));
  const float in_scale = static_cast<float>(m0.prescale * options.gradient_scale);
  size_t offset = 0;
  {
    TimelineSpan pack(*c_.timeline, 1 + stream, "fp16 compress", "compression");
    for (auto& q : requests) {
      size_t n = static_cast<size_t>(NumElements(q->meta.shape));
      plane.ToHalf(stream, static_cast<const float*>(q->input), half + offset, n, in_scale);
      offset += n;
    }
  }
  if (!r.envelope.Around(half, total, DataType::kFloat16, c_.rank, &plane, stream,
                         [&](size_t count) {
                           c_.allreduce(stream, plane, half, count, DataType::kFloat16,
                                        ReduceOp::kSum, 0);
                         })) {
    return false;  // voted down
  }
  const double post = PostScale(m0, c_.size);
  const float out_scale = static_cast<float>(post / options.gradient_scale);
  offset = 0;
  TimelineSpan unpack(*c_.timeline, 1 + stream, "fp16 decompress", "compression");
  for (auto& q : requests) {
    size_t n = static_cast<size_t>(NumElements(q->meta.shape));
    plane.FromHalf(stream, half + offset, static_cast<float*>(q->output), n, out_scale);
    offset += n;
  }
  return true;
}

}  // namespace

std::unique_ptr<Compressor> MakeFp16Compressor(const CompressionContext& context) {
  return std::unique_ptr<Compressor>(new Fp16(context));
}

}  // namespace perseus
