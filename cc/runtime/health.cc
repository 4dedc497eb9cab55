// The health monitor (health.h): heartbeats, closed peers, naming the ranks
// that caused a failure, the marks of a rank leaving, the slow-rank check;
// and the process's first failure.
#include "cc/runtime/health.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <sstream>

#include "cc/core/common.h"
#include "cc/rendezvous/store_client.h"
#include "cc/rendezvous/store_protocol.h"
#include "cc/runtime/runtime_internal.h"

namespace perseus {
namespace {

// What the store sets when the connection that rank Own()ed closes.
// (round: the world's round prefix, job_id + "/round<N>")
std::string ClosedKey(const std::string& round, int rank) {
  return store_protocol::kClosedPrefix + round + "/rank" + std::to_string(rank);
}

std::string LeftKey(const std::string& round, int rank) {
  return round + "/left/rank" + std::to_string(rank);
}

// LeftKey's value for a rank that called abort() (any other: it left by
// shutdown between plan steps).
constexpr char kLeftByAbort = 'a';

// Set by a rank whose runtime shut down normally, before its store
// connection closes: its closing is no failure.
std::string DoneKey(const std::string& round, int rank) {
  return round + "/done/rank" + std::to_string(rank);
}

// How many ranks of the round closed their store connection (the store adds
// to it as it sets each ClosedKey).
std::string ClosedCountKey(const std::string& round) {
  return store_protocol::kClosedPrefix + round + store_protocol::kClosedCountSuffix;
}

}  // namespace


namespace {
std::mutex first_failure_mu;
FirstFailure first_failure;
}  // namespace

void RecordFirstFailure(const std::vector<int>& culprits, const std::string& message) {
  std::lock_guard<std::mutex> lock(first_failure_mu);
  if (first_failure.seen) return;
  first_failure.seen = true;
  first_failure.wall_time =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  first_failure.culprits = culprits;
  first_failure.message = message;
}

FirstFailure GetFirstFailure() {
  std::lock_guard<std::mutex> lock(first_failure_mu);
  return first_failure;
}

namespace {

class StoreClientHealth : public HealthStore {
 public:
  StoreClientHealth(StoreClient* store, std::shared_ptr<StoreClient> owned)
      : store_(store), owned_(std::move(owned)) {}
  void Set(const std::string& key, const std::vector<char>& value) override {
    store_->set(key, value);
  }
  bool TryGet(const std::string& key, std::chrono::milliseconds timeout,
              std::vector<char>* value) override {
    return store_->TryGet(key, timeout, value);
  }
  int64_t Add(const std::string& key, int64_t delta) override { return store_->Add(key, delta); }

 private:
  StoreClient* store_;
  std::shared_ptr<StoreClient> owned_;  // a connection of its own (null: borrowed)
};

}  // namespace

std::shared_ptr<HealthStore> StoreForHealth(StoreClient* store) {
  if (store == nullptr) return nullptr;
  return std::make_shared<StoreClientHealth>(store, nullptr);
}

std::shared_ptr<HealthStore> ConnectStoreForHealth(const Topology& ranks,
                                                   std::chrono::milliseconds limit) {
  auto client = std::make_shared<StoreClient>(ranks.store_addr, ranks.store_port, ranks.secret,
                                              limit, limit);
  client->SetAnswerTimeout(limit);
  return std::make_shared<StoreClientHealth>(client.get(), client);
}

HealthMonitor::HealthMonitor(HealthContext context) : c_(std::move(context)) {}

HealthMonitor::~HealthMonitor() { StopHeartbeat(); }

void HealthMonitor::PerfCheckStep(const std::vector<double>& ms_by_rank) {
  double total = 0;
  for (double v : ms_by_rank) total += v;
  if (total <= 0) return;  // the first step after a plan: nothing measured yet
  std::vector<int> slow;
  std::vector<double> mean;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (perf_sum_.size() != ms_by_rank.size()) perf_sum_.assign(ms_by_rank.size(), 0.0);
    for (size_t i = 0; i < ms_by_rank.size(); ++i) perf_sum_[i] += ms_by_rank[i];
    if (++perf_steps_ < c_.health.perf_check_n_steps) return;
    for (double v : perf_sum_) mean.push_back(v / perf_steps_);
    perf_sum_.assign(ms_by_rank.size(), 0.0);
    perf_steps_ = 0;
  }
  // Abnormally slow: more than 1.5x the median time outside communication,
  // and by more than a millisecond (noise on tiny steps).
  std::vector<double> sorted = mean;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[(sorted.size() - 1) / 2];  // the lower median
  std::ostringstream msg;
  for (size_t i = 0; i < mean.size(); ++i) {
    if (mean[i] > 1.5 * median && mean[i] - median > 1.0) {
      slow.push_back(WorldRank(static_cast<int>(i)));
      msg << (slow.size() > 1 ? "; " : "") << "rank " << WorldRank(static_cast<int>(i)) << " "
          << static_cast<int64_t>(mean[i] * 10) / 10.0 << " ms ("
          << static_cast<int64_t>(mean[i] / std::max(median, 1e-9) * 10) / 10.0 << "x)";
    }
  }
  c_.stats->Update([&](Stats& s) {
    ++s.perf_reports;
    s.slow_ranks = slow;
  });
  if (!slow.empty() && WorldRank(c_.ranks.rank) == 0) {
    std::fprintf(stderr,
                 "Perseus perf check (last %d steps): slow rank(s), time per step outside "
                 "communication against the median of %.1f ms: %s\n",
                 c_.health.perf_check_n_steps, median, msg.str().c_str());
    std::fflush(stderr);
  }
}

