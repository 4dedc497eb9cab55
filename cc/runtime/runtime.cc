// The facade: Init, Shutdown, Enqueue, stats and timeline control. The parts
// live in the files named in runtime.h.
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
#include "cc/rendezvous/store_client.h"
#include "cc/runtime/controller.h"
#include "cc/runtime/faults.h"
#include "cc/runtime/fusion.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/allreduce_algorithms.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/factory.h"

namespace perseus {
Runtime::Runtime() = default;
Runtime::~Runtime() = default;

int Runtime::WorldRank(int r) const {
  return options_.global_ranks.empty() ? r : options_.global_ranks[r];
}

const char* Runtime::state_name() const {
  switch (state_.load()) {
    case State::kUninitialized: return "uninitialized";
    case State::kRunning: return "running";
    case State::kFailed: return "failed";
    case State::kShutdown: return "shutdown";
  }
  return "unknown";
}

Status Runtime::Init(const InitOptions& options) {
  if (state_.load() == State::kRunning) return Status::OK();
  if (controller_) Shutdown();  // the last round failed or was aborted
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "rank " + std::to_string(options.rank) + " is outside world size " +
                             std::to_string(options.size));
  }
  if (options.streams < 1 || options.streams > 12) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "PERSEUS_ALLREDUCE_STREAMS must be from 1 to 12");
  }
  options_ = options;
  faults_ = FaultInjector::FromEnv(WorldRank(options.rank), options.process_set_id);
  TransportOptions bo;
  bo.rank = options.rank;
  bo.size = options.size;
  // One more stream than asked: it runs online work while a plan runs offline.
  bo.streams = options.streams + 1;
  bo.host_addr = options.host_addr;
  bo.iface = options.gloo_iface;
  bo.timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds * 1000));
  bo.local_rank = options.local_rank;
  bo.local_size = options.local_size;
  bo.cross_rank = options.cross_rank;
  bo.cross_size = options.cross_size;
  // Two-level contexts for the world when the job spans hosts: hierarchical
  // allreduce, and mixed compression (which needs to know what crosses hosts).
  bo.hierarchy = options.process_set_id == 0;
  try {
    if (options.size > 1) {
      auto wait = StartupStoreWait(bo.timeout);
      store_.reset(new StoreClient(options.store_addr, options.store_port, options.secret, wait));
    }
    // The round's keys. The world's round is the job's, read from the store:
    // every process that init()s joins the round after the last one whose
    // roll call completed, whether it ran the earlier rounds or started
    // since (a replacement). No member can miss it: rank 0 records a round
    // only once every member's roll call entry is in. A process set
    // connects under the world's round, with a count of its own.
    if (options.process_set_id == 0) {
      round_ = 0;
      std::vector<char> last;
      if (store_ && store_->TryGet(options.job_id + "/round", std::chrono::milliseconds(0), &last)) {
        round_ = std::stoll(std::string(last.begin(), last.end())) + 1;
      }
      world_prefix_ = options.job_id + "/round" + std::to_string(round_);
      bo.key_prefix = world_prefix_;
    } else {
      world_prefix_ = Get().world_prefix_;
      bo.key_prefix = world_prefix_ + "/ps" + std::to_string(options.process_set_id) + "/gen" +
                      std::to_string(generation_);
    }
    key_prefix_ = bo.key_prefix;
    if (store_ && options.process_set_id == 0) {
      // The world's connection stands for this process: when it closes,
      // the store marks the rank gone (see IdentifyFailedRanks).
      store_->Own(world_prefix_ + "/rank" + std::to_string(options.rank));
      Status called = RollCall(options, bo.key_prefix + "/rollcall", StartupStoreWait(bo.timeout));
      if (!called.ok()) {
        store_.reset();
        return called;
      }
      if (options.rank == 0) {
        const std::string round = std::to_string(round_);
        store_->set(options.job_id + "/round", std::vector<char>(round.begin(), round.end()));
      }
    }
    transports_.reset();
    ConnectTransport(&bo);
    TransportTopology topo;
    topo.rank = options.rank;
    topo.size = options.size;
    topo.local_rank = options.local_rank;
    topo.local_size = options.local_size;
    topo.cross_rank = options.cross_rank;
    topo.cross_size = options.cross_size;
    topo.streams = bo.streams;
    topo.world_group = options.process_set_id == 0;
    topo.shm_allowed = options.shm;
    topo.allreduce_mode = options.allreduce_mode;
    topo.key_prefix = bo.key_prefix;
    topo.timeout = bo.timeout;
    transports_ = BuildTransports(*transport_, topo, [this] {
      if (faults_) faults_->BeforeSharedMemory();
    });
  } catch (const std::exception& e) {
    transports_.reset();
    transport_.reset();
    store_.reset();
    return Status::Error(StatusCode::kUnavailable,
                         "Perseus could not connect rank " + std::to_string(options.rank) +
                             " of " + std::to_string(options.size) + ": " + e.what());
  }
  if (options.process_set_id == 0 && options.size > 1) StartHeartbeat();
  joined_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
    pending_.clear();
    abandoned_.clear();
    shutdown_requested_ = false;
    shutdown_by_.clear();
    shutdown_by_rank_ = -1;
    failure_ = Status::OK();
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = Stats();
    stats_.streams.resize(options.streams + 1);
    stats_.hierarchical = transport_->hierarchical() && options.allreduce_mode != 0;
    stats_.shm = transports_->shm();
    stats_.round = round_;
  }
  state_ = State::kRunning;
  plan_waiting_ = false;
  mark_cycles_ = true;
  timeline_.Start(options.process_set_id == 0 ? options.timeline_path : std::string(),
                  WorldRank(options.rank), "rank " + std::to_string(WorldRank(options.rank)));
  last_step_done_ = Clock::time_point{};
  perf_sum_.clear();
  perf_steps_ = 0;
  plan_ = OfflinePlan();
  ExecutorContext ec;
  ec.options = options_;
  ec.world = transport_.get();
  ec.topology = transports_->topology();
  ec.groups = transports_->groups();
  ec.timeline = &timeline_;
  ec.failure = [this] {
    if (state_.load() != State::kFailed) return Status::OK();
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  };
  ec.fail = [this](const std::string& what) {
    Fail(what);
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  };
  // NCCL's unique ids travel through the store on connections of their own
  // (made only when a communicator is), under this round's keys.
  const std::string nccl_keys = bo.key_prefix + "/nccl/";
  const auto store_wait = StartupStoreWait(bo.timeout);
  ec.nccl_bootstrap = [options, nccl_keys, store_wait](const std::string& name) {
    const std::string key = nccl_keys + name;
    NcclBootstrap b;
    b.publish = [options, key, store_wait](const std::string& id) {
      if (options.size == 1) return;
      StoreClient store(options.store_addr, options.store_port, options.secret, store_wait);
      store.set(key, std::vector<char>(id.begin(), id.end()));
    };
    b.fetch = [options, key, store_wait](std::chrono::milliseconds wait, std::string* id) {
      StoreClient store(options.store_addr, options.store_port, options.secret, store_wait);
      std::vector<char> data;
      if (!store.TryGet(key, wait, &data)) return false;
      id->assign(data.begin(), data.end());
      return true;
    };
    return b;
  };
  executor_.reset(new Executor(ec));
  controller_.reset(new Controller(*this));
  controller_->Start();
  return Status::OK();
}

