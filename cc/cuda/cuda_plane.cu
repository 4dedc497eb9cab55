// The CUDA data plane (cc/device/data_plane.h): every memory operation of
// the executor is queued on the runtime's own non-blocking streams, ordered
// after the producer's event, and a request completes when a thread of the
// plane sees the event recorded after its work fire. Nothing here makes the
// whole device wait. Host staging buffers are pinned, so copies through
// them are asynchronous.
#include "cc/cuda/cuda_plane.h"

#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cc/cuda/kernels.h"
#include "cc/device/data_plane.h"

namespace perseus {
namespace {

void Check(cudaError_t e, const char* what, int device) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + " on device " +
                             std::to_string(device) + ": " + cudaGetErrorString(e));
  }
}

size_t ElementSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kUint16:
    case DataType::kInt16: return 2;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    default: return 1;
  }
}

bool OnDevice(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // plain host memory on old drivers: clear the error
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
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
  void Add(cudaEvent_t event, std::function<void(const std::string&)> done) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.emplace_back(event, std::move(done));
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    cudaSetDevice(device_);
    while (true) {
      std::pair<cudaEvent_t, std::function<void(const std::string&)>> item;
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
      cudaError_t e;
      while ((e = cudaEventQuery(item.first)) == cudaErrorNotReady) {
        std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
        if (pause_us < 500) pause_us *= 2;
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
      cudaEventDestroy(item.first);
      item.second(e == cudaSuccess ? std::string()
                                   : std::string("CUDA error in the device work of ") + what_ +
                                         ": " + cudaGetErrorString(e));
    }
  }

  int device_;
  std::string what_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<cudaEvent_t, std::function<void(const std::string&)>>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

class CudaPlane : public DataPlane {
 public:
  CudaPlane(int device, int streams) : device_(device) {
    Check(cudaSetDevice(device), "cudaSetDevice", device);
    for (int s = 0; s < streams; ++s) {
      auto st = std::make_unique<PerStream>();
      Check(cudaStreamCreateWithFlags(&st->stream, cudaStreamNonBlocking), "cudaStreamCreate",
            device);
      Check(cudaEventCreateWithFlags(&st->staging_free, cudaEventDisableTiming),
            "cudaEventCreate", device);
      Check(cudaEventCreateWithFlags(&st->table_free, cudaEventDisableTiming), "cudaEventCreate",
            device);
      st->finisher = std::make_unique<Finisher>(
          device, "stream " + std::to_string(s) + " of CUDA device " + std::to_string(device));
      streams_.push_back(std::move(st));
    }
    Check(cudaStreamCreateWithFlags(&check_stream_, cudaStreamNonBlocking), "cudaStreamCreate",
          device);
    Check(cudaMalloc(&flag_, sizeof(int)), "cudaMalloc", device);
    Check(cudaHostAlloc(reinterpret_cast<void**>(&flag_host_), sizeof(int), cudaHostAllocDefault),
          "cudaHostAlloc", device);
  }

  ~CudaPlane() override {
    cudaSetDevice(device_);
    for (auto& st : streams_) {
      cudaStreamSynchronize(st->stream);
      st->finisher.reset();  // runs what is left to complete
      for (auto& b : st->device) cudaFreeAsync(b.ptr, st->stream);
      cudaFreeAsync(st->table.ptr, st->stream);
      cudaStreamSynchronize(st->stream);
      cudaFreeHost(st->staging.ptr);
      cudaFreeHost(st->table_host.ptr);
      for (void* p : st->retired_host) cudaFreeHost(p);
      cudaEventDestroy(st->staging_free);
      cudaEventDestroy(st->table_free);
      cudaStreamDestroy(st->stream);
    }
    cudaStreamSynchronize(check_stream_);
    cudaStreamDestroy(check_stream_);
    cudaFree(flag_);
    cudaFreeHost(flag_host_);
  }

  MemoryKind kind() const override { return MemoryKind::kCuda; }
  int device() const override { return device_; }
  void* NativeStream(int stream) override { return at(stream).stream; }

  void WaitReady(int stream, const Placement& where) override {
    if (!where.ready) return;
    Use();
    Check(cudaStreamWaitEvent(at(stream).stream, static_cast<cudaEvent_t>(where.ready.get()), 0),
          "cudaStreamWaitEvent (the producer's event)", device_);
  }

  void* Buffer(int stream, PlaneBuffer which, size_t bytes) override {
    Use();
    PerStream& st = at(stream);
    if (which == PlaneBuffer::kStaging) {
      Grow(st, st.staging, bytes, /*host=*/true);
      // An asynchronous copy out of it (FromHost) may still be reading.
      Check(cudaEventSynchronize(st.staging_free), "waiting for the staging buffer", device_);
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
        Check(cudaMemcpyAsync(s->dst, s->src, s->bytes, cudaMemcpyDefault, st.stream),
              "cudaMemcpyAsync", device_);
      }
      // Host memory among them: done before returning, as on the host plane.
      if (!all_device) Check(cudaStreamSynchronize(st.stream), "cudaStreamSynchronize", device_);
      return;
    }
    // All on the device: one launch, its table uploaded from pinned memory.
    const size_t table_bytes = 3 * sizeof(uint64_t) * work.size();
    Check(cudaEventSynchronize(st.table_free), "waiting for the copy table", device_);
    Grow(st, st.table_host, table_bytes, /*host=*/true);
    Grow(st, st.table, table_bytes, /*host=*/false);
    uint64_t* t = static_cast<uint64_t*>(st.table_host.ptr);
    for (size_t i = 0; i < work.size(); ++i) {
      t[3 * i] = reinterpret_cast<uint64_t>(work[i]->src);
      t[3 * i + 1] = reinterpret_cast<uint64_t>(work[i]->dst);
      t[3 * i + 2] = work[i]->bytes;
    }
    Check(cudaMemcpyAsync(st.table.ptr, t, table_bytes, cudaMemcpyHostToDevice, st.stream),
          "cudaMemcpyAsync (copy table)", device_);
    Check(cudaEventRecord(st.table_free, st.stream), "cudaEventRecord", device_);
    Check(static_cast<cudaError_t>(perseus_cuda_batched_copy(
              static_cast<const uint64_t*>(st.table.ptr), static_cast<int>(work.size()),
              st.stream)),
          "the batched copy kernel", device_);
  }

  void Scale(int stream, void* data, DataType dtype, size_t n, double factor) override {
    if (factor == 1.0 || n == 0) return;
    Use();
    Check(static_cast<cudaError_t>(
              perseus_cuda_scale(data, static_cast<int>(dtype), n, factor, at(stream).stream)),
          "the scale kernel", device_);
  }

  void ToHalf(int stream, const float* in, uint16_t* out, size_t n, float scale) override {
    if (n == 0) return;
    Use();
    Check(static_cast<cudaError_t>(perseus_cuda_to_half(in, out, n, scale, at(stream).stream)),
          "the float16 kernel", device_);
  }

  void FromHalf(int stream, const uint16_t* in, float* out, size_t n, float scale) override {
    if (n == 0) return;
    Use();
    Check(static_cast<cudaError_t>(perseus_cuda_from_half(in, out, n, scale, at(stream).stream)),
          "the float16 kernel", device_);
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
      Check(cudaStreamWaitEvent(check_stream_, static_cast<cudaEvent_t>(where.ready.get()), 0),
            "cudaStreamWaitEvent (the producer's event)", device_);
    }
    Check(cudaMemsetAsync(flag_, 0, sizeof(int), check_stream_), "cudaMemsetAsync", device_);
    Check(static_cast<cudaError_t>(perseus_cuda_nonfinite(data, kind, n, flag_, check_stream_)),
          "the NaN check kernel", device_);
    Check(cudaMemcpyAsync(flag_host_, flag_, sizeof(int), cudaMemcpyDeviceToHost, check_stream_),
          "cudaMemcpyAsync", device_);
    Check(cudaStreamSynchronize(check_stream_), "cudaStreamSynchronize (NaN check)", device_);
    return *flag_host_ != 0;
  }

  void ToHost(int stream, void* host, const void* src, size_t bytes) override {
    Use();
    PerStream& st = at(stream);
    if (bytes) {
      Check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDefault, st.stream), "cudaMemcpyAsync",
            device_);
    }
    Check(cudaStreamSynchronize(st.stream), "cudaStreamSynchronize", device_);
  }

  void FromHost(int stream, void* dst, const void* host, size_t bytes) override {
    if (!bytes) return;
    Use();
    PerStream& st = at(stream);
    Check(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyDefault, st.stream), "cudaMemcpyAsync",
          device_);
    const char* h = static_cast<const char*>(host);
    const char* staging = static_cast<const char*>(st.staging.ptr);
    if (staging != nullptr && h >= staging && h + bytes <= staging + st.staging.size) {
      // The plane's own pinned staging: asynchronous; Buffer waits for it.
      Check(cudaEventRecord(st.staging_free, st.stream), "cudaEventRecord", device_);
    } else {
      // The caller may reuse its memory at once.
      Check(cudaStreamSynchronize(st.stream), "cudaStreamSynchronize", device_);
    }
  }

  std::function<bool()> Marker(int stream) override {
    Use();
    cudaEvent_t event;
    Check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate", device_);
    Check(cudaEventRecord(event, at(stream).stream), "cudaEventRecord", device_);
    auto held = std::shared_ptr<CUevent_st>(event, [](cudaEvent_t e) { cudaEventDestroy(e); });
    const int device = device_;
    return [held, device] {
      const cudaError_t e = cudaEventQuery(held.get());
      if (e == cudaErrorNotReady) return false;
      Check(e, "the device work of a transport", device);
      return true;
    };
  }

  void Finish(int stream, std::function<void(const std::string&)> done) override {
    Use();
    PerStream& st = at(stream);
    cudaEvent_t event;
    Check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate", device_);
    Check(cudaEventRecord(event, st.stream), "cudaEventRecord", device_);
    st.finisher->Add(event, std::move(done));
  }

 private:
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;
  };
  struct PerStream {
    cudaStream_t stream = nullptr;
    Block device[static_cast<int>(PlaneBuffer::kCount)];
    Block staging;     // pinned host memory
    Block table;       // the batched copy's table, on the device
    Block table_host;  // and where it is written, pinned
    std::vector<void*> retired_host;  // pinned blocks outgrown (Grow)
    cudaEvent_t staging_free = nullptr;
    cudaEvent_t table_free = nullptr;
    std::unique_ptr<Finisher> finisher;
  };

  PerStream& at(int stream) { return *streams_.at(static_cast<size_t>(stream)); }
  void Use() { Check(cudaSetDevice(device_), "cudaSetDevice", device_); }

  // Grows b to at least `bytes` (growing is rare: buffers only grow) without
  // a device-wide synchronisation: cudaFree and cudaFreeHost wait for the
  // whole device, and a NCCL kernel of another stream may be waiting there
  // for a peer that is itself waiting for this rank, a deadlock. Device
  // memory is freed and allocated in the stream's order (work queued there
  // may still use the old block); pinned host memory is kept until the plane
  // goes, as transports and queued copies may still read the old block.
  void Grow(PerStream& st, Block& b, size_t bytes, bool host) {
    if (b.size >= bytes && b.ptr != nullptr) return;
    size_t want = bytes < 256 ? 256 : bytes;
    if (want < b.size * 5 / 4) want = b.size * 5 / 4;
    if (host) {
      if (b.ptr) st.retired_host.push_back(b.ptr);
      b.ptr = nullptr;
      b.size = 0;
      Check(cudaHostAlloc(&b.ptr, want, cudaHostAllocPortable), "cudaHostAlloc", device_);
    } else {
      if (b.ptr) Check(cudaFreeAsync(b.ptr, st.stream), "cudaFreeAsync", device_);
      b.ptr = nullptr;
      b.size = 0;
      Check(cudaMallocAsync(&b.ptr, want, st.stream), "cudaMallocAsync", device_);
    }
    b.size = want;
  }

  int device_;
  std::vector<std::unique_ptr<PerStream>> streams_;
  std::mutex check_mu_;
  cudaStream_t check_stream_ = nullptr;
  int* flag_ = nullptr;
  int* flag_host_ = nullptr;
};

