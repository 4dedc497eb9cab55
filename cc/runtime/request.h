// Request: one collective a caller asked for (validated in request.cc).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/core/common.h"
#include "cc/device/data_plane.h"
#include "cc/runtime/message.h"

namespace perseus {

// One collective a caller asked for. `done` runs exactly once, on a runtime
// thread, after the output is written (or with an error): for device memory,
// once the device work that writes it has finished.
// A part of a request's input that is not one buffer (a reducescatter of a
// sharded optimizer's gradients): `count` elements at element `offset` of
// the whole input; the elements no piece covers are zeros.
struct InputPiece {
  const void* data = nullptr;
  int64_t offset = 0;
  int64_t count = 0;
};

// Where a part of this rank's reducescatter result goes instead of one
// allocated output: `count` elements at element `offset` of this rank's
// block (a sharded optimizer's own gradients, often in their own buffers).
struct OutputPiece {
  void* data = nullptr;
  int64_t offset = 0;
  int64_t count = 0;
};

struct Request {
  TensorMeta meta;
  const void* input = nullptr;
  // Reducescatter on the host only: the input in pieces (sorted by offset,
  // not overlapping) instead of `input`.
  std::vector<InputPiece> pieces;
  // Reducescatter with pieces: this rank's result goes here (sorted by
  // offset) instead of `allocate`; elements no piece covers are dropped.
  std::vector<OutputPiece> out_pieces;
  // Allreduce and broadcast write here (may equal input). Ops whose output
  // shape depends on other ranks leave it null and provide `allocate`.
  void* output = nullptr;
  // Where input and output live (host unless a device's producer said so);
  // a result allocated through `allocate` lives there too.
  Placement where;
  std::function<void*(const std::vector<int64_t>& shape)> allocate;
  std::vector<int64_t> received_splits;  // alltoall: rows from each rank
  int64_t result = 0;                     // join: the rank that joined last
  std::function<void(const Status&)> done;
  // When Enqueue accepted it (statistics: time waiting before it ran).
  std::chrono::steady_clock::time_point enqueued{};
  // Buffers of a stand-in request (a joined rank taking part with no data).
  std::vector<char> scratch;
  // The names of the grouped call it came in (null for a single call):
  // when one of them fails, the others fail with it (request_table.cc).
  std::shared_ptr<const std::vector<std::string>> call;
  // Not OK once another tensor of its grouped call failed on every rank
  // (Response::siblings_run): it still runs, and completes with this error.
  Status failed_with_call;
};

// The requests a response covers, in its order.
using Requests = std::vector<std::shared_ptr<Request>>;

}  // namespace perseus
