// The controller with a real request table and executor, over the fakes of
// fakes_for_tests.h: a world of two whose other rank makes the same calls
// (the control exchange returns this rank's message as the peer's). Checks
// the negotiation cycle at its seam: requests submitted to the table are
// negotiated, fused and completed; a grouped call completes whole; both
// ranks asking to shut down stops the thread; a control channel that fails
// fails the round with what it said, and the requests with it.
#include "cc/runtime/controller.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "cc/runtime/executor.h"
#include "cc/runtime/fakes_for_tests.h"
#include "cc/runtime/request_table.h"
#include "cc/testing/check.h"

using namespace perseus;
using namespace perseus::testing;

namespace {

struct Round {
  Bench bench;
  RequestTable table;
  StatsBook stats;
  std::atomic<bool> mark_cycles{false};
  std::atomic<bool> running{true};
  std::atomic<bool> stopped{false};
  std::unique_ptr<Executor> executor;
  std::unique_ptr<Controller> controller;

  Round() {
    table.Open(0);
    executor.reset(new Executor(bench.Context()));
    ControllerContext c;
    c.ranks.rank = 0;
    c.ranks.size = 2;
    c.streams = 1;
    c.requests = &table;
    c.executor = executor.get();
    c.control = &bench.world;
    c.stats = &stats;
    c.timeline = &bench.timeline;
    c.mark_cycles = &mark_cycles;
    c.running = [this] { return running.load(); };
    c.fail = [this](const std::string& what) {
      running = false;
      Status failed = Status::Error(StatusCode::kUnavailable, what);
      {
        std::lock_guard<std::mutex> lock(bench.mu);
        bench.failure = failed;
        bench.failed_with = what;
      }
      table.Close(failed);
    };
    c.stopped = [this] { stopped = true; };
    controller.reset(new Controller(c));
    controller->Start();
  }
  ~Round() {
    running = false;
    table.RequestShutdown();
    controller->Join();
    executor->Stop();
  }
  bool Submit(const Requests& requests) {
    bool closed = false;
    return table.Submit(requests, RequestTable::Clock::now(), &closed).ok() && !closed;
  }
};

}  // namespace

TEST(RequestsAreNegotiatedFusedAndCompleted) {
  Round round;
  Done done;
  std::vector<float> a{1, 2}, b{3}, c{4, 5, 6};
  // One grouped call of two tensors, then a call of one.
  CHECK(round.Submit({Tensor("a", &a, done), Tensor("b", &b, done)}));
  CHECK(round.Submit({Tensor("c", &c, done)}));
  CHECK(done.WaitFor(3));
  for (const Status& s : done.statuses) CHECK(s.ok());
  CHECK_EQ(a[1], 4.0f);
  CHECK_EQ(b[0], 6.0f);
  CHECK_EQ(c[2], 12.0f);
  // Fused: a and b (one grouped call) always travel together, c with them
  // when it came in the same cycle; 6 elements in one or two calls.
  std::vector<std::string> calls = round.bench.world.calls();
  CHECK(calls.size() == 1 || calls.size() == 2);
  CHECK(calls[0] == "allreduce float32 6" || calls[0] == "allreduce float32 3");
  CHECK(round.stats.Get().cycles > 0);
}

TEST(BothRanksAskingToShutDownStopsTheThread) {
  Round round;
  round.table.RequestShutdown();
  for (int i = 0; i < 3000 && !round.stopped; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(round.stopped.load());
  CHECK(round.table.ShuttingDown());
}

TEST(AFailingControlChannelFailsTheRoundAndItsRequests) {
  Round round;
  Done done;
  round.bench.world.fail = true;
  std::vector<float> x{1};
  CHECK(round.Submit({Tensor("x", &x, done)}));
  CHECK(done.WaitFor(1));
  CHECK(!done.statuses[0].ok());
  CHECK(round.bench.failed_with.find("the peer hung up") != std::string::npos);
  CHECK_EQ(x[0], 1.0f);
}
