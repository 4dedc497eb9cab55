// libperseus_cuda.so's C calls besides the plane (cuda_plane.h): device
// count, error text, the events TF's GPU kernels record, and the test
// harness's memory and producer; and the primary contexts (context.h).
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cc/cuda/context.h"
#include "cc/cuda/cuda_plane.h"
#include "cc/cuda/kernels.h"

namespace perseus {

const cu::Driver& D() { return *cu::Driver::Get(nullptr); }

// Device `device`'s primary context (retained once, kept for the process)
// made current on the calling thread.
cu::Result UseDevice(int device) {
  static std::mutex mu;
  static std::map<int, cu::Context> contexts;
  cu::Context ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = contexts.find(device);
    if (it != contexts.end()) {
      ctx = it->second;
    } else {
      cu::Device dev = 0;
      cu::Result r = D().DeviceGet(&dev, device);
      if (r == cu::kSuccess) r = D().DevicePrimaryCtxRetain(&ctx, dev);
      if (r != cu::kSuccess) return r;
      contexts[device] = ctx;
    }
  }
  cu::Context current = nullptr;
  D().CtxGetCurrent(&current);
  return current == ctx ? cu::kSuccess : D().CtxSetCurrent(ctx);
}

namespace {

std::mutex g_events_mu;
std::map<int, std::vector<cu::Event>> g_free_events;  // by device
std::map<cu::Event, int> g_event_device;              // every event the pool made

}  // namespace

cu::Result TakeEvent(int device, cu::Event* out) {
  {
    std::lock_guard<std::mutex> lock(g_events_mu);
    std::vector<cu::Event>& free = g_free_events[device];
    if (!free.empty()) {
      *out = free.back();
      free.pop_back();
      return cu::kSuccess;
    }
  }
  const cu::Result r = D().EventCreate(out, cu::kEventDisableTiming);
  if (r == cu::kSuccess) {
    std::lock_guard<std::mutex> lock(g_events_mu);
    g_event_device[*out] = device;
  }
  return r;
}

void GiveEvent(cu::Event event) {
  if (event == nullptr) return;
  std::lock_guard<std::mutex> lock(g_events_mu);
  auto it = g_event_device.find(event);
  if (it == g_event_device.end()) {
    D().EventDestroy(event);
    return;
  }
  g_free_events[it->second].push_back(event);
}

namespace {

// The device's clock in kHz, for the test producer's delay (0: unknown).
// Asked once per device: CUDA 13 took about 0.7 ms to answer on an H100,
// which spread 40 back-to-back test requests over as many negotiation cycles.
int TestClockKhz(int device) {
  static std::mutex mu;
  static std::map<int, int> khz;
  std::lock_guard<std::mutex> lock(mu);
  auto it = khz.find(device);
  if (it != khz.end()) return it->second;
  int k = 0;
  cu::Device dev = 0;
  if (D().DeviceGet(&dev, device) != cu::kSuccess ||
      D().DeviceGetAttribute(&k, cu::kAttrClockRate, dev) != cu::kSuccess) {
    k = 0;  // not fatal: assume 1 GHz
  }
  khz[device] = k;
  return k;
}

// The test producer's stream of `device` (one per device, non-blocking).
cu::Result TestProducerStream(int device, cu::Stream* out) {
  static std::mutex mu;
  static std::map<int, cu::Stream> producers;
  std::lock_guard<std::mutex> lock(mu);
  auto it = producers.find(device);
  if (it != producers.end()) {
    *out = it->second;
    return cu::kSuccess;
  }
  cu::Result e = D().StreamCreate(out, cu::kStreamNonBlocking);
  if (e == cu::kSuccess) producers[device] = *out;
  return e;
}

// The driver, or its reason in a code error_string gives back.
cu::Result Ready(int device) {
  if (cu::Driver::Get(nullptr) == nullptr) return kKernelsUnavailable;
  return UseDevice(device);
}

}  // namespace
}  // namespace perseus

using perseus::D;
using perseus::DP;
namespace cu = perseus::cu;

