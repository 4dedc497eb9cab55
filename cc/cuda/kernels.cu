// The GPU data plane's kernels, CUDA C++ compiled at run time by NVRTC for
// the GPU in use (kernels.cc) and cached. The build embeds this file as a
// string (tools/gen_kernel_source.py writes kernel_source.cc from it), and
// the tests compile it as host C++ (cc/testing/fake_cuda.cc, a stand-in CUDA
// driver that runs each kernel's threads on the CPU), so that the kernels
// and the launches of kernels.cc are checked against numpy in CI. Written for
// NVRTC with no headers at all: fixed-width types are declared here, float16
// casts are PTX instructions, and NaN/infinity tests look at the exponent
// bits. Grid-stride loops throughout; element counts are 64-bit. Every
// kernel is listed once in kernel_list.h.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef short i16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#define GRID_STRIDE(i, n) \
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

#ifdef __CUDACC_RTC__
__device__ __forceinline__ u16 to_half_rn(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float from_half(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
#else  // the host emulation of the tests (cc/testing/fake_cuda.cc) converts in software
__device__ __forceinline__ u16 to_half_rn(float f) { return emulated_to_half(f); }
__device__ __forceinline__ float from_half(u16 h) { return emulated_from_half(h); }
#endif

// The element-wise kernels move 16 bytes per load where the pointers allow
// (4-byte loads keep too few bytes in flight to fill an H200's memory: 0.6 of
// its copy bandwidth); the last n % 4 elements, or misaligned arrays, go one
// element at a time. VECTOR_TAIL(i, n, start) strides over [start, n).
#define VECTOR_TAIL(i, n, start) \
  for (u64 i = (start) + blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); \
       i += (u64)gridDim.x * blockDim.x)

__device__ __forceinline__ bool aligned(const void* p, u64 bytes) {
  return ((u64)p & (bytes - 1)) == 0;
}

extern "C" __global__ void perseus_to_half(const float* in, u16* out, u64 n, float scale) {
  u64 done = 0;
  if (aligned(in, 16) && aligned(out, 8)) {
    done = n / 4 * 4;
    GRID_STRIDE(q, n / 4) {
      const uint4 v = ((const uint4*)in)[q];
      uint2 h;
      h.x = (u32)to_half_rn(__uint_as_float(v.x) * scale) |
            ((u32)to_half_rn(__uint_as_float(v.y) * scale) << 16);
      h.y = (u32)to_half_rn(__uint_as_float(v.z) * scale) |
            ((u32)to_half_rn(__uint_as_float(v.w) * scale) << 16);
      ((uint2*)out)[q] = h;
    }
  }
  VECTOR_TAIL(i, n, done) out[i] = to_half_rn(in[i] * scale);
}

extern "C" __global__ void perseus_from_half(const u16* in, float* out, u64 n, float scale) {
  u64 done = 0;
  if (aligned(in, 8) && aligned(out, 16)) {
    done = n / 4 * 4;
    GRID_STRIDE(q, n / 4) {
      const uint2 h = ((const uint2*)in)[q];
      uint4 v;
      v.x = __float_as_uint(from_half((u16)(h.x & 0xffffu)) * scale);
      v.y = __float_as_uint(from_half((u16)(h.x >> 16)) * scale);
      v.z = __float_as_uint(from_half((u16)(h.y & 0xffffu)) * scale);
      v.w = __float_as_uint(from_half((u16)(h.y >> 16)) * scale);
      ((uint4*)out)[q] = v;
    }
  }
  VECTOR_TAIL(i, n, done) out[i] = from_half(in[i]) * scale;
}

// As the host does (cc/core/reduce.cc ScaleBuffer), so that both planes give
// the same bits: floats times the factor in their own precision, float16
// and bfloat16 through a double product rounded to float, integers through
// double, truncated toward zero.
extern "C" __global__ void perseus_scale_f32(float* data, u64 n, float factor) {
  u64 done = 0;
  if (aligned(data, 16)) {
    done = n / 4 * 4;
    GRID_STRIDE(q, n / 4) {
      uint4 v = ((uint4*)data)[q];
      v.x = __float_as_uint(__uint_as_float(v.x) * factor);
      v.y = __float_as_uint(__uint_as_float(v.y) * factor);
      v.z = __float_as_uint(__uint_as_float(v.z) * factor);
      v.w = __float_as_uint(__uint_as_float(v.w) * factor);
      ((uint4*)data)[q] = v;
    }
  }
  VECTOR_TAIL(i, n, done) data[i] *= factor;
}

extern "C" __global__ void perseus_scale_f64(double* data, u64 n, double factor) {
  GRID_STRIDE(i, n) data[i] *= factor;
}

extern "C" __global__ void perseus_scale_f16(u16* data, u64 n, double factor) {
  GRID_STRIDE(i, n) data[i] = to_half_rn((float)(from_half(data[i]) * factor));
}

extern "C" __global__ void perseus_scale_bf16(u16* data, u64 n, double factor) {
  GRID_STRIDE(i, n) {
    const float v = (float)(__uint_as_float(((u32)data[i]) << 16) * factor);
    u32 x = __float_as_uint(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a quiet NaN
      data[i] = (u16)((x >> 16) | 0x40);
    } else {
      x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even
      data[i] = (u16)(x >> 16);
    }
  }
}

template <typename T>
__device__ void scale_int(T* data, u64 n, double factor) {
  GRID_STRIDE(i, n) data[i] = (T)((double)data[i] * factor);
}

extern "C" __global__ void perseus_scale_i32(i32* d, u64 n, double f) { scale_int(d, n, f); }
extern "C" __global__ void perseus_scale_i64(i64* d, u64 n, double f) { scale_int(d, n, f); }
extern "C" __global__ void perseus_scale_u8(u8* d, u64 n, double f) { scale_int(d, n, f); }
extern "C" __global__ void perseus_scale_i8(i8* d, u64 n, double f) { scale_int(d, n, f); }
extern "C" __global__ void perseus_scale_u16(u16* d, u64 n, double f) { scale_int(d, n, f); }
extern "C" __global__ void perseus_scale_i16(i16* d, u64 n, double f) { scale_int(d, n, f); }

// out[i] = the sum over k of in[k][i], in chunk order.
extern "C" __global__ void perseus_sum_chunks(const float* const* in, int chunks, float* out,
                                              u64 n) {
  GRID_STRIDE(i, n) {
    float s = in[0][i];
    for (int k = 1; k < chunks; ++k) s += in[k][i];
    out[i] = s;
  }
}

// Exponent all ones: an infinity or a NaN.
extern "C" __global__ void perseus_nonfinite_f32(const u32* data, u64 n, int* flag) {
  u64 done = 0;
  if (aligned(data, 16)) {
    done = n / 4 * 4;
    GRID_STRIDE(q, n / 4) {
      const uint4 v = ((const uint4*)data)[q];
      const u32 e = 0x7f800000u;
      if ((v.x & e) == e || (v.y & e) == e || (v.z & e) == e || (v.w & e) == e) {
        *flag = 1;
        return;
      }
    }
  }
  VECTOR_TAIL(i, n, done) {
    if ((data[i] & 0x7f800000u) == 0x7f800000u) {
      *flag = 1;
      return;
    }
  }
}

extern "C" __global__ void perseus_nonfinite_f64(const u64* data, u64 n, int* flag) {
  GRID_STRIDE(i, n) {
    if ((data[i] & 0x7ff0000000000000ull) == 0x7ff0000000000000ull) {
      *flag = 1;
      return;
    }
  }
}

// float16: mask 0x7c00, bfloat16: 0x7f80.
extern "C" __global__ void perseus_nonfinite_16(const u16* data, u64 n, u32 mask, int* flag) {
  GRID_STRIDE(i, n) {
    if ((data[i] & mask) == mask) {
      *flag = 1;
      return;
    }
  }
}

// With fewer spans than blocks, each span gets gridDim.x / count blocks, each
// copying an even share of it (one block for a large span kept it to one
// multiprocessor: 20 GB/s on an H200); with more spans, each block copies
// whole spans, grid-strided. Each span moves in the widest words both ends
// allow: 16 bytes when source and destination sit alike modulo 16 (after up
// to 15 bytes one by one), else 8, 4 or 2 bytes when both are aligned so (a
// float32 tensor packed after an odd count of others is 4-aligned), else
// bytes; the last partial word goes byte by byte.
template <typename W>
__device__ __forceinline__ void copy_words(const char* src, char* dst, u64 lo, u64 hi) {
  const W* s = (const W*)src;
  W* d = (W*)dst;
  for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) d[i] = s[i];
}

