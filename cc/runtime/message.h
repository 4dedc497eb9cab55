// What ranks tell each other during negotiation, and its byte encoding.
//
// A TensorMeta describes one named collective request as a rank sees it.
// Every cycle each rank sends the metas it enqueued since the last cycle;
// every rank receives all of them and runs the same deterministic decision
// (negotiation.h), so no coordinator reply has to travel.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cc/core/common.h"

namespace perseus {

struct TensorMeta {
  std::string name;
  OpType op = OpType::kAllreduce;
  DataType dtype = DataType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  std::vector<int64_t> shape;
  int32_t root = 0;                // broadcast
  double prescale = 1.0;           // allreduce / reducescatter
  double postscale = 1.0;
  std::vector<int64_t> splits;     // alltoall: rows sent to each rank
  int32_t group = 0;               // >0: size of the grouped call this request came in
  int32_t compression = 0;         // allreduce of float32: a kCompress* code
  int32_t flags = 0;               // kMetaNonFinite: the input held NaN/Inf (nancheck)
  std::string rejected;            // kMetaRejected: why this rank refused its call
};

// How a float32 sum or average travels (TensorMeta::compression).
constexpr int32_t kCompressNone = 0;
constexpr int32_t kCompressFp16 = 1;        // float16 times the gradient scale
constexpr int32_t kCompressMixed = 2;       // float32 inside a host, float16 across hosts
constexpr int32_t kCompressTopk = 3;        // top-k with error feedback (gradients only)
constexpr int32_t kCompressDownsample = 4;  // 1/N of the elements per step, rotating
const char* CompressionName(int32_t code);

constexpr int32_t kMetaNonFinite = 1;
// The request may run from an offline plan (a training step's gradients).
constexpr int32_t kMetaPlannable = 2;
// This rank refused the call (a bad argument: TensorMeta::rejected says
// which): the other ranks' requests of this name fail at once instead of
// waiting for it. On the wire only with this flag set.
constexpr int32_t kMetaRejected = 4;
// The request's memory is on a CUDA device. In a response: every rank that
// submitted it has it there, so NCCL may carry it on every rank alike (the
// choice of transport must not depend on one rank's placement).
constexpr int32_t kMetaOnDevice = 8;
// With kMetaRejected: the call was refused because this rank's previous call
// of the name was still in flight (two threads); that call fails on every
// rank too where it has not run yet.
constexpr int32_t kMetaInFlightTwice = 16;

// One rank's message for one negotiation cycle.
struct CycleMessage {
  bool shutdown = false;           // this rank asks every rank to stop
  std::vector<TensorMeta> requests;
};

std::vector<char> EncodeCycle(const CycleMessage& msg);
// Throws std::runtime_error on malformed input.
CycleMessage DecodeCycle(const char* data, size_t size);

}  // namespace perseus
