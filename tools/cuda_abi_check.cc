// Checks driver.h's declarations against the real cuda.h and nvrtc.h (from
// the nvidia-cuda-runtime-cu12 and nvidia-cuda-nvrtc-cu12 wheels; tests/
// test_cuda.py builds and runs it): every call has the header's parameter
// and result types (an enum as an int of its size), and the symbol loaded
// is the one the header maps the name to (cuMemAlloc -> cuMemAlloc_v2). Not
// part of libperseus_cuda.so (built only by that test).
#include <cuda.h>
#include <nvrtc.h>

#include <cstdio>
#include <cstring>
#include <type_traits>

#include "cc/cuda/driver.h"

namespace {

template <typename A, typename B>
constexpr bool SameArg() {
  if constexpr (std::is_enum_v<B>) {
    return std::is_integral_v<A> && sizeof(A) == sizeof(B);
  } else if constexpr (std::is_pointer_v<A> && std::is_pointer_v<B> &&
                       std::is_enum_v<std::remove_pointer_t<B>>) {
    return std::is_integral_v<std::remove_pointer_t<A>> &&
           sizeof(std::remove_pointer_t<A>) == sizeof(std::remove_pointer_t<B>);
  } else {
    return std::is_same_v<A, B>;
  }
}

template <typename F, typename G>
struct Match : std::false_type {};

template <typename RA, typename... A, typename RB, typename... B>
struct Match<RA (*)(A...), RB (*)(B...)> {
  static constexpr bool Args() {
    if constexpr (sizeof...(A) != sizeof...(B)) {
      return false;
    } else {
      return (SameArg<A, B>() && ...);
    }
  }
  static constexpr bool value = SameArg<RA, RB>() && Args();
};

#define PTF_STR2(x) #x
#define PTF_STR(x) PTF_STR2(x)

int failures = 0;

void Name(const char* field, const char* header_symbol, const char* ours) {
  if (std::strcmp(header_symbol, ours) != 0) {
    std::printf("MISMATCH %s: the header's symbol is %s, driver.h loads %s\n", field,
                header_symbol, ours);
    ++failures;
  } else {
    std::printf("ok %s -> %s\n", field, ours);
  }
}

}  // namespace

#define PTF_CHECK_DRIVER(field, api, symbol)                                   \
  static_assert(Match<decltype(perseus::cu::Driver::field), decltype(&api)>::value, \
                "driver.h's " #field " does not have cuda.h's type");
PTF_CUDA_DRIVER_CALLS(PTF_CHECK_DRIVER)

#define PTF_CHECK_NVRTC(field, api, symbol)                                   \
  static_assert(Match<decltype(perseus::cu::Nvrtc::field), decltype(&api)>::value, \
                "driver.h's Nvrtc::" #field " does not have nvrtc.h's type");
PTF_NVRTC_CALLS(PTF_CHECK_NVRTC)

static_assert(std::is_same_v<perseus::cu::Stream, CUstream>);
static_assert(std::is_same_v<perseus::cu::Event, CUevent>);
static_assert(std::is_same_v<perseus::cu::Context, CUcontext>);
static_assert(std::is_same_v<perseus::cu::DevicePtr, CUdeviceptr>);
static_assert(std::is_same_v<perseus::cu::Nvrtc::Program, nvrtcProgram>);
static_assert(perseus::cu::kNotReady == CUDA_ERROR_NOT_READY);
static_assert(perseus::cu::kInvalidValue == CUDA_ERROR_INVALID_VALUE);
static_assert(perseus::cu::kStreamNonBlocking == CU_STREAM_NON_BLOCKING);
static_assert(perseus::cu::kEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(perseus::cu::kHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE);
static_assert(perseus::cu::kAttrClockRate == CU_DEVICE_ATTRIBUTE_CLOCK_RATE);
static_assert(perseus::cu::kAttrComputeMajor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
static_assert(perseus::cu::kAttrComputeMinor == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
static_assert(perseus::cu::kPointerMemoryType == CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
static_assert(perseus::cu::kPointerIsManaged == CU_POINTER_ATTRIBUTE_IS_MANAGED);
static_assert(perseus::cu::kMemoryTypeDevice == CU_MEMORYTYPE_DEVICE);

int main() {
#define PTF_NAME(field, api, symbol) Name(#field, PTF_STR(api), symbol);
  PTF_CUDA_DRIVER_CALLS(PTF_NAME)
  PTF_NVRTC_CALLS(PTF_NAME)
  std::printf("CUDA_VERSION %d: %d mismatches\n", CUDA_VERSION, failures);
  return failures == 0 ? 0 : 1;
}