extern "C" __global__ void perseus_batched_copy(const u64* spans, int count) {
  const u64 per = gridDim.x >= (unsigned)count ? gridDim.x / count : 1;
  const u64 part = blockIdx.x % per;
  const u64 stride = per > 1 ? (u64)count : gridDim.x;  // per > 1: one span each
  for (u64 s = blockIdx.x / per; s < (u64)count; s += stride) {
    const char* src = (const char*)spans[3 * s];
    char* dst = (char*)spans[3 * s + 1];
    const u64 bytes = spans[3 * s + 2];
    const u64 a = (u64)src, b = (u64)dst;
    u64 head = 0, unit = 1;
    if (((a ^ b) & 15) == 0) {
      head = (16 - (a & 15)) & 15;
      if (head > bytes) head = bytes;
      unit = 16;
    } else if (((a | b) & 7) == 0) {
      unit = 8;
    } else if (((a | b) & 3) == 0) {
      unit = 4;
    } else if (((a | b) & 1) == 0) {
      unit = 2;
    }
    if (part == 0) {
      for (u64 i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
    }
    const u64 words = (bytes - head) / unit;
    const u64 lo = words * part / per, hi = words * (part + 1) / per;
    switch (unit) {
      case 16: copy_words<uint4>(src + head, dst + head, lo, hi); break;
      case 8: copy_words<u64>(src + head, dst + head, lo, hi); break;
      case 4: copy_words<u32>(src + head, dst + head, lo, hi); break;
      case 2: copy_words<u16>(src + head, dst + head, lo, hi); break;
      default: copy_words<u8>(src + head, dst + head, lo, hi); break;
    }
    if (part == per - 1) {
      for (u64 i = head + words * unit + threadIdx.x; i < bytes; i += blockDim.x) {
        dst[i] = src[i];
      }
    }
  }
}

// --- top-k with error feedback ---------------------------------------------

// acc = grad * prescale + residual; key = the bits of |acc| (ordered as the
// values are, for non-negative floats).
extern "C" __global__ void perseus_topk_keys(const float* grad, const float* residual, u64 n,
                                             float prescale, float* acc, u32* key) {
  GRID_STRIDE(i, n) {
    const float a = grad[i] * prescale + residual[i];
    acc[i] = a;
    key[i] = __float_as_uint(a) & 0x7fffffffu;
  }
}

// One block: the largest key T with at least k keys >= T (the k-th largest
// key), found bit by bit from the top; out[1] = how many keys are > T.
extern "C" __global__ void perseus_topk_threshold(const u32* key, u64 n, u64 k, u32* out) {
  __shared__ u64 count;
  u32 prefix = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const u32 candidate = prefix | (1u << bit);
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    u64 local = 0;
    for (u64 i = threadIdx.x; i < n; i += blockDim.x) local += key[i] >= candidate;
    atomicAdd(&count, local);
    __syncthreads();
    if (count >= k) prefix = candidate;
    __syncthreads();
  }
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  u64 local = 0;
  for (u64 i = threadIdx.x; i < n; i += blockDim.x) local += key[i] > prefix;
  atomicAdd(&count, local);
  __syncthreads();
  if (threadIdx.x == 0) {
    out[0] = prefix;
    out[1] = (u32)count;  // fewer than k
  }
}

