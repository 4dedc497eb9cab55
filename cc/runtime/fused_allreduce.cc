// The fused allreduce of one bucket (fused_allreduce.h).
#include "cc/runtime/fused_allreduce.h"

#include "cc/runtime/compression/compression.h"

namespace perseus {

void SplitForFusion(const Response& r, const Requests& requests, Requests* packed,
                    Requests* large) {
  const TensorMeta& m0 = r.metas[0];
  for (auto& q : requests) {
    const size_t bytes = static_cast<size_t>(NumElements(q->meta.shape)) * DataTypeSize(m0.dtype);
    (m0.compression != kCompressMixed && bytes >= kInPlaceBytes ? large : packed)->push_back(q);
  }
}

bool RunFusedAllreduce(const FusedBucket& b, const Response& r, Requests& requests) {
  DataPlane& plane = *b.plane;
  const int stream = b.stream;
  const TensorMeta& m0 = r.metas[0];
  const DataType dtype = m0.dtype;
  const size_t esize = DataTypeSize(dtype);
  const ReduceOp op = m0.reduce_op;
  const double post = PostScale(m0, b.size);
  const bool mixed = m0.compression == kCompressMixed;
  size_t total = 0;
  for (auto& q : requests) total += static_cast<size_t>(NumElements(q->meta.shape));
  const size_t slots = total + r.envelope.slots();
  char* buf = static_cast<char*>(plane.Buffer(stream, PlaneBuffer::kFusion, slots * esize));
  std::vector<CopySpan> spans;
  spans.reserve(requests.size());
  size_t offset = 0;
  {
    TimelineSpan pack(*b.timeline, 1 + stream, "pack", "memory");
    for (auto& q : requests) {
      const size_t bytes = static_cast<size_t>(NumElements(q->meta.shape)) * esize;
      spans.push_back({q->input, buf + offset, bytes});
      offset += bytes;
    }
    plane.Copy(stream, spans);
    plane.Scale(stream, buf, dtype, total, m0.prescale);
  }
  if (!r.envelope.Around(buf, total, dtype, b.rank, &plane, stream, [&](size_t count) {
        b.reduce(buf, count, dtype, op, mixed ? total : 0);
      })) {
    return false;  // voted down: outputs untouched, the plan took the requests back
  }
  plane.Scale(stream, buf, dtype, total, post);
  offset = 0;  // the same spans back, from the bucket to each output
  for (size_t i = 0; i < requests.size(); ++i) {
    spans[i].src = buf + offset;
    spans[i].dst = requests[i]->output;
    offset += spans[i].bytes;
  }
  plane.Copy(stream, spans);
  return true;
}

}  // namespace perseus
