// Types shared by every layer of the native runtime. Nothing here knows
// about TensorFlow or Gloo: a tensor is a pointer, a dtype and a shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace perseus {

enum class DataType : int32_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUint8 = 6,
  kInt8 = 7,
  kBool = 8,
  kUint16 = 9,
  kInt16 = 10,
};

enum class ReduceOp : int32_t {
  kSum = 0,
  kAverage = 1,
  kMin = 2,
  kMax = 3,
  kProduct = 4,
};

enum class OpType : int32_t {
  kAllreduce = 0,
  kAllgather = 1,
  kBroadcast = 2,
  kAlltoall = 3,
  kReducescatter = 4,
  kBarrier = 5,
  // Horovod's join: this rank has no more data; until every rank has
  // joined it takes part in the others' collectives with empty input.
  kJoin = 6,
};

// Error categories. The TF adapter maps them onto tf.errors classes.
enum class StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,
  kFailedPrecondition = 2,  // ranks disagree about a tensor
  kUnavailable = 3,         // a peer died, timed out, or the runtime is down
};

struct Status {
  StatusCode code = StatusCode::kOk;
  std::string message;

  static Status OK() { return Status(); }
  static Status Error(StatusCode code, std::string message) {
    Status s;
    s.code = code;
    s.message = std::move(message);
    return s;
  }
  bool ok() const { return code == StatusCode::kOk; }
};

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);
const char* ReduceOpName(ReduceOp op);
const char* OpTypeName(OpType op);
bool IsFloatingPoint(DataType dtype);
std::string ShapeString(const std::vector<int64_t>& shape);
int64_t NumElements(const std::vector<int64_t>& shape);
// Names the calling thread (what top -H, perf and /proc/<pid>/task/*/comm
// show), cut to Linux's 15 characters, so that the runtime's own CPU time
// can be told apart from the host program's.
void NameThisThread(const std::string& name);

// 64-bit FNV-1a of n bytes, continuing from h (the offset basis by default).
uint64_t Fnv1a(const void* data, size_t n, uint64_t h = 14695981039346656037ull);

}  // namespace perseus
