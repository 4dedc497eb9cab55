// The cost model's arithmetic (cost_model.h): its times and the line it
// draws between recursive doubling and the ring.
#include "cc/transport/cost_model.h"

#include <cmath>

#include "cc/testing/check.h"

using namespace perseus;

namespace {

LinkCost Cost(double alpha, double beta, double gamma) {
  LinkCost c;
  c.alpha = alpha;
  c.beta = beta;
  c.gamma = gamma;
  return c;
}

}  // namespace

TEST(CostModelTimesFollowTheHopsAndBytesOfEachAlgorithm) {
  const LinkCost c = Cost(1e-4, 1e9, 0);
  // 4 ranks: the ring 6 hops and 1.5x the bytes; doubling 2 exchanges.
  CHECK(std::fabs(RingSeconds(4, 1e6, c) - (6e-4 + 1.5e-3)) < 1e-12);
  CHECK(std::fabs(DoublingSeconds(4, 1e6, c) - 2 * (1e-4 + 1e-3)) < 1e-12);
  // 5 ranks: doubling among 4 plus the fold and unfold, 4 exchanges.
  CHECK(std::fabs(DoublingSeconds(5, 0, c) - 4e-4) < 1e-12);
  CHECK_EQ(RingSeconds(1, 1e6, c), 0.0);
}

TEST(TheLineIsWhereDoublingStopsBeatingTheRing) {
  const LinkCost c = Cost(2e-5, 1e9, 2e-10);
  for (int n : {3, 4, 5, 8, 13, 32, 256}) {
    const int64_t line = DoublingCrossover(n, c);
    CHECK(line > 0 && line < kMaxDoublingBytes);
    const double below = 0.99 * line, above = 1.01 * line;
    CHECK(DoublingSeconds(n, below, c) < RingSeconds(n, below, c));
    CHECK(DoublingSeconds(n, above, c) > RingSeconds(n, above, c));
  }
  // 4 ranks, no reduction cost: the ring's 4 extra hops pay for 0.5x the
  // bytes at 8 alpha beta = 800000 bytes.
  const int64_t four = DoublingCrossover(4, Cost(1e-4, 1e9, 0));
  CHECK(four >= 799999 && four <= 800000);
  // More ranks, more hops saved: the line moves up.
  CHECK(DoublingCrossover(4, c) < DoublingCrossover(8, c));
  CHECK(DoublingCrossover(8, c) < DoublingCrossover(32, c));
  // Slower hops, or faster links, move it up too.
  CHECK(DoublingCrossover(8, c) < DoublingCrossover(8, Cost(1e-4, 1e9, 2e-10)));
  CHECK(DoublingCrossover(8, c) < DoublingCrossover(8, Cost(2e-5, 1e10, 2e-10)));
}

TEST(TheLineAtItsEdges) {
  // 2 ranks move the same bytes either way: only the reduction (doubling
  // reduces all of them, the ring half) limits doubling, at 2 alpha / gamma.
  const int64_t two = DoublingCrossover(2, Cost(2e-5, 1e9, 2e-10));
  CHECK(two >= 199999 && two <= 200000);
  CHECK_EQ(DoublingCrossover(2, Cost(1e-4, 1e9, 0)), kMaxDoublingBytes);
  CHECK_EQ(DoublingCrossover(1, Cost(1e-4, 1e9, 0)), int64_t{0});
  CHECK_EQ(DoublingCrossover(8, Cost(1e-4, 0, 0)), int64_t{0});  // nothing measured
  CHECK_EQ(DoublingCrossover(8, Cost(1, 1e9, 0)), kMaxDoublingBytes);  // capped
  CHECK_EQ(kMaxDoublingBytes, int64_t{16} << 20);
}
