// The simulated device's data plane (sim_device.h): every operation is work
// queued on the runtime's own simulated streams, with the memory it reads
// and writes declared, so the device checks the ordering the executor
// relies on. Host staging buffers are host memory.
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <mutex>
#include <vector>

#include "cc/core/reduce.h"
#include "cc/device/data_plane.h"
#include "cc/device/sim_device.h"

namespace perseus {
namespace {

class SimPlane : public DataPlane {
 public:
  explicit SimPlane(int streams) : dev_(SimDevice::Get()) {
    // Faults for the tests that show the device catches a missing wait on
    // the producer's event and a request completed before its device work.
    const char* fault = std::getenv("PERSEUS_TEST_SIM_FAULT");
    skip_wait_ = fault != nullptr && std::string(fault) == "skip_wait";
    early_finish_ = fault != nullptr && std::string(fault) == "early_finish";
    for (int s = 0; s < streams; ++s) {
      ids_.push_back(dev_.CreateStream());
      buffers_.emplace_back();
      sizes_.emplace_back();
      buffers_.back().fill(nullptr);
      sizes_.back().fill(0);
    }
    staging_.resize(ids_.size());
  }
  ~SimPlane() override {
    for (int id : ids_) dev_.DestroyStream(id);  // drains: queued work finishes first
    for (auto& per_stream : buffers_) {
      for (void* p : per_stream) dev_.Free(p);
    }
    if (check_ >= 0) dev_.DestroyStream(check_);
  }
  MemoryKind kind() const override { return MemoryKind::kSimulated; }
  Memory BufferMemory() const override { return {device_bytes_.load(), host_bytes_.load()}; }

  void WaitReady(int stream, const Placement& where) override {
    if (where.ready && !skip_wait_) {
      dev_.StreamWait(id(stream), std::static_pointer_cast<SimDevice::Event>(where.ready));
    }
  }
  void* Buffer(int stream, PlaneBuffer which, size_t bytes) override {
    if (which == PlaneBuffer::kStaging) {
      std::vector<char>& b = staging_.at(static_cast<size_t>(stream));
      if (b.size() < bytes) {
        host_bytes_ += bytes - b.size();
        b.resize(bytes);
      }
      return b.data();
    }
    void*& p = buffers_.at(stream)[static_cast<int>(which)];
    size_t& size = sizes_.at(stream)[static_cast<int>(which)];
    if (size < bytes) {
      void* old = p;
      p = dev_.Alloc(bytes);
      device_bytes_ += bytes - size;
      size = bytes;
      // Freed once the work queued on this stream before now has finished.
      if (old) dev_.LaunchHostFunc(id(stream), [old] { SimDevice::Get().Free(old); });
    }
    return p;
  }
  void Copy(int stream, const std::vector<CopySpan>& spans) override {
    std::vector<SimDevice::Range> reads, writes;
    for (const CopySpan& s : spans) {
      if (!s.bytes || s.src == s.dst) continue;
      reads.push_back({s.src, s.bytes});
      writes.push_back({s.dst, s.bytes});
    }
    if (reads.empty()) return;
    dev_.Launch(id(stream), "copy", reads, writes, [spans] {
      for (const CopySpan& s : spans) {
        if (s.bytes && s.src != s.dst) std::memcpy(s.dst, s.src, s.bytes);
      }
    });
  }
  void Scale(int stream, void* data, DataType dtype, size_t n, double factor) override {
    if (factor == 1.0 || n == 0) return;
    const size_t bytes = n * DataTypeSize(dtype);
    dev_.Launch(id(stream), "scale", {{data, bytes}}, {{data, bytes}},
                [=] { ScaleBuffer(data, dtype, n, factor); });
  }
  void ToHalf(int stream, const float* in, uint16_t* out, size_t n, float scale) override {
    if (n == 0) return;
    dev_.Launch(id(stream), "to float16", {{in, 4 * n}}, {{out, 2 * n}},
                [=] { FloatToHalfScaled(in, out, n, scale); });
  }
  void FromHalf(int stream, const uint16_t* in, float* out, size_t n, float scale) override {
    if (n == 0) return;
    dev_.Launch(id(stream), "from float16", {{in, 2 * n}}, {{out, 4 * n}},
                [=] { HalfToFloatScaled(in, out, n, scale); });
  }
  bool HasNonFinite(const Placement& where, const void* data, DataType dtype,
                    size_t n) override {
    std::lock_guard<std::mutex> lock(check_mu_);
    if (check_ < 0) check_ = dev_.CreateStream();
    if (where.ready) dev_.StreamWait(check_, std::static_pointer_cast<SimDevice::Event>(where.ready));
    auto found = std::make_shared<bool>(false);
    dev_.Launch(check_, "NaN check", {{data, n * DataTypeSize(dtype)}}, {},
                [=] { *found = perseus::HasNonFinite(data, dtype, n); });
    dev_.Synchronize(dev_.Record(check_));
    return *found;
  }
  void ToHost(int stream, void* host, const void* src, size_t bytes) override {
    if (bytes) {
      dev_.Launch(id(stream), "to host", {{src, bytes}}, {{host, bytes}},
                  [=] { std::memcpy(host, src, bytes); });
    }
    dev_.Synchronize(dev_.Record(id(stream)));
  }
  void FromHost(int stream, void* dst, const void* host, size_t bytes) override {
    if (!bytes) return;
    // Taken now, as a pageable cudaMemcpyAsync does: the host may reuse it.
    auto copy = std::make_shared<std::vector<char>>(static_cast<const char*>(host),
                                                    static_cast<const char*>(host) + bytes);
    dev_.Launch(id(stream), "from host", {}, {{dst, bytes}},
                [=] { std::memcpy(dst, copy->data(), bytes); });
  }
  void Finish(int stream, std::function<void(const std::string&)> done) override {
    if (early_finish_) return done("");
    dev_.LaunchHostFunc(id(stream), [done] { done(""); });
  }

 private:
  int id(int stream) const { return ids_.at(static_cast<size_t>(stream)); }

  SimDevice& dev_;
  std::vector<int> ids_;
  std::vector<std::array<void*, static_cast<int>(PlaneBuffer::kCount)>> buffers_;
  std::vector<std::array<size_t, static_cast<int>(PlaneBuffer::kCount)>> sizes_;
  std::atomic<size_t> device_bytes_{0}, host_bytes_{0};
  std::vector<std::vector<char>> staging_;
  std::mutex check_mu_;
  int check_ = -1;
  bool skip_wait_ = false;
  bool early_finish_ = false;
};

}  // namespace

std::unique_ptr<DataPlane> MakeSimPlane(int streams) {
  return std::unique_ptr<DataPlane>(new SimPlane(streams));
}

}  // namespace perseus
