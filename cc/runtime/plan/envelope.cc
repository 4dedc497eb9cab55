// The envelope of an offline plan bucket (envelope.h).
#include "cc/runtime/plan/envelope.h"

#include <algorithm>
#include <cstring>

#include "cc/core/reduce.h"

namespace perseus {

void WriteValue(void* p, DataType dtype, double v) {
  switch (dtype) {
    case DataType::kFloat16: {
      float f = static_cast<float>(v);
      FloatToHalf(&f, static_cast<uint16_t*>(p), 1);
      break;
    }
    case DataType::kBFloat16: {
      float f = static_cast<float>(v);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      *static_cast<uint16_t*>(p) = static_cast<uint16_t>(bits >> 16);
      break;
    }
    case DataType::kFloat32: *static_cast<float*>(p) = static_cast<float>(v); break;
    case DataType::kFloat64: *static_cast<double*>(p) = v; break;
    case DataType::kInt32: *static_cast<int32_t*>(p) = static_cast<int32_t>(v + 0.5); break;
    case DataType::kInt64: *static_cast<int64_t*>(p) = static_cast<int64_t>(v + 0.5); break;
    case DataType::kUint16: *static_cast<uint16_t*>(p) = static_cast<uint16_t>(v + 0.5); break;
    case DataType::kInt16: *static_cast<int16_t*>(p) = static_cast<int16_t>(v + 0.5); break;
    default: *static_cast<uint8_t*>(p) = static_cast<uint8_t>(v + 0.5); break;
  }
}
double ReadValue(const void* p, DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16: {
      float f;
      HalfToFloat(static_cast<const uint16_t*>(p), &f, 1);
      return f;
    }
    case DataType::kBFloat16: {
      uint32_t bits = static_cast<uint32_t>(*static_cast<const uint16_t*>(p)) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case DataType::kFloat32: return *static_cast<const float*>(p);
    case DataType::kFloat64: return *static_cast<const double*>(p);
    case DataType::kInt32: return *static_cast<const int32_t*>(p);
    case DataType::kInt64: return static_cast<double>(*static_cast<const int64_t*>(p));
    case DataType::kUint16: return *static_cast<const uint16_t*>(p);
    case DataType::kInt16: return *static_cast<const int16_t*>(p);
    default: return *static_cast<const uint8_t*>(p);
  }
}
bool Envelope::Around(void* data, size_t count, DataType dtype, int rank, DataPlane* plane,
                      int stream, const std::function<void(size_t total)>& reduce) const {
  if (empty()) {
    reduce(count);
    return true;
  }
  const size_t esize = DataTypeSize(dtype);
  std::vector<char> extras(slots() * esize);
  WriteValue(extras.data(), dtype, vote);
  for (int i = 0; i < perf_slots; ++i) {
    WriteValue(extras.data() + (1 + i) * esize, dtype, i == rank ? perf_value : 0.0);
  }
  char* at = static_cast<char*>(data) + count * esize;
  if (plane) {
    plane->FromHost(stream, at, extras.data(), extras.size());
  } else {
    std::memcpy(at, extras.data(), extras.size());
  }
  reduce(count + slots());
  if (plane) {
    plane->ToHost(stream, extras.data(), at, extras.size());
  } else {
    std::memcpy(extras.data(), at, extras.size());
  }
  BucketOutcome outcome;
  outcome.votes = static_cast<int64_t>(ReadValue(extras.data(), dtype) + 0.5);
  for (int i = 0; i < perf_slots; ++i) {
    outcome.perf_ms.push_back(ReadValue(extras.data() + (1 + i) * esize, dtype));
  }
  return !on_outcome || on_outcome(outcome);
}

}  // namespace perseus
