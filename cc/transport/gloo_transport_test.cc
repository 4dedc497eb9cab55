// Checks of GlooTransport's own algorithms against real Gloo TCP contexts on
// loopback, every rank a thread of this process. tests/test_cc_unit.py builds
// it on its own, with -lgloo.
#include "cc/transport/gloo_transport.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gloo/rendezvous/hash_store.h>

#include "cc/testing/check.h"
#include "cc/transport/cost_model.h"

using namespace perseus;

namespace {

// Runs body(transport) on `size` connected ranks at once.
void OnRanks(int size, const std::string& prefix,
             const std::function<void(GlooTransport&)>& body) {
  gloo::rendezvous::HashStore store;
  std::vector<std::future<void>> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.push_back(std::async(std::launch::async, [&, r] {
      TransportOptions o;
      o.rank = r;
      o.size = size;
      o.streams = 1;
      o.host_addr = "127.0.0.1";
      o.timeout = std::chrono::milliseconds(30000);
      o.key_prefix = prefix;
      GlooTransport transport(o, &store);
      body(transport);
    }));
  }
  for (auto& f : ranks) f.get();
}

}  // namespace

// Every world size from 2 to 7 (powers of two, and the folds of 3, 5, 6, 7):
// the sum, min and max of each rank's values, the same bits on every rank,
// and a float sum whose order matters ends identical everywhere.
TEST(RecursiveDoublingReducesOnEveryWorldSize) {
  for (int size = 2; size <= 7; ++size) {
    const size_t n = 1000;
    std::vector<std::vector<float>> sums(size), mins(size), orders(size);
    std::vector<std::vector<int64_t>> ints(size);
    OnRanks(size, "doubling" + std::to_string(size), [&](GlooTransport& t) {
      const int r = t.rank();
      std::vector<float> x(n), lo(n), order(n);
      std::vector<int64_t> k(n);
      for (size_t i = 0; i < n; ++i) {
        x[i] = static_cast<float>(r + 1) * static_cast<float>(i % 13);
        lo[i] = static_cast<float>((r * 7 + i) % 11);
        order[i] = r == 0 ? 1e8f : 1.0f / static_cast<float>(r + 3 + i % 5);
        k[i] = (int64_t{1} << 40) + r * 1000 + static_cast<int64_t>(i);
      }
      if (r == 1) lo[5] = std::numeric_limits<float>::quiet_NaN();
      t.AllreduceDoubling(0, x.data(), n, DataType::kFloat32, ReduceOp::kSum);
      t.AllreduceDoubling(0, lo.data(), n, DataType::kFloat32, ReduceOp::kMin);
      t.AllreduceDoubling(0, order.data(), n, DataType::kFloat32, ReduceOp::kSum);
      t.AllreduceDoubling(0, k.data(), n, DataType::kInt64, ReduceOp::kSum);
      sums[r] = x;
      mins[r] = lo;
      orders[r] = order;
      ints[r] = k;
    });
    const float ranks_sum = static_cast<float>(size * (size + 1) / 2);
    for (int r = 0; r < size; ++r) {
      for (size_t i = 0; i < n; ++i) {
        CHECK_EQ(sums[r][i], ranks_sum * static_cast<float>(i % 13));
        CHECK_EQ(ints[r][i], size * ((int64_t{1} << 40) + static_cast<int64_t>(i)) +
                                 1000 * static_cast<int64_t>(size * (size - 1) / 2));
        float want = std::numeric_limits<float>::infinity();
        for (int q = 0; q < size; ++q) want = std::min(want, static_cast<float>((q * 7 + i) % 11));
        if (i != 5) CHECK_EQ(mins[r][i], want);
      }
      // The same bits on every rank, NaN under min and order-dependent sums included.
      CHECK(std::memcmp(mins[r].data(), mins[0].data(), n * sizeof(float)) == 0);
      CHECK(std::memcmp(orders[r].data(), orders[0].data(), n * sizeof(float)) == 0);
    }
  }
}

// Empty and one-element buffers, and a call after a call (the slots reused).
TEST(RecursiveDoublingHandlesTinyBuffersBackToBack) {
  OnRanks(3, "tiny", [](GlooTransport& t) {
    double none = 0;
    t.AllreduceDoubling(0, &none, 0, DataType::kFloat64, ReduceOp::kSum);
    for (int round = 0; round < 20; ++round) {
      double one = t.rank() + round;
      t.AllreduceDoubling(0, &one, 1, DataType::kFloat64, ReduceOp::kSum);
      CHECK_EQ(one, 3.0 + 3.0 * round);
    }
  });
}


// Bruck's allgather on every world size from 2 to 9 (rounds that send fewer
// blocks than they could at 3, 5, 6, 7, 9), blocks of 1, 13 and 512 bytes,
// many calls back to back (the rounds' slots reused): every rank ends with
// every rank's bytes in rank order, as Gloo's ring allgather gives them.
TEST(BruckAllgatherPutsEveryRanksBlockInRankOrder) {
  for (int size = 2; size <= 9; ++size) {
    OnRanks(size, "bruck" + std::to_string(size), [size](GlooTransport& t) {
      const int r = t.rank();
      for (size_t block : {size_t{1}, size_t{13}, size_t{512}}) {
        for (int call = 0; call < 3; ++call) {
          std::vector<char> mine(block), all(block * size, 0), ring(block * size, 0);
          for (size_t i = 0; i < block; ++i) mine[i] = static_cast<char>(r * 31 + i * 7 + call);
          t.AllgatherBlocks(0, mine.data(), all.data(), block);
          t.Allgatherv(0, mine.data(), ring.data(), std::vector<size_t>(size, block));
          CHECK(all == ring);
          for (int q = 0; q < size; ++q) {
            CHECK_EQ(static_cast<int>(all[q * block]), static_cast<int>(static_cast<char>(q * 31 + call)));
          }
        }
      }
    });
  }
}

// The cost model's measurement at 2, 3, 4 and 8 ranks: every rank ends with
// the same bits (the line every rank draws from them is one line), all three
// costs measured; alpha and beta as given when given, gamma still measured.
TEST(LinkCostIsMeasuredAndAgreedOnEveryRank) {
  for (int size : {2, 3, 4, 8}) {
    for (bool given : {false, true}) {
      std::vector<LinkCost> got(size);
      OnRanks(size, "cost" + std::to_string(size) + (given ? "g" : ""), [&](GlooTransport& t) {
        LinkCost in;
        if (given) {
          in.alpha = 5e-5;
          in.beta = 1.25e9;
        }
        got[t.rank()] = MeasureLinkCost(t, 0, in);
      });
      for (int r = 0; r < size; ++r) {
        CHECK(std::memcmp(&got[r], &got[0], sizeof(LinkCost)) == 0);
      }
      CHECK(got[0].alpha > 0 && got[0].beta > 0 && got[0].gamma > 0);
      if (given) {
        CHECK(std::fabs(got[0].alpha - 5e-5) < 1e-15);
        CHECK(std::fabs(got[0].beta - 1.25e9) < 1e-3);
      }
      CHECK(DoublingCrossover(size, got[0]) > 0);
    }
  }
}
