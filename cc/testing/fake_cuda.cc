// A stand-in for the CUDA driver (libcuda.so.1) and NVRTC in one library,
// for CI, which has no GPU: libperseus_cuda.so opens it through
// PERSEUS_CUDA_DRIVER and PERSEUS_NVRTC_LIBRARY (tests/test_cuda.py builds
// it). It runs Perseus's kernels on the CPU: the kernel source of
// cc/cuda/kernels.cu, included and compiled here as host C++ behind a small emulation of CUDA's built-ins
// (threadIdx and friends, __syncthreads, atomicAdd, shared memory).
//
// What it is: "device memory" is host memory the fake allocated and knows
// by address; every call runs at once, in the caller's thread (streams and
// events exist but are always done). Launches take the kernel's arguments
// the driver's way (an array of pointers to each) and unpack them by the
// kernel's own parameter types, so a launch of kernels.cc that passes the
// wrong types or order computes wrong numbers here too. A kernel runs block
// after block; the threads of a block run one after another, except for
// the kernels that synchronise their threads, whose blocks run as real
// threads meeting at a barrier (__syncthreads anywhere else aborts, naming
// the kernel). What it is not: asynchrony, the PTX float16 casts (done in
// software here), real memory spaces.
//
// Devices (FAKE_CUDA_DEVICES of them, default 1) are told apart as a GPU
// tells them: each has its primary context, and allocations, streams,
// events and loaded kernels belong to the device whose context was current
// when they were made. A call that needs a context fails with
// CUDA_ERROR_INVALID_CONTEXT when none is current, and a launch, copy,
// memset, allocation or event record on a stream (or with a kernel or an
// event) of another device than the current context's fails with
// CUDA_ERROR_INVALID_HANDLE, as the real driver refuses them, so that code
// which leaves the wrong device current fails in CI, not only on a machine
// with several GPUs. (A stream may wait for another device's event, as in
// CUDA.) fake_cuda_pointer_device() and fake_cuda_current_device() let the
// stand-in NCCL check its calls the same way.
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
thread_local std::barrier<>* g_barrier = nullptr;
thread_local const char* g_kernel = "";

void __syncthreads() {
  if (g_barrier == nullptr) {
    std::fprintf(stderr, "fake CUDA: kernel %s calls __syncthreads but is not listed as "
                 "synchronising in cc/testing/fake_cuda.cc\n", g_kernel);
    std::abort();
  }
  g_barrier->arrive_and_wait();
}

template <typename T>
T atomicAdd(T* p, T v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}

float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

long long clock64() {
  return std::chrono::steady_clock::now().time_since_epoch().count();
}

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};

// float32 -> float16 bits, round to nearest even (what cvt.rn.f16.f32 does).
unsigned short emulated_to_half(float f) {
  const unsigned x = __float_as_uint(f);
  const unsigned sign = (x >> 16) & 0x8000u;
  const unsigned abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<unsigned short>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<unsigned short>(sign | 0x7c00u);  // overflow: inf
  if (abs < 0x38800000u) {  // a float16 subnormal (or zero): a multiple of 2^-24
    const float scaled = __uint_as_float(abs) * 16777216.0f;  // exact
    return static_cast<unsigned short>(sign | static_cast<unsigned>(std::nearbyint(scaled)));
  }
  const unsigned mantissa = abs & 0x7fffffu;
  unsigned half = ((abs >> 23) - 112) << 10 | (mantissa >> 13);
  const unsigned rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into the exponent
  return static_cast<unsigned short>(sign | half);
}

float emulated_from_half(unsigned short h) {
  const unsigned sign = (h & 0x8000u) << 16;
  const unsigned exponent = (h >> 10) & 0x1fu;
  const unsigned mantissa = h & 0x3ffu;
  if (exponent == 0) {
    const float v = static_cast<float>(mantissa) / 16777216.0f;
    return sign ? -v : v;
  }
  if (exponent == 31) return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
  return __uint_as_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

}  // namespace

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

#include "cc/cuda/kernels.cu"
#include "cc/cuda/kernel_list.h"

