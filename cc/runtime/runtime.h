// The per-process runtime: one instance, shared by the TensorFlow op library
// and the pybind11 module (both link libperseus_core.so).
//
// Callers enqueue named Requests from any thread. A background thread runs
// negotiation cycles on the control context: every rank contributes the
// requests it enqueued since the last cycle, all ranks decide identically
// which are ready (negotiation.h), and the ready work is handed, in that
// order, to the stream threads, each of which owns one Gloo context.
//
// Runtime is the facade (runtime.cc). Its parts, one concern per file:
//   process_sets.cc  the registry of runtimes by process-set id
//   connect.cc       roll call and connecting the transport
//   request.cc       local validation of a request
//   controller.{h,cc} Controller, a round's negotiation thread: the cycle,
//                    the stall budget, dispatch; offline.cc its offline mode
//   plan.{h,cc}      OfflinePlan, the plan state machine;
//                    plan_check.cc compares the ranks' plans
//   executor.{h,cc}  Executor: streams, execute switch, plain/fused allreduce
//   fusion.{h,cc}    plan bucket sizing and bucket extras (free functions)
//   compression/     fp16, top-k and downsampling behind one interface
//   collectives.cc   allgather, alltoall, reduce-scatter
//   health.cc        failure naming, heartbeats, perf check
// The data path (executor, compression, collectives) never reads plan
// state: a plan bucket reports its outcome to the closure the plan attached.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cc/core/common.h"
#include "cc/core/reduce.h"
#include "cc/core/timeline.h"
#include "cc/runtime/executor.h"
#include "cc/runtime/faults.h"
#include "cc/runtime/message.h"
#include "cc/runtime/negotiation.h"
#include "cc/runtime/options.h"
#include "cc/runtime/plan.h"
#include "cc/runtime/request.h"
#include "cc/runtime/stats.h"
#include "cc/transport/allreduce_algorithms.h"

namespace perseus {

class GlooTransport;
class TransportSet;
class StoreClient;
class Controller;

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

class Runtime {
 public:
  // The world's runtime (process set 0).
  static Runtime& Get();
  // The runtime of a process set this process belongs to, or null.
  static Runtime* Find(int process_set_id);
  // Collective over the members only (the caller checks membership and that
  // every rank registers the same ranks): connects the set's own contexts.
  static Status AddProcessSet(int id, const std::vector<int>& world_ranks);
  // Collective over the members: shuts the set's runtime down.
  static Status RemoveProcessSet(int id);
  // Ids of the process sets this process belongs to and has not removed,
  // besides the world (running or stopped).
  static std::vector<int> ProcessSetIds();

  ~Runtime();

  Status Init(const InitOptions& options);
  // Collective: asks every rank to stop, drains, closes connections.
  void Shutdown();
  // Local, not collective; any thread, at any time, any number of times:
  // fails every pending collective of this rank at once, wakes every wait of
  // its transports, marks it as gone in the store and closes its
  // connections (so the others fail at once, naming it), then tears down as
  // Shutdown does without asking anyone. Init may follow (the job's next
  // round). `why` goes into the error of the pending collectives.
  void Abort(const std::string& why);
  // Abort of every process set's runtime, then the world's.
  static void AbortAll(const std::string& why);
  bool initialized() const { return state_.load() == State::kRunning; }
  // "uninitialized", "running", "failed" or "shutdown".
  const char* state_name() const;
  const InitOptions& options() const { return options_; }

  // Validates locally, then queues. An error is returned without calling
  // done; otherwise done is always called later.
  Status Enqueue(std::shared_ptr<Request> request);
  // One call of several requests (a grouped allreduce), queued all together
  // or, on an error, not at all.
  Status EnqueueGroup(const std::vector<std::shared_ptr<Request>>& requests);

  Stats GetStats();

  // Starts (or restarts) this rank's timeline into `path`, or writes and
  // stops it (Horovod's start_timeline/stop_timeline; PERSEUS_TIMELINE
  // starts it at Init). Returns false with `error` when the file fails.
  // mark_cycles: also record each negotiation cycle (thread 0), as
  // PERSEUS_TIMELINE does.
  void StartTimeline(const std::string& path, bool mark_cycles);
  bool StopTimeline(std::string* error);

  // Benchmark baseline: a raw contiguous Gloo allreduce on a dedicated
  // context, bypassing negotiation and fusion. Collective.
  Status RawAllreduce(void* data, size_t count, DataType dtype);

 private:
  enum class State { kUninitialized, kRunning, kFailed, kShutdown };

  friend class Controller;

