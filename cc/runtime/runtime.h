// The per-process runtime: one instance, shared by the TensorFlow op library
// and the pybind11 module (both link libperseus_core.so).
//
// Callers enqueue named Requests from any thread. A background thread runs
// negotiation cycles on the control context: every rank contributes the
// requests it enqueued since the last cycle, all ranks decide identically
// which are ready (negotiation.h), and the ready work is handed, in that
// order, to the stream threads, each of which owns one Gloo context.
//
// Runtime is the facade (runtime.cc): it owns one round (Init to Shutdown)
// and the objects that do the work, each behind its own interface:
//   request_table.{h,cc}  RequestTable: the queue, the pending requests, the
//                    join, the offline plan's request side (one lock);
//                    plan/request_table_plan.cc its offline half
//   controller.{h,cc} Controller, a round's negotiation thread: the cycle,
//                    the stall budget, dispatch; plan/offline.cc its offline mode
//   executor.{h,cc}  Executor: the streams and the execute switch
//   health.{h,cc}    HealthMonitor: heartbeats, naming failed ranks, the
//                    marks of leaving, the slow-rank check
// and the rest of its parts:
//   process_sets.cc  the registry of runtimes by process-set id
//   connect.cc       roll call and connecting the transport
//   request.cc       local validation of a request
//   plan/            the offline plan, behind plan/plan.h: learning it
//                    (PlanLearner, which the Negotiator owns), running it
//                    (OfflinePlan, in the request table), the ranks' check,
//                    bucket sizing, and a bucket's envelope (envelope.h)
//   response.h       Response, the unit of work every rank runs in order
//   fused_allreduce.{h,cc} packs a bucket, reduces it once
//   staging.{h,cc}   device requests through host memory and back
//   compression/     fp16, top-k and downsampling behind one interface
//   collectives.cc   allgather, alltoall, reduce-scatter
// The data path (executor, compression, collectives) never reads plan
// state: a plan bucket reduces through its envelope, which hands the sum of
// its extras to the plan.
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
#include "cc/runtime/health.h"
#include "cc/runtime/message.h"
#include "cc/runtime/options.h"
#include "cc/runtime/request.h"
#include "cc/runtime/request_table.h"
#include "cc/runtime/stats.h"
#include "cc/transport/allreduce_algorithms.h"
#include "cc/transport/transport.h"

namespace perseus {

class GlooTransport;
class TransportSet;
class StoreClient;
class Controller;

class Runtime {
 public:
  // The world's runtime (process set 0).
  static Runtime& Get();
  // In a process forked after init(), why a collective cannot run there
  // (the whole message); "" in any other. The child does not share its
  // parent's runtime (whose threads did not come with it): the fork gets a
  // runtime of its own, not initialized.
  static std::string ForkedAfterInit();
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
  // context, bypassing negotiation and fusion: Gloo's ring, or (doubling)
  // the transport's recursive doubling. Collective.
  Status RawAllreduce(void* data, size_t count, DataType dtype, bool doubling = false);
  // The same for an allgather of `in` (the same length on every rank):
  // *out gets every rank's, in rank order, by Gloo's ring (allgatherv) or
  // (bruck) Bruck's rounds, the negotiation cycle's algorithm.
  Status RawAllgather(const std::string& in, std::string* out, bool bruck);

 private:
  // Runs `run` on the benchmarks' raw Gloo context (made on first use),
  // with the raw calls' lock; its exceptions become a Status naming `what`.
  Status OnRawChannel(const char* what, const std::function<void()>& run);
  // The world's runtime, and what a child forked after init() does with it
  // (process_sets.cc).
  static Runtime*& WorldSlot();
  static void InChildAfterFork();
  enum class State { kUninitialized, kRunning, kFailed, kShutdown };
  // A round's place in the store.
  struct RoundKeys {
    // The job-wide round of the world's runtime (Init reads it from the
    // store).
    int64_t round = 0;
    std::string world_prefix;  // the world's round: job_id + "/round<N>"
    std::string key_prefix;    // this runtime's keys in it (a set's are under the world's)
  };

  Runtime();
  // World rank of member `r` (names in error messages are world ranks).
  int WorldRank(int r) const { return WorldRankOf(options_, r); }
  // Init's steps, in order (runtime.cc).
  static Status Validate(const InitOptions& options);
  TransportOptions TransportOptionsFor(const InitOptions& options) const;
  // Opens the store and reads the round; takes part in the world's roll call.
  Status JoinRound(TransportOptions* bo);
  // Connects the transport and builds the data plane's transports (throws).
  void Connect(TransportOptions* bo);
  void StartRound();
  ExecutorContext MakeExecutorContext(const TransportOptions& bo);
  void StartController();
  // Local checks of one request (may adjust its compression and flags;
  // request.cc).
  Status Check(Request& request);
  Status CheckReduction(Request& request);
  Status CheckCompression(Request& request);
  Status CheckShape(const TensorMeta& m);
  // Why a request cannot run when the runtime is not running (`state`).
  Status StoppedStatus(State state);
  // Fails the round: names the culprits, wakes every wait, fails what is
  // pending. The failure's message is returned.
  std::string Fail(const std::string& what);
  Status failure();
  // The controller stopped after an agreed shutdown.
  void OnControllerStopped();
  // connect.cc
  Status RollCall(const InitOptions& o, const std::string& prefix,
                  std::chrono::milliseconds wait);
  void ConnectTransport(TransportOptions* bo);
  std::string ConnectWithDeadline(const TransportOptions& bo);

  InitOptions options_;
  std::atomic<State> state_{State::kUninitialized};
  std::mutex mu_;    // guards failure_ and the state's changes
  Status failure_;
  // How many times this runtime was shut down (a process set's keys).
  std::atomic<int> generation_{0};
  RoundKeys keys_;
  std::unique_ptr<StoreClient> store_;
  std::unique_ptr<GlooTransport> transport_;
  std::unique_ptr<TransportSet> transports_;  // the data plane's (factory.h)
  // What this rank asked for and has not run; lives as long as the runtime,
  // opened by each round's Init and closed when it ends.
  RequestTable requests_;
  // The round's parts: made by Init, destroyed by Shutdown.
  std::unique_ptr<HealthMonitor> health_;
  std::unique_ptr<Executor> executor_;      // the streams
  std::unique_ptr<Controller> controller_;  // the negotiation thread
  // What the round's threads are doing, for failure reports (activity.h);
  // made by each round, shared with its controller and executor (mu_).
  std::shared_ptr<Activity> activity_;
  std::unique_ptr<FaultInjector> faults_;   // test-only faults (faults.h); null in production
  StatsBook stats_;
  Timeline timeline_;
  std::atomic<bool> mark_cycles_{true};  // the timeline records negotiation cycles
  std::mutex raw_mu_;
};

}  // namespace perseus