#undef __global__
#undef __device__
#undef __forceinline__
#undef __shared__

namespace {

using Result = int;
constexpr Result kSuccess = 0, kInvalidValue = 1, kInvalidDevice = 101, kInvalidImage = 200,
                 kInvalidContext = 201, kInvalidHandle = 400, kNotFound = 500;

// --- launches: unpacking the driver's argument array by parameter type ----

template <typename... A, size_t... I>
void CallWith(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_reference_t<A>*>(params[I])...);
}

template <typename... A>
constexpr size_t Arity(void (*)(A...)) {
  return sizeof...(A);
}

template <auto Kernel>
void Run(void** params) {
  CallWith(Kernel, params, std::make_index_sequence<Arity(Kernel)>());
}

struct KernelEntry {
  const char* name;
  void (*run)(void**);
  bool synchronising;  // calls __syncthreads: its blocks' threads run at once
};

#define PTF_KERNEL_ENTRY(name, function, synchronising) {#function, &Run<function>, synchronising},
const KernelEntry kKernels[] = {PERSEUS_CUDA_KERNELS(PTF_KERNEL_ENTRY)};
#undef PTF_KERNEL_ENTRY

std::mutex g_mu;
std::map<uintptr_t, size_t> g_device;  // allocations: start -> bytes
std::map<uintptr_t, int> g_owner;      // allocations: start -> device
std::map<uintptr_t, size_t> g_pinned;
long g_launches = 0;
std::string g_last_arch;
std::string g_last_options;  // NVRTC's options at the last compile, space-separated

bool Inside(const std::map<uintptr_t, size_t>& m, uintptr_t p) {
  auto it = m.upper_bound(p);
  if (it == m.begin()) return false;
  --it;
  return p < it->first + (it->second ? it->second : 1);
}

int Devices() {
  const char* env = std::getenv("FAKE_CUDA_DEVICES");
  return env ? std::atoi(env) : 1;
}

struct Context {
  int device;
};
Context g_contexts[16];
thread_local Context* g_current = nullptr;

// What belongs to a device: made while its context was current.
struct Stream {
  int device;
};
struct Event {
  int device;
};
struct Function {
  const KernelEntry* kernel;
  int device;
};
struct Module {
  int device;
  std::map<std::string, Function> functions;
};

int CurrentDevice() { return g_current ? g_current->device : -1; }

// kSuccess when a context is current and `device` (of a stream, event or
// kernel; -1: the current context's own) is its device.
Result OnCurrent(int device) {
  if (g_current == nullptr) return kInvalidContext;
  return device < 0 || device == g_current->device ? kSuccess : kInvalidHandle;
}
// A stream argument: null is the current context's default stream.
Result StreamOnCurrent(void* stream) {
  return OnCurrent(stream ? static_cast<Stream*>(stream)->device : -1);
}

}  // namespace

