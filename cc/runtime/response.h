// What negotiation or an offline plan hands the executor: one unit of work
// that every rank executes in the same order.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include "cc/core/common.h"
#include "cc/core/reduce.h"
#include "cc/runtime/message.h"
#include "cc/runtime/plan/envelope.h"

namespace perseus {

// A stream's allreduce of a buffer (its algorithm chosen as for any bucket).
using BufferAllreduce = std::function<void(void* data, size_t count, DataType dtype, ReduceOp op)>;

// One unit of work that every rank executes in the same order.
struct Response {
  OpType op = OpType::kAllreduce;
  // Tensor names; more than one for a fused allreduce bucket.
  std::vector<std::string> names;
  // Meta of each tensor as rank 0 sent it (identical on all ranks once
  // validated, except first dimensions and splits, kept below). For a join,
  // metas[0].root is the rank that joined last.
  std::vector<TensorMeta> metas;
  // allgather: first dimension of each rank's tensor, per name.
  std::vector<std::vector<int64_t>> first_dims;
  // alltoall: splits[r][d] = rows rank r sends to rank d.
  std::vector<std::vector<int64_t>> splits;
  // Non-OK: every rank completes these names with this error.
  Status error;
  // A refused call's failure (kMetaRejected): per rank, whether this
  // response fails its request of the name. The others ignore it: a rank
  // that refused the call, or whose request of it failed already, may have
  // its next call of the name pending. Empty: every rank.
  std::vector<bool> real_request;
  // An error response whose every rank sent the name in a grouped call of
  // the same size (and none refused it or has joined): every rank holds the
  // call's other tensors too, so they still run everywhere and fail with
  // this error afterwards, instead of being given up on some ranks while
  // the others run them.
  bool siblings_run = false;
  // An offline plan bucket's extras (its vote, its perf slots) and the
  // plan's verdict on their sum; empty outside a plan (plan/envelope.h).
  Envelope envelope;
  // Set: not a collective of tensors but work the plan attached (its
  // check), run in this stream's order on every rank, given the stream's
  // allreduce of a buffer.
  std::function<void(const BufferAllreduce&)> control;
};

}  // namespace perseus
