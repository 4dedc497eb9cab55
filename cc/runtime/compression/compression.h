// Gradient compression behind one interface. Each compressor runs a whole
// allreduce response (one tensor, or a fused plan bucket) in its own form:
//   fp16        float16 on the wire, times the gradient scale (fp16.cc);
//   top-k       each rank's largest |gradient + residual| entries, allgathered
//               and summed into a dense result, with error feedback (topk.cc);
//   downsample  1/N of each tensor per step from a rotating phase, the rest
//               kept in a residual with momentum (downsample.cc).
// Mixed compression (fp16 between hosts only) is a flag of the two-level
// allreduce (allreduce_algorithms.h), not a compressor.
//
// Compressors know nothing of plans: they leave a bucket's envelope room
// after their buffer and reduce through it (plan/envelope.h), which carries
// the plan's extras and hands their sum to the plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/core/common.h"
#include "cc/core/reduce.h"
#include "cc/core/timeline.h"
#include "cc/device/data_plane.h"
#include "cc/runtime/response.h"
#include "cc/runtime/options.h"
#include "cc/runtime/request.h"
#include "cc/transport/transport.h"

namespace perseus {

// Scratch buffers of one stream (only its thread uses them).
struct StreamScratch {
  std::vector<char> fusion;    // packed buckets
  std::vector<uint16_t> half;  // float16 buckets
  std::vector<int32_t> index;  // top-k candidates
};

// Per-tensor residuals of top-k and downsampling, keyed by tensor name.
class Residuals {
 public:
  struct State {
    std::vector<float> residual;
    int64_t steps = 0;
  };
  // The tensor's state, reset when it is new or changed shape.
  State& For(const TensorMeta& m);
  void Clear();

 private:
  std::mutex mu_;
  std::unordered_map<std::string, State> states_;
};

// What compressors use from the runtime.
struct CompressionContext {
  // The compression settings (settings.h), and the runtime's rank and size.
  const CompressionSettings* settings = nullptr;
  int rank = 0;
  int size = 1;
  Timeline* timeline = nullptr;
  Transport* world = nullptr;  // top-k's allgather
  Residuals* residuals = nullptr;
  // The runtime's allreduce of a buffer on a stream (its algorithm chosen by
  // allreduce_algorithms; half_across as there).
  std::function<void(int stream, DataPlane& plane, void* data, size_t count, DataType dtype,
                     ReduceOp op,
                     size_t half_across)>
      allreduce;
};

class Compressor {
 public:
  virtual ~Compressor() = default;
  // Reduces the requests' inputs into their outputs, with the memory
  // operations of `plane` (top-k and downsampling run on the host plane
  // only: the executor stages device requests for them). False: a plan
  // bucket its plan said not to deliver (outputs and residuals untouched).
  virtual bool Allreduce(int stream, DataPlane& plane, StreamScratch& scratch, const Response& r,
                         std::vector<std::shared_ptr<Request>>& requests) = 0;
};

std::unique_ptr<Compressor> MakeFp16Compressor(const CompressionContext& context);
std::unique_ptr<Compressor> MakeTopkCompressor(const CompressionContext& context);
std::unique_ptr<Compressor> MakeDownsampleCompressor(const CompressionContext& context);

// The compressors of one executor, chosen by a response's compression
// (compressors.cc).
class Compressors {
 public:
  explicit Compressors(const CompressionContext& context);
  // The compressor that runs an allreduce of `compression` (kCompress*), or
  // null when it travels uncompressed (none, or mixed: a flag of the
  // two-level allreduce).
  Compressor* For(int compression) const;

 private:
  std::unique_ptr<Compressor> fp16_, topk_, downsample_;
};

// Bytes one rank puts on the wire for a tensor (statistics); two_level: the
// job's allreduce runs in two levels, so mixed compression halves what
// crosses hosts.
int64_t WireBytes(const TensorMeta& m, const CompressionSettings& options, bool two_level);

// Elements top-k sends of a tensor of n (at least 1).
int64_t TopkCount(int64_t n, double ratio);

// The multiplier after a reduction: postscale, and 1/size for an average.
inline double PostScale(const TensorMeta& m, int size) {
  return m.postscale * (m.reduce_op == ReduceOp::kAverage ? 1.0 / size : 1.0);
}

}  // namespace perseus
