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
#include "cc/runtime/health.h"
#include "cc/runtime/faults.h"
#include "cc/runtime/plan/plan.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/allreduce_algorithms.h"
#include "cc/transport/gloo_abortable.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/factory.h"

namespace perseus {
Runtime::Runtime() = default;
Runtime::~Runtime() = default;

const char* Runtime::state_name() const {
  switch (state_.load()) {
    case State::kUninitialized: return "uninitialized";
    case State::kRunning: return "running";
    case State::kFailed: return "failed";
    case State::kShutdown: return "shutdown";
  }
  return "unknown";
}

// ---- A round: Init's steps -------------------------------------------------

Status Runtime::Init(const InitOptions& options) {
  if (state_.load() == State::kRunning) return Status::OK();
  if (controller_) Shutdown();  // the last round failed or was aborted
  Status valid = Validate(options);
  if (!valid.ok()) return valid;
  options_ = options;
  faults_ = FaultInjector::FromEnv(WorldRank(options.rank), options.process_set_id);
  TransportOptions bo = TransportOptionsFor(options);
  using Seconds = std::chrono::duration<double>;
  const auto started = std::chrono::steady_clock::now();
  auto joined_at = started, connected_at = started;
  try {
    Status joined = JoinRound(&bo);
    if (!joined.ok()) {
      store_.reset();
      return joined;
    }
    joined_at = std::chrono::steady_clock::now();
    Connect(&bo);
    connected_at = std::chrono::steady_clock::now();
  } catch (const std::exception& e) {
    transports_.reset();
    transport_.reset();
    store_.reset();
    return Status::Error(StatusCode::kUnavailable,
                         "Perseus could not connect rank " + std::to_string(options.rank) +
                             " of " + std::to_string(options.size) + ": " + e.what());
  }
  StartRound();
  stats_.Update([&](Stats& st) {
    st.startup_store_seconds = Seconds(joined_at - started).count();
    st.startup_connect_seconds = Seconds(connected_at - joined_at).count();
  });
  executor_.reset(new Executor(MakeExecutorContext(bo)));
  StartController();
  return Status::OK();
}

Status Runtime::Validate(const InitOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "rank " + std::to_string(options.rank) + " is outside world size " +
                             std::to_string(options.size));
  }
  if (options.streams < 1 || options.streams > 12) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "PERSEUS_ALLREDUCE_STREAMS must be from 1 to 12");
  }
  return Status::OK();
}

TransportOptions Runtime::TransportOptionsFor(const InitOptions& options) const {
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
  return bo;
}

Status Runtime::JoinRound(TransportOptions* bo) {
  const InitOptions& o = options_;
  if (o.size > 1) {
    store_.reset(new StoreClient(o.store_addr, o.store_port, o.secret,
                                 StartupStoreWait(bo->timeout)));
    store_->SetAnswerTimeout(StoreAnswerTimeout(bo->timeout));
  }
  // The round's keys. The world's round is the job's, read from the store:
  // every process that init()s joins the round after the last one whose
  // roll call completed, whether it ran the earlier rounds or started since
  // (a replacement). No member can miss it: rank 0 records a round only
  // once every member's roll call entry is in. A process set connects
  // under the world's round, with a count of its own.
  if (o.process_set_id == 0) {
    keys_.round = 0;
    std::vector<char> last;
    if (store_ && store_->TryGet(o.job_id + "/round", std::chrono::milliseconds(0), &last)) {
      keys_.round = std::stoll(std::string(last.begin(), last.end())) + 1;
    }
    keys_.world_prefix = o.job_id + "/round" + std::to_string(keys_.round);
    bo->key_prefix = keys_.world_prefix;
  } else {
    keys_.world_prefix = Get().keys_.world_prefix;
    bo->key_prefix = keys_.world_prefix + "/ps" + std::to_string(o.process_set_id) + "/gen" +
                     std::to_string(generation_);
  }
  keys_.key_prefix = bo->key_prefix;
  if (!store_ || o.process_set_id != 0) return Status::OK();
  // The world's connection stands for this process: when it closes, the
  // store marks the rank gone (see HealthMonitor::IdentifyFailedRanks).
  store_->Own(keys_.world_prefix + "/rank" + std::to_string(o.rank));
  Status called = RollCall(o, bo->key_prefix + "/rollcall", StartupStoreWait(bo->timeout));
  if (!called.ok()) return called;
  if (o.rank == 0) {
    const std::string round = std::to_string(keys_.round);
    store_->set(o.job_id + "/round", std::vector<char>(round.begin(), round.end()));
  }
  return Status::OK();
}

