// The CUDA data plane (cc/device/data_plane.h): every memory operation of
// the executor is queued on the runtime's own non-blocking streams, ordered
// after the producer's event, and a request completes when a thread of the
// plane sees the event recorded after its work fire. Nothing here makes the
// whole device wait. Host staging buffers are pinned, so copies through
// them are asynchronous. Everything goes through the driver API (driver.h),
// in the device's primary context, the one TF and the CUDA runtime use.
#include "cc/cuda/cuda_plane.h"

#include "cc/cuda/context.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "cc/cuda/driver.h"
#include "cc/cuda/kernels.h"
#include "cc/device/data_plane.h"

namespace perseus {
namespace {

void Check(cu::Result r, const char* what, int device) {
  if (r != cu::kSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + " on device " +
                             std::to_string(device) + ": " +
                             (r == kKernelsUnavailable ? KernelsUnavailableReason()
                                                       : D().Describe(r)));
  }
}

// Device (or managed) memory; plain host memory is unknown to the driver.
bool OnDevice(const void* p) {
  unsigned type = 0;
  if (D().PointerGetAttribute(&type, cu::kPointerMemoryType, DP(p)) != cu::kSuccess) return false;
  int managed = 0;
  D().PointerGetAttribute(&managed, cu::kPointerIsManaged, DP(p));
  return type == cu::kMemoryTypeDevice || managed != 0;
}

// Runs the completions of one stream, in order, each once the event
// recorded after its work has fired. The thread polls (a blocking event
// wait cannot be given a deadline) and says so on stderr when device work
// has not finished after a minute, every minute, rather than wait silently.
class Finisher {
 public:
  Finisher(int device, std::string what)
      : device_(device), what_(std::move(what)), thread_(&Finisher::Loop, this) {}
  ~Finisher() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Add(cu::Event event, std::function<void(const std::string&)> done) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(event, std::move(done));
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    UseDevice(device_);
    while (true) {
      std::pair<cu::Event, std::function<void(const std::string&)>> item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and everything ran
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      const auto start = std::chrono::steady_clock::now();
      auto next_warning = start + std::chrono::seconds(60);
      int pause_us = 2;
      cu::Result e;
      while ((e = D().EventQuery(item.first)) == cu::kNotReady) {
        std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
        if (pause_us < 50) pause_us *= 2;  // seen within ~50 us of the event
        const auto now = std::chrono::steady_clock::now();
        if (now >= next_warning) {
          std::fprintf(stderr,
                       "Perseus: device work on %s has not finished after %lld s (a kernel or "
                       "a copy that never ends?)\n",
                       what_.c_str(),
                       static_cast<long long>(
                           std::chrono::duration_cast<std::chrono::seconds>(now - start).count()));
          next_warning = now + std::chrono::seconds(60);
        }
      }
      GiveEvent(item.first);
      item.second(e == cu::kSuccess ? std::string()
                                    : std::string("CUDA error in the device work of ") + what_ +
                                          ": " + D().Describe(e));
    }
  }

  int device_;
  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<cu::Event, std::function<void(const std::string&)>>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

class CudaPlane : public DataPlane {
 public:
  CudaPlane(int device, int streams) : device_(device) {
    Use();
    // Compiled (or read from the cache) now: a GPU that NVRTC cannot serve
    // fails the first request with the reason, not a later kernel.
    EnsureKernels();
    for (int s = 0; s < streams; ++s) {
      auto st = std::make_unique<PerStream>();
      Check(D().StreamCreate(&st->stream, cu::kStreamNonBlocking), "cuStreamCreate", device);
      Check(D().EventCreate(&st->staging_free, cu::kEventDisableTiming), "cuEventCreate", device);
      Check(D().EventCreate(&st->table_free, cu::kEventDisableTiming), "cuEventCreate", device);
      st->finisher = std::make_unique<Finisher>(
          device, "stream " + std::to_string(s) + " of CUDA device " + std::to_string(device));
      streams_.push_back(std::move(st));
    }
    Check(D().StreamCreate(&check_stream_, cu::kStreamNonBlocking), "cuStreamCreate", device);
    Check(D().MemAlloc(&flag_, sizeof(int)), "cuMemAlloc", device);
    Check(D().MemHostAlloc(reinterpret_cast<void**>(&flag_host_), sizeof(int), 0),
          "cuMemHostAlloc", device);
  }

