// Health: failure naming (census and heartbeats in the store), failing the
// job, the slow-rank perf check.
#include "cc/runtime/runtime.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>

#include "cc/core/reduce.h"
#include "cc/transport/gloo_transport.h"
#include "cc/rendezvous/store_client.h"
#include "cc/rendezvous/store_protocol.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/factory.h"
#include "cc/transport/gloo_abortable.h"

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

void Runtime::PerfCheckStep(const std::vector<double>& ms_by_rank) {
  double total = 0;
  for (double v : ms_by_rank) total += v;
  if (total <= 0) return;  // the first step after a plan: nothing measured yet
  std::vector<int> slow;
  std::vector<double> mean;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (perf_sum_.size() != ms_by_rank.size()) perf_sum_.assign(ms_by_rank.size(), 0.0);
    for (size_t i = 0; i < ms_by_rank.size(); ++i) perf_sum_[i] += ms_by_rank[i];
    if (++perf_steps_ < options_.perf_check_n_steps) return;
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
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.perf_reports;
    stats_.slow_ranks = slow;
  }
  if (!slow.empty() && WorldRank(options_.rank) == 0) {
    std::fprintf(stderr,
                 "Perseus perf check (last %d steps): slow rank(s), time per step outside "
                 "communication against the median of %.1f ms: %s\n",
                 options_.perf_check_n_steps, median, msg.str().c_str());
    std::fflush(stderr);
  }
}

void Runtime::Fail(const std::string& what) {
  static std::mutex fail_mu;
  std::lock_guard<std::mutex> fail_lock(fail_mu);
  if (state_.load() != State::kRunning) return;
  std::vector<int> culprits;
  std::string who = IdentifyFailedRanks(&culprits);
  std::ostringstream msg;
  msg << "Perseus rank " << options_.rank << ": ";
  if (!who.empty()) msg << who << "; ";
  msg << what << ". Collectives cannot continue; restart the job.";
  Status status = Status::Error(StatusCode::kUnavailable, msg.str());
  RecordFirstFailure(culprits, msg.str());
  if (transports_) transports_->Abort();  // ranks waiting in a shared-memory barrier stop waiting
  // Peers waiting on this rank over TCP (a send it will never match, say)
  // fail now, not at GLOO_TIMEOUT_SECONDS; so do this process's other waits.
  // The census key written above tells them this rank is a survivor.
  if (transport_) transport_->CloseAll(msg.str());
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = status;
    state_ = State::kFailed;
  }
  queue_cv_.notify_all();
  FailAllPending(status);
}

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

void Runtime::Abort(const std::string& why) {
  const std::string message = "Perseus rank " + std::to_string(options_.rank) +
                              ": this rank called abort()" + (why.empty() ? "" : " (" + why + ")") +
                              "; its collectives stopped. init() starts the job's next round";
  bool was_running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const State state = state_.load();
    if (state == State::kUninitialized || state == State::kShutdown) return;
    was_running = state == State::kRunning;
    if (was_running) {
      failure_ = Status::Error(StatusCode::kUnavailable, message);
      state_ = State::kFailed;
    }
  }
  if (was_running) {
    RecordFirstFailure({WorldRank(options_.rank)}, message);
    AnnounceLeaving(/*aborted=*/true);  // the store's mark, shared memory's waits
    if (transport_) transport_->CloseAll(message);
    queue_cv_.notify_all();
    FailAllPending(Status::Error(StatusCode::kUnavailable, message));
  }
  Shutdown();  // the background thread sees the failed state and stops at once
}

void Runtime::AnnounceLeaving(bool aborted) {
  if (options_.process_set_id == 0 && store_) {
    try {
      store_->set(LeftKey(world_prefix_, WorldRank(options_.rank)), {aborted ? kLeftByAbort : '1'});
    } catch (const std::exception&) {
      // the store is gone: the others still see the closed connections
    }
  }
  if (transports_) transports_->Abort();  // ranks waiting for this one in a barrier stop waiting
}

std::string Runtime::HeartbeatKey(int world_rank) const {
  return options_.job_id + "/heartbeat/" + std::to_string(world_rank);
}

void Runtime::StartHeartbeat() {
  StopHeartbeat();
  try {
    heartbeat_store_.reset(new StoreClient(options_.store_addr, options_.store_port,
                                           options_.secret, std::chrono::milliseconds(1000)));
    heartbeat_store_->SetIoTimeout(std::chrono::milliseconds(3000));
  } catch (const std::exception&) {
    heartbeat_store_.reset();  // failures are then told apart by the census alone
    return;
  }
  heartbeat_stop_ = false;
  const std::string key = HeartbeatKey(WorldRank(options_.rank));
  const std::string closed_key = ClosedCountKey(world_prefix_);
  heartbeat_ = std::thread([this, key, closed_key] {
    NameThisThread("perseus-health");
    int64_t closed_seen = 0;
    std::unique_lock<std::mutex> lock(heartbeat_mu_);
    while (!heartbeat_stop_) {
      lock.unlock();
      try {
        heartbeat_store_->Add(key, 1);
        const int64_t closed = heartbeat_store_->Add(closed_key, 0);
        if (closed > closed_seen) {
          closed_seen = closed;
          WatchClosedPeers();
        }
      } catch (const std::exception&) {
        return;  // the store is gone: nothing left to tell
      }
      lock.lock();
      heartbeat_cv_.wait_for(lock, std::chrono::milliseconds(250),
                             [this] { return heartbeat_stop_; });
    }
  });
}

