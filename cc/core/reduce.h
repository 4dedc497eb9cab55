// Element-wise arithmetic on raw buffers: reductions, scaling, and float16
// conversion. Debian's Gloo is built without AVX and converts float16 one
// element at a time, so float16 paths here use F16C/AVX2 when the CPU has
// them (checked at run time) and a portable loop otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cc/core/common.h"

namespace perseus {

// out[i] = op(a[i], b[i]) for n elements; out may alias a or b.
// Average reduces as sum (the division is a postscale).
using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

// Returns nullptr when op does not apply to dtype (e.g. sum of bool).
ReduceFn GetReduceFn(DataType dtype, ReduceOp op);
// The same, throwing std::invalid_argument naming both instead of null:
// what a transport uses to carry out the reduce operation it is given.
ReduceFn HostReduceFn(DataType dtype, ReduceOp op);

// data[i] *= factor, computed in double for integers (truncated toward zero).
void ScaleBuffer(void* data, DataType dtype, size_t n, double factor);

// float32 <-> IEEE float16 (round to nearest even).
void FloatToHalf(const float* in, uint16_t* out, size_t n);
void HalfToFloat(const uint16_t* in, float* out, size_t n);
// The same with a multiplication on the way: out = half(in * scale) and
// out = float(in) * scale (both products in float32).
void FloatToHalfScaled(const float* in, uint16_t* out, size_t n, float scale);
void HalfToFloatScaled(const uint16_t* in, float* out, size_t n, float scale);

// True if a floating-point buffer holds a NaN or an infinity (integer and
// bool buffers never do).
bool HasNonFinite(const void* data, DataType dtype, size_t n);

bool CpuHasF16C();

}  // namespace perseus