  ~CudaPlane() override {
    UseDevice(device_);
    for (auto& st : streams_) {
      D().StreamSynchronize(st->stream);
      st->finisher.reset();  // runs what is left to complete
      for (auto& b : st->device) {
        if (b.ptr) D().MemFreeAsync(DP(b.ptr), st->stream);
      }
      if (st->table.ptr) D().MemFreeAsync(DP(st->table.ptr), st->stream);
      D().StreamSynchronize(st->stream);
      if (st->staging.ptr) D().MemFreeHost(st->staging.ptr);
      if (st->table_host.ptr) D().MemFreeHost(st->table_host.ptr);
      for (void* p : st->retired_host) D().MemFreeHost(p);
      D().EventDestroy(st->staging_free);
      D().EventDestroy(st->table_free);
      D().StreamDestroy(st->stream);
    }
    D().StreamSynchronize(check_stream_);
    D().StreamDestroy(check_stream_);
    D().MemFree(flag_);
    D().MemFreeHost(flag_host_);
  }

  MemoryKind kind() const override { return MemoryKind::kCuda; }
  int device() const override { return device_; }

  Memory BufferMemory() const override { return {device_bytes_.load(), host_bytes_.load()}; }

  std::string DeviceIdentity() const override {
    char bus[64] = {0};
    cu::Device dev = 0;
    if (D().DeviceGet(&dev, device_) != cu::kSuccess ||
        D().DeviceGetPCIBusId(bus, sizeof(bus), dev) != cu::kSuccess) {
      return "";
    }
    const char* host_id = std::getenv("NCCL_HOSTID");
    char name[256] = {0};
    if (host_id == nullptr || *host_id == '\0') {
      gethostname(name, sizeof(name) - 1);
      host_id = name;
    }
    return std::string(host_id) + "|" + bus;
  }
  void* NativeStream(int stream) override { return at(stream).stream; }
  void MakeCurrent() override { Use(); }

  void WaitReady(int stream, const Placement& where) override {
    if (!where.ready) return;
    Use();
    Check(D().StreamWaitEvent(at(stream).stream, static_cast<cu::Event>(where.ready.get()), 0),
          "cuStreamWaitEvent (the producer's event)", device_);
  }

  void* Buffer(int stream, PlaneBuffer which, size_t bytes) override {
    Use();
    PerStream& st = at(stream);
    if (which == PlaneBuffer::kStaging) {
      Grow(st, st.staging, bytes, /*host=*/true);
      // An asynchronous copy out of it (FromHost) may still be reading.
      Check(D().EventSynchronize(st.staging_free), "waiting for the staging buffer", device_);
      return st.staging.ptr;
    }
    Block& b = st.device[static_cast<int>(which)];
    Grow(st, b, bytes, /*host=*/false);
    return b.ptr;
  }

  void Copy(int stream, const std::vector<CopySpan>& spans) override {
    Use();
    PerStream& st = at(stream);
    std::vector<const CopySpan*> work;
    for (const CopySpan& s : spans) {
      if (s.bytes && s.src != s.dst) work.push_back(&s);
    }
    if (work.empty()) return;
    bool all_device = true;
    for (size_t i = 0; all_device && i < work.size(); ++i) {
      all_device = OnDevice(work[i]->src) && OnDevice(work[i]->dst);
    }
    if (work.size() == 1 || !all_device) {
      for (const CopySpan* s : work) {
        Check(D().MemcpyAsync(DP(s->dst), DP(s->src), s->bytes, st.stream), "cuMemcpyAsync",
              device_);
      }
      // Host memory among them: done before returning, as on the host plane.
      if (!all_device) Check(D().StreamSynchronize(st.stream), "cuStreamSynchronize", device_);
      return;
    }
    // All on the device: one launch, its table uploaded from pinned memory.
    const size_t table_bytes = 3 * sizeof(uint64_t) * work.size();
    Check(D().EventSynchronize(st.table_free), "waiting for the copy table", device_);
    Grow(st, st.table_host, table_bytes, /*host=*/true);
    Grow(st, st.table, table_bytes, /*host=*/false);
    uint64_t* t = static_cast<uint64_t*>(st.table_host.ptr);
    for (size_t i = 0; i < work.size(); ++i) {
      t[3 * i] = reinterpret_cast<uint64_t>(work[i]->src);
      t[3 * i + 1] = reinterpret_cast<uint64_t>(work[i]->dst);
      t[3 * i + 2] = work[i]->bytes;
    }
    Check(D().MemcpyAsync(DP(st.table.ptr), DP(t), table_bytes, st.stream),
          "cuMemcpyAsync (copy table)", device_);
    Check(D().EventRecord(st.table_free, st.stream), "cuEventRecord", device_);
    Check(perseus_cuda_batched_copy(static_cast<const uint64_t*>(st.table.ptr),
                                    static_cast<int>(work.size()), st.stream),
          "the batched copy kernel", device_);
  }