void Runtime::WatchClosedPeers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A shutdown agreed in negotiation: ranks that finish first close.
    if (state_.load() != State::kRunning || shutdown_requested_ || !shutdown_by_.empty()) return;
  }
  // Over the heartbeat's own connection, the ranks that closed it, but for
  // those done (a normal shutdown) or left between plan steps by shutdown:
  // dead, with no word; or failed, a survivor of a failure in this round
  // (census) or gone by abort().
  const std::string census = key_prefix_ + "/census/rank";
  std::vector<char> value;  // the last key read's
  auto has = [&](const std::string& k) {
    return heartbeat_store_->TryGet(k, std::chrono::milliseconds(0), &value);
  };
  std::vector<int> dead, failed;
  for (int r = 0; r < options_.size; ++r) {
    const int w = WorldRank(r);
    if (r == options_.rank || !has(ClosedKey(world_prefix_, w)) || has(DoneKey(world_prefix_, w))) {
      continue;
    }
    if (has(LeftKey(world_prefix_, w))) {
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
  Fail(what);
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure = failure_.message;
  }
  AbortGlooWaits(failure);
}

void Runtime::MarkDone() {
  if (options_.process_set_id != 0 || !store_) return;
  try {
    store_->set(DoneKey(world_prefix_, WorldRank(options_.rank)), {'1'});
  } catch (const std::exception&) {
    // the store is gone: nobody is left to watch
  }
}

void Runtime::StopHeartbeat() {
  {
    std::lock_guard<std::mutex> lock(heartbeat_mu_);
    heartbeat_stop_ = true;
  }
  heartbeat_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  heartbeat_store_.reset();
}

std::string Runtime::IdentifyFailedRanks(std::vector<int>* culprits) {
  if (!store_) return "";
  try {
    const std::string& round = world_prefix_;
    const std::string census = key_prefix_ + "/census/rank";
    store_->set(census + std::to_string(options_.rank), {'1'});
    std::vector<char> ignored;
    // Every live process beats every 250 ms, even while blocked in a
    // collective; take a first reading now, a second after the dead check.
    StoreClient* beats = heartbeat_store_ ? heartbeat_store_.get() : nullptr;
    std::vector<int64_t> first(options_.size, -1);
    const auto first_at = Clock::now();
    if (beats) {
      try {
        for (int r = 0; r < options_.size; ++r) first[r] = beats->Add(HeartbeatKey(WorldRank(r)), 0);
      } catch (const std::exception&) {
        beats = nullptr;
      }
    }
    // Ranks that shut down between plan steps said so (AnnounceLeaving).
    std::vector<int> left;
    for (int r = 0; r < options_.size; ++r) {
      if (r != options_.rank &&
          store_->TryGet(LeftKey(round, WorldRank(r)), std::chrono::milliseconds(0),
                         &ignored)) {
        left.push_back(WorldRank(r));
      }
    }
    if (!left.empty()) {
      *culprits = left;
      return RankList(left) + (left.size() == 1 ? " has" : " have") +
             " called shutdown and left the job while this rank still ran collectives with it";
    }
    // A rank that died closed its store connection; the store may take a
    // moment to notice, so look for up to a second.
    auto deadline = Clock::now() + std::chrono::seconds(1);
    std::vector<int> dead;
    while (dead.empty()) {
      for (int r = 0; r < options_.size; ++r) {
        // A rank that noticed the failure itself (census key written) and
        // then exited is a survivor, not the cause.
        if (r != options_.rank &&
            store_->TryGet(ClosedKey(round, WorldRank(r)), std::chrono::milliseconds(0), &ignored) &&
            !store_->TryGet(census + std::to_string(r), std::chrono::milliseconds(0), &ignored)) {
          dead.push_back(WorldRank(r));
        }
      }
      if (!dead.empty() || Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!dead.empty()) *culprits = dead;
    if (!dead.empty()) return RankList(dead) + (dead.size() == 1 ? " exited or lost its connection"
                                                                : " exited or lost their connection");
    // Nobody died. A rank whose heartbeat did not move in 1.5 s (six beats)
    // is stopped: this names it about 1.5 s after the timeout.
    if (beats) {
      std::this_thread::sleep_until(first_at + std::chrono::milliseconds(1500));
      std::vector<int> stopped;
      try {
        for (int r = 0; r < options_.size; ++r) {
          if (r == options_.rank) continue;
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
    auto census_deadline = Clock::now() + std::chrono::seconds(10);
    std::vector<int> silent;
    for (int r = 0; r < options_.size; ++r) {
      if (r == options_.rank) continue;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(census_deadline - Clock::now());
      if (left.count() < 0) left = std::chrono::milliseconds(0);
      if (!store_->TryGet(census + std::to_string(r), left, &ignored)) {
        silent.push_back(WorldRank(r));
      }
    }
    *culprits = silent;
    if (!silent.empty()) return RankList(silent) + " stopped responding";
    return "";
  } catch (const std::exception&) {
    return "the rendezvous store is gone (the launcher or rank 0 exited)";
  }
}

void Runtime::FailAllPending(const Status& status) {
  std::unordered_map<std::string, std::shared_ptr<Request>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(pending_);
    queue_.clear();
  }
  for (auto& kv : pending) kv.second->done(status);
}

}  // namespace perseus
