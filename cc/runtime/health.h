// The health monitor: one round's watch over the other ranks. It owns the
// heartbeat thread (this rank's beat in the store, and the store's count of
// closed connections, read with each beat), names the ranks that caused a
// failure (dead, stopped, left), marks how this rank leaves the round
// (done, left between plan steps, aborted), and runs the slow-rank check.
// It reports what it finds through one callback, and never touches the
// runtime's requests or state.
//
// The process-wide first failure (which rank failed first, for perseusrun's
// summary) is kept here too.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cc/runtime/options.h"
#include "cc/runtime/stats.h"

namespace perseus {

class StoreClient;

// What the monitor needs of the rendezvous store: StoreClient over TCP in a
// job (StoreForHealth below), a map in memory in the unit tests
// (health_test.cc). Each call throws StoreUnanswered (store_client.h) when
// the store does not answer in time, another std::exception when it is gone.
class HealthStore {
 public:
  virtual ~HealthStore() = default;
  virtual void Set(const std::string& key, const std::vector<char>& value) = 0;
  // False when `key` is not there by `timeout` (0: look once).
  virtual bool TryGet(const std::string& key, std::chrono::milliseconds timeout,
                      std::vector<char>* value) = 0;
  virtual int64_t Add(const std::string& key, int64_t delta) = 0;
};

// The round's own connection as a HealthStore (not owned).
std::shared_ptr<HealthStore> StoreForHealth(StoreClient* store);
// A new connection to the store of `ranks` for the heartbeat, each request
// answered within `limit` or StoreUnanswered.
std::shared_ptr<HealthStore> ConnectStoreForHealth(const Topology& ranks,
                                                   std::chrono::milliseconds limit);

// The first failure of any runtime in this process (world or process set):
// when it was seen, and which world ranks it was blamed on (empty: none
// named). perseusrun uses it to tell the rank that failed first from the
// ranks that failed because of it.
struct FirstFailure {
  bool seen = false;
  double wall_time = 0;  // seconds since the epoch
  std::vector<int> culprits;
  std::string message;
};
void RecordFirstFailure(const std::vector<int>& culprits, const std::string& message);
FirstFailure GetFirstFailure();

struct HealthContext {
  Topology ranks;                // this runtime's members, the store's address and secret
  HealthSettings health;         // the slow-rank check
  double timeout_seconds = 60;   // TransportSettings::timeout_seconds: how long silence may last
  // The round's store connection (null: a job of one rank), and how the
  // monitor opens its own for the heartbeat (each request answered within
  // the limit given, or StoreUnanswered).
  std::shared_ptr<HealthStore> store;
  std::function<std::shared_ptr<HealthStore>(std::chrono::milliseconds limit)> connect;
  std::string world_prefix;  // the world's round: job_id + "/round<N>"
  std::string key_prefix;    // this runtime's keys in the round
  StatsBook* stats = nullptr;
  // Wakes the waits of this rank's shared-memory transports.
  std::function<void()> wake_local_waits;
  // Fails the round with what the heartbeat found; returns the failure's
  // whole message.
  std::function<std::string(const std::string& what)> report;
  // Ends the waits of every collective of this process at once (Gloo's may
  // not wake on a dead peer until its timeout), with `why`.
  std::function<void(const std::string& why)> abort_waits;
  // True while a closed peer is no failure: the round is not running, or
  // it ends by an agreed shutdown (ranks that finish first close).
  std::function<bool()> ending;
  // How long this runtime's longest current wait (a negotiation exchange, a
  // collective) has lasted (null: not watched). The heartbeat reads the
  // peers' beats while such a wait nears GLOO_TIMEOUT_SECONDS, so that a
  // stopped rank is named when the wait times out, not a window later.
  std::function<std::chrono::steady_clock::duration()> longest_wait;
};

class HealthMonitor {
 public:
  explicit HealthMonitor(HealthContext context);
  ~HealthMonitor();  // stops the heartbeat
  HealthMonitor(const HealthMonitor&) = delete;
  HealthMonitor& operator=(const HealthMonitor&) = delete;