extern "C" {

int perseus_cuda_device_count(int* count) {
  *count = 0;
  std::string why;
  const cu::Driver* driver = cu::Driver::Get(&why);
  return driver == nullptr ? perseus::kKernelsUnavailable : driver->DeviceGetCount(count);
}

const char* perseus_cuda_error_string(int code) {
  thread_local std::string text;
  if (code == perseus::kKernelsUnavailable) {
    std::string why;
    text = cu::Driver::Get(&why) == nullptr ? why : perseus::KernelsUnavailableReason();
  } else {
    text = cu::Driver::Get(nullptr) ? D().Describe(code) : "CUDA error " + std::to_string(code);
  }
  return text.c_str();
}

// The test's memory comes and goes in the producer stream's order: an
// ordinary allocation or free could wait for the whole device, NCCL kernels
// included, which deadlocks ranks whose NCCL kernels wait for each other
// (as TF's allocator, which never frees to CUDA while it runs, never does).
// Nothing here waits: the allocation and its fill are ordered before the
// producer's later work and event (perseus_cuda_test_produce); memory handed
// over without such an event needs the caller to wait for the stream itself.
int perseus_cuda_test_alloc(int device, size_t bytes, void** out) {
  cu::Stream ps = nullptr;
  cu::Result e = perseus::Ready(device);
  if (e == cu::kSuccess) e = perseus::TestProducerStream(device, &ps);
  cu::DevicePtr p = 0;
  if (e == cu::kSuccess) e = D().MemAllocAsync(&p, bytes ? bytes : 1, ps);
  if (e == cu::kSuccess) e = D().MemsetD8Async(p, 0xff, bytes ? bytes : 1, ps);
  *out = reinterpret_cast<void*>(p);
  return e;
}

int perseus_cuda_test_free(int device, void* ptr) {
  cu::Stream ps = nullptr;
  cu::Result e = perseus::Ready(device);
  if (e == cu::kSuccess) e = perseus::TestProducerStream(device, &ps);
  // Called once the runtime's device work on it has finished.
  return e == cu::kSuccess ? D().MemFreeAsync(DP(ptr), ps) : e;
}

int perseus_cuda_test_produce(int device, void* dst, const void* host, size_t bytes,
                              int delay_us, void** stream, void** event) {
  cu::Result e = perseus::Ready(device);
  if (e != cu::kSuccess) return e;
  cu::Stream ps;
  e = perseus::TestProducerStream(device, &ps);
  if (e != cu::kSuccess) return e;
  const int khz = perseus::TestClockKhz(device);
  if (bytes) {
    cu::DevicePtr tmp = 0;
    e = D().MemAllocAsync(&tmp, bytes, ps);
    if (e == cu::kSuccess) e = D().MemcpyAsync(tmp, DP(host), bytes, ps);
    if (e != cu::kSuccess) return e;
    e = perseus_cuda_spin(static_cast<long long>(delay_us) * (khz > 0 ? khz : 1000000) / 1000,
                          ps);
    if (e == cu::kSuccess) e = D().MemcpyAsync(DP(dst), tmp, bytes, ps);
    if (e == cu::kSuccess) e = D().MemFreeAsync(tmp, ps);
    if (e != cu::kSuccess) return e;
  }
  cu::Event ev = nullptr;
  e = perseus::TakeEvent(device, &ev);
  if (e == cu::kSuccess) e = D().EventRecord(ev, ps);
  *stream = ps;
  *event = ev;
  return e;
}

int perseus_cuda_test_fetch(int device, void* host, const void* src, size_t bytes) {
  cu::Result e = perseus::Ready(device);
  if (e == cu::kSuccess && bytes) e = D().Memcpy(DP(host), DP(src), bytes);
  return e;
}

int perseus_cuda_event_destroy(void* event) {
  perseus::GiveEvent(static_cast<cu::Event>(event));
  return cu::kSuccess;
}

int perseus_cuda_record_event(int device, void* stream, void** event) {
  *event = nullptr;
  cu::Result e = perseus::Ready(device);
  cu::Event ev = nullptr;
  if (e == cu::kSuccess) e = perseus::TakeEvent(device, &ev);
  if (e == cu::kSuccess) e = D().EventRecord(ev, static_cast<cu::Stream>(stream));
  if (e != cu::kSuccess) {
    if (ev != nullptr) perseus::GiveEvent(ev);
    return e;
  }
  *event = ev;
  return cu::kSuccess;
}

int perseus_cuda_event_synchronize(void* event) {
  return D().EventSynchronize(static_cast<cu::Event>(event));
}

}  // extern "C"
