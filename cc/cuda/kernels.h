// CUDA kernels of the GPU data plane, behind a C interface (so that Python,
// through ctypes, can call them too). Each function queues its work on
// `stream` (a CUstream / cudaStream_t; null is the legacy default stream) in
// the calling thread's current CUDA context (none current: an error, never
// a guess at device 0) and returns a CUresult (0: queued). Nothing here
// waits for the device.
//
// The kernels' source (kernels.cu, embedded as kernel_source.cc) is compiled at run time by NVRTC
// for the GPU of the context, once per context, and the result is cached
// on disk (PERSEUS_KERNEL_CACHE, default ~/.cache/perseus_tf/kernels). So
// libperseus_cuda.so builds with the host compiler alone, at `pip install`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

extern "C" {

// out[i] = half(in[i] * scale), round to nearest even.
int perseus_cuda_to_half(const float* in, uint16_t* out, size_t n, float scale, void* stream);
// out[i] = float(in[i]) * scale.
int perseus_cuda_from_half(const uint16_t* in, float* out, size_t n, float scale, void* stream);
// data[i] *= factor, for every dtype of the runtime (its DataType codes:
// float16 0, bfloat16 1, float32 2, float64 3, int32 4, int64 5, uint8 6,
// int8 7, bool 8 (left as it is), uint16 9, int16 10), with the host's
// rounding (ScaleBuffer): integers through double, truncated toward zero.
// Returns CUDA_ERROR_INVALID_VALUE (1) for other codes.
int perseus_cuda_scale(void* data, int dtype, size_t n, double factor, void* stream);
// out[i] = sum over k < chunks of in[k][i], float32, in chunk order (the sum
// of host-staged chunks, the same order on every rank). `in` is a device
// array of `chunks` device pointers.
int perseus_cuda_sum_chunks(const float* const* in, int chunks, float* out, size_t n,
                            void* stream);
// *flag = 1 if any element is NaN or infinite (float32 0 / float16 1 /
// float64 2 / bfloat16 3 by `kind`), else left as it is: clear it first.
int perseus_cuda_nonfinite(const void* data, int kind, size_t n, int* flag, void* stream);
// Copies `count` spans in one launch: spans is a device array of
// {src, dst, bytes} triples (three uint64 each).
int perseus_cuda_batched_copy(const uint64_t* spans, int count, void* stream);
// Top-k with error feedback (float32): acc = grad * prescale + residual; the
// k entries of largest |acc| (ties to the lower index) are written to
// out_index/out_value in index order, and the residual keeps the rest
// (residual = acc with the chosen entries zeroed). `scratch` is device
// memory of perseus_cuda_topk_scratch_bytes(n) bytes.
size_t perseus_cuda_topk_scratch_bytes(size_t n);
int perseus_cuda_topk(const float* grad, float* residual, size_t n, size_t k, float prescale,
                      int32_t* out_index, float* out_value, void* scratch, void* stream);
// out = the exclusive prefix sum of in (uint32); `scratch` is device memory
// of perseus_cuda_scan_scratch_bytes(n) bytes.
size_t perseus_cuda_scan_scratch_bytes(size_t n);
int perseus_cuda_exclusive_sum(const uint32_t* in, uint32_t* out, size_t n, void* scratch,
                               void* stream);

// For tests: a kernel busy for `cycles` clock cycles (a slow producer).
int perseus_cuda_spin(long long cycles, void* stream);

// Compiles the kernels with NVRTC for `arch` ("sm_80": machine code for
// that GPU; "compute_90": PTX that newer GPUs' drivers compile at load) into
// the file `path`; needs no GPU. 0 on success, else the reason in error.
int perseus_cuda_compile_to_file(const char* arch, const char* path, char* error,
                                 size_t error_len);
// What NVRTC compiles for: its version and real architectures, as text
// ("12.5: 50 52 ... 90"), or why it cannot be loaded. 0 when loaded.
int perseus_cuda_nvrtc_info(char* out, size_t out_len);

}  // extern "C"

namespace perseus {

// The kernels for the current context, compiled (or read from the cache)
// and loaded on first use; throws std::runtime_error saying why not (no
// NVRTC, a GPU older than NVRTC's oldest target, a compile error).
void EnsureKernels();

// The error code kernels.cc returns when the kernels could not be made
// ready; perseus_cuda_error_string gives the reason.
constexpr int kKernelsUnavailable = 999999;
std::string KernelsUnavailableReason();

}  // namespace perseus