extern "C" {

// --- the driver --------------------------------------------------------------

Result cuInit(unsigned) { return kSuccess; }
Result cuDriverGetVersion(int* v) {
  *v = 12050;
  return kSuccess;
}
Result cuDeviceGetCount(int* n) {
  *n = Devices();
  return kSuccess;
}
Result cuDeviceGet(int* d, int ordinal) {
  if (ordinal < 0 || ordinal >= Devices()) return kInvalidDevice;
  *d = ordinal;
  return kSuccess;
}
Result cuDeviceGetAttribute(int* v, int attribute, int device) {
  if (device < 0 || device >= Devices()) return kInvalidDevice;
  const char* cc = std::getenv("FAKE_CUDA_CC");  // e.g. "86"; default 80
  const int capability = cc ? std::atoi(cc) : 80;
  switch (attribute) {
    case 13: *v = 1410000; return kSuccess;            // clock rate, kHz
    case 75: *v = capability / 10; return kSuccess;    // compute capability major
    case 76: *v = capability % 10; return kSuccess;    // and minor
    default: return kInvalidValue;
  }
}
Result cuDeviceGetPCIBusId(char* out, int len, int device) {
  if (device < 0 || device >= Devices()) return kInvalidDevice;
  std::snprintf(out, static_cast<size_t>(len), "0000:%02X:00.0", device + 1);
  return kSuccess;
}
Result cuDevicePrimaryCtxRetain(void** ctx, int device) {
  if (device < 0 || device >= Devices()) return kInvalidDevice;
  g_contexts[device].device = device;
  *ctx = &g_contexts[device];
  return kSuccess;
}
Result cuCtxGetCurrent(void** ctx) {
  *ctx = g_current;
  return kSuccess;
}
Result cuCtxSetCurrent(void* ctx) {
  g_current = static_cast<Context*>(ctx);
  return kSuccess;
}
Result cuCtxGetDevice(int* device) {
  if (g_current == nullptr) return kInvalidContext;
  *device = g_current->device;
  return kSuccess;
}
Result cuGetErrorString(Result r, const char** text) {
  static thread_local char buf[64];
  std::snprintf(buf, sizeof(buf), "fake CUDA error %d", r);
  *text = buf;
  return kSuccess;
}
Result cuModuleLoadData(void** module, const void* image) {
  if (g_current == nullptr) return kInvalidContext;
  if (std::strncmp(static_cast<const char*>(image), "FAKE-CUBIN", 10) != 0) return kInvalidImage;
  *module = new Module{g_current->device, {}};  // kept for the process, as modules are
  return kSuccess;
}
Result cuModuleGetFunction(void** function, void* module, const char* name) {
  auto* m = static_cast<Module*>(module);
  for (const KernelEntry& k : kKernels) {
    if (std::strcmp(k.name, name) == 0) {
      std::lock_guard<std::mutex> lock(g_mu);
      Function& f = m->functions[name];
      f = Function{&k, m->device};
      *function = &f;
      return kSuccess;
    }
  }
  return kNotFound;
}
Result cuLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                      unsigned by, unsigned bz, unsigned, void* stream, void** params, void**) {
  const Function& f = *static_cast<const Function*>(function);
  const KernelEntry& k = *f.kernel;
  if (gy != 1 || gz != 1 || by != 1 || bz != 1 || gx == 0 || bx == 0 || bx > 1024) {
    return kInvalidValue;
  }
  // The kernel was loaded into the current context, the stream is of it.
  if (Result r = OnCurrent(f.device); r != kSuccess) return r;
  if (Result r = StreamOnCurrent(stream); r != kSuccess) return r;
  std::lock_guard<std::mutex> lock(g_mu);  // one kernel at a time: gridDim is shared
  ++g_launches;
  gridDim = dim3{gx, 1, 1};
  blockDim = dim3{bx, 1, 1};
  for (unsigned b = 0; b < gx; ++b) {
    if (k.synchronising) {
      std::barrier<> barrier(static_cast<ptrdiff_t>(bx));
      std::vector<std::thread> threads;
      for (unsigned t = 0; t < bx; ++t) {
        threads.emplace_back([&, b, t] {
          blockIdx = dim3{b, 1, 1};
          threadIdx = dim3{t, 1, 1};
          g_barrier = &barrier;
          g_kernel = k.name;
          k.run(params);
        });
      }
      for (auto& th : threads) th.join();
    } else {
      blockIdx = dim3{b, 1, 1};
      g_barrier = nullptr;
      g_kernel = k.name;
      for (unsigned t = 0; t < bx; ++t) {
        threadIdx = dim3{t, 1, 1};
        k.run(params);
      }
    }
  }
  return kSuccess;
}
Result cuStreamCreate(void** stream, unsigned) {
  if (g_current == nullptr) return kInvalidContext;
  *stream = new Stream{g_current->device};
  return kSuccess;
}
Result cuStreamDestroy_v2(void* stream) {
  delete static_cast<Stream*>(stream);
  return kSuccess;
}
Result cuStreamSynchronize(void*) { return kSuccess; }
// The event may be another device's (CUDA allows that); the stream is the
// current context's.
Result cuStreamWaitEvent(void* stream, void*, unsigned) { return StreamOnCurrent(stream); }
long g_event_creates = 0;
Result cuEventCreate(void** event, unsigned) {
  if (g_current == nullptr) return kInvalidContext;
  __atomic_fetch_add(&g_event_creates, 1, __ATOMIC_SEQ_CST);
  *event = new Event{g_current->device};
  return kSuccess;
}
Result cuEventDestroy_v2(void* event) {
  delete static_cast<Event*>(event);
  return kSuccess;
}
Result cuEventRecord(void* event, void* stream) {
  if (Result r = StreamOnCurrent(stream); r != kSuccess) return r;
  return OnCurrent(static_cast<Event*>(event)->device);
}
Result cuEventQuery(void*) { return kSuccess; }
Result cuEventSynchronize(void*) { return kSuccess; }

