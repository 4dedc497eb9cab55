// The executor on its own: a fake world transport stands in for the other
// rank (no Gloo, no second process), responses are made by hand as the
// controller would hand them over, and each request's `done` records how it
// completed. What a multi-rank launch shows end to end (tests/test_core.py),
// checked here at the executor's own seam: fused buckets, pre- and
// post-scaling, float16 compression, broadcast and allgather, a transport
// that fails, a runtime that failed before the work ran, and Stop draining
// what is queued. (controller_test.cc drives the controller over the same
// fakes.)
#include "cc/runtime/executor.h"

#include <cmath>
#include <cstring>

#include "cc/runtime/fakes_for_tests.h"
#include "cc/testing/check.h"

using namespace perseus;
using namespace perseus::testing;

namespace {

Response ResponseOf(const Requests& requests, OpType op = OpType::kAllreduce) {
  Response r;
  r.op = op;
  for (const auto& q : requests) {
    r.names.push_back(q->meta.name);
    r.metas.push_back(q->meta);
  }
  return r;
}

}  // namespace

TEST(AFusedBucketIsReducedInOneCallAndScaled) {
  Bench bench;
  Executor executor(bench.Context());
  Done done;
  // A bucket's tensors share their reduction and scales (the negotiator
  // fuses only such): prescaled by 2, summed over the two ranks (which hold
  // the same values), postscaled by 3.
  std::vector<float> a{1, 2, 3}, b{0.5f, -4};
  Requests requests{Tensor("a", &a, done), Tensor("b", &b, done)};
  for (auto& q : requests) {
    q->meta.prescale = 2.0;
    q->meta.postscale = 3.0;
  }
  executor.Submit(0, ResponseOf(requests), requests);
  CHECK(done.WaitFor(2));
  for (const Status& s : done.statuses) CHECK(s.ok());
  CHECK_EQ(a[0], 12.0f);
  CHECK_EQ(a[2], 36.0f);
  CHECK_EQ(b[0], 6.0f);
  CHECK_EQ(b[1], -48.0f);
  std::vector<std::string> calls = bench.world.calls();
  CHECK_EQ(calls.size(), 1u);  // one fused call for both tensors
  CHECK_EQ(calls[0], std::string("allreduce float32 5"));

  // One tensor alone, averaged: reduced where it is, prescale and
  // postscale around the mean.
  std::vector<float> c{1, -2};
  Requests alone{Tensor("c", &c, done)};
  alone[0]->meta.reduce_op = ReduceOp::kAverage;
  alone[0]->meta.prescale = 2.0;
  alone[0]->meta.postscale = 3.0;
  executor.Submit(0, ResponseOf(alone), alone);
  CHECK(done.WaitFor(3));
  CHECK_EQ(c[0], 6.0f);
  CHECK_EQ(c[1], -12.0f);
  executor.Stop();
}

TEST(Float16CompressionTravelsAsHalvesAndComesBackClose) {
  Bench bench;
  Executor executor(bench.Context());
  Done done;
  std::vector<float> g(64);
  for (size_t i = 0; i < g.size(); ++i) g[i] = 0.01f * static_cast<float>(i) - 0.3f;
  const std::vector<float> original = g;
  Requests requests{Tensor("grad", &g, done)};
  requests[0]->meta.compression = kCompressFp16;
  executor.Submit(0, ResponseOf(requests), requests);
  CHECK(done.WaitFor(1));
  CHECK(done.statuses[0].ok());
  for (size_t i = 0; i < g.size(); ++i) {
    CHECK(std::fabs(g[i] - 2 * original[i]) <= 2e-3f * std::fabs(original[i]) + 1e-4f);
  }
  std::vector<std::string> calls = bench.world.calls();
  CHECK_EQ(calls.size(), 1u);
  CHECK_EQ(calls[0], std::string("allreduce float16 64"));
  executor.Stop();
}

TEST(BroadcastAndAllgatherCarryTheOtherRanksData) {
  Bench bench;
  Executor executor(bench.Context());
  Done done;
  std::vector<float> weights(4, 1.0f);
  Requests bcast{Tensor("w", &weights, done, OpType::kBroadcast)};
  bcast[0]->meta.root = 1;
  executor.Submit(0, ResponseOf(bcast, OpType::kBroadcast), bcast);
  CHECK(done.WaitFor(1));
  uint32_t bits = 0;
  std::memcpy(&bits, &weights[3], sizeof(bits));
  CHECK_EQ(bits, 0x5A5A5A5Au);

  std::vector<float> rows{1, 2};
  std::vector<float> gathered;
  Requests gather{Tensor("rows", &rows, done, OpType::kAllgather)};
  gather[0]->output = nullptr;
  gather[0]->allocate = [&gathered](const std::vector<int64_t>& shape) {
    gathered.assign(static_cast<size_t>(shape[0]), 0.0f);
    return static_cast<void*>(gathered.data());
  };
  Response r = ResponseOf(gather, OpType::kAllgather);
  r.first_dims = {{2, 3}};  // the other rank has three rows
  executor.Submit(0, r, gather);
  CHECK(done.WaitFor(2));
  CHECK(done.statuses[1].ok());
  CHECK_EQ(gathered.size(), 5u);
  CHECK_EQ(gathered[0], 1.0f);
  CHECK_EQ(gathered[2], 101.0f);
  CHECK_EQ(gathered[4], 101.0f);
  executor.Stop();
}

TEST(AFailingTransportFailsTheRuntimeNamingTheStreamTheOpAndTheTensor) {
  Bench bench;
  Executor executor(bench.Context());
  Done done;
  std::vector<float> x{1, 2};
  bench.world.fail = true;
  Requests requests{Tensor("layer/kernel", &x, done)};
  executor.Submit(0, ResponseOf(requests), requests);
  CHECK(done.WaitFor(1));
  CHECK(!done.statuses[0].ok());
  CHECK(bench.failed_with.find("stream 0 allreduce of 'layer/kernel' failed: the peer hung up") !=
        std::string::npos);
  // Later work completes with the runtime's failure, without a collective.
  bench.world.fail = false;
  std::vector<float> y{3};
  Requests later{Tensor("later", &y, done)};
  executor.Submit(0, ResponseOf(later), later);
  CHECK(done.WaitFor(2));
  CHECK(done.statuses[1].message == bench.failure.message);
  CHECK_EQ(bench.world.calls().size(), 1u);
  CHECK_EQ(y[0], 3.0f);
  executor.Stop();
}

TEST(StopRunsWhatIsQueuedOnEveryStreamFirst) {
  Bench bench;
  Executor executor(bench.Context(/*streams=*/2));
  Done done;
  std::vector<std::vector<float>> data(12, std::vector<float>{1.0f});
  for (size_t i = 0; i < data.size(); ++i) {
    Requests requests{Tensor("t" + std::to_string(i), &data[i], done)};
    executor.Submit(static_cast<int>(i % 3), ResponseOf(requests), requests);
  }
  executor.Stop();
  CHECK_EQ(done.count, 12);
  for (const auto& d : data) CHECK_EQ(d[0], 2.0f);
}
