// Checks of gloo_abortable.cc against real Gloo TCP contexts on loopback,
// two ranks as two threads of this process. tests/test_cc_unit.py builds it
// on its own, with -lgloo (the other unit tests are built without Gloo).
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gloo/allreduce.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include "cc/testing/check.h"
#include "cc/transport/gloo_abortable.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kTimeout = std::chrono::seconds(60);

std::shared_ptr<gloo::Context> Connect(gloo::rendezvous::Store& store, const std::string& name,
                                       int rank) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = perseus::WrapGlooDevice(gloo::transport::tcp::CreateDevice(attr), kTimeout);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, 2);
  ctx->setTimeout(kTimeout);
  gloo::rendezvous::PrefixStore prefixed(name, store);
  ctx->connectFullMesh(prefixed, device);
  return ctx;
}

// Both ranks' contexts of one name.
std::vector<std::shared_ptr<gloo::Context>> ConnectPair(gloo::rendezvous::Store& store,
                                                        const std::string& name) {
  auto one = std::async(std::launch::async, [&] { return Connect(store, name, 1); });
  auto zero = Connect(store, name, 0);
  return {zero, one.get()};
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// A receive nobody sends to: without an abort it would wait kTimeout.
// Returns the error and how long the wait took.
std::string AbortedReceive(const std::shared_ptr<gloo::Context>& ctx,
                           const std::function<void()>& abort, double* seconds) {
  int value = 0;
  auto buffer = ctx->createUnboundBuffer(&value, sizeof(value));
  buffer->recv(1, /*slot=*/7);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    abort();
  });
  const auto start = Clock::now();
  std::string error = "no error";
  try {
    buffer->waitRecv();
  } catch (const gloo::IoException& e) {
    error = e.what();
  }
  *seconds = Seconds(start);
  aborter.join();
  return error;
}

void Exchange(const std::vector<std::shared_ptr<gloo::Context>>& ctx) {
  auto run = [&](int rank) {
    std::vector<float> data(1000, static_cast<float>(rank + 1));
    gloo::AllreduceOptions opts(ctx[rank]);
    opts.setOutput(data.data(), data.size());
    opts.setReduceFunction(gloo::AllreduceOptions::Func(
        [](void* a, const void* b, const void* c, size_t n) {
          auto* out = static_cast<float*>(a);
          auto* x = static_cast<const float*>(b);
          auto* y = static_cast<const float*>(c);
          for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
        }));
    gloo::allreduce(opts);
    return data;
  };
  auto other = std::async(std::launch::async, run, 1);
  const auto mine = run(0);
  const auto theirs = other.get();
  CHECK_EQ(mine[0], 3.0f);
  CHECK_EQ(mine[999], 3.0f);
  CHECK_EQ(theirs[500], 3.0f);
}

}  // namespace

TEST(WrappedContextsRunGlooCollectives) {
  gloo::rendezvous::HashStore store;
  Exchange(ConnectPair(store, "plain"));
}

TEST(AbortGlooDeviceEndsAWaitAndLaterCallsThrowItsReason) {
  gloo::rendezvous::HashStore store;
  auto ctx = ConnectPair(store, "device");
  double seconds = 0;
  const std::string error = AbortedReceive(
      ctx[0], [&] { perseus::AbortGlooDevice(ctx[0]->getDevice(), "rank 1 died (test)"); },
      &seconds);
  CHECK(error.find("rank 1 died (test)") != std::string::npos);
  CHECK(seconds < 10);
  int value = 0;
  auto later = ctx[0]->createUnboundBuffer(&value, sizeof(value));
  CHECK_THROWS(later->send(1, 8));
  CHECK_THROWS(later->waitSend());
  // The other rank's context was not aborted.
  auto theirs = ctx[1]->createUnboundBuffer(&value, sizeof(value));
  theirs->recv(0, 9);  // posts a receive; no throw
}

TEST(AbortGlooWaitsEndsEveryLiveContextButNotLaterOnes) {
  gloo::rendezvous::HashStore store;
  auto ctx = ConnectPair(store, "global");
  double seconds = 0;
  const std::string error =
      AbortedReceive(ctx[0], [] { CHECK(perseus::AbortGlooWaits("the job failed (test)") >= 2); },
                     &seconds);
  CHECK(error.find("the job failed (test)") != std::string::npos);
  CHECK(seconds < 10);
  int value = 0;
  auto theirs = ctx[1]->createUnboundBuffer(&value, sizeof(value));
  CHECK_THROWS(theirs->recv(0, 9));
  // Contexts made after the abort work.
  Exchange(ConnectPair(store, "after"));
}