void HealthMonitor::AnnounceLeaving(bool aborted) {
  if (c_.ranks.process_set_id == 0 && c_.store) {
    try {
      c_.store->Set(LeftKey(c_.world_prefix, WorldRank(c_.ranks.rank)),
                    {aborted ? kLeftByAbort : '1'});
    } catch (const std::exception&) {
      // the store is gone: the others still see the closed connections
    }
  }
  c_.wake_local_waits();  // ranks waiting for this one in a barrier stop waiting
}

void HealthMonitor::MarkDone() {
  if (c_.ranks.process_set_id != 0 || !c_.store) return;
  try {
    c_.store->Set(DoneKey(c_.world_prefix, WorldRank(c_.ranks.rank)), {'1'});
  } catch (const std::exception&) {
    // the store is gone: nobody is left to watch
  }
}

std::string HealthMonitor::HeartbeatKey(int world_rank) const {
  return c_.ranks.job_id + "/heartbeat/" + std::to_string(world_rank);
}

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch())
      .count();
}

// A 250 ms wait of the heartbeat that took longer than this: the process
// was not running.
constexpr int64_t kFrozeMs = 5000;

// A rank whose beat did not move in this long (six beats) is stopped.
constexpr std::chrono::milliseconds kSilentWindow(1500);
// The heartbeat reads every rank's beat once a wait has lasted to within
// this of the timeout (and half of it): the reading is then older than
// kSilentWindow when the wait times out.
constexpr std::chrono::milliseconds kEarlyReadLead(2000);

std::string Seconds(int64_t ms) {
  std::ostringstream out;
  out << (ms / 100) / 10.0 << " s";
  return out.str();
}

}  // namespace

std::shared_ptr<HealthStore> HealthMonitor::Beats() {
  std::lock_guard<std::mutex> lock(beats_mu_);
  return beats_;
}