  Runtime();
  // World rank of member `r` (names in error messages are world ranks).
  int WorldRank(int r) const;
  // Local checks of one request (may adjust its compression and flags).
  Status Check(Request& request);
  // Why a request cannot run when the runtime is not running (`state`);
  // the caller holds mu_.
  Status StoppedStatus(State state) const;
  // Plan check: this rank's digest of the plan, and the check itself
  // (throws, naming the first tensor where the ranks' plans differ).
  std::shared_ptr<PlanDigest> DigestPlanLocked(int64_t step) const;
  void CheckPlan(const PlanDigest& plan, const BufferAllreduce& allreduce);
  // Perf check: a step's per-rank times (from the first bucket's slots).
  void PerfCheckStep(const std::vector<double>& ms_by_rank);
  void Fail(const std::string& what);
  // Names the ranks that caused a failure (dead, stopped, left); their world
  // ranks go to *culprits.
  std::string IdentifyFailedRanks(std::vector<int>* culprits);
  // This rank shuts down between plan steps without a last cycle, or
  // aborts: the store records it (and which) for the others' error messages
  // and heartbeats, and shared-memory waiters for it are woken.
  void AnnounceLeaving(bool aborted = false);
  // A call refused here for a bad argument: its names go to the others as
  // rejected (kMetaRejected), so their requests fail at once.
  void RejectCall(const std::vector<std::shared_ptr<Request>>& requests, const std::string& why);
  void FailAllPending(const Status& status);
  void ConnectTransport(TransportOptions* bo);
  std::string ConnectWithDeadline(const TransportOptions& bo);
  Status RollCall(const InitOptions& o, const std::string& prefix,
                  std::chrono::milliseconds wait);

  InitOptions options_;
  std::atomic<State> state_{State::kUninitialized};
  Status failure_;
  // How many times this runtime was shut down (a process set's keys).
  std::atomic<int> generation_{0};
  // The job-wide round of the world's runtime (Init reads it from the
  // store), and the prefix of its store keys: job_id + "/round<N>".
  int64_t round_ = 0;
  std::string world_prefix_;
  std::string key_prefix_;  // this runtime's keys in its round (a set's are under the world's)

  std::unique_ptr<StoreClient> store_;
  // The world's liveness beat: a thread adds to this rank's counter in the
  // store every few hundred ms over its own connection. A rank whose counter
  // stops is stopped (SIGSTOP, a debugger), not merely slow or dead.
  std::unique_ptr<StoreClient> heartbeat_store_;
  std::thread heartbeat_;
  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  bool heartbeat_stop_ = false;
  std::string HeartbeatKey(int world_rank) const;
  void StartHeartbeat();
  void StopHeartbeat();
  // From the heartbeat thread, when the store's count of closed ranks grows:
  // fails the runtime at once if one of them died (health.cc).
  void WatchClosedPeers();
  // A normal shutdown's mark in the store, before the connection closes.
  void MarkDone();
  std::unique_ptr<GlooTransport> transport_;
  std::unique_ptr<TransportSet> transports_;  // the data plane's (factory.h)

  std::mutex mu_;  // guards queue_, pending_, shutdown_requested_, failure_
  std::condition_variable queue_cv_;
  std::deque<TensorMeta> queue_;
  std::unordered_map<std::string, std::shared_ptr<Request>> pending_;
  // Names this rank sent but gave up (their grouped call failed): if the
  // others still run one, the job fails naming it.
  std::unordered_set<std::string> abandoned_;
  bool shutdown_requested_ = false;
  std::string shutdown_by_;
  int shutdown_by_rank_ = -1;  // the rank (in this runtime) whose shutdown ended it

  // This round's negotiation thread and its state (controller.h): made by
  // Init, joined and destroyed by Shutdown.
  std::unique_ptr<Controller> controller_;
  bool joined_ = false;  // this rank called join() and it has not completed

  // This rank's offline plan (plan.h); guarded by mu_.
  OfflinePlan plan_;
  // The background thread is waiting with a deadline for plannable requests
  // that cannot run yet (Enqueue wakes it when one arrives and it is not).
  bool plan_waiting_ = false;
  // Test-only faults (faults.h); null in production.
  std::unique_ptr<FaultInjector> faults_;
  // Perf check: when this rank's previous step finished its last bucket, and
  // the window of per-rank times being summed.
  std::chrono::steady_clock::time_point last_step_done_{};
  std::vector<double> perf_sum_;
  int perf_steps_ = 0;

  std::unique_ptr<Executor> executor_;  // the streams

  std::mutex stats_mu_;
  Stats stats_;
  Timeline timeline_;
  std::atomic<bool> mark_cycles_{true};  // the timeline records negotiation cycles
  std::mutex raw_mu_;

};

}  // namespace perseus
