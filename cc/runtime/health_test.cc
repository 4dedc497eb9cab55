// The health monitor alone, over a store kept in memory (FakeStore below,
// the HealthStore seam of health.h): naming a dead, a departed, a failed and
// a stopped rank; the heartbeat failing the round when a peer's connection
// closes or the store goes silent; the marks of leaving; the slow-rank check.
// This rank is rank 0 of a world of three; the store's keys are what the
// other ranks and the store's server would have written.
#include "cc/runtime/health.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cc/rendezvous/store_client.h"
#include "cc/rendezvous/store_protocol.h"
#include "cc/testing/check.h"

using namespace perseus;

namespace {

using Clock = std::chrono::steady_clock;

// A store in memory. Silent: every call throws StoreUnanswered; gone: a
// plain error (the store's process exited).
class FakeStore : public HealthStore {
 public:
  void Set(const std::string& key, const std::vector<char>& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    Check();
    values_[key] = value;
  }
  bool TryGet(const std::string& key, std::chrono::milliseconds, std::vector<char>* value) override {
    std::lock_guard<std::mutex> lock(mu_);
    Check();
    auto it = values_.find(key);
    if (it == values_.end()) return false;
    *value = it->second;
    return true;
  }
  int64_t Add(const std::string& key, int64_t delta) override {
    std::lock_guard<std::mutex> lock(mu_);
    Check();
    return counters_[key] += delta;
  }
  bool Has(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return values_.count(key) > 0;
  }
  std::vector<char> Value(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return values_[key];
  }
  void SetSilent(bool silent) {
    std::lock_guard<std::mutex> lock(mu_);
    silent_ = silent;
  }

 private:
  void Check() const {
    if (silent_) throw StoreUnanswered("the store did not answer (fake)");
  }
  std::mutex mu_;
  bool silent_ = false;
  std::map<std::string, std::vector<char>> values_;
  std::map<std::string, int64_t> counters_;
};

const char kRound[] = "job/round1";

std::string Closed(int rank) {
  return std::string(store_protocol::kClosedPrefix) + kRound + "/rank" + std::to_string(rank);
}
std::string ClosedCount() {
  return std::string(store_protocol::kClosedPrefix) + kRound + store_protocol::kClosedCountSuffix;
}
std::string Census(int rank) { return std::string(kRound) + "/census/rank" + std::to_string(rank); }
std::string Beat(int rank) { return "job/heartbeat/" + std::to_string(rank); }

// A live peer's heartbeat: `rank` beats every 50 ms until this is destroyed.
class PeerBeating {
 public:
  PeerBeating(FakeStore& store, int rank)
      : thread_([this, &store, rank] {
          while (!stop_) {
            store.Add(Beat(rank), 1);
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
          }
        }) {}
  ~PeerBeating() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Rank 0 of three, the fake store for both connections, and what the
// monitor reported and aborted with.
struct World {
  std::shared_ptr<FakeStore> store = std::make_shared<FakeStore>();
  StatsBook stats;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> reports, aborts;
  int woken = 0;

  HealthContext Context(double timeout_seconds = 30) {
    HealthContext c;
    c.ranks.rank = 0;
    c.ranks.size = 3;
    c.ranks.job_id = "job";
    c.ranks.store_addr = "10.0.0.1";
    c.ranks.store_port = 29500;
    c.health.perf_check_n_steps = 2;
    c.timeout_seconds = timeout_seconds;
    c.store = store;
    c.connect = [this](std::chrono::milliseconds) { return store; };
    c.world_prefix = kRound;
    c.key_prefix = kRound;
    c.stats = &stats;
    c.wake_local_waits = [this] {
      std::lock_guard<std::mutex> lock(mu);
      ++woken;
    };
    c.report = [this](const std::string& what) {
      std::lock_guard<std::mutex> lock(mu);
      reports.push_back(what);
      return "Perseus: " + what;
    };
    c.ending = [] { return false; };
    c.abort_waits = [this](const std::string& why) {
      std::lock_guard<std::mutex> lock(mu);
      aborts.push_back(why);
      cv.notify_all();
    };
    return c;
  }
  // Waits (10 s at most) for the monitor to abort the waits.
  bool Aborted() {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] { return !aborts.empty(); });
  }
};

}  // namespace

TEST(HealthNamesADeadRankALeftOneAndNotASurvivor) {
  World w;
  w.store->Set(Census(1), {'1'});  // rank 1 noticed the failure: alive
  w.store->Set(Census(2), {'1'});
  {
    HealthMonitor health(w.Context());
    std::vector<int> culprits;
    CHECK_EQ(health.IdentifyFailedRanks(&culprits), std::string());  // nobody failed
    CHECK(w.store->Has(Census(0)));                                // this rank answered
  }
  World dead;
  dead.store->Set(Census(1), {'1'});
  dead.store->Set(Closed(1), {'1'});  // closed after its census: a survivor
  dead.store->Set(Closed(2), {'1'});  // closed with no census: dead
  {
    HealthMonitor health(dead.Context());
    std::vector<int> culprits;
    const std::string why = health.IdentifyFailedRanks(&culprits);
    CHECK(why.find("rank 2 exited or lost its connection") != std::string::npos);
    CHECK(culprits == std::vector<int>({2}));
  }
  World left;
  left.store->Set(std::string(kRound) + "/left/rank1", {'1'});
  {
    HealthMonitor health(left.Context());
    std::vector<int> culprits;
    const std::string why = health.IdentifyFailedRanks(&culprits);
    CHECK(why.find("rank 1 has called shutdown and left the job") != std::string::npos);
    CHECK(culprits == std::vector<int>({1}));
  }
}