void HealthMonitor::StartHeartbeat() {
  StopHeartbeat();
  // How long one beat may wait for the store, and how long the store may
  // stay silent before it is the failure (GLOO_TIMEOUT_SECONDS: a
  // collective waiting for a rank gives up as late).
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(c_.timeout_seconds * 1000));
  const auto beat_limit = std::max(std::chrono::milliseconds(500),
                                   std::min<std::chrono::milliseconds>(timeout / 10,
                                                                       std::chrono::seconds(3)));
  auto connect = [this, beat_limit] { return c_.connect(beat_limit); };
  try {
    auto first = connect();
    std::vector<char> who;
    if (first->TryGet(store_protocol::kServedByKey, std::chrono::milliseconds(0), &who)) {
      served_by_.assign(who.begin(), who.end());
    }
    std::lock_guard<std::mutex> lock(beats_mu_);
    beats_ = first;
  } catch (const std::exception&) {
    // the thread tries again
  }
  stop_ = false;
  last_answer_ms_ = NowMs();
  const std::string key = HeartbeatKey(WorldRank(c_.ranks.rank));
  const std::string closed_key = ClosedCountKey(c_.world_prefix);
  thread_ = std::thread([this, key, closed_key, connect, timeout] {
    NameThisThread("perseus-health");
    int64_t closed_seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      lock.unlock();
      try {
        auto beats = Beats();
        if (!beats) {
          beats = connect();
          std::lock_guard<std::mutex> guard(beats_mu_);
          beats_ = beats;
        }
        beats->Add(key, 1);
        const int64_t closed = beats->Add(closed_key, 0);
        last_answer_ms_ = NowMs();
        if (closed > closed_seen) {
          closed_seen = closed;
          WatchClosedPeers(beats.get());
        }
        ReadBeatsBeforeTimeout(beats.get(), timeout);
      } catch (const StoreUnanswered&) {
        {
          std::lock_guard<std::mutex> guard(beats_mu_);
          beats_.reset();  // the next turn connects again
        }
        const int64_t silent = NowMs() - last_answer_ms_.load();
        if (silent >= timeout.count() && !c_.ending()) {
          store_lost_ = true;
          c_.abort_waits(c_.report("this rank stopped waiting for it"));
          return;
        }
      } catch (const std::exception&) {
        // The store's process exited (refused, closed): the job is ending,
        // or the ranks' own connections tell the rest.
        std::lock_guard<std::mutex> guard(beats_mu_);
        beats_.reset();
        last_answer_ms_ = 0;
        return;
      }
      lock.lock();
      // A timed wait of 250 ms that takes seconds: this process did not
      // run (stopped by a signal or a debugger, or starved).
      const int64_t before = NowMs();
      asleep_since_ms_ = before;
      cv_.wait_for(lock, std::chrono::milliseconds(250), [this] { return stop_; });
      asleep_since_ms_ = 0;
      const int64_t slept = NowMs() - before;
      if (slept > kFrozeMs) {
        froze_for_ms_ = slept;
        froze_until_ms_ = NowMs();
      }
    }
  });
}

void HealthMonitor::ReadBeatsBeforeTimeout(HealthStore* beats,
                                           std::chrono::milliseconds timeout) {
  if (!c_.longest_wait) return;
  const auto waited = c_.longest_wait();
  if (waited < timeout / 2 || waited < timeout - kEarlyReadLead) return;
  const auto now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(early_mu_);
    if (!early_beats_.empty() && early_at_ >= now - waited) return;  // read in this wait
  }
  std::vector<int64_t> read(c_.ranks.size);
  for (int r = 0; r < c_.ranks.size; ++r) read[r] = beats->Add(HeartbeatKey(WorldRank(r)), 0);
  std::lock_guard<std::mutex> lock(early_mu_);
  early_beats_ = std::move(read);
  early_at_ = now;
}

void HealthMonitor::StopHeartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(beats_mu_);
  beats_.reset();
}

std::string HealthMonitor::StoreSilence(std::vector<int>* culprits) {
  const int64_t last = last_answer_ms_.load();
  if (last == 0) return "";
  const int64_t silent = NowMs() - last;
  if (!store_lost_ && silent < 2000) return "";
  const std::string who = served_by_.empty() ? std::string() : ", served by " + served_by_;
  // The store's host stopped: when it is a rank, that rank is the cause.
  if (served_by_.rfind("rank ", 0) == 0) culprits->assign(1, std::atoi(served_by_.c_str() + 5));
  return "the rendezvous store (at " + c_.ranks.store_addr + ":" +
         std::to_string(c_.ranks.store_port) + who + ") stopped answering " + Seconds(silent) +
         " ago: its process is stopped or overloaded, or the network to its host is cut";
}

std::string HealthMonitor::ThisProcessFroze(std::vector<int>* culprits) {
  const int64_t now = NowMs();
  int64_t until = froze_until_ms_.load();
  int64_t length = froze_for_ms_.load();
  // Just resumed: the heartbeat's 250 ms wait has not returned yet.
  const int64_t asleep = asleep_since_ms_.load();
  if (asleep != 0 && now - asleep > kFrozeMs) {
    until = now;
    length = now - asleep;
  }
  const auto timeout = static_cast<int64_t>(c_.timeout_seconds * 1000);
  if (until == 0 || now - until > timeout + 10000) return "";
  culprits->assign(1, WorldRank(c_.ranks.rank));
  return "this process did not run for " + Seconds(length) +
         " (stopped by a signal or a debugger, or starved of CPU), so the other ranks gave up "
         "on it";
}