void Runtime::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  queue_cv_.notify_all();
  if (controller_) controller_->Join();
  {
    // From here on Enqueue refuses calls (nothing would run them).
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() == State::kRunning) state_ = State::kShutdown;
  }
  if (executor_) {
    executor_->Stop();
    executor_->ReleaseDevices();
  }
  // Nothing runs the round's plan buckets any more (their closures call
  // the controller): the round's control plane goes whole.
  controller_.reset();
  FailAllPending(Status::Error(StatusCode::kUnavailable,
                               "Perseus was shut down before this collective ran"));
  StopHeartbeat();
  if (state_.load() == State::kShutdown) MarkDone();
  transports_.reset();
  transport_.reset();
  store_.reset();
  std::string timeline_error;
  if (!timeline_.Write(&timeline_error)) std::fprintf(stderr, "Perseus: %s\n", timeline_error.c_str());
  ++generation_;
}

Status Runtime::Enqueue(std::shared_ptr<Request> request) {
  return EnqueueGroup({std::move(request)});
}

Status Runtime::EnqueueGroup(const std::vector<std::shared_ptr<Request>>& requests) {
  if (requests.empty()) return Status::OK();
  for (const auto& q : requests) {
    Status s = Check(*q);
    if (!s.ok()) {
      if (s.code == StatusCode::kInvalidArgument) RejectCall(requests, s.message);
      return s;
    }
  }
  if (requests.size() > 1) {
    auto call = std::make_shared<std::vector<std::string>>();
    for (const auto& q : requests) call->push_back(q->meta.name);
    for (const auto& q : requests) q->call = call;
  }
  if (faults_) {
    const int generation = generation_.load();
    faults_->BeforeQueuing([this, generation] { return generation_.load() != generation; });
  }
  const auto now = Clock::now();
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Failed or shut down since Check: Fail and Shutdown change the state
    // under mu_ before they complete everything pending, so a call queued
    // now would never complete. It gets their error instead.
    const State state = state_.load();
    if (state != State::kRunning) return StoppedStatus(state);
    // All or nothing: the whole call is in pending_ before the background
    // thread can look at any of it (it waits for mu_), so a plan bucket
    // never sees half a call. A name already pending (from an earlier call,
    // or twice in this one) takes back what this call inserted.
    for (size_t i = 0; i < requests.size(); ++i) {
      const TensorMeta& m = requests[i]->meta;
      const bool joining_twice = m.op == OpType::kJoin && joined_;
      if (joining_twice || !pending_.emplace(m.name, requests[i]).second) {
        for (size_t j = 0; j < i; ++j) pending_.erase(requests[j]->meta.name);
        if (joining_twice) {
          return Status::Error(StatusCode::kInvalidArgument,
                               "Perseus join: join() is already in progress on this rank");
        }
        return Status::Error(StatusCode::kInvalidArgument,
                             std::string("Perseus ") + OpTypeName(m.op) + " of tensor '" + m.name +
                                 "': a collective with this name is already in flight on rank " +
                                 std::to_string(options_.rank) +
                                 "; concurrent collectives need distinct names");
      }
    }
    for (const auto& q : requests) {
      TensorMeta& m = q->meta;
      q->enqueued = now;
      if (m.op == OpType::kJoin) joined_ = true;
      if (plan_.active() && (m.flags & kMetaPlannable)) {
        // Runs from the plan; one that does not fit it votes to leave the
        // plan. The background thread is woken when this completes a
        // bucket (or votes).
        bool completes;
        wake |= !plan_.Arrive(m, &completes) || completes;
        wake |= !plan_waiting_;  // its deadline starts now
      } else {
        queue_.push_back(m);
        wake = true;
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.requests += static_cast<int64_t>(requests.size());
  }
  if (wake) queue_cv_.notify_one();
  return Status::OK();
}

void Runtime::RejectCall(const std::vector<std::shared_ptr<Request>>& requests,
                         const std::string& why) {
  // The other ranks made this call with good arguments, or will: tell them
  // in the next cycle, so that theirs fail at once instead of stalling.
  std::lock_guard<std::mutex> lock(mu_);
  if (state_.load() != State::kRunning) return;
  for (const auto& q : requests) {
    if (q->meta.name.empty() || pending_.count(q->meta.name)) continue;
    TensorMeta m = q->meta;
    m.flags = kMetaRejected;
    m.rejected = why;
    queue_.push_back(std::move(m));
  }
  queue_cv_.notify_one();
}

void Runtime::StartTimeline(const std::string& path, bool mark_cycles) {
  mark_cycles_ = mark_cycles;
  timeline_.Start(path, WorldRank(options_.rank), "rank " + std::to_string(WorldRank(options_.rank)));
}

bool Runtime::StopTimeline(std::string* error) { return timeline_.Write(error); }

Stats Runtime::GetStats() {
  std::vector<StreamStats> streams;
  if (executor_) streams = executor_->stats();
  std::lock_guard<std::mutex> lock(stats_mu_);
  Stats out = stats_;
  if (!streams.empty()) out.streams = std::move(streams);
  return out;
}

Status Runtime::RawAllreduce(void* data, size_t count, DataType dtype) {
  if (state_.load() != State::kRunning) {
    return Status::Error(StatusCode::kFailedPrecondition, "Perseus is not initialized");
  }
  std::lock_guard<std::mutex> lock(raw_mu_);
  try {
    if (store_) transport_->CreateRawChannel(*store_);
    transport_->Allreduce(GlooTransport::kRawChannel, data, count, dtype, ReduceOp::kSum);
  } catch (const std::exception& e) {
    return Status::Error(StatusCode::kUnavailable, std::string("raw allreduce failed: ") + e.what());
  }
  return Status::OK();
}

}  // namespace perseus
