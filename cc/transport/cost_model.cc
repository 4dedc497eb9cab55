#include "cc/transport/cost_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "cc/core/reduce.h"
#include "cc/transport/transport.h"

namespace perseus {

namespace {

// Exchanges of recursive doubling among n ranks (GlooTransport's: the fold
// and unfold add one each when n is not a power of two).
int DoublingSteps(int n) {
  int p = 1, steps = 0;
  while (p * 2 <= n) {
    p *= 2;
    ++steps;
  }
  return steps + (p == n ? 0 : 2);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
std::vector<double> Timed(int calls, F f) {
  std::vector<double> out;
  for (int i = 0; i < calls; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return out;
}

constexpr size_t kBetaBytes = 256 << 10;
constexpr size_t kGammaBytes = 4 << 20;

}  // namespace

double RingSeconds(int n, double bytes, const LinkCost& c) {
  if (n < 2) return 0;
  const double share = static_cast<double>(n - 1) / n;
  return 2 * (n - 1) * c.alpha + 2 * share * bytes / c.beta + share * bytes * c.gamma;
}

double DoublingSeconds(int n, double bytes, const LinkCost& c) {
  if (n < 2) return 0;
  const int steps = DoublingSteps(n);
  return steps * (c.alpha + bytes / c.beta + bytes * c.gamma);
}

int64_t DoublingCrossover(int n, const LinkCost& c) {
  if (n < 2 || c.beta <= 0) return 0;
  // ring - doubling = latency_gain - bytes * per_byte_loss: doubling wins
  // while that is positive.
  const int steps = DoublingSteps(n);
  const double share = static_cast<double>(n - 1) / n;
  const double latency_gain = (2 * (n - 1) - steps) * c.alpha;
  const double per_byte_loss = (steps - 2 * share) / c.beta + (steps - share) * c.gamma;
  if (latency_gain <= 0) return 0;
  if (per_byte_loss <= 0) return kMaxDoublingBytes;
  const double bytes = latency_gain / per_byte_loss;
  return bytes >= static_cast<double>(kMaxDoublingBytes) ? kMaxDoublingBytes
                                                         : static_cast<int64_t>(bytes);
}

LinkCost MeasureLinkCost(Transport& world, int channel, const LinkCost& given) {
  const int n = world.size();
  LinkCost mine = given;
  // gamma: this host's float32 sum, on buffers larger than the caches.
  {
    std::vector<float> a(kGammaBytes / 4, 1.0f), b(kGammaBytes / 4, 2.0f);
    const ReduceFn sum = HostReduceFn(DataType::kFloat32, ReduceOp::kSum);
    sum(a.data(), a.data(), b.data(), a.size());  // warm
    mine.gamma = Median(Timed(5, [&] { sum(a.data(), a.data(), b.data(), a.size()); })) /
                 static_cast<double>(kGammaBytes);
  }
  const bool measure = given.alpha <= 0 || given.beta <= 0;
  if (n > 1 && measure) {
    const int steps = DoublingSteps(n);
    float tiny = 0;
    std::vector<float> big(kBetaBytes / 4, 0.0f);
    auto exchange_tiny = [&] {
      world.AllreduceDoubling(channel, &tiny, 1, DataType::kFloat32, ReduceOp::kSum);
    };
    auto exchange_big = [&] {
      world.AllreduceDoubling(channel, big.data(), big.size(), DataType::kFloat32, ReduceOp::kSum);
    };
    exchange_tiny();  // every rank has arrived
    const double alpha = Median(Timed(9, exchange_tiny)) / steps;
    const double per_step = Median(Timed(3, exchange_big)) / steps;
    // per_step = alpha + bytes / beta + bytes * gamma
    const double wire = std::max(per_step - alpha - kBetaBytes * mine.gamma, 1e-9);
    if (given.alpha <= 0) mine.alpha = alpha;
    if (given.beta <= 0) mine.beta = static_cast<double>(kBetaBytes) / wire;
  }
  if (n > 1) {
    // One set for all: the average, by doubling (the same bits everywhere).
    double v[3] = {mine.alpha, mine.beta, mine.gamma};
    world.AllreduceDoubling(channel, v, 3, DataType::kFloat64, ReduceOp::kSum);
    mine.alpha = v[0] / n;
    mine.beta = v[1] / n;
    mine.gamma = v[2] / n;
  }
  return mine;
}

}  // namespace perseus
