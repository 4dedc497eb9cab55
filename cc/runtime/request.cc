// Request validation: the local checks of one request before it is queued.
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
#include "cc/runtime/message.h"
#include "cc/runtime/runtime_internal.h"

namespace perseus {
Status Runtime::StoppedStatus(State state) {
  if (state == State::kFailed) return failure();
  if (state == State::kShutdown) {
    const std::string by = requests_.shutdown_by();
    return Status::Error(StatusCode::kUnavailable,
                         "Perseus has been shut down" +
                             (by.empty() ? std::string() : " (" + by + ")") +
                             "; no collective can run after shutdown()");
  }
  const std::string forked = ForkedAfterInit();
  if (!forked.empty()) return Status::Error(StatusCode::kFailedPrecondition, forked);
  return Status::Error(StatusCode::kFailedPrecondition,
                       "Perseus is not initialized: call perseus_tf.init() (or hvd.init()) first");
}

namespace {

Status Invalid(const TensorMeta& m, const std::string& msg) {
  return Status::Error(StatusCode::kInvalidArgument,
                       std::string("Perseus ") + OpTypeName(m.op) + " of tensor '" + m.name +
                           "': " + msg);
}

}  // namespace

Status Runtime::Check(Request& request) {
  const State state = state_.load();
  // A first look; EnqueueGroup looks again when it queues.
  if (state != State::kRunning) return StoppedStatus(state);
  const TensorMeta& m = request.meta;
  if (m.name.empty()) return Invalid(m, "a collective needs a name");
  if (m.op == OpType::kAllreduce || m.op == OpType::kReducescatter) {
    Status s = CheckReduction(request);
    if (!s.ok()) return s;
  }
  if (request.where.kind == MemoryKind::kCuda) {
    request.meta.flags |= kMetaOnDevice;
  } else {
    request.meta.flags &= ~kMetaOnDevice;
  }
  Status s = CheckCompression(request);
  if (!s.ok()) return s;
  return CheckShape(m);
}

Status Runtime::CheckReduction(Request& request) {
  const TensorMeta& m = request.meta;
  if (GetReduceFn(m.dtype, m.reduce_op) == nullptr) {
    return Invalid(m, std::string("reduction '") + ReduceOpName(m.reduce_op) +
                          "' is not defined for dtype " + DataTypeName(m.dtype) +
                          (m.dtype == DataType::kBool ? " (use min or max for bool)" : ""));
  }
  if (m.reduce_op == ReduceOp::kAverage && m.dtype == DataType::kBool) {
    return Invalid(m, "average is not defined for bool");
  }
  if (!std::isfinite(m.prescale) || !std::isfinite(m.postscale)) {
    // NaN never equals itself: left to negotiation, it read as "the ranks
    // disagree on the prescale/postscale factors".
    std::ostringstream got;
    got << "prescale_factor " << m.prescale << ", postscale_factor " << m.postscale;
    return Invalid(m, "prescale_factor and postscale_factor must be finite numbers; got " +
                          got.str());
  }
  if (options_.nancheck && IsFloatingPoint(m.dtype) && !request.pieces.empty()) {
    bool bad = false;
    for (const InputPiece& p : request.pieces) {
      bad = bad || HasNonFinite(p.data, m.dtype, static_cast<size_t>(p.count));
    }
    if (bad) request.meta.flags |= kMetaNonFinite;  // every rank fails it (negotiation.cc)
  }
  if (options_.nancheck && IsFloatingPoint(m.dtype) && request.input != nullptr) {
    const size_t n = static_cast<size_t>(NumElements(m.shape));
    const bool bad = request.where.kind == MemoryKind::kHost
                         ? HasNonFinite(request.input, m.dtype, n)
                         : executor_->PlaneFor(request.where)
                               .HasNonFinite(request.where, request.input, m.dtype, n);
    if (bad) request.meta.flags |= kMetaNonFinite;  // every rank fails it (negotiation.cc)
  }
  return Status::OK();
}

Status Runtime::CheckCompression(Request& request) {
  const TensorMeta& m = request.meta;
  // Compression applies to float32 sums and averages; anything else travels
  // as it is.
  if ((m.op != OpType::kAllreduce && m.op != OpType::kReducescatter) ||
      m.dtype != DataType::kFloat32 ||
      (m.reduce_op != ReduceOp::kSum && m.reduce_op != ReduceOp::kAverage)) {
    request.meta.compression = 0;
  } else if (m.op == OpType::kReducescatter &&
             (m.compression < kCompressNone || m.compression > kCompressMixed)) {
    return Invalid(m, "a reducescatter's compression must be 0, 1 or 2 (none, float16, "
                      "mixed), got " + std::to_string(m.compression));
  } else if (m.compression < kCompressNone || m.compression > kCompressDownsample) {
    return Invalid(m, "compression must be from 0 to 4 (none, float16, mixed, top-k, "
                      "downsample), got " + std::to_string(m.compression));
  } else if (m.compression == kCompressTopk) {
    if (NumElements(m.shape) * 4 < options_.topk_threshold) {
      request.meta.compression = options_.topk_fallback;  // too small to sparsify
    } else {
      // Its residual changes with every run, so it is never voted down and
      // re-run: top-k tensors are negotiated online, step by step.
      request.meta.flags &= ~kMetaPlannable;
    }
  } else if (m.compression == kCompressDownsample && options_.downsample_n_elements <= 1) {
    request.meta.compression = kCompressNone;
  }
  return Status::OK();
}

Status Runtime::CheckShape(const TensorMeta& m) {
  const int size = options_.size;
  if (m.op == OpType::kBroadcast && (m.root < 0 || m.root >= size)) {
    return Invalid(m, "root_rank " + std::to_string(m.root) +
                          " is out of range: valid ranks are 0 to " + std::to_string(size - 1));
  }
  if ((m.op == OpType::kAllgather || m.op == OpType::kAlltoall ||
       m.op == OpType::kReducescatter) && m.shape.empty()) {
    return Invalid(m, "needs a tensor with at least one dimension, got a scalar");
  }
  if (m.op != OpType::kAlltoall) return Status::OK();
  if (m.splits.empty()) {
    if (m.shape[0] % size != 0) {
      return Invalid(m, "first dimension " + std::to_string(m.shape[0]) +
                            " is not divisible by the number of ranks (" + std::to_string(size) +
                            "); pass splits");
    }
    return Status::OK();
  }
  if (static_cast<int>(m.splits.size()) != size) {
    return Invalid(m, "splits has " + std::to_string(m.splits.size()) +
                          " entries; it needs one per rank (" + std::to_string(size) + ")");
  }
  int64_t sum = 0;
  for (int64_t s : m.splits) {
    if (s < 0) return Invalid(m, "splits must not be negative, got " + ShapeString(m.splits));
    sum += s;
  }
  if (sum != m.shape[0]) {
    return Invalid(m, "splits " + ShapeString(m.splits) + " sum to " + std::to_string(sum) +
                          " but the first dimension is " + std::to_string(m.shape[0]));
  }
  return Status::OK();
}

}  // namespace perseus
