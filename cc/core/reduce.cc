#include "cc/core/reduce.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace perseus {
namespace {

// ---- scalar float16 / bfloat16 conversion ------------------------------

inline float HalfBitsToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToHalfBits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t abs = x & 0x7fffffff;
  if (abs >= 0x7f800000) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0));
  }
  if (abs >= 0x477ff000) return static_cast<uint16_t>(sign | 0x7c00);  // overflow
  if (abs < 0x38800000) {  // subnormal or zero in half
    // Add as float to let the FPU round to the subnormal grid.
    float af;
    std::memcpy(&af, &abs, 4);
    float r = af + 0.5f;  // 0.5 = 2^-1: aligns half subnormal ulp (2^-24) to float ulp
    uint32_t rb;
    std::memcpy(&rb, &r, 4);
    return static_cast<uint16_t>(sign | (rb - 0x3f000000));
  }
  uint32_t mant_odd = (abs >> 13) & 1;
  abs += 0xc8000fff + mant_odd;  // rebias exponent and round to nearest even
  return static_cast<uint16_t>(sign | (abs >> 13));
}

inline float Bf16BitsToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);
  x += 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

// ---- generic reductions -------------------------------------------------

struct SumOp {
  template <typename T>
  static T Apply(T a, T b) { return a + b; }
};
struct ProdOp {
  template <typename T>
  static T Apply(T a, T b) { return a * b; }
};
struct MinOp {
  template <typename T>
  static T Apply(T a, T b) { return b < a ? b : a; }
};
struct MaxOp {
  template <typename T>
  static T Apply(T a, T b) { return a < b ? b : a; }
};

template <typename T, typename Op>
void ReduceTyped(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Op::Apply(x[i], y[i]);
}

// bool: sum/max are logical or, product/min logical and.
template <bool kOr>
void ReduceBool(void* out, const void* a, const void* b, size_t n) {
  uint8_t* o = static_cast<uint8_t*>(out);
  const uint8_t* x = static_cast<const uint8_t*>(a);
  const uint8_t* y = static_cast<const uint8_t*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = kOr ? (x[i] | y[i]) : (x[i] & y[i]);
}

template <typename Op>
void ReduceBf16(void* out, const void* a, const void* b, size_t n) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < n; ++i) {
    o[i] = FloatToBf16Bits(Op::Apply(Bf16BitsToFloat(x[i]), Bf16BitsToFloat(y[i])));
  }
}

template <typename Op>
void ReduceHalfScalar(uint16_t* o, const uint16_t* x, const uint16_t* y, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    o[i] = FloatToHalfBits(Op::Apply(HalfBitsToFloat(x[i]), HalfBitsToFloat(y[i])));
  }
}

__attribute__((target("avx2,f16c"))) __m256 ApplyVec(SumOp, __m256 a, __m256 b) {
  return _mm256_add_ps(a, b);
}
__attribute__((target("avx2,f16c"))) __m256 ApplyVec(ProdOp, __m256 a, __m256 b) {
  return _mm256_mul_ps(a, b);
}
__attribute__((target("avx2,f16c"))) __m256 ApplyVec(MinOp, __m256 a, __m256 b) {
  return _mm256_min_ps(a, b);
}
__attribute__((target("avx2,f16c"))) __m256 ApplyVec(MaxOp, __m256 a, __m256 b) {
  return _mm256_max_ps(a, b);
}

template <typename Op>
__attribute__((target("avx2,f16c"))) void ReduceHalfF16C(uint16_t* o,
                                                       const uint16_t* x,
                                                       const uint16_t* y,
                                                       size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y + i)));
    __m128i r = _mm256_cvtps_ph(ApplyVec(Op(), a, b), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), r);
  }
  ReduceHalfScalar<Op>(o + i, x + i, y + i, n - i);
}

template <typename Op>
void ReduceHalf(void* out, const void* a, const void* b, size_t n) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  if (CpuHasF16C()) {
    ReduceHalfF16C<Op>(o, x, y, n);
  } else {
    ReduceHalfScalar<Op>(o, x, y, n);
  }
}

template <typename Op>
ReduceFn ForDtype(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat16: return &ReduceHalf<Op>;
    case DataType::kBFloat16: return &ReduceBf16<Op>;
    case DataType::kFloat32: return &ReduceTyped<float, Op>;
    case DataType::kFloat64: return &ReduceTyped<double, Op>;
    case DataType::kInt32: return &ReduceTyped<int32_t, Op>;
    case DataType::kInt64: return &ReduceTyped<int64_t, Op>;
    case DataType::kUint8: return &ReduceTyped<uint8_t, Op>;
    case DataType::kInt8: return &ReduceTyped<int8_t, Op>;
    case DataType::kUint16: return &ReduceTyped<uint16_t, Op>;
    case DataType::kInt16: return &ReduceTyped<int16_t, Op>;
    case DataType::kBool: return nullptr;
  }
  return nullptr;
}

template <typename T>
void ScaleTyped(void* data, size_t n, double factor) {
  T* p = static_cast<T*>(data);
  if (std::is_floating_point<T>::value) {
    T f = static_cast<T>(factor);
    for (size_t i = 0; i < n; ++i) p[i] *= f;
  } else {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(static_cast<double>(p[i]) * factor);
  }
}

}  // namespace