TEST(TheHeartbeatNamesAStoppedRankAndFailsTheRoundOnAClosedPeer) {
  World w;
  HealthMonitor health(w.Context());
  health.StartHeartbeat();
  // Rank 2 beats, rank 1 does not: rank 1 is stopped.
  PeerBeating beating(*w.store, 2);
  std::vector<int> culprits;
  const auto start = Clock::now();
  const std::string why = health.IdentifyFailedRanks(&culprits);
  CHECK(why.find("rank 1 stopped responding") != std::string::npos);
  CHECK(culprits == std::vector<int>({1}));
  CHECK(Clock::now() - start < std::chrono::seconds(5));
  CHECK(w.store->Add(Beat(0), 0) > 0);  // this rank's own beat went in
  // A peer's connection closes while the round runs: the round fails at
  // once, and every wait of this process is ended with the report.
  w.store->Set(Closed(2), {'1'});
  w.store->Add(ClosedCount(), 1);
  CHECK(w.Aborted());
  std::lock_guard<std::mutex> lock(w.mu);
  CHECK(!w.reports.empty() && w.reports[0].find("connection close") != std::string::npos);
  CHECK(!w.aborts.empty() && w.aborts[0].rfind("Perseus: ", 0) == 0);
}

// A wait that reaches its timeout: the heartbeat read every rank's beat as
// the wait neared it, so the stopped rank is named at once, not after the
// 1.5 s the readings take otherwise (the previous test's path).
TEST(AStoppedRankIsNamedWhenTheWaitTimesOutNotAWindowLater) {
  World w;
  const auto wait_began = Clock::now();
  HealthContext c = w.Context(/*timeout_seconds=*/3);
  c.longest_wait = [wait_began] { return Clock::now() - wait_began; };
  HealthMonitor health(std::move(c));
  health.StartHeartbeat();
  PeerBeating beating(*w.store, 2);
  // The read comes once the wait has lasted 1.5 s (half the timeout): by
  // 3.5 s it is more than the 1.5 s window old unless the beat ran late.
  std::this_thread::sleep_until(wait_began + std::chrono::milliseconds(3500));
  std::vector<int> culprits;
  const auto start = Clock::now();
  const std::string why = health.IdentifyFailedRanks(&culprits);
  const auto took = Clock::now() - start;
  CHECK(why.find("rank 1 stopped responding") != std::string::npos);
  CHECK(culprits == std::vector<int>({1}));
  CHECK(took < std::chrono::milliseconds(1200));
  health.StopHeartbeat();
}

TEST(AStoreThatFallsSilentFailsTheRoundWithinItsTimeout) {
  World w;
  HealthMonitor health(w.Context(/*timeout_seconds=*/1));
  health.StartHeartbeat();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a beat answered
  const auto start = Clock::now();
  w.store->SetSilent(true);
  CHECK(w.Aborted());
  CHECK(Clock::now() - start < std::chrono::seconds(5));
  {
    std::lock_guard<std::mutex> lock(w.mu);
    CHECK(!w.reports.empty() && w.reports[0] == "this rank stopped waiting for it");
  }
  std::vector<int> culprits;
  const std::string why = health.IdentifyFailedRanks(&culprits);
  CHECK(why.find("the rendezvous store (at 10.0.0.1:29500") != std::string::npos);
  CHECK(why.find("stopped answering") != std::string::npos);
  health.StopHeartbeat();
}

TEST(LeavingIsMarkedAndTheSlowRankIsNamed) {
  World w;
  HealthMonitor health(w.Context());
  health.AnnounceLeaving(/*aborted=*/true);
  CHECK(w.store->Value(std::string(kRound) + "/left/rank0") == std::vector<char>({'a'}));
  CHECK_EQ(w.woken, 1);
  health.MarkDone();
  CHECK(w.store->Has(std::string(kRound) + "/done/rank0"));
  // Two plan steps (perf_check_n_steps = 2): rank 1 spends three times the
  // others' time outside communication.
  health.PerfCheckStep({10, 30, 10});
  CHECK(w.stats.Get().perf_reports == 0);
  health.PerfCheckStep({10, 30, 11});
  CHECK_EQ(w.stats.Get().perf_reports, 1);
  CHECK(w.stats.Get().slow_ranks == std::vector<int>({1}));
}