  void Scale(int stream, void* data, DataType dtype, size_t n, double factor) override {
    if (factor == 1.0 || n == 0) return;
    Use();
    Check(perseus_cuda_scale(data, static_cast<int>(dtype), n, factor, at(stream).stream),
          "the scale kernel", device_);
  }

  void ToHalf(int stream, const float* in, uint16_t* out, size_t n, float scale) override {
    if (n == 0) return;
    Use();
    Check(perseus_cuda_to_half(in, out, n, scale, at(stream).stream), "the float16 kernel",
          device_);
  }

  void FromHalf(int stream, const uint16_t* in, float* out, size_t n, float scale) override {
    if (n == 0) return;
    Use();
    Check(perseus_cuda_from_half(in, out, n, scale, at(stream).stream), "the float16 kernel",
          device_);
  }

  bool HasNonFinite(const Placement& where, const void* data, DataType dtype,
                    size_t n) override {
    int kind;
    switch (dtype) {
      case DataType::kFloat32: kind = 0; break;
      case DataType::kFloat16: kind = 1; break;
      case DataType::kFloat64: kind = 2; break;
      case DataType::kBFloat16: kind = 3; break;
      default: return false;
    }
    if (n == 0) return false;
    std::lock_guard<std::mutex> lock(check_mu_);
    Use();
    if (where.ready) {
      Check(D().StreamWaitEvent(check_stream_, static_cast<cu::Event>(where.ready.get()), 0),
            "cuStreamWaitEvent (the producer's event)", device_);
    }
    Check(D().MemsetD8Async(flag_, 0, sizeof(int), check_stream_), "cuMemsetD8Async", device_);
    Check(perseus_cuda_nonfinite(data, kind, n, reinterpret_cast<int*>(flag_), check_stream_),
          "the NaN check kernel", device_);
    Check(D().MemcpyAsync(DP(flag_host_), flag_, sizeof(int), check_stream_), "cuMemcpyAsync",
          device_);
    Check(D().StreamSynchronize(check_stream_), "cuStreamSynchronize (NaN check)", device_);
    return *flag_host_ != 0;
  }

  void ToHost(int stream, void* host, const void* src, size_t bytes) override {
    Use();
    PerStream& st = at(stream);
    if (bytes) {
      Check(D().MemcpyAsync(DP(host), DP(src), bytes, st.stream), "cuMemcpyAsync", device_);
    }
    Check(D().StreamSynchronize(st.stream), "cuStreamSynchronize", device_);
  }

  void FromHost(int stream, void* dst, const void* host, size_t bytes) override {
    if (!bytes) return;
    Use();
    PerStream& st = at(stream);
    Check(D().MemcpyAsync(DP(dst), DP(host), bytes, st.stream), "cuMemcpyAsync", device_);
    const char* h = static_cast<const char*>(host);
    const char* staging = static_cast<const char*>(st.staging.ptr);
    if (staging != nullptr && h >= staging && h + bytes <= staging + st.staging.size) {
      // The plane's own pinned staging: asynchronous; Buffer waits for it.
      Check(D().EventRecord(st.staging_free, st.stream), "cuEventRecord", device_);
    } else {
      // The caller may reuse its memory at once.
      Check(D().StreamSynchronize(st.stream), "cuStreamSynchronize", device_);
    }
  }

  std::function<bool()> Marker(int stream) override {
    Use();
    cu::Event event;
    Check(TakeEvent(device_, &event), "cuEventCreate", device_);
    Check(D().EventRecord(event, at(stream).stream), "cuEventRecord", device_);
    auto held = std::shared_ptr<std::remove_pointer_t<cu::Event>>(event, GiveEvent);
    const int device = device_;
    return [held, device] {
      const cu::Result e = D().EventQuery(held.get());
      if (e == cu::kNotReady) return false;
      Check(e, "the device work of a transport", device);
      return true;
    };
  }

  void Finish(int stream, std::function<void(const std::string&)> done) override {
    Use();
    PerStream& st = at(stream);
    cu::Event event;
    Check(TakeEvent(device_, &event), "cuEventCreate", device_);
    Check(D().EventRecord(event, st.stream), "cuEventRecord", device_);
    st.finisher->Add(event, std::move(done));
  }

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;
  };
  struct PerStream {
    cu::Stream stream = nullptr;
    Block device[static_cast<int>(PlaneBuffer::kCount)];
    Block staging;     // pinned host memory
    Block table;       // the batched copy's table, on the device
    Block table_host;  // and where it is written, pinned
    std::vector<void*> retired_host;  // pinned blocks outgrown (Grow)
    cu::Event staging_free = nullptr;
    cu::Event table_free = nullptr;
    std::unique_ptr<Finisher> finisher;
  };

