// The GPU data plane's kernels (kernels.h). Grid-stride loops throughout;
// sizes are size_t. Built by nvcc only.
#include "cc/cuda/kernels.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cub/device/device_scan.cuh>

namespace {

constexpr int kThreads = 256;

int Blocks(size_t n) {
  size_t b = (n + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  if (b > 4096) b = 4096;
  return static_cast<int>(b);
}

cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

__global__ void ToHalf(const float* in, uint16_t* out, size_t n, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = __half_as_ushort(__float2half_rn(in[i] * scale));
  }
}

__global__ void FromHalf(const uint16_t* in, float* out, size_t n, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    out[i] = __half2float(__ushort_as_half(in[i])) * scale;
  }
}

// As the host does (cc/core/reduce.cc ScaleBuffer), so that both planes
// give the same bits: floats times the factor in their own precision,
// float16 and bfloat16 through a double product rounded to float.
template <typename T>
__global__ void ScaleFloat(T* data, size_t n, T factor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    data[i] *= factor;
  }
}

__global__ void ScaleHalf(uint16_t* data, size_t n, double factor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(__half2float(__ushort_as_half(data[i])) * factor);
    data[i] = __half_as_ushort(__float2half_rn(v));
  }
}

__global__ void ScaleBf16(uint16_t* data, size_t n, double factor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float v = static_cast<float>(__uint_as_float(uint32_t(data[i]) << 16) * factor);
    uint32_t x = __float_as_uint(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
      data[i] = static_cast<uint16_t>((x >> 16) | 0x40);
    } else {
      x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even
      data[i] = static_cast<uint16_t>(x >> 16);
    }
  }
}

template <typename T>
__global__ void ScaleInt(T* data, size_t n, double factor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    data[i] = static_cast<T>(static_cast<double>(data[i]) * factor);  // truncates toward zero
  }
}

__global__ void SumChunks(const float* const* in, int chunks, float* out, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    float s = in[0][i];
    for (int k = 1; k < chunks; ++k) s += in[k][i];
    out[i] = s;
  }
}

__device__ bool Bad(float v) { return !isfinite(v); }
__device__ bool Bad(double v) { return !isfinite(v); }

template <typename T>
__global__ void NonFinite(const T* data, size_t n, int* flag) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    if (Bad(data[i])) {
      *flag = 1;
      return;
    }
  }
}

// Exponent all ones: inf or NaN (float16: mask 0x7c00, bfloat16: 0x7f80).
__global__ void NonFinite16(const uint16_t* data, size_t n, uint16_t mask, int* flag) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    if ((data[i] & mask) == mask) {
      *flag = 1;
      return;
    }
  }
}

// One block per span (grid-strided over spans), its threads over the bytes.
__global__ void BatchedCopy(const uint64_t* spans, int count) {
  for (int s = blockIdx.x; s < count; s += gridDim.x) {
    const char* src = reinterpret_cast<const char*>(spans[3 * s]);
    char* dst = reinterpret_cast<char*>(spans[3 * s + 1]);
    const size_t bytes = static_cast<size_t>(spans[3 * s + 2]);
    const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    size_t done = 0;
    if (aligned) {
      const size_t words = bytes / 16;
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      for (size_t i = threadIdx.x; i < words; i += blockDim.x) d4[i] = s4[i];
      done = words * 16;
    }
    for (size_t i = done + threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
}

// --- top-k -----------------------------------------------------------------

// acc = grad * prescale + residual; key = the bits of |acc| (for
// non-negative floats, ordered as the values are).
__global__ void TopkKeys(const float* grad, const float* residual, size_t n, float prescale,
                         float* acc, uint32_t* key) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const float a = grad[i] * prescale + residual[i];
    acc[i] = a;
    key[i] = __float_as_uint(fabsf(a));
  }
}

