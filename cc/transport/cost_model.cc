#include "cc/transport/cost_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
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

double Least(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

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

namespace {

// This rank's alpha and beta from recursive doubling among n ranks
// (`doubling(data, floats)`) of 4 bytes and 256 KiB, where `given` has none;
// gamma as given.
LinkCost MeasureDoubling(int n, const std::function<void(float*, size_t)>& doubling,
                         const LinkCost& given) {
  LinkCost mine = given;
  const bool measure = given.alpha <= 0 || given.beta <= 0;
  if (n > 1 && measure) {
    const int steps = DoublingSteps(n);
    float tiny = 0;
    std::vector<float> big(kBetaBytes / 4, 0.0f);
    auto exchange_tiny = [&] { doubling(&tiny, 1); };
    auto exchange_big = [&] { doubling(big.data(), big.size()); };
    exchange_tiny();  // every rank has arrived
    const std::vector<double> tiny_s = Timed(15, exchange_tiny);
    const double alpha = Median(tiny_s) / steps;
    // A step of bytes costs alpha + bytes / beta + bytes * gamma. The bytes'
    // share: the 256 KiB's median (a link's sustained rate, not a first
    // burst) less the fastest 4-byte call (a loaded host only adds to a
    // call's time, and subtracting a noisy median could leave nothing). A
    // link moves bytes no faster than this host reads them once.
    const double big_s = Median(Timed(3, exchange_big)) / steps;
    const double per_byte = std::max(big_s - Least(tiny_s) / steps, 0.0) / kBetaBytes;
    const double wire = std::max(per_byte - mine.gamma, mine.gamma);
    if (given.alpha <= 0) mine.alpha = alpha;
    if (given.beta <= 0) mine.beta = 1.0 / wire;
  }
  return mine;
}

}  // namespace

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
  mine = MeasureDoubling(n, [&](float* data, size_t count) {
    world.AllreduceDoubling(channel, data, count, DataType::kFloat32, ReduceOp::kSum);
  }, mine);
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

double FlatSeconds(int n, double bytes, const LinkCost& cost, int64_t line) {
  const bool doubles = line > 0 && bytes <= static_cast<double>(line) && bytes >= 4.0 * n;
  return doubles ? DoublingSeconds(n, bytes, cost) : RingSeconds(n, bytes, cost);
}

double TwoLevelSeconds(int hosts, double bytes, const TwoLevelCost& c) {
  return c.host_seconds + bytes * c.host_per_byte +
         FlatSeconds(hosts, bytes, c.cross, c.cross_line);
}

bool TwoLevelFaster(int n, int hosts, double bytes, const LinkCost& flat, int64_t line,
                    const TwoLevelCost& c) {
  if (hosts < 2 || n <= hosts || flat.beta <= 0 || c.cross.beta <= 0) return false;
  return TwoLevelSeconds(hosts, bytes, c) < FlatSeconds(n, bytes, flat, line);
}

TwoLevelCost MeasureTwoLevelCost(Transport& world, GroupCollectives& host,
                                 GroupCollectives* leaders, int hosts, int channel,
                                 const LinkCost& given, double gamma, int64_t given_line) {
  TwoLevelCost mine;
  // Inside the host: a reduce and a broadcast, as the two levels run them.
  {
    float tiny = 0;
    std::vector<float> big(kBetaBytes / 4, 0.0f);
    auto phases = [&](float* data, size_t count) {
      host.Reduce(channel, data, count, DataType::kFloat32, ReduceOp::kSum);
      host.Broadcast(channel, data, count * 4);
    };
    phases(&tiny, 1);  // every rank of the host has arrived
    const std::vector<double> small = Timed(15, [&] { phases(&tiny, 1); });
    const double large = Median(Timed(3, [&] { phases(big.data(), big.size()); }));
    mine.host_seconds = Median(small);
    mine.host_per_byte = std::max(large - Least(small), 0.0) / kBetaBytes;
  }
  // Across hosts: doubling among the leaders, as MeasureLinkCost on the world.
  LinkCost cross = given;
  cross.gamma = gamma;
  if (leaders != nullptr) {
    cross = MeasureDoubling(hosts, [&](float* data, size_t count) {
      leaders->AllreduceDoubling(channel, data, count, DataType::kFloat32, ReduceOp::kSum);
    }, cross);
  }
  // The host phases averaged over every rank, the links across hosts over
  // the leaders (the others add zeros): the same bits everywhere.
  const bool leader = leaders != nullptr;
  double v[4] = {mine.host_seconds, mine.host_per_byte, leader ? cross.alpha : 0.0,
                 leader ? cross.beta : 0.0};
  world.AllreduceDoubling(channel, v, 4, DataType::kFloat64, ReduceOp::kSum);
  const int n = world.size();
  mine.host_seconds = v[0] / n;
  mine.host_per_byte = v[1] / n;
  mine.cross.alpha = v[2] / hosts;
  mine.cross.beta = v[3] / hosts;
  mine.cross.gamma = gamma;
  mine.cross_line = given_line >= 0 ? given_line : DoublingCrossover(hosts, mine.cross);
  return mine;
}

}  // namespace perseus