bool CpuHasF16C() {
  static const bool has = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
  return has;
}

ReduceFn HostReduceFn(DataType dtype, ReduceOp op) {
  ReduceFn fn = GetReduceFn(dtype, op);
  if (fn == nullptr) {
    throw std::invalid_argument(std::string("reduction ") + ReduceOpName(op) +
                                " is not defined for dtype " + DataTypeName(dtype));
  }
  return fn;
}

ReduceFn GetReduceFn(DataType dtype, ReduceOp op) {
  if (dtype == DataType::kBool) {
    switch (op) {
      case ReduceOp::kMax: return &ReduceBool<true>;
      case ReduceOp::kMin:
      case ReduceOp::kProduct: return &ReduceBool<false>;
      default: return nullptr;
    }
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage: return ForDtype<SumOp>(dtype);
    case ReduceOp::kProduct: return ForDtype<ProdOp>(dtype);
    case ReduceOp::kMin: return ForDtype<MinOp>(dtype);
    case ReduceOp::kMax: return ForDtype<MaxOp>(dtype);
  }
  return nullptr;
}

void ScaleBuffer(void* data, DataType dtype, size_t n, double factor) {
  if (factor == 1.0) return;
  switch (dtype) {
    case DataType::kFloat32: ScaleTyped<float>(data, n, factor); break;
    case DataType::kFloat64: ScaleTyped<double>(data, n, factor); break;
    case DataType::kInt32: ScaleTyped<int32_t>(data, n, factor); break;
    case DataType::kInt64: ScaleTyped<int64_t>(data, n, factor); break;
    case DataType::kUint8: ScaleTyped<uint8_t>(data, n, factor); break;
    case DataType::kInt8: ScaleTyped<int8_t>(data, n, factor); break;
    case DataType::kUint16: ScaleTyped<uint16_t>(data, n, factor); break;
    case DataType::kInt16: ScaleTyped<int16_t>(data, n, factor); break;
    case DataType::kFloat16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) {
        p[i] = FloatToHalfBits(static_cast<float>(HalfBitsToFloat(p[i]) * factor));
      }
      break;
    }
    case DataType::kBFloat16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) {
        p[i] = FloatToBf16Bits(static_cast<float>(Bf16BitsToFloat(p[i]) * factor));
      }
      break;
    }
    case DataType::kBool: break;
  }
}

namespace {
__attribute__((target("avx2,f16c"))) void FloatToHalfF16C(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i) out[i] = FloatToHalfBits(in[i]);
}
__attribute__((target("avx2,f16c"))) void HalfToFloatF16C(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i, f);
  }
  for (; i < n; ++i) out[i] = HalfBitsToFloat(in[i]);
}
__attribute__((target("avx2,f16c"))) void FloatToHalfScaledF16C(const float* in, uint16_t* out,
                                                              size_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_mul_ps(_mm256_loadu_ps(in + i), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = FloatToHalfBits(in[i] * scale);
}
__attribute__((target("avx2,f16c"))) void HalfToFloatScaledF16C(const uint16_t* in, float* out,
                                                              size_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(f, s));
  }
  for (; i < n; ++i) out[i] = HalfBitsToFloat(in[i]) * scale;
}

template <typename T>
bool AnyNonFinite(const T* p, size_t n) {
  // Summing x - x gives 0 for finite x and NaN otherwise; no branch per element.
  T acc = 0;
  for (size_t i = 0; i < n; ++i) acc += p[i] - p[i];
  return !(acc == 0);
}
}  // namespace

void FloatToHalfScaled(const float* in, uint16_t* out, size_t n, float scale) {
  if (CpuHasF16C()) return FloatToHalfScaledF16C(in, out, n, scale);
  for (size_t i = 0; i < n; ++i) out[i] = FloatToHalfBits(in[i] * scale);
}

void HalfToFloatScaled(const uint16_t* in, float* out, size_t n, float scale) {
  if (CpuHasF16C()) return HalfToFloatScaledF16C(in, out, n, scale);
  for (size_t i = 0; i < n; ++i) out[i] = HalfBitsToFloat(in[i]) * scale;
}

bool HasNonFinite(const void* data, DataType dtype, size_t n) {
  switch (dtype) {
    case DataType::kFloat32: return AnyNonFinite(static_cast<const float*>(data), n);
    case DataType::kFloat64: return AnyNonFinite(static_cast<const double*>(data), n);
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      // Exponent bits all ones: 0x7c00 for float16, 0x7f80 for bfloat16.
      const uint16_t mask = dtype == DataType::kFloat16 ? 0x7c00 : 0x7f80;
      const uint16_t* p = static_cast<const uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) {
        if ((p[i] & mask) == mask) return true;
      }
      return false;
    }
    default: return false;
  }
}

void FloatToHalf(const float* in, uint16_t* out, size_t n) {
  if (CpuHasF16C()) return FloatToHalfF16C(in, out, n);
  for (size_t i = 0; i < n; ++i) out[i] = FloatToHalfBits(in[i]);
}

void HalfToFloat(const uint16_t* in, float* out, size_t n) {
  if (CpuHasF16C()) return HalfToFloatF16C(in, out, n);
  for (size_t i = 0; i < n; ++i) out[i] = HalfBitsToFloat(in[i]);
}

}  // namespace perseus