extern "C" __global__ void perseus_topk_equal_flags(const u32* key, u64 n, const u32* threshold,
                                                    u32* equal) {
  const u32 t = threshold[0];
  GRID_STRIDE(i, n) equal[i] = key[i] == t;
}

// Chosen: above the threshold, or equal to it and among the first
// k - greater equal ones (equal_rank: the exclusive scan of the equal flags).
extern "C" __global__ void perseus_topk_chosen_flags(const u32* key, u64 n, u64 k,
                                                     const u32* threshold, const u32* equal_rank,
                                                     u32* chosen) {
  const u32 t = threshold[0];
  const u64 room = k - threshold[1];
  GRID_STRIDE(i, n) chosen[i] = key[i] > t || (key[i] == t && equal_rank[i] < room);
}

extern "C" __global__ void perseus_topk_write(const float* acc, u64 n, const u32* chosen,
                                              const u32* position, float* residual,
                                              i32* out_index, float* out_value) {
  GRID_STRIDE(i, n) {
    if (chosen[i]) {
      out_index[position[i]] = (i32)i;
      out_value[position[i]] = acc[i];
      residual[i] = 0.0f;
    } else {
      residual[i] = acc[i];
    }
  }
}

// --- exclusive sum of u32 values, in three launches ------------------------
// Block b of `gridDim.x` takes elements [b * per_block, (b + 1) * per_block).