// One block: the largest key T with at least k keys >= T (the k-th largest
// key), found bit by bit from the top; and how many keys are > T.
__global__ void TopkThreshold(const uint32_t* key, size_t n, size_t k, uint32_t* out) {
  __shared__ unsigned long long count;
  uint32_t prefix = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint32_t candidate = prefix | (1u << bit);
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    unsigned long long local = 0;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) local += key[i] >= candidate;
    atomicAdd(&count, local);
    __syncthreads();
    if (count >= k) prefix = candidate;
    __syncthreads();
  }
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  unsigned long long local = 0;
  for (size_t i = threadIdx.x; i < n; i += blockDim.x) local += key[i] > prefix;
  atomicAdd(&count, local);
  __syncthreads();
  if (threadIdx.x == 0) {
    out[0] = prefix;
    out[1] = static_cast<uint32_t>(count);  // fewer than k
  }
}

__global__ void TopkEqualFlags(const uint32_t* key, size_t n, const uint32_t* threshold,
                               uint32_t* equal) {
  const uint32_t t = threshold[0];
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    equal[i] = key[i] == t;
  }
}

// Chosen: above the threshold, or equal to it and among the first
// k - greater equal ones (equal_rank: exclusive scan of the equal flags).
__global__ void TopkChosenFlags(const uint32_t* key, size_t n, size_t k,
                                const uint32_t* threshold, const uint32_t* equal_rank,
                                uint32_t* chosen) {
  const uint32_t t = threshold[0];
  const size_t room = k - threshold[1];
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    chosen[i] = key[i] > t || (key[i] == t && equal_rank[i] < room);
  }
}

__global__ void TopkWrite(const float* acc, size_t n, const uint32_t* chosen,
                          const uint32_t* position, float* residual, int32_t* out_index,
                          float* out_value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    if (chosen[i]) {
      out_index[position[i]] = static_cast<int32_t>(i);
      out_value[position[i]] = acc[i];
      residual[i] = 0.0f;
    } else {
      residual[i] = acc[i];
    }
  }
}

size_t ScanBytes(size_t n) {
  size_t bytes = 0;
  cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                static_cast<uint32_t*>(nullptr), static_cast<int>(n));
  return bytes;
}

size_t Align(size_t b) { return (b + 255) / 256 * 256; }

}  // namespace

