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
#include "cc/rendezvous/store_client.h"
#include "cc/runtime/message.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/factory.h"

namespace perseus {
Status Runtime::StoppedStatus(State state) const {
  if (state == State::kFailed) return failure_;
  if (state == State::kShutdown) {
    return Status::Error(StatusCode::kUnavailable,
                         "Perseus has been shut down" +
                             (shutdown_by_.empty() ? std::string() : " (" + shutdown_by_ + ")") +
                             "; no collective can run after shutdown()");
  }
  return Status::Error(StatusCode::kFailedPrecondition,
                       "Perseus is not initialized: call perseus_tf.init() (or hvd.init()) first");
}

Status Runtime::Check(Request& request) {
  State state = state_.load();
  if (state != State::kRunning) {
    // A first look without the lock; EnqueueGroup looks again under it.
    std::lock_guard<std::mutex> lock(mu_);
    return StoppedStatus(state);
  }
  const TensorMeta& m = request.meta;
  const int size = options_.size;
  auto invalid = [&](const std::string& msg) {
    return Status::Error(StatusCode::kInvalidArgument,
                         std::string("Perseus ") + OpTypeName(m.op) + " of tensor '" + m.name +
                             "': " + msg);
  };
  if (m.name.empty()) return invalid("a collective needs a name");
  if (m.op == OpType::kAllreduce || m.op == OpType::kReducescatter) {
    if (GetReduceFn(m.dtype, m.reduce_op) == nullptr) {
      return invalid(std::string("reduction '") + ReduceOpName(m.reduce_op) +
                     "' is not defined for dtype " + DataTypeName(m.dtype) +
                     (m.dtype == DataType::kBool ? " (use min or max for bool)" : ""));
    }
    if (m.reduce_op == ReduceOp::kAverage && m.dtype == DataType::kBool) {
      return invalid("average is not defined for bool");
    }
    if (!std::isfinite(m.prescale) || !std::isfinite(m.postscale)) {
      // NaN never equals itself: left to negotiation, it read as "the ranks
      // disagree on the prescale/postscale factors".
      std::ostringstream got;
      got << "prescale_factor " << m.prescale << ", postscale_factor " << m.postscale;
      return invalid("prescale_factor and postscale_factor must be finite numbers; got " +
                     got.str());
    }
    if (options_.nancheck && IsFloatingPoint(m.dtype) && request.input != nullptr) {
      const size_t n = static_cast<size_t>(NumElements(m.shape));
      const bool bad = request.where.kind == MemoryKind::kHost
                           ? HasNonFinite(request.input, m.dtype, n)
                           : executor_->PlaneFor(request.where)
                                 .HasNonFinite(request.where, request.input, m.dtype, n);
      if (bad) request.meta.flags |= kMetaNonFinite;  // every rank fails it (negotiation.cc)
    }
  }
  if (request.where.kind == MemoryKind::kCuda) {
    request.meta.flags |= kMetaOnDevice;
  } else {
    request.meta.flags &= ~kMetaOnDevice;
  }
  // Compression applies to float32 sums and averages; anything else travels
  // as it is.
  if (m.op != OpType::kAllreduce || m.dtype != DataType::kFloat32 ||
      (m.reduce_op != ReduceOp::kSum && m.reduce_op != ReduceOp::kAverage)) {
    request.meta.compression = 0;
  } else if (m.compression < kCompressNone || m.compression > kCompressDownsample) {
    return invalid("compression must be from 0 to 4 (none, float16, mixed, top-k, "
                   "downsample), got " + std::to_string(m.compression));
  } else if (m.compression == kCompressTopk) {
    if (NumElements(m.shape) * 4 < options_.topk_threshold_bytes) {
      request.meta.compression = options_.topk_fallback;  // too small to sparsify
    } else {
      // Its residual changes with every run, so it is never voted down and
      // re-run: top-k tensors are negotiated online, step by step.
      request.meta.flags &= ~kMetaPlannable;
    }
  } else if (m.compression == kCompressDownsample && options_.downsample_n <= 1) {
    request.meta.compression = kCompressNone;
  }
  if (m.op == OpType::kBroadcast && (m.root < 0 || m.root >= size)) {
    return invalid("root_rank " + std::to_string(m.root) + " is out of range: valid ranks are 0 to " +
                   std::to_string(size - 1));
  }
  if ((m.op == OpType::kAllgather || m.op == OpType::kAlltoall ||
       m.op == OpType::kReducescatter) && m.shape.empty()) {
    return invalid("needs a tensor with at least one dimension, got a scalar");
  }
  if (m.op == OpType::kAlltoall) {
    if (m.splits.empty()) {
      if (m.shape[0] % size != 0) {
        return invalid("first dimension " + std::to_string(m.shape[0]) +
                       " is not divisible by the number of ranks (" + std::to_string(size) +
                       "); pass splits");
      }
    } else {
      if (static_cast<int>(m.splits.size()) != size) {
        return invalid("splits has " + std::to_string(m.splits.size()) +
                       " entries; it needs one per rank (" + std::to_string(size) + ")");
      }
      int64_t sum = 0;
      for (int64_t s : m.splits) {
        if (s < 0) return invalid("splits must not be negative, got " + ShapeString(m.splits));
        sum += s;
      }
      if (sum != m.shape[0]) {
        return invalid("splits " + ShapeString(m.splits) + " sum to " + std::to_string(sum) +
                       " but the first dimension is " + std::to_string(m.shape[0]));
      }
    }
  }
  return Status::OK();
}

}  // namespace perseus