// FAKE_CUDA_ALLOC_LIMIT: an allocation of more bytes than this fails with
// CUDA_ERROR_OUT_OF_MEMORY (2), as on a GPU whose memory TF took.
bool OverLimit(size_t bytes) {
  const char* limit = std::getenv("FAKE_CUDA_ALLOC_LIMIT");
  return limit != nullptr && bytes > std::strtoull(limit, nullptr, 10);
}

Result cuMemAlloc_v2(unsigned long long* p, size_t bytes) {
  if (g_current == nullptr) return kInvalidContext;
  if (OverLimit(bytes)) return 2;
  void* mem = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  if (mem == nullptr) return 2;  // out of memory
  std::memset(mem, 0xab, bytes);
  std::lock_guard<std::mutex> lock(g_mu);
  g_device[reinterpret_cast<uintptr_t>(mem)] = bytes;
  g_owner[reinterpret_cast<uintptr_t>(mem)] = g_current->device;
  *p = reinterpret_cast<uintptr_t>(mem);
  return kSuccess;
}
Result cuMemFree_v2(unsigned long long p) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_device.erase(static_cast<uintptr_t>(p)) == 0) return kInvalidValue;
  g_owner.erase(static_cast<uintptr_t>(p));
  std::free(reinterpret_cast<void*>(p));
  return kSuccess;
}
Result cuMemAllocAsync(unsigned long long* p, size_t bytes, void* stream) {
  if (Result r = StreamOnCurrent(stream); r != kSuccess) return r;
  return cuMemAlloc_v2(p, bytes);
}
Result cuMemFreeAsync(unsigned long long p, void* stream) {
  if (Result r = StreamOnCurrent(stream); r != kSuccess) return r;
  return cuMemFree_v2(p);
}
Result cuMemHostAlloc(void** p, size_t bytes, unsigned) {
  if (g_current == nullptr) return kInvalidContext;
  *p = std::malloc(bytes ? bytes : 1);
  std::lock_guard<std::mutex> lock(g_mu);
  g_pinned[reinterpret_cast<uintptr_t>(*p)] = bytes;
  return kSuccess;
}
Result cuMemFreeHost(void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_pinned.erase(reinterpret_cast<uintptr_t>(p)) == 0) return kInvalidValue;
  std::free(p);
  return kSuccess;
}
Result cuMemcpy(unsigned long long dst, unsigned long long src, size_t bytes) {
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes);
  return kSuccess;
}
long g_pageable_d2h = 0;
Result cuMemcpyAsync(unsigned long long dst, unsigned long long src, size_t bytes,
                     void* stream) {
  if (Result r = StreamOnCurrent(stream); r != kSuccess) return r;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (bytes && Inside(g_device, static_cast<uintptr_t>(src)) &&
        !Inside(g_device, static_cast<uintptr_t>(dst)) &&
        !Inside(g_pinned, static_cast<uintptr_t>(dst))) {
      ++g_pageable_d2h;  // an asynchronous copy to pageable memory: synchronous on a GPU
    }
  }
  return cuMemcpy(dst, src, bytes);
}
Result cuMemsetD8Async(unsigned long long dst, unsigned char value, size_t bytes,
                       void* stream) {
  if (Result r = StreamOnCurrent(stream); r != kSuccess) return r;
  std::memset(reinterpret_cast<void*>(dst), value, bytes);
  return kSuccess;
}
Result cuPointerGetAttribute(void* out, int attribute, unsigned long long p) {
  std::lock_guard<std::mutex> lock(g_mu);
  const bool device = Inside(g_device, static_cast<uintptr_t>(p));
  const bool pinned = Inside(g_pinned, static_cast<uintptr_t>(p));
  if (!device && !pinned) return kInvalidValue;  // memory the driver does not know
  if (attribute == 2) {  // memory type
    *static_cast<unsigned*>(out) = device ? 2u : 1u;
  } else if (attribute == 8) {  // managed
    *static_cast<int*>(out) = 0;
  } else {
    return kInvalidValue;
  }
  return kSuccess;
}

