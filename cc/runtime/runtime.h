// The per-process runtime: one instance, shared by the TensorFlow op library
// and the pybind11 module (both link libperseus_core.so).
//
// Callers enqueue named Requests from any thread. A background thread runs
// negotiation cycles on the control context: every rank contributes the
// requests it enqueued since the last cycle, all ranks decide identically
// which are ready (negotiation.h), and the ready work is handed, in that
// order, to the stream threads, each of which owns one Gloo context.
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
#include <vector>

#include "cc/core/common.h"
#include "cc/runtime/message.h"
#include "cc/runtime/negotiation.h"
#include "cc/transport/allreduce_algorithms.h"
#include "cc/core/reduce.h"
#include "cc/core/timeline.h"

namespace perseus {

class GlooTransport;
class ShmTransport;
class StoreClient;

// Who this process is and how to reach the others (the launcher's env
// contract, already parsed and validated in Python: perseus_tf/config.py).
struct InitOptions {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int cross_rank = 0;
  int cross_size = 1;
  std::string store_addr;
  int store_port = 0;
  std::string secret;
  std::string job_id = "local";
  std::string host_addr;
  std::string gloo_iface;
  int streams = 4;
  double timeout_seconds = 60;
  int64_t fusion_threshold_bytes = 64 << 20;
  // PERSEUS_ALLREDUCE_FUSION: an offline plan's buckets hold about 1/N of
  // the step's gradient bytes (0: one tensor per bucket); -1: choose.
  int fusion_granularity = -1;
  double cycle_time_ms = 1.0;
  // A collective some ranks submitted and others did not: rank 0 reports it
  // after stall_check_seconds (again every interval), and it fails on every
  // rank after stall_timeout_seconds (0: never).
  double stall_check_seconds = 60;
  double stall_timeout_seconds = 0;
  // Compressed allreduces send x * gradient_scale as float16 and divide after.
  double gradient_scale = 10.0;
  bool nancheck = false;  // reject reductions whose input holds NaN/Inf
  std::string timeline_path;  // PERSEUS_TIMELINE (this rank's file); empty: off
  int perf_check_n_steps = 0;  // report slow ranks every N offline steps (0: off)
  // PERSEUS_OFFLINE_NEG_CHECK_N_STEPS: compare every rank's copy of the
  // offline plan when it is entered and then every N plan steps (0: off).
  int plan_check_n_steps = 0;
  // PERSEUS_ALLREDUCE_MODE: 0 flat ring, 1 hierarchical (reduce in the host,
  // allreduce among hosts' leaders, broadcast in the host), -1 choose.
  // Hierarchy needs several hosts of several ranks each (launcher topology).
  int allreduce_mode = -1;
  // PERSEUS_SHM_ALLREDUCE: allreduce through shared memory instead of TCP
  // over loopback between the ranks of a host (the whole allreduce when the
  // world is one host; the host phases of the two-level one otherwise).
  bool shm = true;
  // Top-k (kCompressTopk): each rank sends its ceil(ratio * n) largest
  // |gradient + residual| elements; tensors under threshold bytes use
  // `topk_fallback` (the PERSEUS_ALLREDUCE_DTYPE code) instead.
  double topk_ratio = 0.01;
  // Settings every rank must share, as "NAME=value" lines; compared at
  // init (the world only) before any connection is made.
  std::string settings;
  int64_t topk_threshold_bytes = 1 << 20;
  bool topk_fp16 = false;
  int topk_fallback = 0;
  // Downsampling (kCompressDownsample): 1/N of each tensor per step.
  int downsample_n = 1;
  double gradient_momentum = 1.0;
  // A process set (sub-group) runtime: its id and the world ranks of its
  // members, in order (this process is member `rank`). Empty: the world.
  int process_set_id = 0;
  std::vector<int> global_ranks;
};

// One collective a caller asked for. `done` runs exactly once, on a runtime
// thread, after the output is written (or with an error).
struct Request {
  TensorMeta meta;
  const void* input = nullptr;
  // Allreduce and broadcast write here (may equal input). Ops whose output
  // shape depends on other ranks leave it null and provide `allocate`.
  void* output = nullptr;
  std::function<void*(const std::vector<int64_t>& shape)> allocate;
  std::vector<int64_t> received_splits;  // alltoall: rows from each rank
  int64_t result = 0;                     // join: the rank that joined last
  std::function<void(const Status&)> done;
  // When Enqueue accepted it (statistics: time waiting before it ran).
  std::chrono::steady_clock::time_point enqueued{};
  // Buffers of a stand-in request (a joined rank taking part with no data).
  std::vector<char> scratch;
};

struct StreamStats {
  int64_t responses = 0;
  int64_t tensors = 0;
  int64_t bytes = 0;
  double busy_seconds = 0;
  // Summed over this stream's collectives: how long the oldest request of
  // each had waited (for the other ranks, negotiation, a free stream) when
  // it started.
  double wait_seconds = 0;
};

struct Stats {
  int64_t perf_reports = 0;      // slow-rank checks made (PERSEUS_PERF_CHECK_N_STEPS)
  std::vector<int> slow_ranks;   // flagged by the latest check (world ranks)
  bool hierarchical = false;  // two-level allreduce is available (and not turned off)
  bool shm = false;           // ranks of a host allreduce through shared memory
  int64_t plans = 0;          // offline plans entered
  int64_t plan_exits = 0;     // plans left (a step changed, or shutdown)
  int64_t offline_steps = 0;  // steps run from a plan, without control messages
  int64_t plan_checks = 0;    // plan checksums compared (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS)
  int64_t plan_timeouts = 0;  // plans this rank voted to leave after waiting for its own data
  int64_t cycles = 0;
  int64_t control_bytes_sent = 0;
  int64_t requests = 0;
  int64_t responses = 0;
  int64_t fused_responses = 0;
  std::vector<StreamStats> streams;
};

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
  // Ids of the process sets this process belongs to, besides the world.
  static std::vector<int> ProcessSetIds();

