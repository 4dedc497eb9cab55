#include "cc/core/reduce.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cc/testing/check.h"

using namespace perseus;

namespace {

uint16_t Half(float f) {
  uint16_t h;
  FloatToHalf(&f, &h, 1);
  return h;
}

float Float(uint16_t h) {
  float f;
  HalfToFloat(&h, &f, 1);
  return f;
}

template <typename T>
void CheckReduce(DataType dtype, ReduceOp op, T (*ref)(T, T)) {
  std::vector<T> a, b;
  for (int i = 0; i < 37; ++i) {  // odd length: vector loops and their tails
    a.push_back(static_cast<T>((i * 7) % 11 + 1));
    b.push_back(static_cast<T>((i * 5) % 13 + 1));
  }
  std::vector<T> out(a.size());
  ReduceFn fn = GetReduceFn(dtype, op);
  CHECK(fn != nullptr);
  if (!fn) return;
  fn(out.data(), a.data(), b.data(), a.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(out[i] == ref(a[i], b[i]));
  fn(a.data(), a.data(), b.data(), a.size());  // out may alias a
  CHECK(a == out);
}

template <typename T> T Sum(T x, T y) { return static_cast<T>(x + y); }
template <typename T> T Min(T x, T y) { return x < y ? x : y; }
template <typename T> T Max(T x, T y) { return x < y ? y : x; }
template <typename T> T Prod(T x, T y) { return static_cast<T>(x * y); }

template <typename T>
void CheckAllOps(DataType dtype) {
  CheckReduce<T>(dtype, ReduceOp::kSum, Sum<T>);
  CheckReduce<T>(dtype, ReduceOp::kAverage, Sum<T>);  // the division is a postscale
  CheckReduce<T>(dtype, ReduceOp::kMin, Min<T>);
  CheckReduce<T>(dtype, ReduceOp::kMax, Max<T>);
  CheckReduce<T>(dtype, ReduceOp::kProduct, Prod<T>);
}

}  // namespace

TEST(HalfConversionOfExactValues) {
  CHECK_EQ(Half(1.0f), 0x3C00);
  CHECK_EQ(Half(-2.0f), 0xC000);
  CHECK_EQ(Half(65504.0f), 0x7BFF);                // largest finite half
  CHECK_EQ(Half(0.0f), 0x0000);
  CHECK_EQ(Half(-0.0f), 0x8000);
  CHECK_EQ(Half(std::ldexp(1.0f, -24)), 0x0001);   // smallest subnormal
  CHECK_EQ(Half(std::numeric_limits<float>::infinity()), 0x7C00);
  CHECK_EQ(Half(1e6f), 0x7C00);                    // overflow to infinity
  const uint16_t nan = Half(std::numeric_limits<float>::quiet_NaN());
  CHECK((nan & 0x7C00) == 0x7C00 && (nan & 0x03FF) != 0);
}

TEST(HalfConversionRoundsToNearestEven) {
  CHECK_EQ(Half(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // tie, to even (down)
  CHECK_EQ(Half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie, to even (up)
  CHECK_EQ(Half(1.0f + std::ldexp(1.2f, -11)), 0x3C01);      // above the tie
}

TEST(EveryHalfSurvivesTheRoundTrip) {
  int wrong = 0;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7C00) == 0x7C00 && (h & 0x03FF)) continue;  // NaN payloads
    if (Half(Float(static_cast<uint16_t>(h))) != h) ++wrong;
  }
  CHECK_EQ(wrong, 0);
  // A long buffer takes the vector path: same bits as one at a time.
  std::vector<float> in(1000);
  for (size_t i = 0; i < in.size(); ++i) in[i] = std::sin(static_cast<float>(i)) * 1000;
  std::vector<uint16_t> out(in.size());
  FloatToHalf(in.data(), out.data(), in.size());
  for (size_t i = 0; i < in.size(); ++i) CHECK_EQ(out[i], Half(in[i]));
}

TEST(ScaledHalfConversion) {
  const float in[3] = {0.5f, -3.0f, 1e-6f};
  uint16_t h[3];
  FloatToHalfScaled(in, h, 3, 4.0f);
  CHECK_EQ(h[0], Half(2.0f));
  CHECK_EQ(h[1], Half(-12.0f));
  CHECK_EQ(h[2], Half(4e-6f));
  float back[3];
  HalfToFloatScaled(h, back, 3, 0.25f);
  CHECK_EQ(back[0], 0.5f);
  CHECK_EQ(back[1], -3.0f);
}

TEST(ReductionsOfEveryDtypeAndOp) {
  CheckAllOps<float>(DataType::kFloat32);
  CheckAllOps<double>(DataType::kFloat64);
  CheckAllOps<int32_t>(DataType::kInt32);
  CheckAllOps<int64_t>(DataType::kInt64);
  CheckAllOps<uint8_t>(DataType::kUint8);
  CheckAllOps<int8_t>(DataType::kInt8);
  CheckAllOps<uint16_t>(DataType::kUint16);
  CheckAllOps<int16_t>(DataType::kInt16);
}

TEST(Float16SumMatchesFloatRounding) {
  std::vector<uint16_t> a, b, out(50);
  for (int i = 0; i < 50; ++i) {
    a.push_back(Half(0.1f * i));
    b.push_back(Half(-0.37f * i + 3));
  }
  GetReduceFn(DataType::kFloat16, ReduceOp::kSum)(out.data(), a.data(), b.data(), 50);
  for (int i = 0; i < 50; ++i) CHECK_EQ(out[i], Half(Float(a[i]) + Float(b[i])));
}

TEST(BoolHasMinAndMaxOnly) {
  CHECK(GetReduceFn(DataType::kBool, ReduceOp::kSum) == nullptr);
  const bool a[2] = {true, false}, b[2] = {true, true};
  bool out[2];
  GetReduceFn(DataType::kBool, ReduceOp::kMin)(out, a, b, 2);
  CHECK(out[0] && !out[1]);
  GetReduceFn(DataType::kBool, ReduceOp::kMax)(out, a, b, 2);
  CHECK(out[0] && out[1]);
}

TEST(ScaleBufferTruncatesIntegersTowardZero) {
  int32_t i[3] = {7, -7, 10};
  ScaleBuffer(i, DataType::kInt32, 3, 0.5);
  CHECK_EQ(i[0], 3);
  CHECK_EQ(i[1], -3);
  CHECK_EQ(i[2], 5);
  float f[2] = {1.0f, -3.0f};
  ScaleBuffer(f, DataType::kFloat32, 2, 0.25);
  CHECK_EQ(f[0], 0.25f);
  CHECK_EQ(f[1], -0.75f);
}

TEST(NonFiniteIsFoundInFloatsOnly) {
  float f[3] = {1, 2, 3};
  CHECK(!HasNonFinite(f, DataType::kFloat32, 3));
  f[2] = std::numeric_limits<float>::infinity();
  CHECK(HasNonFinite(f, DataType::kFloat32, 3));
  uint16_t h[2] = {Half(1.0f), 0x7E00};
  CHECK(HasNonFinite(h, DataType::kFloat16, 2));
  int32_t i[2] = {-1, 0x7F800000};
  CHECK(!HasNonFinite(i, DataType::kInt32, 2));
}