extern "C" __global__ void perseus_scan_block_sums(const u32* in, u64 n, u64 per_block,
                                                   u32* sums) {
  __shared__ u32 total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  const u64 begin = blockIdx.x * per_block;
  const u64 end = begin + per_block < n ? begin + per_block : n;
  u32 local = 0;
  for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) local += in[i];
  atomicAdd(&total, local);
  __syncthreads();
  if (threadIdx.x == 0) sums[blockIdx.x] = total;
}

// One thread: the block sums become each block's starting offset.
extern "C" __global__ void perseus_scan_offsets(u32* sums, int blocks) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  u32 running = 0;
  for (int b = 0; b < blocks; ++b) {
    const u32 v = sums[b];
    sums[b] = running;
    running += v;
  }
}

// Each block scans its span tile by tile (blockDim.x elements, at most
// 1024), carrying the running total from the block's offset.
extern "C" __global__ void perseus_scan_apply(const u32* in, u32* out, u64 n, u64 per_block,
                                              const u32* offsets) {
  __shared__ u32 tile[1024];
  const u64 begin = blockIdx.x * per_block;
  const u64 end = begin + per_block < n ? begin + per_block : n;
  u32 carry = offsets[blockIdx.x];
  for (u64 base = begin; base < end; base += blockDim.x) {
    const u64 i = base + threadIdx.x;
    const u32 v = i < end ? in[i] : 0;
    tile[threadIdx.x] = v;
    __syncthreads();
    for (unsigned step = 1; step < blockDim.x; step *= 2) {  // inclusive, Hillis-Steele
      const u32 add = threadIdx.x >= step ? tile[threadIdx.x - step] : 0;
      __syncthreads();
      tile[threadIdx.x] += add;
      __syncthreads();
    }
    if (i < end) out[i] = carry + tile[threadIdx.x] - v;
    carry += tile[blockDim.x - 1];
    __syncthreads();
  }
}

// For tests: busy for `cycles` clock cycles (a slow producer).
extern "C" __global__ void perseus_spin(i64 cycles) {
  const i64 start = clock64();
  while (clock64() - start < cycles) {
  }
}