  Status Init(const InitOptions& options);
  // Collective: asks every rank to stop, drains, closes connections.
  void Shutdown();
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
  void StartTimeline(const std::string& path);
  bool StopTimeline(std::string* error);

  // Benchmark baseline: a raw contiguous Gloo allreduce on a dedicated
  // context, bypassing negotiation and fusion. Collective.
  Status RawAllreduce(void* data, size_t count, DataType dtype);

 private:
  enum class State { kUninitialized, kRunning, kFailed, kShutdown };

  Runtime() = default;
  // World rank of member `r` (names in error messages are world ranks).
  int WorldRank(int r) const;
  std::shared_ptr<Request> StandIn(const Response& response, size_t index);
  void BackgroundLoop();
  void RunCycle(bool* stop);
  // lone: the cycle's only response, which may run on this thread.
  // Local checks of one request (may adjust its compression and flags).
  Status Check(Request& request);
  // any_in_plan: some rank runs an offline plan in this cycle (then online
  // work takes the extra stream on every rank).
  void Dispatch(Response response, bool lone, bool any_in_plan);
  void RunOnStream(int index, Response& response,
                   std::vector<std::shared_ptr<Request>>& requests);
  // Runs the response on the calling thread when `stream` is idle; false
  // (nothing done) when it is busy or has work queued.
  bool RunHereIfIdle(int stream, Response& response,
                     std::vector<std::shared_ptr<Request>>& requests);
  void DispatchTo(int stream, Response response,
                  std::vector<std::shared_ptr<Request>> requests);
  // Offline mode (see runtime.cc, "Offline plans").
  void RunOffline(bool* stop);
  bool FitsPlanLocked(const TensorMeta& m) const;
  // How long plannable requests wait for a plan bucket this rank cannot
  // complete before it votes to leave the plan.
  std::chrono::milliseconds PlanDeadline() const;
  void ReportPlanTimeoutLocked(std::chrono::steady_clock::time_point oldest);
  bool PlanBucketReadyLocked() const;
  bool CanDispatchPlanLocked() const;
  void EnterOffline();
  void LeaveOfflineLocked();
  // A plan bucket's collective finished with `votes`; false: do not deliver
  // (the real requests go back to pending, to be negotiated online).
  // Plan check: due before the next step starts; and the check itself
  // (throws, naming the first tensor where the ranks' plans differ).
  bool PlanCheckDueLocked() const;
  std::shared_ptr<PlanDigest> DigestPlanLocked(int64_t step) const;
  void CheckPlan(const PlanDigest& plan);
  bool PlanBucketFinished(int64_t votes, const std::vector<std::shared_ptr<Request>>& requests,
                          int plan_index);
  // Perf check: a step's per-rank times (from the first bucket's slots).
  void PerfCheckStep(const std::vector<double>& ms_by_rank);
  void StreamLoop(int stream);
  // These return false when the requests must not be completed (an aborted
  // plan bucket).
  bool Execute(int stream, const Response& response,
               std::vector<std::shared_ptr<Request>>& requests);
  bool ExecuteAllreduce(int stream, const Response& r,
                        std::vector<std::shared_ptr<Request>>& requests);
  bool ExecuteCompressedAllreduce(int stream, const Response& r,
                                  std::vector<std::shared_ptr<Request>>& requests);
  bool ExecuteTopk(int stream, const Response& r, Request& req);
  // Allreduces count elements of buf on the stream: the flat ring, or in two
  // levels when the topology has hosts. half_across > 0 (mixed compression,
  // float32 only): between hosts, the first half_across elements travel as
  // float16 times the gradient scale and the rest as plain float16.
  void AllreduceBuffer(int stream, void* buf, size_t count, DataType dtype, ReduceFn fn,
                       size_t half_across = 0);
  // Elements top-k sends of a tensor of n (at least 1).
  int64_t TopkCount(int64_t n) const;
  // Bytes one rank puts on the wire for a tensor (statistics).
  int64_t PayloadBytes(const TensorMeta& m) const;
  void ExecuteAllgather(int stream, const Response& r, Request& req);
  void ExecuteAlltoall(int stream, const Response& r, Request& req);
  void ExecuteReducescatter(int stream, const Response& r, Request& req);
  void Fail(const std::string& what);
  std::string IdentifyFailedRanks();
  void FailAllPending(const Status& status);
  void StopThreads();
  void ConnectTransport(TransportOptions* bo);
  std::string ConnectWithDeadline(const TransportOptions& bo);
  Status RollCall(const InitOptions& o, const std::string& prefix,
                  std::chrono::milliseconds wait);