void Runtime::Connect(TransportOptions* bo) {
  const InitOptions& o = options_;
  transports_.reset();
  ConnectTransport(bo);
  TransportTopology topo;
  topo.rank = o.rank;
  topo.size = o.size;
  topo.local_rank = o.local_rank;
  topo.local_size = o.local_size;
  topo.cross_rank = o.cross_rank;
  topo.cross_size = o.cross_size;
  topo.streams = bo->streams;
  topo.world_group = o.process_set_id == 0;
  topo.shm_allowed = o.shm_allreduce;
  topo.allreduce_mode = o.allreduce_mode;
  topo.allreduce_doubling_bytes = o.allreduce_doubling_bytes;
  topo.link_cost.alpha = o.link_latency_us * 1e-6;
  topo.link_cost.beta = o.link_bandwidth_mbytes * 1e6;
  topo.key_prefix = bo->key_prefix;
  topo.timeout = bo->timeout;
  transports_ = BuildTransports(*transport_, topo, [this] {
    if (faults_) faults_->BeforeSharedMemory();
  });
}

void Runtime::StartRound() {
  const InitOptions& o = options_;
  auto activity = std::make_shared<Activity>(o.streams);
  HealthContext hc;
  hc.ranks = o;
  hc.health = o;
  hc.timeout_seconds = o.timeout_seconds;
  hc.store = StoreForHealth(store_.get());
  hc.connect = [ranks = static_cast<const Topology&>(o)](std::chrono::milliseconds limit) {
    return ConnectStoreForHealth(ranks, limit);
  };
  hc.abort_waits = [](const std::string& why) { AbortGlooWaits(why); };
  hc.world_prefix = keys_.world_prefix;
  hc.key_prefix = keys_.key_prefix;
  hc.stats = &stats_;
  hc.wake_local_waits = [this] {
    if (transports_) transports_->Abort();
  };
  hc.report = [this](const std::string& what) { return Fail(what); };
  hc.ending = [this] { return state_.load() != State::kRunning || requests_.ShuttingDown(); };
  hc.longest_wait = [activity] { return activity->Longest(); };
  health_.reset(new HealthMonitor(std::move(hc)));
  if (o.process_set_id == 0 && o.size > 1) health_->StartHeartbeat();
  requests_.Open(WorldRank(o.rank));
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = Status::OK();
  }
  stats_.Update([&](Stats& s) {
    s = Stats();
    s.streams.resize(o.streams + 1);
    s.hierarchical = transport_->hierarchical() && o.allreduce_mode != 0;
    s.shm = transports_->shm();
    s.round = keys_.round;
    s.allreduce_doubling_bytes = static_cast<int64_t>(transports_->topology().doubling_bytes);
    s.link_latency_us = transports_->cost().alpha * 1e6;
    s.link_bandwidth_mbytes = transports_->cost().beta * 1e-6;
    s.reduce_mbytes = transports_->cost().gamma > 0 ? 1e-6 / transports_->cost().gamma : 0;
    const TwoLevelCost& two = transports_->two_level_cost();
    s.host_phase_us = two.host_seconds * 1e6;
    s.host_phase_mbytes = two.host_per_byte > 0 ? 1e-6 / two.host_per_byte : 0;
    s.cross_latency_us = two.cross.alpha * 1e6;
    s.cross_bandwidth_mbytes = two.cross.beta * 1e-6;
    s.leaders_doubling_bytes =
        static_cast<int64_t>(transports_->topology().leaders_doubling_bytes);
  });
  {
    std::lock_guard<std::mutex> lock(mu_);
    activity_ = activity;
  }
  state_ = State::kRunning;
  mark_cycles_ = true;
  timeline_.Start(o.process_set_id == 0 ? o.timeline_path : std::string(), WorldRank(o.rank),
                  "rank " + std::to_string(WorldRank(o.rank)));
}