void HealthMonitor::WatchClosedPeers(HealthStore* beats) {
  if (c_.ending()) return;
  // Over the heartbeat's own connection, the ranks that closed it, but for
  // those done (a normal shutdown) or left between plan steps by shutdown:
  // dead, with no word; or failed, a survivor of a failure in this round
  // (census) or gone by abort().
  const std::string census = c_.key_prefix + "/census/rank";
  const std::string& round = c_.world_prefix;
  std::vector<char> value;  // the last key read's
  auto has = [&](const std::string& k) {
    return beats->TryGet(k, std::chrono::milliseconds(0), &value);
  };
  std::vector<int> dead, failed;
  for (int r = 0; r < c_.ranks.size; ++r) {
    const int w = WorldRank(r);
    if (r == c_.ranks.rank || !has(ClosedKey(round, w)) || has(DoneKey(round, w))) continue;
    if (has(LeftKey(round, w))) {
      // Left between plan steps by shutdown: no failure (a collective still
      // pending with it fails on its closed connections). Left by abort():
      // the round is over for everyone.
      if (value.size() == 1 && value[0] == kLeftByAbort) failed.push_back(w);
      continue;
    }
    (has(census + std::to_string(r)) ? failed : dead).push_back(w);
  }
  if (dead.empty() && failed.empty()) return;
  // Gloo may not wake a wait on a dead peer until GLOO_TIMEOUT_SECONDS (a
  // send it could not write; gloo_abortable.h): fail now, and end the
  // waits of this process's other contexts (process sets) too. A peer that
  // failed in this round (its census) and closed has ended the round too:
  // a rank that was not running when the others failed (stopped, swapped
  // out) learns it here, not from a Gloo wait on a closed pair that only
  // its timeout ends.
  const std::string what =
      dead.empty() ? RankList(failed) + (failed.size() == 1 ? " has" : " have") +
                         " failed or called abort() in this round and closed " +
                         (failed.size() == 1 ? "its" : "their") + " connection"
                   : std::string("the store saw ") + (dead.size() == 1 ? "its" : "their") +
                         " connection close while this rank ran collectives";
  c_.abort_waits(c_.report(what));
}

std::string HealthMonitor::IdentifyFailedRanks(std::vector<int>* culprits) {
  if (!c_.store) return "";
  // A process that did not run for a while is why the others gave up.
  std::string who = ThisProcessFroze(culprits);
  if (!who.empty()) return who;
  // A store that does not answer cannot tell who failed: say so at once.
  who = StoreSilence(culprits);
  if (!who.empty()) return who;
  try {
    const std::string census = c_.key_prefix + "/census/rank";
    c_.store->Set(census + std::to_string(c_.ranks.rank), {'1'});
    // Every live process beats every 250 ms, even while blocked in a
    // collective; take a first reading now, a second after the dead check.
    auto beats = Beats();
    std::vector<int64_t> first(c_.ranks.size, -1);
    const auto first_at = Clock::now();
    if (beats) {
      try {
        for (int r = 0; r < c_.ranks.size; ++r) first[r] = beats->Add(HeartbeatKey(WorldRank(r)), 0);
      } catch (const std::exception&) {
        beats.reset();
      }
    }
    who = LeftRanks(culprits);
    if (!who.empty()) return who;
    // A reading the heartbeat took as the wait neared its timeout names a
    // stopped rank now, without a window's sleep; a dead rank's closed
    // connection has long been seen by then. Else (no such reading, or it
    // names nobody) the readings above and the full checks.
    std::vector<int64_t> early;
    Clock::time_point early_at;
    {
      std::lock_guard<std::mutex> lock(early_mu_);
      early = early_beats_;
      early_at = early_at_;
    }
    if (beats && !early.empty() && Clock::now() - early_at >= kSilentWindow &&
        Clock::now() - early_at <= 4 * kEarlyReadLead) {
      who = DeadRanks(culprits, std::chrono::milliseconds(0));
      if (who.empty()) who = SilentRanks(beats.get(), early, early_at, culprits);
      if (!who.empty()) return who;
    }
    who = DeadRanks(culprits, std::chrono::milliseconds(1000));
    if (who.empty()) who = SilentRanks(beats.get(), first, first_at, culprits);
    return who;
  } catch (const StoreUnanswered& e) {
    store_lost_ = true;
    who = StoreSilence(culprits);
    return who.empty() ? std::string(e.what()) : who;
  } catch (const std::exception&) {
    return "the rendezvous store is gone (the launcher or rank 0 exited)";
  }
}