  InitOptions options_;
  std::atomic<State> state_{State::kUninitialized};
  Status failure_;
  int generation_ = 0;

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
  std::unique_ptr<GlooTransport> transport_;
  std::unique_ptr<ShmTransport> shm_;  // among this host's ranks
  // How allreduces travel (set at Init from the connected transports).
  AllreduceTopology topology_;
  AllreduceGroups groups_;
  std::unique_ptr<Negotiator> negotiator_;

  std::mutex mu_;  // guards queue_, pending_, shutdown_requested_, failure_
  std::condition_variable queue_cv_;
  std::deque<TensorMeta> queue_;
  std::unordered_map<std::string, std::shared_ptr<Request>> pending_;
  bool shutdown_requested_ = false;
  std::string shutdown_by_;

  std::thread background_;
  std::chrono::steady_clock::time_point last_cycle_;
  std::chrono::steady_clock::time_point started_;  // Init (this rank's clock origin)
  int idle_cycles_ = 0;
  uint64_t dispatched_ = 0;
  bool joined_ = false;  // this rank called join() and it has not completed

  // Offline plan state. offline_, leave_vote_ and the carrier fields are
  // guarded by mu_; plan_ and plan_pos_ belong to the background thread
  // (Enqueue reads plan_.metas under mu_ only while offline_, when it is
  // not being changed).
  bool offline_ = false;
  Plan plan_;
  size_t plan_pos_ = 0;
  bool leave_vote_ = false;     // a plannable request does not fit the plan
  bool aborting_ = false;       // a bucket of this step was voted down
  bool step_started_ = false;   // a bucket of the current step was dispatched
  int plan_in_flight_ = 0;      // plan buckets dispatched, not finished
  std::vector<size_t> plan_have_;  // per bucket: fitting requests pending here
  int64_t plan_steps_ = 0;      // steps of this plan started
  int64_t plan_checked_ = -1;   // the step whose plan check passed
  // The background thread is waiting with a deadline for plannable requests
  // that cannot run yet (Enqueue wakes it when one arrives and it is not).
  bool plan_waiting_ = false;
  // Fault injection for tests (PERSEUS_TEST_PLAN_SWAP=rank:step): that rank
  // swaps two same-shaped tensors of a bucket in its copy of the plan when
  // that plan step starts, a divergence the votes cannot see.
  int test_swap_rank_ = -1;
  int64_t test_swap_step_ = 0;
  // Perf check: when this rank's previous step finished its last bucket, and
  // the window of per-rank times being summed.
  std::chrono::steady_clock::time_point last_step_done_{};
  std::vector<double> perf_sum_;
  int perf_steps_ = 0;

  struct Stream {
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Response> queue;
    std::deque<std::vector<std::shared_ptr<Request>>> work;
    bool stop = false;
    bool busy = false;  // a response of this stream is running (here or inline)
    std::vector<char> fusion_buffer;
    std::vector<uint16_t> half_buffer;  // compressed buckets
    std::vector<int32_t> index;         // top-k candidates
    StreamStats stats;
  };
  std::vector<std::unique_ptr<Stream>> streams_;

  std::mutex stats_mu_;
  Stats stats_;
  Timeline timeline_;
  std::mutex raw_mu_;

  // Per-tensor state of top-k and downsampling (keyed by tensor name).
  struct SparseState {
    std::vector<float> residual;
    int64_t steps = 0;
  };
  std::mutex sparse_mu_;
  std::unordered_map<std::string, SparseState> sparse_;
  SparseState& SparseFor(const TensorMeta& m);
};

}  // namespace perseus