__global__ void Spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace
}  // namespace perseus

extern "C" {

void* perseus_cuda_plane_create(int device, int streams, char* error, size_t error_len) {
  try {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
      throw std::runtime_error(std::string("no CUDA device is usable here (") +
                               cudaGetErrorString(e) + ")");
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

int perseus_cuda_device_count(int* count) { return cudaGetDeviceCount(count); }

const char* perseus_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// The device's clock in kHz, for the producer's delay (0: unknown). Asked
// once per device: CUDA 13 takes about 0.7 ms to answer (seen on an H100),
// which spread 40 back-to-back test requests over as many negotiation cycles.
static int TestClockKhz(int device) {
  static std::mutex mu;
  static std::map<int, int> khz;
  std::lock_guard<std::mutex> lock(mu);
  auto it = khz.find(device);
  if (it != khz.end()) return it->second;
  int k = 0;
  if (cudaDeviceGetAttribute(&k, cudaDevAttrClockRate, device) != cudaSuccess) {
    cudaGetLastError();  // not fatal: assume 1 GHz
    k = 0;
  }
  khz[device] = k;
  return k;
}

// The test producer's stream of `device` (one per device, non-blocking).
static cudaError_t TestProducerStream(int device, cudaStream_t* out) {
  static std::mutex mu;
  static std::map<int, cudaStream_t> producers;
  std::lock_guard<std::mutex> lock(mu);
  auto it = producers.find(device);
  if (it != producers.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  cudaError_t e = cudaStreamCreateWithFlags(out, cudaStreamNonBlocking);
  if (e == cudaSuccess) producers[device] = *out;
  return e;
}

// The test's memory comes and goes in the producer stream's order: cudaMalloc
// and cudaFree could wait for the whole device, NCCL kernels included, which
// deadlocks ranks whose NCCL kernels wait for each other (as TF's allocator,
// which never frees to CUDA while it runs, never does). Nothing here waits:
// the allocation and its fill are ordered before the producer's later work
// and event (perseus_cuda_test_produce); memory handed over without such an
// event needs the caller to wait for the stream itself.
int perseus_cuda_test_alloc(int device, size_t bytes, void** out) {
  cudaStream_t ps = nullptr;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = TestProducerStream(device, &ps);
  if (e == cudaSuccess) e = cudaMallocAsync(out, bytes ? bytes : 1, ps);
  if (e == cudaSuccess) e = cudaMemsetAsync(*out, 0xff, bytes ? bytes : 1, ps);
  return e;
}

int perseus_cuda_test_free(int device, void* ptr) {
  cudaStream_t ps = nullptr;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = TestProducerStream(device, &ps);
  // Called once the runtime's device work on it has finished.
  return e == cudaSuccess ? cudaFreeAsync(ptr, ps) : e;
}

int perseus_cuda_test_produce(int device, void* dst, const void* host, size_t bytes,
                              int delay_us, void** stream, void** event) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) return e;
  cudaStream_t ps;
  e = TestProducerStream(device, &ps);
  if (e != cudaSuccess) return e;
  const int khz = TestClockKhz(device);
  if (bytes) {
    void* tmp = nullptr;
    e = cudaMallocAsync(&tmp, bytes, ps);
    if (e == cudaSuccess) e = cudaMemcpyAsync(tmp, host, bytes, cudaMemcpyHostToDevice, ps);
    if (e != cudaSuccess) return e;
    perseus::Spin<<<1, 1, 0, ps>>>(static_cast<long long>(delay_us) * (khz > 0 ? khz : 1000000) /
                                   1000);
    e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaMemcpyAsync(dst, tmp, bytes, cudaMemcpyDeviceToDevice, ps);
    if (e == cudaSuccess) e = cudaFreeAsync(tmp, ps);
    if (e != cudaSuccess) return e;
  }
  cudaEvent_t ev;
  e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(ev, ps);
  *stream = ps;
  *event = ev;
  return e;
}

int perseus_cuda_test_fetch(int device, void* host, const void* src, size_t bytes) {
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess && bytes) e = cudaMemcpy(host, src, bytes, cudaMemcpyDeviceToHost);
  return e;
}

int perseus_cuda_event_destroy(void* event) {
  return cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

int perseus_cuda_record_event(int device, void* stream, void** event) {
  *event = nullptr;
  cudaError_t e = cudaSetDevice(device);
  cudaEvent_t ev = nullptr;
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(ev, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    if (ev != nullptr) cudaEventDestroy(ev);
    return e;
  }
  *event = ev;
  return cudaSuccess;
}

int perseus_cuda_event_synchronize(void* event) {
  return cudaEventSynchronize(static_cast<cudaEvent_t>(event));
}

}  // extern "C"