  // The world's beat (a job of more than one rank): a thread adds to this
  // rank's counter in the store every 250 ms over its own connection. A
  // rank whose counter stops is stopped (SIGSTOP, a debugger), not merely
  // slow or dead. When the store's count of closed ranks grows, it looks
  // at once for a rank that died or failed (report). A store that does not
  // answer is tried again (a new connection each time) until it has been
  // silent for GLOO_TIMEOUT_SECONDS: then the store itself is the failure
  // (report), on every rank. A store whose process exited (refused, closed)
  // ends the beat quietly: the job is ending, or its ranks' connections
  // tell the rest. The thread also notices when this process itself did not
  // run for a while (SIGSTOP, a debugger): its failures then say so.
  void StartHeartbeat();
  void StopHeartbeat();

  // Names the ranks that caused a failure (left by shutdown, dead, stopped,
  // or silent in the census); their world ranks go to *culprits. Marks this
  // rank a survivor in the round's census first. "" if none can be named.
  std::string IdentifyFailedRanks(std::vector<int>* culprits);
  // This rank shuts down between plan steps without a last cycle, or
  // aborts: the store records it (and which) for the others' error messages
  // and heartbeats, and shared-memory waiters for it are woken.
  void AnnounceLeaving(bool aborted);
  // A normal shutdown's mark in the store, before the connection closes.
  void MarkDone();
  // Perf check: a plan step's per-rank times outside communication (from the
  // first bucket's slots); every PERSEUS_PERF_CHECK_N_STEPS steps rank 0
  // names the ranks well above the median.
  void PerfCheckStep(const std::vector<double>& ms_by_rank);

 private:
  std::string HeartbeatKey(int world_rank) const;
  // The heartbeat's connection (null while it has none): shared with the
  // census, which reads counters over it from other threads.
  std::shared_ptr<HealthStore> Beats();
  // Why the store is not answering, and since when; "" while it answers.
  std::string StoreSilence(std::vector<int>* culprits);
  // Why this process did not run for a while lately; "" if it ran.
  std::string ThisProcessFroze(std::vector<int>* culprits);
  int WorldRank(int r) const { return WorldRankOf(c_.ranks, r); }
  // From the heartbeat thread, when the store's count of closed ranks grows:
  // fails the round at once if one of them died or failed.
  void WatchClosedPeers(HealthStore* beats);
  // From the heartbeat thread: every rank's beat counter, read once per
  // wait that has lasted half the timeout and to within 2 s of it.
  void ReadBeatsBeforeTimeout(HealthStore* beats, std::chrono::milliseconds timeout);
  // The census, heartbeats and left marks, read for IdentifyFailedRanks.
  // DeadRanks looks for a closed connection for up to `look`.
  std::string LeftRanks(std::vector<int>* culprits);
  std::string DeadRanks(std::vector<int>* culprits, std::chrono::milliseconds look);
  std::string SilentRanks(HealthStore* beats, const std::vector<int64_t>& first_beats,
                          std::chrono::steady_clock::time_point first_at,
                          std::vector<int>* culprits);

  HealthContext c_;
  std::mutex beats_mu_;                 // guards beats_
  std::shared_ptr<HealthStore> beats_;  // the heartbeat's own connection
  std::string served_by_;               // who serves the store (its SERVED_BY key)
  // Steady-clock milliseconds: the store's last answer to the heartbeat
  // (0: no heartbeat), and the end and length of this process's last
  // freeze that the heartbeat saw.
  std::atomic<int64_t> last_answer_ms_{0};
  std::atomic<int64_t> froze_until_ms_{0};
  std::atomic<int64_t> froze_for_ms_{0};
  std::atomic<int64_t> asleep_since_ms_{0};  // the heartbeat's wait began (0: not waiting)
  std::atomic<bool> store_lost_{false};
  std::thread thread_;
  std::mutex mu_;  // guards stop_ and the perf check's sums
  std::condition_variable cv_;
  bool stop_ = false;
  std::vector<double> perf_sum_;
  int perf_steps_ = 0;
  // ReadBeatsBeforeTimeout's reading (empty: none) and when it was taken.
  std::mutex early_mu_;
  std::vector<int64_t> early_beats_;
  std::chrono::steady_clock::time_point early_at_;
};

}  // namespace perseus
