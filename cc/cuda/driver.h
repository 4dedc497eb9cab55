// The CUDA driver API and NVRTC, opened at run time: libperseus_cuda.so is
// built by the host compiler alone (at `pip install`, with no CUDA toolkit)
// and links neither. The driver (libcuda.so.1) comes with any NVIDIA
// driver; NVRTC with TF's CUDA wheels (nvidia-cuda-nvrtc-cu12) or a CUDA
// toolkit. Only the calls Perseus makes are declared, with the driver's
// C ABI (the names are the versioned symbols cuda.h maps them to);
// tests/test_cuda.py compares each with the real cuda.h and nvrtc.h.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

// The handles' types, as cuda.h and nvrtc.h name them.
struct CUctx_st;
struct CUmod_st;
struct CUfunc_st;
struct CUstream_st;
struct CUevent_st;
struct _nvrtcProgram;

namespace perseus {
namespace cu {

using Result = int;                    // CUresult
using Device = int;                    // CUdevice
using Context = ::CUctx_st*;           // CUcontext
using Module = ::CUmod_st*;            // CUmodule
using Function = ::CUfunc_st*;         // CUfunction
using Stream = ::CUstream_st*;         // CUstream (a cudaStream_t)
using Event = ::CUevent_st*;           // CUevent (a cudaEvent_t)
using DevicePtr = unsigned long long;  // CUdeviceptr

// Each call: (field of Driver, the name cuda.h declares, the symbol loaded:
// the versioned one cuda.h maps the name to).
#define PTF_CUDA_DRIVER_CALLS(X)                                   \
  X(Init, cuInit, "cuInit")                                             \
  X(DriverGetVersion, cuDriverGetVersion, "cuDriverGetVersion")         \
  X(DeviceGetCount, cuDeviceGetCount, "cuDeviceGetCount")               \
  X(DeviceGet, cuDeviceGet, "cuDeviceGet")                              \
  X(DeviceGetAttribute, cuDeviceGetAttribute, "cuDeviceGetAttribute")   \
  X(DeviceGetPCIBusId, cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId")      \
  X(DevicePrimaryCtxRetain, cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain") \
  X(CtxGetCurrent, cuCtxGetCurrent, "cuCtxGetCurrent")                  \
  X(CtxSetCurrent, cuCtxSetCurrent, "cuCtxSetCurrent")                  \
  X(CtxGetDevice, cuCtxGetDevice, "cuCtxGetDevice")                     \
  X(GetErrorString, cuGetErrorString, "cuGetErrorString")               \
  X(ModuleLoadData, cuModuleLoadData, "cuModuleLoadData")               \
  X(ModuleGetFunction, cuModuleGetFunction, "cuModuleGetFunction")      \
  X(LaunchKernel, cuLaunchKernel, "cuLaunchKernel")                     \
  X(StreamCreate, cuStreamCreate, "cuStreamCreate")                     \
  X(StreamDestroy, cuStreamDestroy, "cuStreamDestroy_v2")               \
  X(StreamSynchronize, cuStreamSynchronize, "cuStreamSynchronize")      \
  X(StreamWaitEvent, cuStreamWaitEvent, "cuStreamWaitEvent")            \
  X(EventCreate, cuEventCreate, "cuEventCreate")                        \
  X(EventDestroy, cuEventDestroy, "cuEventDestroy_v2")                  \
  X(EventRecord, cuEventRecord, "cuEventRecord")                        \
  X(EventQuery, cuEventQuery, "cuEventQuery")                           \
  X(EventSynchronize, cuEventSynchronize, "cuEventSynchronize")         \
  X(MemAlloc, cuMemAlloc, "cuMemAlloc_v2")                              \
  X(MemFree, cuMemFree, "cuMemFree_v2")                                 \
  X(MemAllocAsync, cuMemAllocAsync, "cuMemAllocAsync")                  \
  X(MemFreeAsync, cuMemFreeAsync, "cuMemFreeAsync")                     \
  X(MemHostAlloc, cuMemHostAlloc, "cuMemHostAlloc")                     \
  X(MemFreeHost, cuMemFreeHost, "cuMemFreeHost")                        \
  X(Memcpy, cuMemcpy, "cuMemcpy")                                       \
  X(MemcpyAsync, cuMemcpyAsync, "cuMemcpyAsync")                        \
  X(MemsetD8Async, cuMemsetD8Async, "cuMemsetD8Async")                  \
  X(PointerGetAttribute, cuPointerGetAttribute, "cuPointerGetAttribute")

#define PTF_NVRTC_CALLS(X)                                                   \
  X(Version, nvrtcVersion, "nvrtcVersion")                                        \
  X(GetNumSupportedArchs, nvrtcGetNumSupportedArchs, "nvrtcGetNumSupportedArchs") \
  X(GetSupportedArchs, nvrtcGetSupportedArchs, "nvrtcGetSupportedArchs")          \
  X(CreateProgram, nvrtcCreateProgram, "nvrtcCreateProgram")                      \
  X(DestroyProgram, nvrtcDestroyProgram, "nvrtcDestroyProgram")                   \
  X(CompileProgram, nvrtcCompileProgram, "nvrtcCompileProgram")                   \
  X(GetProgramLogSize, nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize")          \
  X(GetProgramLog, nvrtcGetProgramLog, "nvrtcGetProgramLog")                      \
  X(GetCUBINSize, nvrtcGetCUBINSize, "nvrtcGetCUBINSize")                         \
  X(GetCUBIN, nvrtcGetCUBIN, "nvrtcGetCUBIN")                                     \
  X(GetPTXSize, nvrtcGetPTXSize, "nvrtcGetPTXSize")                               \
  X(GetPTX, nvrtcGetPTX, "nvrtcGetPTX")                                           \
  X(GetErrorString, nvrtcGetErrorString, "nvrtcGetErrorString")

constexpr Result kSuccess = 0;
constexpr Result kInvalidValue = 1;
constexpr Result kNotReady = 600;
constexpr unsigned kStreamNonBlocking = 1;     // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDisableTiming = 2;    // CU_EVENT_DISABLE_TIMING
constexpr unsigned kHostAllocPortable = 1;     // CU_MEMHOSTALLOC_PORTABLE
constexpr int kAttrClockRate = 13;             // CU_DEVICE_ATTRIBUTE_CLOCK_RATE
constexpr int kAttrComputeMajor = 75;          // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttrComputeMinor = 76;          // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
constexpr int kPointerMemoryType = 2;          // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr int kPointerIsManaged = 8;           // CU_POINTER_ATTRIBUTE_IS_MANAGED
constexpr unsigned kMemoryTypeDevice = 2;      // CU_MEMORYTYPE_DEVICE

struct Driver {
  Result (*Init)(unsigned) = nullptr;
  Result (*DriverGetVersion)(int*) = nullptr;
  Result (*DeviceGetCount)(int*) = nullptr;
  Result (*DeviceGet)(Device*, int) = nullptr;
  Result (*DeviceGetAttribute)(int*, int, Device) = nullptr;
  Result (*DeviceGetPCIBusId)(char*, int, Device) = nullptr;
  Result (*DevicePrimaryCtxRetain)(Context*, Device) = nullptr;
  Result (*CtxGetCurrent)(Context*) = nullptr;
  Result (*CtxSetCurrent)(Context) = nullptr;
  Result (*CtxGetDevice)(Device*) = nullptr;
  Result (*GetErrorString)(Result, const char**) = nullptr;
  Result (*ModuleLoadData)(Module*, const void*) = nullptr;
  Result (*ModuleGetFunction)(Function*, Module, const char*) = nullptr;
  Result (*LaunchKernel)(Function, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, Stream, void**, void**) = nullptr;
  Result (*StreamCreate)(Stream*, unsigned) = nullptr;
  Result (*StreamDestroy)(Stream) = nullptr;
  Result (*StreamSynchronize)(Stream) = nullptr;
  Result (*StreamWaitEvent)(Stream, Event, unsigned) = nullptr;
  Result (*EventCreate)(Event*, unsigned) = nullptr;
  Result (*EventDestroy)(Event) = nullptr;
  Result (*EventRecord)(Event, Stream) = nullptr;
  Result (*EventQuery)(Event) = nullptr;
  Result (*EventSynchronize)(Event) = nullptr;
  Result (*MemAlloc)(DevicePtr*, size_t) = nullptr;
  Result (*MemFree)(DevicePtr) = nullptr;
  Result (*MemAllocAsync)(DevicePtr*, size_t, Stream) = nullptr;
  Result (*MemFreeAsync)(DevicePtr, Stream) = nullptr;
  Result (*MemHostAlloc)(void**, size_t, unsigned) = nullptr;
  Result (*MemFreeHost)(void*) = nullptr;
  Result (*Memcpy)(DevicePtr, DevicePtr, size_t) = nullptr;
  Result (*MemcpyAsync)(DevicePtr, DevicePtr, size_t, Stream) = nullptr;
  Result (*MemsetD8Async)(DevicePtr, unsigned char, size_t, Stream) = nullptr;
  Result (*PointerGetAttribute)(void*, int, DevicePtr) = nullptr;
  std::string path;

  // The process's driver, loaded and initialised once (PERSEUS_CUDA_DRIVER,
  // else libcuda.so.1); null with the reason.
  static const Driver* Get(std::string* why_not);
  // CUDA's name and message for `r`.
  std::string Describe(Result r) const;
};

// NVRTC's calls (nvrtcResult is an int; 0 is success).
struct Nvrtc {
  using Program = ::_nvrtcProgram*;
  int (*Version)(int*, int*) = nullptr;
  int (*GetNumSupportedArchs)(int*) = nullptr;
  int (*GetSupportedArchs)(int*) = nullptr;
  int (*CreateProgram)(Program*, const char*, const char*, int, const char* const*,
                       const char* const*) = nullptr;
  int (*DestroyProgram)(Program*) = nullptr;
  int (*CompileProgram)(Program, int, const char* const*) = nullptr;
  int (*GetProgramLogSize)(Program, size_t*) = nullptr;
  int (*GetProgramLog)(Program, char*) = nullptr;
  int (*GetCUBINSize)(Program, size_t*) = nullptr;
  int (*GetCUBIN)(Program, char*) = nullptr;
  int (*GetPTXSize)(Program, size_t*) = nullptr;
  int (*GetPTX)(Program, char*) = nullptr;
  const char* (*GetErrorString)(int) = nullptr;
  std::string path;
  int major = 0, minor = 0;
  std::vector<int> archs;  // the real architectures it compiles for (70, 75, ...)

  // PERSEUS_NVRTC_LIBRARY, else libnvrtc.so.12 / .13 / libnvrtc.so through
  // the loader path; loaded once, null with where it looked and why.
  static const Nvrtc* Get(std::string* why_not);
};

}  // namespace cu
}  // namespace perseus