// For tests: kernels launched so far, and the last architecture compiled for.
long fake_cuda_launches() { return g_launches; }
long fake_cuda_pageable_d2h() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_pageable_d2h;
}
long fake_cuda_event_creates() { return __atomic_load_n(&g_event_creates, __ATOMIC_SEQ_CST); }
const char* fake_cuda_last_arch() { return g_last_arch.c_str(); }
const char* fake_cuda_last_options() { return g_last_options.c_str(); }
// The device a pointer's allocation belongs to (-1: not device memory), and
// the calling thread's current device (-1: no context current).
int fake_cuda_pointer_device(const void* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_owner.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it == g_owner.begin()) return -1;
  --it;
  return Inside(g_device, reinterpret_cast<uintptr_t>(p)) ? it->second : -1;
}
int fake_cuda_current_device() { return CurrentDevice(); }

// --- NVRTC -------------------------------------------------------------------

struct FakeProgram {
  std::string source, arch, output;
};

int nvrtcVersion(int* major, int* minor) {
  *major = 12;
  *minor = 5;
  return 0;
}
const int kArchs[] = {50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90};
int nvrtcGetNumSupportedArchs(int* n) {
  *n = static_cast<int>(sizeof(kArchs) / sizeof(kArchs[0]));
  return 0;
}
int nvrtcGetSupportedArchs(int* out) {
  std::memcpy(out, kArchs, sizeof(kArchs));
  return 0;
}
int nvrtcCreateProgram(void** prog, const char* src, const char*, int, const char* const*,
                       const char* const*) {
  auto* p = new FakeProgram();
  p->source = src;
  *prog = p;
  return 0;
}
int nvrtcDestroyProgram(void** prog) {
  delete static_cast<FakeProgram*>(*prog);
  *prog = nullptr;
  return 0;
}
int nvrtcCompileProgram(void* prog, int n, const char* const* options) {
  auto* p = static_cast<FakeProgram*>(prog);
  std::string all;
  for (int i = 0; i < n; ++i) {
    const std::string o = options[i];
    if (o.rfind("--gpu-architecture=", 0) == 0) p->arch = o.substr(19);
    all += (i ? " " : "") + o;
  }
  if (p->arch.empty() || p->source.find("perseus_to_half") == std::string::npos) return 6;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_last_arch = p->arch;
    g_last_options = all;
  }
  p->output = "FAKE-CUBIN for " + p->arch;
  p->output.push_back('\0');
  return 0;
}
int nvrtcGetProgramLogSize(void*, size_t* n) {
  *n = 1;
  return 0;
}
int nvrtcGetProgramLog(void*, char* log) {
  *log = '\0';
  return 0;
}
int nvrtcGetCUBINSize(void* prog, size_t* n) {
  *n = static_cast<FakeProgram*>(prog)->output.size();
  return 0;
}
int nvrtcGetCUBIN(void* prog, char* out) {
  const std::string& o = static_cast<FakeProgram*>(prog)->output;
  std::memcpy(out, o.data(), o.size());
  return 0;
}
int nvrtcGetPTXSize(void* prog, size_t* n) { return nvrtcGetCUBINSize(prog, n); }
int nvrtcGetPTX(void* prog, char* out) { return nvrtcGetCUBIN(prog, out); }
const char* nvrtcGetErrorString(int r) { return r == 0 ? "NVRTC_SUCCESS" : "fake NVRTC error"; }

}  // extern "C"
