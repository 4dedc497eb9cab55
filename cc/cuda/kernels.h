// CUDA kernels of the GPU data plane, behind a C interface (so that code
// built without nvcc, and Python through ctypes, can call them). Each
// function queues its work on `stream` (a cudaStream_t; null is the legacy
// default stream) and returns a cudaError_t (0: queued). Nothing here waits
// for the device.
//
// Built with nvcc into libperseus_cuda.so when nvcc is found (tools/
// build_native.py); the rest of Perseus builds and runs without it.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// out[i] = half(in[i] * scale), round to nearest even.
int perseus_cuda_to_half(const float* in, uint16_t* out, size_t n, float scale, void* stream);
// out[i] = float(in[i]) * scale.
int perseus_cuda_from_half(const uint16_t* in, float* out, size_t n, float scale, void* stream);
// data[i] *= factor, for every dtype of the runtime (its DataType codes:
// float16 0, bfloat16 1, float32 2, float64 3, int32 4, int64 5, uint8 6,
// int8 7, bool 8 (left as it is), uint16 9, int16 10), with the host's
// rounding (ScaleBuffer): integers through double, truncated toward zero.
// Returns cudaErrorInvalidValue (1) for other codes.
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

}  // extern "C"