extern "C" {

int perseus_cuda_to_half(const float* in, uint16_t* out, size_t n, float scale, void* stream) {
  if (n == 0) return 0;
  ToHalf<<<Blocks(n), kThreads, 0, S(stream)>>>(in, out, n, scale);
  return cudaGetLastError();
}

int perseus_cuda_from_half(const uint16_t* in, float* out, size_t n, float scale, void* stream) {
  if (n == 0) return 0;
  FromHalf<<<Blocks(n), kThreads, 0, S(stream)>>>(in, out, n, scale);
  return cudaGetLastError();
}

int perseus_cuda_scale(void* data, int dtype, size_t n, double factor, void* stream) {
  if (n == 0 || factor == 1.0) return 0;
  switch (dtype) {
    case 0: ScaleHalf<<<Blocks(n), kThreads, 0, S(stream)>>>(static_cast<uint16_t*>(data), n,
                                                             factor); break;
    case 1: ScaleBf16<<<Blocks(n), kThreads, 0, S(stream)>>>(static_cast<uint16_t*>(data), n,
                                                             factor); break;
    case 2: ScaleFloat<float><<<Blocks(n), kThreads, 0, S(stream)>>>(static_cast<float*>(data), n,
                                                                     static_cast<float>(factor));
      break;
    case 3: ScaleFloat<double><<<Blocks(n), kThreads, 0, S(stream)>>>(static_cast<double*>(data),
                                                                      n, factor); break;
    case 4: ScaleInt<int32_t><<<Blocks(n), kThreads, 0, S(stream)>>>(static_cast<int32_t*>(data),
                                                                     n, factor); break;
    case 5: ScaleInt<int64_t><<<Blocks(n), kThreads, 0, S(stream)>>>(static_cast<int64_t*>(data),
                                                                     n, factor); break;
    case 6: ScaleInt<uint8_t><<<Blocks(n), kThreads, 0, S(stream)>>>(static_cast<uint8_t*>(data),
                                                                     n, factor); break;
    case 7: ScaleInt<int8_t><<<Blocks(n), kThreads, 0, S(stream)>>>(static_cast<int8_t*>(data),
                                                                    n, factor); break;
    case 8: break;  // bool: as on the host, scaling leaves it
    case 9: ScaleInt<uint16_t><<<Blocks(n), kThreads, 0, S(stream)>>>(
        static_cast<uint16_t*>(data), n, factor); break;
    case 10: ScaleInt<int16_t><<<Blocks(n), kThreads, 0, S(stream)>>>(
        static_cast<int16_t*>(data), n, factor); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int perseus_cuda_sum_chunks(const float* const* in, int chunks, float* out, size_t n,
                            void* stream) {
  if (n == 0 || chunks < 1) return chunks < 1 ? cudaErrorInvalidValue : 0;
  SumChunks<<<Blocks(n), kThreads, 0, S(stream)>>>(in, chunks, out, n);
  return cudaGetLastError();
}

int perseus_cuda_nonfinite(const void* data, int kind, size_t n, int* flag, void* stream) {
  if (n == 0) return 0;
  switch (kind) {
    case 0: NonFinite<float><<<Blocks(n), kThreads, 0, S(stream)>>>(
        static_cast<const float*>(data), n, flag); break;
    case 1: NonFinite16<<<Blocks(n), kThreads, 0, S(stream)>>>(
        static_cast<const uint16_t*>(data), n, 0x7c00u, flag); break;
    case 3: NonFinite16<<<Blocks(n), kThreads, 0, S(stream)>>>(
        static_cast<const uint16_t*>(data), n, 0x7f80u, flag); break;
    case 2: NonFinite<double><<<Blocks(n), kThreads, 0, S(stream)>>>(
        static_cast<const double*>(data), n, flag); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int perseus_cuda_batched_copy(const uint64_t* spans, int count, void* stream) {
  if (count <= 0) return 0;
  BatchedCopy<<<count < 1024 ? count : 1024, kThreads, 0, S(stream)>>>(spans, count);
  return cudaGetLastError();
}

size_t perseus_cuda_topk_scratch_bytes(size_t n) {
  // acc, key, equal, equal_rank, chosen, position (4 bytes each per
  // element), the threshold pair, and the scans' temporary storage.
  return 6 * Align(4 * (n ? n : 1)) + 256 + Align(ScanBytes(n ? n : 1));
}

int perseus_cuda_topk(const float* grad, float* residual, size_t n, size_t k, float prescale,
                      int32_t* out_index, float* out_value, void* scratch, void* stream) {
  if (n == 0 || k == 0) return 0;
  if (k > n) return cudaErrorInvalidValue;
  char* p = static_cast<char*>(scratch);
  const size_t slab = Align(4 * n);
  float* acc = reinterpret_cast<float*>(p);
  uint32_t* key = reinterpret_cast<uint32_t*>(p + slab);
  uint32_t* equal = reinterpret_cast<uint32_t*>(p + 2 * slab);
  uint32_t* equal_rank = reinterpret_cast<uint32_t*>(p + 3 * slab);
  uint32_t* chosen = reinterpret_cast<uint32_t*>(p + 4 * slab);
  uint32_t* position = reinterpret_cast<uint32_t*>(p + 5 * slab);
  uint32_t* threshold = reinterpret_cast<uint32_t*>(p + 6 * slab);
  void* temp = p + 6 * slab + 256;
  size_t temp_bytes = ScanBytes(n);
  cudaStream_t s = S(stream);
  TopkKeys<<<Blocks(n), kThreads, 0, s>>>(grad, residual, n, prescale, acc, key);
  TopkThreshold<<<1, 1024, 0, s>>>(key, n, k, threshold);
  TopkEqualFlags<<<Blocks(n), kThreads, 0, s>>>(key, n, threshold, equal);
  cudaError_t e = cub::DeviceScan::ExclusiveSum(temp, temp_bytes, equal, equal_rank,
                                                static_cast<int>(n), s);
  if (e != cudaSuccess) return e;
  TopkChosenFlags<<<Blocks(n), kThreads, 0, s>>>(key, n, k, threshold, equal_rank, chosen);
  e = cub::DeviceScan::ExclusiveSum(temp, temp_bytes, chosen, position, static_cast<int>(n), s);
  if (e != cudaSuccess) return e;
  TopkWrite<<<Blocks(n), kThreads, 0, s>>>(acc, n, chosen, position, residual, out_index,
                                           out_value);
  return cudaGetLastError();
}

}  // extern "C"