ExecutorContext Runtime::MakeExecutorContext(const TransportOptions& bo) {
  ExecutorContext ec;
  ec.ranks = options_;
  ec.transport = options_;
  ec.compression = options_;
  ec.nccl = options_.nccl;
  ec.nccl_dirs = options_.nccl_dirs;
  ec.world = transport_.get();
  ec.topology = transports_->topology();
  ec.groups = transports_->groups();
  ec.timeline = &timeline_;
  ec.activity = activity_;
  ec.failure = [this] { return failure(); };
  ec.fail = [this](const std::string& what) {
    Fail(what);
    return failure();
  };
  // NCCL's unique ids travel through the store on connections of their own
  // (made only when a communicator is), under this round's keys.
  const Topology options = options_;
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
    b.gather = [options, key, store_wait](int rank, int size, const std::string& mine,
                                          std::chrono::milliseconds wait,
                                          std::vector<std::string>* all) {
      StoreClient store(options.store_addr, options.store_port, options.secret, store_wait);
      store.set(key + "/gpu/" + std::to_string(rank), std::vector<char>(mine.begin(), mine.end()));
      const auto deadline = std::chrono::steady_clock::now() + wait;
      all->assign(static_cast<size_t>(size), std::string());
      for (int r = 0; r < size; ++r) {
        std::vector<char> data;
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (!store.TryGet(key + "/gpu/" + std::to_string(r),
                          std::max(left, std::chrono::milliseconds(1)), &data)) {
          return false;
        }
        (*all)[static_cast<size_t>(r)].assign(data.begin(), data.end());
      }
      return true;
    };
    return b;
  };
  return ec;
}

void Runtime::StartController() {
  ControllerContext cc;
  cc.ranks = options_;
  cc.negotiation = options_;
  cc.streams = options_.streams;
  cc.timeout_seconds = options_.timeout_seconds;
  cc.perf_check_n_steps = options_.perf_check_n_steps;
  cc.requests = &requests_;
  cc.executor = executor_.get();
  cc.control = transport_.get();
  cc.health = health_.get();
  cc.stats = &stats_;
  cc.timeline = &timeline_;
  cc.mark_cycles = &mark_cycles_;
  cc.activity = activity_;
  cc.faults = faults_.get();
  cc.running = [this] { return state_.load() == State::kRunning; };
  cc.fail = [this](const std::string& what) { Fail(what); };
  cc.stopped = [this] { OnControllerStopped(); };
  controller_.reset(new Controller(std::move(cc)));
  controller_->Start();
}

// ---- Ending a round ----------------------------------------------------------

void Runtime::OnControllerStopped() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() == State::kRunning) state_ = State::kShutdown;
  }
  const std::string message = "Perseus was shut down (" + requests_.shutdown_by() +
                              ") before this collective ran on every rank";
  // Collectives of this rank left unfinished by another rank's shutdown:
  // that rank is the cause.
  const int by = requests_.shutdown_by_rank();
  if (requests_.HasPending() && by >= 0 && by != options_.rank) {
    RecordFirstFailure({WorldRank(by)}, message);
  }
  requests_.Close(Status::Error(StatusCode::kUnavailable, message));
}

void Runtime::Shutdown() {
  requests_.RequestShutdown();
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
  requests_.Close(Status::Error(StatusCode::kUnavailable,
                                "Perseus was shut down before this collective ran"));
  if (health_) {
    health_->StopHeartbeat();
    if (state_.load() == State::kShutdown) health_->MarkDone();
  }
  health_.reset();
  transports_.reset();
  transport_.reset();
  store_.reset();
  std::string timeline_error;
  if (!timeline_.Write(&timeline_error)) std::fprintf(stderr, "Perseus: %s\n", timeline_error.c_str());
  ++generation_;
}

std::string Runtime::Fail(const std::string& what) {
  static std::mutex fail_mu;
  std::lock_guard<std::mutex> fail_lock(fail_mu);
  if (state_.load() != State::kRunning) return failure().message;
  std::vector<int> culprits;
  std::string who = health_ ? health_->IdentifyFailedRanks(&culprits) : std::string();
  std::ostringstream msg;
  msg << "Perseus rank " << options_.rank << ": ";
  if (!who.empty()) msg << who << "; ";
  msg << what << ". Collectives cannot continue; restart the job.";
  std::shared_ptr<Activity> activity;
  {
    std::lock_guard<std::mutex> lock(mu_);
    activity = activity_;
  }
  // What held this rank's threads (only waits of a second or more).
  const std::string doing = activity ? activity->Describe(std::chrono::seconds(1)) : "";
  if (!doing.empty()) msg << " On this rank, " << doing << ".";
  Status status = Status::Error(StatusCode::kUnavailable, msg.str());
  RecordFirstFailure(culprits, msg.str());
  if (transports_) transports_->Abort();  // ranks waiting in a shared-memory barrier stop waiting
  // Streams waiting on NCCL for the failed rank stop within a poll, not at
  // their own deadline.
  if (executor_) executor_->StopDeviceWork(msg.str());
  // Peers waiting on this rank over TCP (a send it will never match, say)
  // fail now, not at GLOO_TIMEOUT_SECONDS; so do this process's other waits.
  // The census key written above tells them this rank is a survivor.
  if (transport_) transport_->CloseAll(msg.str());
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = status;
    state_ = State::kFailed;
  }
  requests_.Close(status);
  return status.message;
}