  PerStream& at(int stream) { return *streams_.at(static_cast<size_t>(stream)); }
  void Use() { Check(UseDevice(device_), "making the device's context current", device_); }

  // Grows b to at least `bytes` (growing is rare: buffers only grow) without
  // a device-wide synchronisation: freeing device or pinned memory the
  // ordinary way waits for the whole device, and a NCCL kernel of another
  // stream may be waiting there for a peer that is itself waiting for this
  // rank, a deadlock. Device memory is freed and allocated in the stream's
  // order (work queued there may still use the old block); pinned host
  // memory is kept until the plane goes, as transports and queued copies may
  // still read the old block.
  void Grow(PerStream& st, Block& b, size_t bytes, bool host) {
    if (b.size >= bytes && b.ptr != nullptr) return;
    size_t want = bytes < 256 ? 256 : bytes;
    if (want < b.size * 5 / 4) want = b.size * 5 / 4;
    if (host) {
      if (b.ptr) st.retired_host.push_back(b.ptr);  // still held: counted on
      b.ptr = nullptr;
      b.size = 0;
      CheckAllocation(D().MemHostAlloc(&b.ptr, want, cu::kHostAllocPortable), want, "pinned host");
      host_bytes_ += want;
    } else {
      if (b.ptr) Check(D().MemFreeAsync(DP(b.ptr), st.stream), "cuMemFreeAsync", device_);
      device_bytes_ -= b.size;
      b.ptr = nullptr;
      b.size = 0;
      cu::DevicePtr p = 0;
      CheckAllocation(D().MemAllocAsync(&p, want, st.stream), want, "device");
      b.ptr = reinterpret_cast<void*>(p);
      device_bytes_ += want;
    }
    b.size = want;
  }

  // An allocation of the plane's buffers that failed: what, where, how
  // much, and what to change (out of memory is the usual cause at the first
  // step, when TF took the GPU's memory).
  void CheckAllocation(cu::Result r, size_t bytes, const char* kind) {
    if (r == cu::kSuccess) return;
    char size[32];
    std::snprintf(size, sizeof(size), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
    throw std::runtime_error(
        std::string("Perseus could not allocate ") + size + " of " + kind + " memory for its " +
        "buffers of CUDA device " + std::to_string(device_) + " (" + D().Describe(r) + "; it " +
        "holds " + std::to_string(device_bytes_.load() >> 20) + " MiB on the device and " +
        std::to_string(host_bytes_.load() >> 20) + " MiB pinned already). Leave room beside " +
        "TensorFlow: turn on its memory growth (PERSEUS_GPU_MEMORY_GROWTH=1, the default, or " +
        "TF_FORCE_GPU_ALLOW_GROWTH=true) or give it a memory limit; smaller buckets " +
        "(PERSEUS_FUSION_THRESHOLD) need smaller buffers");
  }

  int device_;
  std::atomic<size_t> device_bytes_{0}, host_bytes_{0};
  std::vector<std::unique_ptr<PerStream>> streams_;
  std::mutex check_mu_;
  cu::Stream check_stream_ = nullptr;
  cu::DevicePtr flag_ = 0;
  int* flag_host_ = nullptr;
};

}  // namespace
}  // namespace perseus

namespace cu = perseus::cu;

extern "C" {

void* perseus_cuda_plane_create(int device, int streams, char* error, size_t error_len) {
  try {
    std::string why;
    const cu::Driver* driver = cu::Driver::Get(&why);
    if (driver == nullptr) throw std::runtime_error(why);
    int count = 0;
    const cu::Result e = driver->DeviceGetCount(&count);
    if (e != cu::kSuccess) {
      throw std::runtime_error("no CUDA device is usable here (" + driver->Describe(e) + ")");
    }
    if (device < 0 || device >= count) {
      throw std::runtime_error("CUDA device " + std::to_string(device) + " does not exist: this "
                               "process sees " + std::to_string(count) + " (CUDA_VISIBLE_DEVICES?)");
    }
    return static_cast<perseus::DataPlane*>(new perseus::CudaPlane(device, streams));
  } catch (const std::exception& ex) {
    if (error && error_len) std::snprintf(error, error_len, "%s", ex.what());
    return nullptr;
  }
}

}  // extern "C"
