// The host's data plane: the executor's memory operations as plain host code,
// done by the time each call returns.
#include <array>
#include <cstring>
#include <vector>

#include "cc/core/reduce.h"
#include "cc/device/data_plane.h"

namespace perseus {

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost: return "host";
    case MemoryKind::kSimulated: return "simulated device";
    case MemoryKind::kCuda: return "CUDA device";
  }
  return "unknown memory";
}

namespace {

class HostPlane : public DataPlane {
 public:
  explicit HostPlane(int streams) : buffers_(static_cast<size_t>(streams)) {}
  MemoryKind kind() const override { return MemoryKind::kHost; }
  void WaitReady(int, const Placement&) override {}
  void* Buffer(int stream, PlaneBuffer which, size_t bytes) override {
    std::vector<char>& b = buffers_.at(static_cast<size_t>(stream))[static_cast<int>(which)];
    if (b.size() < bytes) b.resize(bytes);
    return b.data();
  }
  void Copy(int, const std::vector<CopySpan>& spans) override {
    for (const CopySpan& s : spans) {
      if (s.bytes && s.src != s.dst) std::memcpy(s.dst, s.src, s.bytes);
    }
  }
  void Scale(int, void* data, DataType dtype, size_t n, double factor) override {
    ScaleBuffer(data, dtype, n, factor);
  }
  void ToHalf(int, const float* in, uint16_t* out, size_t n, float scale) override {
    FloatToHalfScaled(in, out, n, scale);
  }
  void FromHalf(int, const uint16_t* in, float* out, size_t n, float scale) override {
    HalfToFloatScaled(in, out, n, scale);
  }
  bool HasNonFinite(const Placement&, const void* data, DataType dtype, size_t n) override {
    return perseus::HasNonFinite(data, dtype, n);
  }
  void ToHost(int, void* host, const void* src, size_t bytes) override {
    if (bytes && host != src) std::memcpy(host, src, bytes);
  }
  void FromHost(int, void* dst, const void* host, size_t bytes) override {
    if (bytes && host != dst) std::memcpy(dst, host, bytes);
  }
  void Finish(int, std::function<void(const std::string&)> done) override { done(""); }

 private:
  std::vector<std::array<std::vector<char>, static_cast<int>(PlaneBuffer::kCount)>> buffers_;
};

}  // namespace

std::unique_ptr<DataPlane> MakeHostPlane(int streams) {
  return std::unique_ptr<DataPlane>(new HostPlane(streams));
}

}  // namespace perseus
