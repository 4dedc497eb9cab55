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

namespace {

TwoLevelCost Two(double host_s, double host_mbytes, const LinkCost& cross, int64_t line) {
  TwoLevelCost c;
  c.host_seconds = host_s;
  c.host_per_byte = 1e-6 / host_mbytes;
  c.cross = cross;
  c.cross_line = line;
  return c;
}

}  // namespace

TEST(FlatAndTwoLevelTimesFollowTheirLines) {
  const LinkCost link = Cost(1e-4, 1e8, 0);
  // Flat: doubling up to the line (from 4 bytes a rank), the ring past it.
  CHECK_EQ(FlatSeconds(8, 1000, link, 4096), DoublingSeconds(8, 1000, link));
  CHECK_EQ(FlatSeconds(8, 8192, link, 4096), RingSeconds(8, 8192, link));
  CHECK_EQ(FlatSeconds(8, 16, link, 4096), RingSeconds(8, 16, link));
  // Two levels: the host phases, then the leaders' doubling or ring.
  const TwoLevelCost c = Two(2e-5, 1e4, link, 4096);
  CHECK(std::fabs(TwoLevelSeconds(4, 1000, c) - (2e-5 + 1e-7 + DoublingSeconds(4, 1000, link))) <
        1e-15);
  CHECK(std::fabs(TwoLevelSeconds(4, 1e6, c) - (2e-5 + 1e-4 + RingSeconds(4, 1e6, link))) <
        1e-12);
}

TEST(TwoLevelsWhereTheModelSaysTheyAreFaster) {
  // 8 hosts of 8 ranks; hops inside a host cheap, across hosts dear. The
  // flat group's average hop is dearer than a hop between leaders; cheap
  // host phases: two levels win from small to large buckets.
  const LinkCost flat = Cost(1e-4, 1e8, 1e-10), cross = Cost(5e-5, 1.25e8, 1e-10);
  const int64_t line = DoublingCrossover(64, flat), cross_line = DoublingCrossover(8, cross);
  const TwoLevelCost cheap = Two(1e-5, 5e3, cross, cross_line);
  for (double b : {1e3, 1e5, 1e7}) {
    CHECK_EQ(TwoLevelFaster(64, 8, b, flat, line, cheap),
             TwoLevelSeconds(8, b, cheap) < FlatSeconds(64, b, flat, line));
    CHECK(TwoLevelFaster(64, 8, b, flat, line, cheap));
  }
  // Host phases of 2 ms and 60 MB/s: a 1 KB bucket goes flat (doubling's
  // 0.7 ms); a 100 KB one takes two levels (flat doubling moves the whole
  // buffer 6 times); a 1 GB one goes flat (the host's copies slower than
  // the link).
  const TwoLevelCost dear = Two(2e-3, 60, cross, cross_line);
  CHECK(!TwoLevelFaster(64, 8, 1e3, flat, line, dear));
  CHECK(TwoLevelFaster(64, 8, 1e5, flat, line, dear));
  CHECK(!TwoLevelFaster(64, 8, 1e9, flat, line, dear));
}

TEST(TwoLevelsNeverWithoutHostsOrAMeasure) {
  const LinkCost link = Cost(5e-5, 1.25e8, 1e-10);
  const TwoLevelCost c = Two(1e-5, 5e3, link, 0);
  CHECK(!TwoLevelFaster(8, 8, 1e6, link, 0, c));   // one rank a host
  CHECK(!TwoLevelFaster(8, 1, 1e6, link, 0, c));   // one host
  CHECK(!TwoLevelFaster(8, 2, 1e6, link, 0, TwoLevelCost()));
  CHECK(!TwoLevelFaster(8, 2, 1e6, LinkCost(), 0, c));
}