std::string HealthMonitor::LeftRanks(std::vector<int>* culprits) {
  // Ranks that shut down between plan steps said so (AnnounceLeaving).
  std::vector<char> ignored;
  std::vector<int> left;
  for (int r = 0; r < c_.ranks.size; ++r) {
    if (r != c_.ranks.rank &&
        c_.store->TryGet(LeftKey(c_.world_prefix, WorldRank(r)), std::chrono::milliseconds(0),
                         &ignored)) {
      left.push_back(WorldRank(r));
    }
  }
  if (left.empty()) return "";
  *culprits = left;
  return RankList(left) + (left.size() == 1 ? " has" : " have") +
         " called shutdown and left the job while this rank still ran collectives with it";
}

std::string HealthMonitor::DeadRanks(std::vector<int>* culprits,
                                    std::chrono::milliseconds look) {
  // A rank that died closed its store connection; the store may take a
  // moment to notice, so look for up to `look`.
  const std::string census = c_.key_prefix + "/census/rank";
  std::vector<char> ignored;
  auto deadline = Clock::now() + look;
  std::vector<int> dead;
  while (dead.empty()) {
    for (int r = 0; r < c_.ranks.size; ++r) {
      // A rank that noticed the failure itself (census key written) and
      // then exited is a survivor, not the cause.
      if (r != c_.ranks.rank &&
          c_.store->TryGet(ClosedKey(c_.world_prefix, WorldRank(r)), std::chrono::milliseconds(0),
                           &ignored) &&
          !c_.store->TryGet(census + std::to_string(r), std::chrono::milliseconds(0), &ignored)) {
        dead.push_back(WorldRank(r));
      }
    }
    if (!dead.empty() || Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (dead.empty()) return "";
  *culprits = dead;
  return RankList(dead) + (dead.size() == 1 ? " exited or lost its connection"
                                            : " exited or lost their connection");
}

std::string HealthMonitor::SilentRanks(HealthStore* beats, const std::vector<int64_t>& first,
                                       Clock::time_point first_at,
                                       std::vector<int>* culprits) {
  // Nobody died. A rank whose heartbeat did not move in 1.5 s (six beats)
  // is stopped: this names it about 1.5 s after the timeout.
  if (beats) {
    std::this_thread::sleep_until(first_at + kSilentWindow);
    std::vector<int> stopped;
    try {
      for (int r = 0; r < c_.ranks.size; ++r) {
        if (r == c_.ranks.rank) continue;
        if (beats->Add(HeartbeatKey(WorldRank(r)), 0) == first[r]) stopped.push_back(WorldRank(r));
      }
      *culprits = stopped;
      if (!stopped.empty()) return RankList(stopped) + " stopped responding";
      return "";
    } catch (const std::exception&) {
      // the store stopped answering: fall back to the census
    }
  }
  // No heartbeats: the ranks that are alive reach this point at about the
  // same time (they all timed out); the one that never does is stuck.
  const std::string census = c_.key_prefix + "/census/rank";
  std::vector<char> ignored;
  auto census_deadline = Clock::now() + std::chrono::seconds(10);
  std::vector<int> silent;
  for (int r = 0; r < c_.ranks.size; ++r) {
    if (r == c_.ranks.rank) continue;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(census_deadline - Clock::now());
    if (left.count() < 0) left = std::chrono::milliseconds(0);
    if (!c_.store->TryGet(census + std::to_string(r), left, &ignored)) {
      silent.push_back(WorldRank(r));
    }
  }
  *culprits = silent;
  if (!silent.empty()) return RankList(silent) + " stopped responding";
  return "";
}

}  // namespace perseus