Status Runtime::failure() {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
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
    if (health_) health_->AnnounceLeaving(/*aborted=*/true);  // the store's mark, shared memory's waits
    if (transport_) transport_->CloseAll(message);
    requests_.Close(Status::Error(StatusCode::kUnavailable, message));
  }
  Shutdown();  // the controller sees the failed state and stops at once
}

// ---- Requests ------------------------------------------------------------------

Status Runtime::Enqueue(std::shared_ptr<Request> request) {
  return EnqueueGroup({std::move(request)});
}

Status Runtime::EnqueueGroup(const std::vector<std::shared_ptr<Request>>& requests) {
  if (requests.empty()) return Status::OK();
  for (const auto& q : requests) {
    Status s = Check(*q);
    if (!s.ok()) {
      if (s.code == StatusCode::kInvalidArgument) requests_.Reject(requests, s.message);
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
  // Failed or shut down since Check: the round closed the table before it
  // completed everything pending, so a call queued now would never
  // complete. It gets their error instead.
  bool closed;
  Status queued = requests_.Submit(requests, Clock::now(), &closed);
  if (closed) return StoppedStatus(state_.load());
  if (!queued.ok()) return queued;
  stats_.Update([&](Stats& s) { s.requests += static_cast<int64_t>(requests.size()); });
  return Status::OK();
}

void Runtime::StartTimeline(const std::string& path, bool mark_cycles) {
  mark_cycles_ = mark_cycles;
  timeline_.Start(path, WorldRank(options_.rank), "rank " + std::to_string(WorldRank(options_.rank)));
}

bool Runtime::StopTimeline(std::string* error) { return timeline_.Write(error); }

Stats Runtime::GetStats() {
  std::vector<StreamStats> streams;
  DataPlane::Memory buffers;
  if (executor_) {
    streams = executor_->stats();
    buffers = executor_->DeviceBufferMemory();
  }
  Stats out = stats_.Get();
  if (!streams.empty()) out.streams = std::move(streams);
  out.device_buffer_bytes = static_cast<int64_t>(buffers.device);
  out.staging_buffer_bytes = static_cast<int64_t>(buffers.host);
  return out;
}

Status Runtime::OnRawChannel(const char* what, const std::function<void()>& run) {
  if (state_.load() != State::kRunning) {
    return Status::Error(StatusCode::kFailedPrecondition, "Perseus is not initialized");
  }
  std::lock_guard<std::mutex> lock(raw_mu_);
  try {
    if (store_) transport_->CreateRawChannel(*store_);
    run();
  } catch (const std::exception& e) {
    return Status::Error(StatusCode::kUnavailable, std::string(what) + " failed: " + e.what());
  }
  return Status::OK();
}

Status Runtime::RawAllreduce(void* data, size_t count, DataType dtype, bool doubling) {
  return OnRawChannel("raw allreduce", [&] {
    if (doubling) {
      transport_->AllreduceDoubling(GlooTransport::kRawChannel, data, count, dtype, ReduceOp::kSum);
    } else {
      transport_->Allreduce(GlooTransport::kRawChannel, data, count, dtype, ReduceOp::kSum);
    }
  });
}

Status Runtime::RawAllgather(const std::string& in, std::string* out, bool bruck) {
  return OnRawChannel("raw allgather", [&] {
    const std::vector<size_t> blocks(transport_->size(), in.size());
    out->assign(in.size() * blocks.size(), '\0');
    if (bruck) {
      transport_->AllgatherBlocks(GlooTransport::kRawChannel, in.data(), &(*out)[0], in.size());
    } else {
      transport_->Allgatherv(GlooTransport::kRawChannel, in.data(), &(*out)[0], blocks);
    }
  });
}

}  // namespace perseus
