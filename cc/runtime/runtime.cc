#include "cc/runtime/runtime.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>

#include "cc/transport/allreduce_algorithms.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/shm_transport.h"
#include "cc/core/reduce.h"
#include "cc/runtime/fusion.h"
#include "cc/rendezvous/store_client.h"

namespace perseus {
namespace {

using Clock = std::chrono::steady_clock;

// How long an idle rank waits before joining the next (empty) cycle. A rank
// with work joins at once; the others join within this bound.
constexpr auto kIdleWait = std::chrono::milliseconds(5);

// Bytes each rank contributes to a cycle's first control allgather.
constexpr size_t kControlSlot = 512;

std::string ClosedKey(const std::string& job, int rank) {
  return "__closed__/" + job + "/rank" + std::to_string(rank);
}

std::string RankList(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

std::string JsonEscape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

std::vector<int64_t> Trailing(const std::vector<int64_t>& shape) {
  return std::vector<int64_t>(shape.begin() + (shape.empty() ? 0 : 1), shape.end());
}

}  // namespace

// Process-set runtimes by id. Like the world's, they are never destroyed:
// their threads may still run while the process exits.
std::mutex registry_mu;
std::map<int, Runtime*>& Registry() {
  static auto* registry = new std::map<int, Runtime*>();
  return *registry;
}

Runtime& Runtime::Get() {
  static Runtime* runtime = new Runtime();
  return *runtime;
}

Runtime* Runtime::Find(int process_set_id) {
  if (process_set_id == 0) return &Get();
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(process_set_id);
  return it == Registry().end() ? nullptr : it->second;
}

std::vector<int> Runtime::ProcessSetIds() {
  std::lock_guard<std::mutex> lock(registry_mu);
  std::vector<int> ids;
  for (const auto& kv : Registry()) {
    if (kv.second->initialized()) ids.push_back(kv.first);
  }
  return ids;
}

Status Runtime::AddProcessSet(int id, const std::vector<int>& world_ranks) {
  Runtime& world = Get();
  if (!world.initialized()) {
    return Status::Error(StatusCode::kFailedPrecondition,
                         "Perseus is not initialized: call init() before adding a process set");
  }
  if (id <= 0) {
    return Status::Error(StatusCode::kInvalidArgument, "process set ids start at 1");
  }
  InitOptions o = world.options();
  auto me = std::find(world_ranks.begin(), world_ranks.end(), o.rank);
  if (me == world_ranks.end()) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "rank " + std::to_string(o.rank) + " is not a member of process set " +
                             std::to_string(id));
  }
  o.rank = static_cast<int>(me - world_ranks.begin());
  o.size = static_cast<int>(world_ranks.size());
  o.process_set_id = id;
  o.global_ranks = world_ranks;
  Runtime* rt;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    if (Registry().count(id)) {
      return Status::Error(StatusCode::kInvalidArgument,
                           "process set " + std::to_string(id) + " already exists");
    }
    rt = new Runtime();
    Registry().emplace(id, rt);
  }
  return rt->Init(o);
}

Status Runtime::RemoveProcessSet(int id) {
  Runtime* rt = id == 0 ? nullptr : Find(id);
  if (rt == nullptr) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "process set " + std::to_string(id) + " does not exist on this rank");
  }
  rt->Shutdown();
  // Its threads are joined; the object itself is left allocated (a caller
  // might still hold the pointer), but the id no longer resolves.
  std::lock_guard<std::mutex> lock(registry_mu);
  Registry().erase(id);
  return Status::OK();
}

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

namespace {

// How long a store read waits at start-up for ranks that have not started:
// importing TensorFlow on a loaded machine can take minutes.
std::chrono::milliseconds StartupStoreWait(std::chrono::milliseconds gloo_timeout) {
  return std::max(gloo_timeout, std::chrono::milliseconds(300000));
}

std::map<std::string, std::string> ParseSettings(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

std::string Join(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

// Before any connection: every process claims its rank (a second claim of
// the same rank fails both at once), publishes the settings that must agree,
// and reads every other rank's, failing at the first difference with the
// variable and both values. Waits for ranks that have not started yet up to
// `wait`, saying so on stderr every GLOO_TIMEOUT_SECONDS.
Status Runtime::RollCall(const InitOptions& o, const std::string& prefix,
                         std::chrono::milliseconds wait) {
  const std::string me = std::to_string(o.rank);
  const std::string claim = prefix + "/claim/" + me;
  auto duplicate = [&]() {
    return Status::Error(
        StatusCode::kInvalidArgument,
        "Perseus: two processes claim rank " + me + " of job " + o.job_id +
            " (PERSEUS_RANK=" + me + " twice?). Every process of a job needs its own rank, " +
            "0 to " + std::to_string(o.size - 1) + " (PERSEUS_SIZE=" + std::to_string(o.size) +
            "); perseusrun assigns them.");
  };
  if (store_->Add(claim, 1) > 1) return duplicate();
  store_->set(prefix + "/settings/" + me, std::vector<char>(o.settings.begin(), o.settings.end()));
  const auto mine = ParseSettings(o.settings);
  std::vector<bool> seen(o.size, false);
  seen[o.rank] = true;
  const auto start = std::chrono::steady_clock::now();
  const auto note_every = std::chrono::milliseconds(
      std::max<int64_t>(1000, static_cast<int64_t>(o.timeout_seconds * 1000)));
  auto next_note = start + note_every;
  for (;;) {
    std::vector<int> missing;
    for (int r = 0; r < o.size; ++r) {
      if (seen[r]) continue;
      std::vector<char> value;
      if (!store_->TryGet(prefix + "/settings/" + std::to_string(r),
                          std::chrono::milliseconds(missing.empty() ? 100 : 0), &value)) {
        missing.push_back(r);
        continue;
      }
      seen[r] = true;
      const auto theirs = ParseSettings(std::string(value.begin(), value.end()));
      std::string diff;
      for (const auto& kv : mine) {
        auto it = theirs.find(kv.first);
        const std::string other = it == theirs.end() ? "(unset)" : it->second;
        if (other != kv.second) {
          diff += (diff.empty() ? "" : "; ") + kv.first + ": rank " + me + " has " + kv.second +
                  ", rank " + std::to_string(r) + " has " + other;
        }
      }
      if (!diff.empty()) {
        return Status::Error(StatusCode::kInvalidArgument,
                             "Perseus: ranks disagree on settings that must be the same on "
                             "every rank: " + diff + ". Set them alike for every rank "
                             "(perseusrun passes its environment to all ranks).");
      }
    }
    if (missing.empty()) return Status::OK();
    if (store_->Add(claim, 0) > 1) return duplicate();
    const auto now = std::chrono::steady_clock::now();
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start).count();
    if (now - start >= wait) {
      return Status::Error(
          StatusCode::kUnavailable,
          "Perseus rank " + me + ": rank(s) " + Join(missing) + " of " +
              std::to_string(o.size) + " did not start within " + std::to_string(waited) +
              " s (PERSEUS_SIZE=" + std::to_string(o.size) + "; is every rank launched, " +
              "with the same PERSEUS_JOB_ID and rendezvous address?)");
    }
    if (now >= next_note) {
      std::fprintf(stderr,
                   "Perseus rank %d: waiting for rank(s) %s to start (%lld s so far; gives up "
                   "after %lld s)\n",
                   o.rank, Join(missing).c_str(), static_cast<long long>(waited),
                   static_cast<long long>(wait.count() / 1000));
      next_note = now + note_every;
    }
  }
}

// Builds the Gloo backend on a helper thread and waits at most
// GLOO_TIMEOUT_SECONDS + 10 s: Gloo's pair set-up can block without a
// deadline of its own after a foreign connection. Returns "" or the error.
// When it gives up, the helper thread is left blocked: the store client it
// uses is deliberately kept alive (leaked) so that it never touches freed
// memory, and this rank votes for another attempt with a new client.
std::string Runtime::ConnectWithDeadline(const TransportOptions& bo) {
  struct Attempt {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::unique_ptr<GlooTransport> backend;
    std::string error;
  };
  auto attempt = std::make_shared<Attempt>();
  StoreClient* store = store_.get();
  std::thread([attempt, bo, store] {
    std::unique_ptr<GlooTransport> backend;
    std::string error;
    try {
      backend.reset(new GlooTransport(bo, store));
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(attempt->mu);
    attempt->backend = std::move(backend);
    attempt->error = error;
    attempt->done = true;
    attempt->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(attempt->mu);
  if (!attempt->cv.wait_for(lock, bo.timeout + std::chrono::seconds(10),
                            [&] { return attempt->done; })) {
    // The blocked thread still uses the store client: keep it alive (its
    // connection also still stands for this rank) and go on with a new one.
    store_.release();
    store_.reset(new StoreClient(options_.store_addr, options_.store_port, options_.secret,
                                 StartupStoreWait(bo.timeout)));
    return "connecting to the other ranks did not finish within GLOO_TIMEOUT_SECONDS + 10 s "
           "(Gloo is stuck on a connection)";
  }
  transport_ = std::move(attempt->backend);
  return attempt->error;
}

// Gloo's TCP pairs take the first connection that reaches their listening
// port: a foreign connect-and-close there (a port scan, a health check)
// fails that pair on both of its ranks. Every rank votes in the store after
// connecting; if any failed, all drop what they made and connect again
// under fresh keys (three attempts), so a stray connection costs a retry,
// not the job. Throws when the last attempt fails.
void Runtime::ConnectTransport(TransportOptions* bo) {
  if (!store_) {
    transport_.reset(new GlooTransport(*bo, nullptr));
    return;
  }
  const std::string base = bo->key_prefix;
  const int kAttempts = 3;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    bo->key_prefix = attempt ? base + "/retry" + std::to_string(attempt) : base;
    std::string error = ConnectWithDeadline(*bo);
    const std::string votes = base + "/connected" + std::to_string(attempt) + "/";
    store_->set(votes + std::to_string(options_.rank), {error.empty() ? '1' : '0'});
    std::vector<int> failed;
    const auto deadline = Clock::now() + bo->timeout + std::chrono::seconds(30);
    for (int r = 0; r < options_.size; ++r) {
      std::vector<char> vote;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (!store_->TryGet(votes + std::to_string(r), std::max(left, std::chrono::milliseconds(0)),
                          &vote)) {
        throw std::runtime_error("rank " + std::to_string(r) +
                                 " did not finish connecting within GLOO_TIMEOUT_SECONDS + 30 s" +
                                 (error.empty() ? std::string() : " (here: " + error + ")"));
      }
      if (vote.empty() || vote[0] != '1') failed.push_back(r);
    }
    if (failed.empty()) return;
    transport_.reset();
    if (attempt + 1 == kAttempts) {
      throw std::runtime_error(
          (error.empty() ? RankList(failed) + " could not connect" : error) +
          " (after " + std::to_string(kAttempts) + " attempts)");
    }
    if (options_.rank == failed.front()) {
      std::fprintf(stderr,
                   "Perseus: connecting the ranks failed on %s (%s; a foreign "
                   "connection to a listening port?); connecting again (attempt %d of %d)\n",
                   RankList(failed).c_str(), error.empty() ? "see that rank" : error.c_str(),
                   attempt + 2, kAttempts);
    }
  }
}

Status Runtime::Init(const InitOptions& options) {
  if (state_.load() == State::kRunning) return Status::OK();
  if (background_.joinable()) Shutdown();
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
  TransportOptions bo;
  bo.rank = options.rank;
  bo.size = options.size;
  // One more stream than asked: it runs online work while a plan runs offline.
  bo.streams = options.streams + 1;
  bo.host_addr = options.host_addr;
  bo.iface = options.gloo_iface;
  bo.timeout = std::chrono::milliseconds(static_cast<int64_t>(options.timeout_seconds * 1000));
  // A process set connects its own contexts under its own keys.
  const std::string group =
      options.process_set_id ? "/ps" + std::to_string(options.process_set_id) : "";
  bo.key_prefix = options.job_id + group + "/gen" + std::to_string(generation_);
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
      // The world's connection stands for this process: when it closes,
      // the store marks the rank gone (see IdentifyFailedRanks).
      if (options.process_set_id == 0) {
        store_->Own(options.job_id + "/rank" + std::to_string(options.rank));
        Status called = RollCall(options, bo.key_prefix + "/rollcall", wait);
        if (!called.ok()) {
          store_.reset();
          return called;
        }
      }
    }
    ConnectTransport(&bo);
    shm_.reset();
    // Shared memory inside each host: for the whole allreduce when the job
    // is one host, for the host phases of the two-level one otherwise.
    if (options.shm && options.process_set_id == 0 && options.local_size > 1 &&
        (options.cross_size == 1 || transport_->hierarchical())) {
      std::string why_not;
      // Test hook: this rank dies while the others set up shared memory.
      if (const char* die = std::getenv("PERSEUS_TEST_EXIT_BEFORE_SHM")) {
        if (std::atoi(die) == options.rank) std::_Exit(7);
      }
      GlooTransport& world = *transport_;
      auto agree_min = [&world](int32_t value) {
        world.Allreduce(Transport::kControl, &value, 1, DataType::kInt32,
                        GetReduceFn(DataType::kInt32, ReduceOp::kMin));
        return value;
      };
      shm_ = ShmTransport::Connect(agree_min, options.rank, bo.key_prefix, options.local_rank,
                                   options.local_size, options.cross_rank, bo.streams,
                                   bo.timeout, &why_not);
      if (!shm_ && (options.rank == 0 || !why_not.empty())) {
        std::fprintf(stderr,
                     "Perseus rank %d: allreduce uses Gloo over TCP, not shared memory: %s "
                     "(PERSEUS_SHM_ALLREDUCE=0 turns shared memory off)\n",
                     options.rank,
                     why_not.empty() ? "another rank could not map the shared segments"
                                     : why_not.c_str());
      }
    }
  } catch (const std::exception& e) {
    shm_.reset();
    transport_.reset();
    store_.reset();
    return Status::Error(StatusCode::kUnavailable,
                         "Perseus could not connect rank " + std::to_string(options.rank) +
                             " of " + std::to_string(options.size) + ": " + e.what());
  }
  if (options.process_set_id == 0 && options.size > 1) StartHeartbeat();
  std::vector<int> world_ranks = options.global_ranks;
  negotiator_.reset(new Negotiator(options.size, options.fusion_threshold_bytes, world_ranks,
                                   [this](int64_t b) {
                                     return PlanBucketBytes(b, options_.fusion_granularity,
                                                            options_.fusion_threshold_bytes);
                                   }));
  joined_ = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.clear();
    pending_.clear();
    shutdown_requested_ = false;
    shutdown_by_.clear();
    failure_ = Status::OK();
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = Stats();
    stats_.streams.resize(options.streams + 1);
    stats_.hierarchical = transport_->hierarchical() && options.allreduce_mode != 0;
    stats_.shm = shm_ != nullptr;
  }
  topology_.one_host_shm = shm_ && options.cross_size == 1;
  topology_.two_level = transport_->hierarchical();
  topology_.mode = options.allreduce_mode;
  groups_.world = transport_.get();
  groups_.host = shm_ ? static_cast<GroupCollectives*>(shm_.get()) : transport_->host();
  groups_.leaders = transport_->leaders();
  {
    std::lock_guard<std::mutex> lock(sparse_mu_);
    sparse_.clear();
  }
  dispatched_ = 0;
  streams_.clear();
  for (int s = 0; s <= options.streams; ++s) streams_.emplace_back(new Stream());
  state_ = State::kRunning;
  last_cycle_ = started_ = Clock::now();
  plan_waiting_ = false;
  timeline_.Start(options.process_set_id == 0 ? options.timeline_path : std::string(),
                  WorldRank(options.rank), "rank " + std::to_string(WorldRank(options.rank)));
  last_step_done_ = Clock::time_point{};
  perf_sum_.clear();
  perf_steps_ = 0;
  offline_ = false;
  plan_ = Plan();
  plan_pos_ = 0;
  leave_vote_ = aborting_ = step_started_ = false;
  plan_in_flight_ = 0;
  test_swap_rank_ = -1;
  if (const char* swap = std::getenv("PERSEUS_TEST_PLAN_SWAP")) {
    long long step = 0;
    if (options.process_set_id == 0 && std::sscanf(swap, "%d:%lld", &test_swap_rank_, &step) == 2) {
      test_swap_step_ = step;
    } else {
      test_swap_rank_ = -1;
    }
  }
  for (int s = 0; s <= options.streams; ++s) {
    streams_[s]->thread = std::thread(&Runtime::StreamLoop, this, s);
  }
  background_ = std::thread(&Runtime::BackgroundLoop, this);
  return Status::OK();
}

void Runtime::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  queue_cv_.notify_all();
  if (background_.joinable()) background_.join();
  StopThreads();
  FailAllPending(Status::Error(StatusCode::kUnavailable,
                               "Perseus was shut down before this collective ran"));
  StopHeartbeat();
  shm_.reset();
  transport_.reset();
  store_.reset();
  std::string timeline_error;
  if (!timeline_.Write(&timeline_error)) std::fprintf(stderr, "Perseus: %s\n", timeline_error.c_str());
  if (state_.load() == State::kRunning) state_ = State::kShutdown;
  ++generation_;
}

void Runtime::StopThreads() {
  for (auto& s : streams_) {
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->stop = true;
    }
    s->cv.notify_all();
  }
  for (auto& s : streams_) {
    if (s->thread.joinable()) s->thread.join();
  }
}

Status Runtime::Enqueue(std::shared_ptr<Request> request) {
  return EnqueueGroup({std::move(request)});
}

Status Runtime::EnqueueGroup(const std::vector<std::shared_ptr<Request>>& requests) {
  if (requests.empty()) return Status::OK();
  for (const auto& q : requests) {
    Status s = Check(*q);
    if (!s.ok()) return s;
  }
  const auto now = Clock::now();
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < requests.size(); ++i) {
      const TensorMeta& m = requests[i]->meta;
      bool twice = pending_.count(m.name) > 0;
      for (size_t j = 0; j < i && !twice; ++j) twice = requests[j]->meta.name == m.name;
      if (twice) {
        return Status::Error(StatusCode::kInvalidArgument,
                             std::string("Perseus ") + OpTypeName(m.op) + " of tensor '" + m.name +
                                 "': a collective with this name is already in flight on rank " +
                                 std::to_string(options_.rank) +
                                 "; concurrent collectives need distinct names");
      }
      if (m.op == OpType::kJoin && joined_) {
        return Status::Error(StatusCode::kInvalidArgument,
                             "Perseus join: join() is already in progress on this rank");
      }
    }
    // All or nothing: the whole call is in pending_ before the background
    // thread can look at any of it, so a plan bucket never sees half a call.
    for (const auto& q : requests) {
      TensorMeta& m = q->meta;
      q->enqueued = now;
      if (m.op == OpType::kJoin) joined_ = true;
      pending_.emplace(m.name, q);
      if (offline_ && (m.flags & kMetaPlannable)) {
        // Runs from the plan; one that does not fit it votes to leave the
        // plan. The background thread is woken when this completes a
        // bucket (or votes).
        if (!FitsPlanLocked(m)) {
          leave_vote_ = wake = true;
        } else {
          size_t b = plan_.bucket_of.at(m.name);
          wake |= ++plan_have_[b] == plan_.buckets[b].names.size();
        }
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

Status Runtime::Check(Request& request) {
  State state = state_.load();
  if (state != State::kRunning) {
    std::lock_guard<std::mutex> lock(mu_);
    if (state == State::kFailed) return failure_;
    if (state == State::kShutdown) {
      return Status::Error(StatusCode::kUnavailable,
                           "Perseus has been shut down" +
                               (shutdown_by_.empty() ? std::string() : " (" + shutdown_by_ + ")") +
                               "; no collective can run after shutdown()");
    }
    return Status::Error(StatusCode::kFailedPrecondition,
                         "Perseus is not initialized: call perseus_tf.init() (or hvd.init()) first");
  }
  const TensorMeta& m = request.meta;
  const int size = options_.size;
  auto invalid = [&](const std::string& msg) {
    return Status::Error(StatusCode::kInvalidArgument,
                         std::string("Perseus ") + OpTypeName(m.op) + " of tensor '" + m.name +
                             "': " + msg);
  };
  if (m.name.empty()) return invalid("a collective needs a name");
  if (m.op == OpType::kAllreduce || m.op == OpType::kReducescatter) {
    if (GetReduceFn(m.dtype, m.reduce_op) == nullptr) {
      return invalid(std::string("reduction '") + ReduceOpName(m.reduce_op) +
                     "' is not defined for dtype " + DataTypeName(m.dtype) +
                     (m.dtype == DataType::kBool ? " (use min or max for bool)" : ""));
    }
    if (m.reduce_op == ReduceOp::kAverage && m.dtype == DataType::kBool) {
      return invalid("average is not defined for bool");
    }
    if (options_.nancheck && IsFloatingPoint(m.dtype) && request.input != nullptr &&
        HasNonFinite(request.input, m.dtype, static_cast<size_t>(NumElements(m.shape)))) {
      request.meta.flags |= kMetaNonFinite;  // every rank fails it (negotiation.cc)
    }
  }
  // Compression applies to float32 sums and averages; anything else travels
  // as it is.
  if (m.op != OpType::kAllreduce || m.dtype != DataType::kFloat32 ||
      (m.reduce_op != ReduceOp::kSum && m.reduce_op != ReduceOp::kAverage)) {
    request.meta.compression = 0;
  } else if (m.compression < kCompressNone || m.compression > kCompressDownsample) {
    return invalid("compression must be from 0 to 4 (none, float16, mixed, top-k, "
                   "downsample), got " + std::to_string(m.compression));
  } else if (m.compression == kCompressTopk) {
    if (NumElements(m.shape) * 4 < options_.topk_threshold_bytes) {
      request.meta.compression = options_.topk_fallback;  // too small to sparsify
    } else {
      // Its residual changes with every run, so it is never voted down and
      // re-run: top-k tensors are negotiated online, step by step.
      request.meta.flags &= ~kMetaPlannable;
    }
  } else if (m.compression == kCompressDownsample && options_.downsample_n <= 1) {
    request.meta.compression = kCompressNone;
  }
  if (m.op == OpType::kBroadcast && (m.root < 0 || m.root >= size)) {
    return invalid("root_rank " + std::to_string(m.root) + " is out of range: valid ranks are 0 to " +
                   std::to_string(size - 1));
  }
  if ((m.op == OpType::kAllgather || m.op == OpType::kAlltoall ||
       m.op == OpType::kReducescatter) && m.shape.empty()) {
    return invalid("needs a tensor with at least one dimension, got a scalar");
  }
  if (m.op == OpType::kAlltoall) {
    if (m.splits.empty()) {
      if (m.shape[0] % size != 0) {
        return invalid("first dimension " + std::to_string(m.shape[0]) +
                       " is not divisible by the number of ranks (" + std::to_string(size) +
                       "); pass splits");
      }
    } else {
      if (static_cast<int>(m.splits.size()) != size) {
        return invalid("splits has " + std::to_string(m.splits.size()) +
                       " entries; it needs one per rank (" + std::to_string(size) + ")");
      }
      int64_t sum = 0;
      for (int64_t s : m.splits) {
        if (s < 0) return invalid("splits must not be negative, got " + ShapeString(m.splits));
        sum += s;
      }
      if (sum != m.shape[0]) {
        return invalid("splits " + ShapeString(m.splits) + " sum to " + std::to_string(sum) +
                       " but the first dimension is " + std::to_string(m.shape[0]));
      }
    }
  }
  return Status::OK();
}

void Runtime::BackgroundLoop() {
  bool stop = false;
  while (!stop) {
    if (state_.load() != State::kRunning) return;
    try {
      if (offline_) {
        RunOffline(&stop);
      } else {
        RunCycle(&stop);
      }
    } catch (const std::exception& e) {
      Fail(std::string("negotiation failed: ") + e.what());
      return;
    }
  }
  // Every rank saw the same shutdown flag in the same cycle: drain and stop.
  StopThreads();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() == State::kRunning) state_ = State::kShutdown;
  }
  FailAllPending(Status::Error(StatusCode::kUnavailable,
                               "Perseus was shut down (" + shutdown_by_ +
                                   ") before this collective ran on every rank"));
}

void Runtime::RunCycle(bool* stop) {
  const auto cycle_time = std::chrono::microseconds(
      static_cast<int64_t>(options_.cycle_time_ms * 1000));
  CycleMessage mine;
  bool in_plan = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto max_wait = negotiator_->HasPending() || idle_cycles_ == 0
                        ? std::chrono::duration_cast<Clock::duration>(cycle_time)
                        : std::chrono::duration_cast<Clock::duration>(kIdleWait);
    queue_cv_.wait_until(lock, last_cycle_ + max_wait,
                         [&] { return !queue_.empty() || shutdown_requested_; });
    if (!queue_.empty()) {
      // Cycles are at least one cycle time apart, so requests that arrive
      // together (a backward pass) travel, and fuse, in few cycles; a
      // request after a quiet spell goes at once.
      auto send_at = last_cycle_ + cycle_time;
      if (Clock::now() < send_at) {
        lock.unlock();
        std::this_thread::sleep_until(send_at);
        lock.lock();
      }
    }
    mine.requests.assign(queue_.begin(), queue_.end());
    queue_.clear();
    mine.shutdown = shutdown_requested_;
    in_plan = offline_;
  }
  last_cycle_ = Clock::now();
  const int64_t my_clock =
      std::chrono::duration_cast<std::chrono::milliseconds>(last_cycle_ - started_).count();

  const int size = options_.size;
  std::vector<CycleMessage> all(size);
  int64_t sent = 0;
  const auto exchange_start = Clock::now();
  const size_t my_requests = mine.requests.size();
  bool any_in_plan = in_plan;
  int64_t clock = my_clock;
  if (size == 1) {
    all[0] = std::move(mine);
  } else {
    // One allgather of a fixed slot per rank carries a header (the message
    // length: 0 = nothing, -1 = only shutdown; this rank's clock, of which
    // rank 0's is the negotiation clock; whether this rank runs an offline
    // plan) and as much of the message as fits, which is the whole message
    // in most cycles; a second allgather moves the rest of longer messages.
    std::vector<char> encoded;
    int64_t len = 0;
    if (!mine.requests.empty()) {
      encoded = EncodeCycle(mine);
      len = static_cast<int64_t>(encoded.size());
    } else if (mine.shutdown) {
      len = -1;
    }
    constexpr size_t kHeader = 3 * sizeof(int64_t);
    constexpr size_t kInline = kControlSlot - kHeader;
    std::vector<char> slot(kControlSlot, 0);
    const int64_t header[3] = {len, my_clock, in_plan ? 1 : 0};
    std::memcpy(slot.data(), header, kHeader);
    const size_t head = std::min(encoded.size(), kInline);
    if (head) std::memcpy(slot.data() + kHeader, encoded.data(), head);
    std::vector<char> slots(kControlSlot * size);
    transport_->Allgatherv(Transport::kControl, slot.data(), slots.data(),
                         std::vector<size_t>(size, kControlSlot));
    sent += kControlSlot;
    std::vector<int64_t> lens(size);
    std::vector<size_t> rest(size, 0);
    size_t total_rest = 0;
    for (int r = 0; r < size; ++r) {
      int64_t h[3];
      std::memcpy(h, slots.data() + r * kControlSlot, kHeader);
      lens[r] = h[0];
      if (r == 0) clock = h[1];
      any_in_plan |= h[2] != 0;
      if (lens[r] > static_cast<int64_t>(kInline)) rest[r] = lens[r] - kInline;
      total_rest += rest[r];
    }
    std::vector<char> gathered(total_rest);
    if (total_rest > 0) {
      char none = 0;
      const char* tail = encoded.size() > kInline ? encoded.data() + kInline : &none;
      transport_->Allgatherv(Transport::kControl, tail, gathered.data(), rest);
      sent += static_cast<int64_t>(rest[options_.rank]);
    }
    size_t offset = 0;
    std::vector<char> message;
    for (int r = 0; r < size; ++r) {
      if (lens[r] > 0) {
        const char* inline_part = slots.data() + r * kControlSlot + kHeader;
        message.assign(inline_part, inline_part + std::min<size_t>(lens[r], kInline));
        message.insert(message.end(), gathered.data() + offset, gathered.data() + offset + rest[r]);
        all[r] = DecodeCycle(message.data(), message.size());
      } else {
        all[r].shutdown = lens[r] < 0;
      }
      offset += rest[r];
    }
  }

  if (timeline_.enabled() && (my_requests > 0 || size == 1)) {
    timeline_.Record(0, "negotiate", "negotiation", exchange_start, Clock::now(),
                     "\"requests\": " + std::to_string(my_requests) +
                         ", \"control_bytes\": " + std::to_string(sent));
  }
  negotiator_->BeginCycle(clock, any_in_plan);
  bool any_requests = false;
  for (int r = 0; r < size; ++r) {
    for (const TensorMeta& m : all[r].requests) {
      negotiator_->Add(r, m);
      any_requests = true;
    }
    if (all[r].shutdown && !*stop) {
      *stop = true;
      std::lock_guard<std::mutex> lock(mu_);
      shutdown_by_ = "rank " + std::to_string(r) + " called shutdown";
    }
  }
  // The next cycle's clock starts when this one ends, which is the same
  // moment on every rank: idle ranks then tick together instead of one rank
  // always waiting inside the control allgather for a later-phased peer (and
  // holding back the requests that arrive meanwhile).
  last_cycle_ = Clock::now();
  std::vector<Response> ready = negotiator_->TakeReady();
  // The stall inspector and the stall timeout read rank 0's clock, which
  // every rank received in this cycle, so their verdicts agree everywhere.
  const std::vector<std::string> stalls =
      negotiator_->StallReport(static_cast<int64_t>(options_.stall_check_seconds * 1000));
  if (!stalls.empty() && WorldRank(options_.rank) == 0) {
    std::ostringstream msg;
    msg << "Perseus stall inspector (rank 0): " << stalls.size()
        << (stalls.size() == 1 ? " collective has" : " collectives have")
        << " waited more than " << options_.stall_check_seconds
        << " s (PERSEUS_STALL_CHECK_TIME_SECONDS) for ranks that have not submitted them";
    if (options_.stall_timeout_seconds > 0) {
      msg << "; the job fails after PERSEUS_STALL_TIMEOUT_SECONDS="
          << options_.stall_timeout_seconds << " s";
    }
    msg << ":\n";
    for (size_t i = 0; i < stalls.size() && i < 20; ++i) msg << "  " << stalls[i] << "\n";
    if (stalls.size() > 20) msg << "  ... and " << stalls.size() - 20 << " more\n";
    std::fputs(msg.str().c_str(), stderr);
    std::fflush(stderr);
  }
  for (Response& r : negotiator_->TakeStalled(
           static_cast<int64_t>(options_.stall_timeout_seconds * 1000))) {
    ready.push_back(std::move(r));
  }
  idle_cycles_ = (any_requests || !ready.empty()) ? 0 : idle_cycles_ + 1;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    ++stats_.cycles;
    stats_.control_bytes_sent += sent;
    stats_.responses += static_cast<int64_t>(ready.size());
    for (const Response& r : ready) {
      if (r.names.size() > 1) ++stats_.fused_responses;
    }
  }
  const bool lone = ready.size() == 1;
  for (Response& r : ready) Dispatch(std::move(r), lone, any_in_plan);
  if (!offline_ && !*stop && negotiator_->PlanReady()) EnterOffline();
}

// ---- Offline plans -------------------------------------------------------
//
// Online negotiation watches plannable allreduces (a training step's
// gradients, sums or averages). Once a step has repeated with the same names
// and metas and a cycle ends exactly between two steps, every rank (deciding
// identically) takes the plan and stops sending control messages for those
// tensors: each rank runs the plan's buckets in order as soon as their
// tensors are pending locally. Other collectives still negotiate online, on
// demand (no idle cycles while a plan runs), on the extra stream.
//
// Leaving is agreed in-band. Every plan bucket carries one extra element,
// this rank's vote, summed with the data. A rank votes 1 when its data does
// not fit the plan: a plannable request whose name, meta or grouped call
// differs, or that arrives for a bucket already run this step, or when it
// is shutting down. A voting rank runs the rest of the step's buckets at once
// with zeros for what it lacks; a bucket with votes is delivered nowhere (its
// requests go back to pending), and once the step's buckets are done every
// rank leaves the plan and sends its pending requests online, where a real
// mismatch is reported by name and a changed step is learned again. Every
// rank runs every bucket of the step exactly once, so no rank waits forever.

void Runtime::EnterOffline() {
  std::lock_guard<std::mutex> lock(mu_);
  plan_ = negotiator_->TakePlan();
  plan_pos_ = 0;
  plan_in_flight_ = 0;
  plan_steps_ = 0;
  plan_checked_ = -1;
  leave_vote_ = aborting_ = step_started_ = false;
  // Plannable requests not yet sent run from the plan instead.
  std::deque<TensorMeta> keep;
  for (TensorMeta& m : queue_) {
    if (!(m.flags & kMetaPlannable)) {
      keep.push_back(std::move(m));
    } else if (!FitsPlanLocked(m)) {
      leave_vote_ = true;
    }
  }
  queue_.swap(keep);
  plan_have_.assign(plan_.buckets.size(), 0);
  for (const auto& kv : pending_) {
    if ((kv.second->meta.flags & kMetaPlannable) && FitsPlanLocked(kv.second->meta)) {
      ++plan_have_[plan_.bucket_of.at(kv.first)];
    }
  }
  offline_ = true;
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  ++stats_.plans;
}

void Runtime::LeaveOfflineLocked() {
  offline_ = false;
  leave_vote_ = aborting_ = step_started_ = false;
  // Pending plannable requests were never sent: negotiate them now.
  std::vector<const TensorMeta*> resend;
  for (const auto& kv : pending_) {
    if (kv.second->meta.flags & kMetaPlannable) resend.push_back(&kv.second->meta);
  }
  std::sort(resend.begin(), resend.end(),
            [](const TensorMeta* a, const TensorMeta* b) { return a->name < b->name; });
  for (const TensorMeta* m : resend) queue_.push_back(*m);
  // The negotiator restarts learning by itself once every rank reports,
  // in a cycle, that it has left (Negotiator::BeginCycle).
  last_cycle_ = Clock::now() - std::chrono::hours(1);  // next cycle at once
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  ++stats_.plan_exits;
}

std::chrono::milliseconds Runtime::PlanDeadline() const {
  // Well inside GLOO_TIMEOUT_SECONDS: a rank that had its data entered the
  // bucket's collective and waits there for this rank's vote.
  const double seconds = std::min(10.0, std::max(0.5, options_.timeout_seconds / 4));
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

void Runtime::ReportPlanTimeoutLocked(Clock::time_point oldest) {
  const Response& b = plan_.buckets[plan_pos_];
  std::vector<std::string> missing;
  for (const std::string& name : b.names) {
    if (!pending_.count(name)) missing.push_back(name);
  }
  std::ostringstream msg;
  msg << "Perseus rank " << WorldRank(options_.rank) << ": offline plan bucket " << plan_pos_
      << " of " << plan_.buckets.size() << " (plan step " << plan_steps_ << ") has waited "
      << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - oldest).count() /
             1000.0
      << " s for ";
  for (size_t i = 0; i < missing.size() && i < 3; ++i) msg << (i ? ", '" : "'") << missing[i] << "'";
  if (missing.size() > 3) msg << " and " << missing.size() - 3 << " more";
  msg << (missing.empty() ? "an earlier bucket" : "") << ", which this rank has not submitted, "
      << "while later gradients wait: this step's calls do not come in the plan's order. "
         "Leaving the plan; online negotiation takes over and learns the step again.\n";
  std::fputs(msg.str().c_str(), stderr);
  std::fflush(stderr);
  std::lock_guard<std::mutex> stats_lock(stats_mu_);
  ++stats_.plan_timeouts;
}

bool Runtime::FitsPlanLocked(const TensorMeta& m) const {
  auto it = plan_.metas.find(m.name);
  if (it == plan_.metas.end() || !MatchesPlan(m, it->second)) return false;
  // A name of a bucket already run this step means the step changed.
  return !(step_started_ && plan_.bucket_of.at(m.name) < plan_pos_);
}

bool Runtime::PlanBucketReadyLocked() const {
  // plan_have_ counts the bucket's fitting requests pending on this rank.
  return plan_have_[plan_pos_] == plan_.buckets[plan_pos_].names.size();
}

bool Runtime::CanDispatchPlanLocked() const {
  if (plan_.buckets.empty()) return false;
  const bool voting = leave_vote_ || aborting_ || shutdown_requested_;
  if (step_started_) return voting || PlanBucketReadyLocked();
  // A new step starts with real data, or with a vote once the previous
  // step's buckets are all finished (then it is the step that leaves).
  if (voting) return plan_in_flight_ == 0 && !aborting_;
  return PlanBucketReadyLocked();
}

bool Runtime::PlanCheckDueLocked() const {
  const int64_t n = options_.plan_check_n_steps;
  return n > 0 && !step_started_ && plan_steps_ % n == 0 && plan_checked_ != plan_steps_;
}

bool Runtime::PlanBucketFinished(int64_t votes,
                                 const std::vector<std::shared_ptr<Request>>& requests,
                                 int plan_index) {
  bool deliver = votes == 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    --plan_in_flight_;
    if (plan_index + 1 == static_cast<int>(plan_.buckets.size())) last_step_done_ = Clock::now();
    if (!deliver) {
      aborting_ = true;
      for (auto& q : requests) {
        if (q->scratch.empty()) pending_.emplace(q->meta.name, q);  // real ones only
      }
    }
  }
  queue_cv_.notify_all();
  return deliver;
}

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

// ---- Plan check (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS) ------------------------
//
// The votes catch a rank whose requests do not fit its plan; they cannot
// catch ranks whose plans differ (the same tensors packed in another order
// or other buckets would be summed with the wrong elements, silently). So
// when a plan is entered, and then every N plan steps, every rank compares
// a digest of its copy of the plan before the step's first bucket: one
// allreduce of four integers. On a difference, two more find the first
// position where the plans differ and gather each rank's tensor there, and
// every rank fails naming them.

namespace {
template <typename T>
uint64_t FnvValue(uint64_t h, const T& v) {
  return Fnv1a(&v, sizeof(v), h);
}
constexpr size_t kPlanCheckText = 240;  // bytes per rank describing its tensor
}  // namespace

std::shared_ptr<PlanDigest> Runtime::DigestPlanLocked(int64_t step) const {
  auto digest = std::make_shared<PlanDigest>();
  digest->step = step;
  std::vector<int64_t>& digests = digest->digests;
  std::vector<std::string>& described = digest->described;
  // One digest per position of the plan (bucket by bucket, in order): the
  // tensor's name and everything MatchesPlan compares, and its bucket.
  for (size_t b = 0; b < plan_.buckets.size(); ++b) {
    const Response& r = plan_.buckets[b];
    for (size_t i = 0; i < r.names.size(); ++i) {
      const TensorMeta& m = r.metas[i];
      uint64_t h = Fnv1a(r.names[i].data(), r.names[i].size());
      h = FnvValue(h, b);
      h = FnvValue(h, static_cast<int32_t>(m.op));
      h = FnvValue(h, static_cast<int32_t>(m.dtype));
      h = FnvValue(h, static_cast<int32_t>(m.reduce_op));
      h = FnvValue(h, m.group);
      h = FnvValue(h, m.compression);
      h = FnvValue(h, m.prescale);
      h = FnvValue(h, m.postscale);
      for (int64_t d : m.shape) h = FnvValue(h, d);
      digests.push_back(static_cast<int64_t>((h >> 2) | 1));  // in [1, 2^62): negation is safe
      described.push_back("'" + r.names[i] + "' (" + DataTypeName(m.dtype) + " " +
                          ShapeString(m.shape) + ") in bucket " + std::to_string(b));
    }
  }
  return digest;
}

void Runtime::CheckPlan(const PlanDigest& plan) {
  TimelineSpan span(timeline_, 1, "plan check", "negotiation");
  const int64_t step = plan.step;
  const std::vector<int64_t>& digests = plan.digests;
  const std::vector<std::string>& described = plan.described;
  const uint64_t whole = Fnv1a(digests.data(), digests.size() * sizeof(int64_t));
  const int64_t all = static_cast<int64_t>((whole >> 2) | 1);
  const int64_t count = static_cast<int64_t>(digests.size());
  ReduceFn min64 = GetReduceFn(DataType::kInt64, ReduceOp::kMin);
  // Minimum of x and of -x: the smallest and (negated) largest value.
  std::vector<int64_t> head{all, -all, count, -count};
  AllreduceBuffer(0, head.data(), head.size(), DataType::kInt64, min64);
  if (head[0] == -head[1] && head[2] == -head[3]) {
    std::lock_guard<std::mutex> stats_lock(stats_mu_);
    ++stats_.plan_checks;
    return;
  }

  const int64_t longest = -head[3];
  std::vector<int64_t> at(2 * static_cast<size_t>(longest), 0);
  for (int64_t i = 0; i < longest; ++i) {
    const int64_t d = i < count ? digests[i] : 0;  // 0: no tensor at this position
    at[i] = d;
    at[longest + i] = -d;
  }
  AllreduceBuffer(0, at.data(), at.size(), DataType::kInt64, min64);
  int64_t pos = -1;
  for (int64_t i = 0; i < longest && pos < 0; ++i) {
    if (at[i] != -at[longest + i]) pos = i;
  }
  // Each rank's description of its tensor at that position, in its own slot
  // (the others are zero, so the sum is the text).
  std::vector<uint8_t> text(kPlanCheckText * options_.size, 0);
  std::string mine = pos < 0 ? "a plan of " + std::to_string(count) + " tensors"
                     : pos < count ? described[pos]
                                   : "no tensor (its plan has " + std::to_string(count) + ")";
  mine.resize(std::min(mine.size(), kPlanCheckText - 1));
  std::memcpy(text.data() + kPlanCheckText * options_.rank, mine.data(), mine.size());
  AllreduceBuffer(0, text.data(), text.size(), DataType::kUint8,
                  GetReduceFn(DataType::kUint8, ReduceOp::kSum));
  // Ranks grouped by what they hold, in order of first appearance.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (int r = 0; r < options_.size; ++r) {
    const char* t = reinterpret_cast<const char*>(text.data() + kPlanCheckText * r);
    std::string what(t, strnlen(t, kPlanCheckText));
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == what; });
    if (it == groups.end()) {
      groups.push_back({what, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(WorldRank(r));
  }
  std::ostringstream msg;
  msg << "offline plan check before plan step " << step
      << " (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS=" << options_.plan_check_n_steps
      << "): the ranks hold different plans";
  if (pos >= 0) msg << "; at position " << pos << " (bucket order)";
  msg << ": ";
  for (size_t g = 0; g < groups.size(); ++g) {
    msg << (g ? "; " : "") << RankList(groups[g].second)
        << (groups[g].second.size() == 1 ? " has " : " have ") << groups[g].first;
  }
  msg << ". Their gradients would be summed with another tensor's elements";
  throw std::runtime_error(msg.str());
}

void Runtime::RunOffline(bool* stop) {
  std::vector<std::pair<size_t, Response>> buckets;
  std::vector<std::vector<std::shared_ptr<Request>>> work;
  bool online = false;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto done_leaving = [&] { return aborting_ && !step_started_ && plan_in_flight_ == 0; };
    auto runnable = [&] {
      return state_.load() != State::kRunning || !queue_.empty() ||
             negotiator_->HasPending() || CanDispatchPlanLocked() || done_leaving();
    };
    while (!runnable()) {
      // Plannable requests waiting here for the plan (their bucket, or an
      // earlier one, lacks tensors this rank has not submitted) wait at
      // most PlanDeadline(); then this rank votes to leave the plan.
      Clock::time_point oldest = Clock::time_point::max();
      for (const auto& kv : pending_) {
        if (kv.second->meta.flags & kMetaPlannable) oldest = std::min(oldest, kv.second->enqueued);
      }
      if (oldest == Clock::time_point::max()) {
        plan_waiting_ = false;  // between steps: nothing of ours is waiting
        queue_cv_.wait_for(lock, std::chrono::seconds(1));
        continue;
      }
      plan_waiting_ = true;
      const auto deadline = oldest + PlanDeadline();
      if (Clock::now() >= deadline) {
        ReportPlanTimeoutLocked(oldest);
        leave_vote_ = true;
        break;
      }
      queue_cv_.wait_until(lock, deadline);
    }
    plan_waiting_ = false;
    if (state_.load() != State::kRunning) return;
    if (CanDispatchPlanLocked() && PlanCheckDueLocked()) {
      // Every rank checks before dispatching the same plan step, on the
      // first stream, after the work already queued there, so the check's
      // collectives line up with the buckets on every rank. It runs on the
      // stream's thread: this thread must stay free to negotiate online.
      Response check;
      check.op = OpType::kAllreduce;
      check.names.push_back("perseus.plan_check");
      check.plan_check = DigestPlanLocked(plan_steps_);
      plan_checked_ = plan_steps_;
      buckets.emplace_back(0, std::move(check));
      work.emplace_back();
    }
    while (CanDispatchPlanLocked()) {
      if (PlanCheckDueLocked()) break;  // this step is checked first (next pass)
      if (plan_pos_ == 0 && WorldRank(options_.rank) == test_swap_rank_ &&
          plan_steps_ == test_swap_step_) {
        // Test fault: two same-shaped tensors of one bucket trade places in
        // this rank's copy of the plan (its requests still fit it).
        for (Response& b : plan_.buckets) {
          size_t i = 0, j = 1;
          while (j < b.names.size() && !(b.metas[j].shape == b.metas[i].shape &&
                                         b.metas[j].dtype == b.metas[i].dtype)) {
            ++j;
          }
          if (j < b.names.size()) {
            std::swap(b.names[i], b.names[j]);
            std::swap(b.metas[i], b.metas[j]);
            break;
          }
        }
      }
      Response r = plan_.buckets[plan_pos_];
      std::vector<std::shared_ptr<Request>> requests;
      bool stand_in = false;
      for (size_t i = 0; i < r.names.size(); ++i) {
        auto it = pending_.find(r.names[i]);
        if (it != pending_.end() && MatchesPlan(it->second->meta, r.metas[i])) {
          requests.push_back(it->second);
          pending_.erase(it);
        } else {
          requests.push_back(StandIn(r, i));  // zeros; this bucket is voted down
          stand_in = true;
        }
      }
      plan_have_[plan_pos_] = 0;
      const bool vote = stand_in || leave_vote_ || aborting_ || shutdown_requested_;
      r.carrier_vote = vote ? 1 : 0;
      r.plan_index = static_cast<int>(plan_pos_);
      if (plan_pos_ == 0 && options_.perf_check_n_steps > 0) {
        // This rank's time outside communication since its last step ended.
        r.perf_slots = options_.size;
        if (last_step_done_ != Clock::time_point{}) {
          r.perf_value =
              std::chrono::duration<double, std::milli>(Clock::now() - last_step_done_).count();
        }
      }
      // The bucket reports its outcome; the plan decides here what it means.
      r.on_outcome = [this, held = requests, index = r.plan_index](const BucketOutcome& o) {
        if (!o.perf_ms.empty()) PerfCheckStep(o.perf_ms);
        return PlanBucketFinished(o.votes, held, index);
      };
      buckets.emplace_back(plan_pos_, std::move(r));
      work.push_back(std::move(requests));
      ++plan_in_flight_;
      step_started_ = true;
      plan_pos_ = (plan_pos_ + 1) % plan_.buckets.size();
      std::lock_guard<std::mutex> stats_lock(stats_mu_);
      ++stats_.responses;
      if (buckets.back().second.names.size() > 1) ++stats_.fused_responses;
      if (plan_pos_ == 0) {
        step_started_ = false;
        ++plan_steps_;
        if (!vote) ++stats_.offline_steps;
      }
    }
    if (buckets.empty() && done_leaving()) {
      LeaveOfflineLocked();
      return;
    }
    online = !queue_.empty() || negotiator_->HasPending();
  }
  // Plan buckets always run on their streams' threads, never on this one: a
  // rank whose negotiation thread sat in a bucket's collective could not
  // join the online cycle another rank waits in before its own bucket.
  const int plan_streams = options_.streams;
  for (size_t i = 0; i < buckets.size(); ++i) {
    DispatchTo(static_cast<int>(buckets[i].first % plan_streams), std::move(buckets[i].second),
               std::move(work[i]));
  }
  if (online) RunCycle(stop);
}

void Runtime::Dispatch(Response response, bool lone, bool any_in_plan) {
  std::vector<std::shared_ptr<Request>> requests;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < response.names.size(); ++i) {
      auto it = pending_.find(response.names[i]);
      if (it == pending_.end()) {
        // Only a joined rank is missing names: it takes part with no data.
        if (response.error.ok()) requests.push_back(StandIn(response, i));
        continue;
      }
      requests.push_back(it->second);
      pending_.erase(it);
    }
    if (response.op == OpType::kJoin) joined_ = false;
  }
  if (response.op == OpType::kJoin) {
    for (auto& q : requests) q->result = response.metas[0].root;
  }
  if (!response.error.ok() || response.op == OpType::kBarrier || response.op == OpType::kJoin) {
    for (auto& q : requests) q->done(response.error);
    return;
  }
  // Online work uses the first `streams` streams in turn; while any rank
  // runs a plan, it goes to the extra stream so that the two orders never
  // mix. Every rank decides from what the cycle told all of them (not from
  // its own plan state: ranks leave a plan at their own pace), so each
  // collective runs on the same stream everywhere.
  int stream = any_in_plan
                   ? options_.streams
                   : static_cast<int>(dispatched_++ % static_cast<uint64_t>(options_.streams));
  if (lone && RunHereIfIdle(stream, response, requests)) return;
  DispatchTo(stream, std::move(response), std::move(requests));
}

bool Runtime::RunHereIfIdle(int stream, Response& response,
                            std::vector<std::shared_ptr<Request>>& requests) {
  // Saves a thread hand-off. The stream's order is unchanged: nothing else
  // can be dispatched to it while this thread is busy.
  Stream& s = *streams_[stream];
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.queue.empty() || s.busy) return false;
    s.busy = true;
  }
  RunOnStream(stream, response, requests);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.busy = false;
  }
  s.cv.notify_one();
  return true;
}

void Runtime::DispatchTo(int stream, Response response,
                         std::vector<std::shared_ptr<Request>> requests) {
  Stream& s = *streams_[stream];
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.queue.push_back(std::move(response));
    s.work.push_back(std::move(requests));
  }
  s.cv.notify_one();
}

std::shared_ptr<Request> Runtime::StandIn(const Response& response, size_t index) {
  auto q = std::make_shared<Request>();
  q->meta = response.metas[index];
  q->done = [](const Status&) {};
  const size_t esize = DataTypeSize(q->meta.dtype);
  switch (response.op) {
    case OpType::kAllgather:
      // No rows from this rank; the gathered result is discarded.
      if (!q->meta.shape.empty()) q->meta.shape[0] = 0;
      q->allocate = [q](const std::vector<int64_t>& shape) -> void* {
        q->scratch.resize(std::max<size_t>(1, NumElements(shape) * DataTypeSize(q->meta.dtype)));
        return q->scratch.data();
      };
      break;
    default: {
      // Zeros in (neutral for a sum, the only reduction a joined rank
      // should meet), result discarded.
      q->scratch.assign(std::max<size_t>(1, NumElements(q->meta.shape) * esize), 0);
      q->input = q->output = q->scratch.data();
      q->allocate = [q](const std::vector<int64_t>& shape) -> void* {
        size_t need = NumElements(shape) * DataTypeSize(q->meta.dtype);
        if (need > q->scratch.size()) q->scratch.resize(need);
        return q->scratch.data();
      };
    }
  }
  return q;
}

void Runtime::StreamLoop(int index) {
  Stream& s = *streams_[index];
  while (true) {
    Response response;
    std::vector<std::shared_ptr<Request>> requests;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      s.cv.wait(lock, [&] { return (!s.queue.empty() && !s.busy) || s.stop; });
      if (s.queue.empty()) return;
      response = std::move(s.queue.front());
      s.queue.pop_front();
      requests = std::move(s.work.front());
      s.work.pop_front();
      s.busy = true;
    }
    RunOnStream(index, response, requests);
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.busy = false;
    }
    s.cv.notify_all();  // the background thread may wait for this stream to be idle
  }
}

void Runtime::RunOnStream(int index, Response& response,
                          std::vector<std::shared_ptr<Request>>& requests) {
  if (state_.load() == State::kFailed) {
    Status failure;
    {
      std::lock_guard<std::mutex> lock(mu_);
      failure = failure_;
    }
    for (auto& q : requests) q->done(failure);
    return;
  }
  auto start = Clock::now();
  Clock::time_point oldest = start;
  for (auto& q : requests) {
    if (q->enqueued != Clock::time_point{} && q->enqueued < oldest) oldest = q->enqueued;
  }
  std::string span_args;
  if (timeline_.enabled()) {
    int64_t bytes = 0;
    for (const TensorMeta& m : response.metas) {
      bytes += NumElements(m.shape) * static_cast<int64_t>(DataTypeSize(m.dtype));
    }
    span_args = "\"tensors\": " + std::to_string(response.names.size()) +
                ", \"bytes\": " + std::to_string(bytes) + ", \"first\": \"" +
                JsonEscape(response.names[0]) + "\", \"plan\": " +
                (response.carrier_vote >= 0 ? "true" : "false");
  }
  Status status;
  bool complete = true;
  try {
    complete = Execute(index, response, requests);
  } catch (const std::exception& e) {
    Fail(response.plan_check ? std::string(e.what())
                             : std::string("stream ") + std::to_string(index) + " " +
                                   OpTypeName(response.op) + " of '" + response.names[0] +
                                   "' failed: " + e.what());
    std::lock_guard<std::mutex> lock(mu_);
    status = failure_;
  }
  const auto end = Clock::now();
  // Recorded before the requests complete, so a caller that stops the
  // timeline right after its collective returns finds it there.
  timeline_.Record(1 + index, OpTypeName(response.op), "bucket", start, end, span_args);
  double secs = std::chrono::duration<double>(end - start).count();
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    StreamStats& st = stats_.streams[index];
    ++st.responses;
    st.tensors += static_cast<int64_t>(response.names.size());
    for (const TensorMeta& m : response.metas) {
      st.bytes += PayloadBytes(m);
    }
    st.busy_seconds += secs;
    st.wait_seconds += std::chrono::duration<double>(start - oldest).count();
  }
  if (complete) {
    for (auto& q : requests) q->done(status);
  }
}

bool Runtime::Execute(int stream, const Response& r,
                      std::vector<std::shared_ptr<Request>>& requests) {
  if (r.plan_check) {
    CheckPlan(*r.plan_check);
    return true;
  }
  if (requests.size() != r.names.size()) {
    throw std::runtime_error("internal error: response and local requests disagree");
  }
  switch (r.op) {
    case OpType::kAllreduce:
      return ExecuteAllreduce(stream, r, requests);
    case OpType::kBroadcast: {
      Request& q = *requests[0];
      size_t bytes = NumElements(q.meta.shape) * DataTypeSize(q.meta.dtype);
      if (options_.rank == q.meta.root && q.output != q.input && bytes) {
        std::memcpy(q.output, q.input, bytes);
      }
      transport_->Broadcast(stream, q.output, bytes, q.meta.root);
      break;
    }
    case OpType::kAllgather:
      ExecuteAllgather(stream, r, *requests[0]);
      break;
    case OpType::kAlltoall:
      ExecuteAlltoall(stream, r, *requests[0]);
      break;
    case OpType::kReducescatter:
      ExecuteReducescatter(stream, r, *requests[0]);
      break;
    case OpType::kBarrier:
    case OpType::kJoin:
      break;
  }
  return true;
}

namespace {
// Delivers a bucket's results unless the plan that dispatched it says not to.
bool Deliver(const Response& r, const BucketOutcome& outcome) {
  return !r.on_outcome || r.on_outcome(outcome);
}
}  // namespace

bool Runtime::ExecuteAllreduce(int stream, const Response& r,
                               std::vector<std::shared_ptr<Request>>& requests) {
  const TensorMeta& m0 = r.metas[0];
  if (m0.compression == kCompressFp16) return ExecuteCompressedAllreduce(stream, r, requests);
  if (m0.compression == kCompressTopk) return ExecuteTopk(stream, r, *requests[0]);
  const DataType dtype = m0.dtype;
  const size_t esize = DataTypeSize(dtype);
  ReduceFn fn = GetReduceFn(dtype, m0.reduce_op);
  const double post =
      m0.postscale * (m0.reduce_op == ReduceOp::kAverage ? 1.0 / options_.size : 1.0);
  const bool carrier = r.carrier_vote >= 0;
  const bool mixed = m0.compression == kCompressMixed;
  const bool down = m0.compression == kCompressDownsample;
  if (requests.size() == 1 && !carrier && !down) {
    Request& q = *requests[0];
    size_t n = static_cast<size_t>(NumElements(q.meta.shape));
    if (q.output != q.input && n) std::memcpy(q.output, q.input, n * esize);
    ScaleBuffer(q.output, dtype, n, m0.prescale);
    AllreduceBuffer(stream, q.output, n, dtype, fn, mixed ? n : 0);
    ScaleBuffer(q.output, dtype, n, post);
    return true;
  }
  // Fused bucket: pack, reduce once, unpack. Downsampling packs only this
  // step's elements of each tensor (every N-th, from a rotating phase), with
  // the residual of the steps that did not send them.
  const size_t N = down ? static_cast<size_t>(options_.downsample_n) : 1;
  const float momentum = static_cast<float>(options_.gradient_momentum);
  std::vector<SparseState*> states;
  std::vector<size_t> phases;
  auto sent_count = [N](size_t n, size_t phase) { return n > phase ? (n - phase + N - 1) / N : 0; };
  size_t total = 0;
  for (auto& q : requests) {
    size_t n = static_cast<size_t>(NumElements(q->meta.shape));
    if (down) {
      states.push_back(&SparseFor(q->meta));
      phases.push_back(static_cast<size_t>(states.back()->steps % static_cast<int64_t>(N)));
      n = sent_count(n, phases.back());
    }
    total += n;
  }
  std::vector<char>& buf = streams_[stream]->fusion_buffer;
  const size_t slots = total + ExtraSlots(r);
  if (buf.size() < slots * esize) buf.resize(slots * esize);
  size_t offset = 0;
  {
    TimelineSpan pack(timeline_, 1 + stream, down ? "downsample pack" : "pack", "memory");
    for (size_t i = 0; i < requests.size(); ++i) {
      auto& q = requests[i];
      size_t n = static_cast<size_t>(NumElements(q->meta.shape));
      if (down) {
        const float* in = static_cast<const float*>(q->input);
        const float* res = states[i]->residual.data();
        float* out = reinterpret_cast<float*>(buf.data()) + offset / esize;
        const float pre = static_cast<float>(m0.prescale);
        size_t j = 0;
        for (size_t e = phases[i]; e < n; e += N) out[j++] = in[e] * pre + momentum * res[e];
        offset += j * esize;
        continue;
      }
      size_t bytes = n * esize;
      if (bytes) std::memcpy(buf.data() + offset, q->input, bytes);
      offset += bytes;
    }
    if (!down) ScaleBuffer(buf.data(), dtype, total, m0.prescale);
  }
  if (carrier) WriteExtras(buf.data() + total * esize, dtype, r, options_.rank);
  AllreduceBuffer(stream, buf.data(), slots, dtype, fn, mixed ? total : 0);
  if (carrier && !Deliver(r, ReadOutcome(buf.data() + total * esize, dtype, r))) {
    return false;  // voted down: outputs and residuals untouched, requests back to pending
  }
  ScaleBuffer(buf.data(), dtype, total, post);
  offset = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto& q = requests[i];
    size_t n = static_cast<size_t>(NumElements(q->meta.shape));
    if (down) {
      // Everything not sent this step stays in the residual (decayed by the
      // momentum); what was sent leaves it. Unsent outputs are zero.
      const float* in = static_cast<const float*>(q->input);
      float* out = static_cast<float*>(q->output);
      float* res = states[i]->residual.data();
      const float pre = static_cast<float>(m0.prescale);
      for (size_t e = 0; e < n; ++e) res[e] = in[e] * pre + momentum * res[e];
      if (n) std::memset(out, 0, n * sizeof(float));
      const float* got = reinterpret_cast<const float*>(buf.data()) + offset / esize;
      size_t j = 0;
      for (size_t e = phases[i]; e < n; e += N) {
        out[e] = got[j++];
        res[e] = 0;
      }
      offset += j * esize;
      ++states[i]->steps;
      continue;
    }
    size_t bytes = n * esize;
    if (bytes) std::memcpy(q->output, buf.data() + offset, bytes);
    offset += bytes;
  }
  return true;
}

Runtime::SparseState& Runtime::SparseFor(const TensorMeta& m) {
  std::lock_guard<std::mutex> lock(sparse_mu_);
  SparseState& st = sparse_[m.name];
  const size_t n = static_cast<size_t>(NumElements(m.shape));
  if (st.residual.size() != n) {  // first use, or the tensor changed shape
    st.residual.assign(n, 0.0f);
    st.steps = 0;
  }
  return st;
}

void Runtime::AllreduceBuffer(int stream, void* buf, size_t count, DataType dtype, ReduceFn fn,
                              size_t half_across) {
  AllreduceCall call;
  call.channel = stream;
  call.data = buf;
  call.count = count;
  call.dtype = dtype;
  call.fn = fn;
  call.half_across = half_across;
  call.scale = static_cast<float>(options_.gradient_scale);
  call.half = &streams_[stream]->half_buffer;
  RunAllreduce(ChooseAllreduce(count * DataTypeSize(dtype), half_across > 0, topology_), groups_,
               call, timeline_);
}

int64_t Runtime::TopkCount(int64_t n) const {
  return std::max<int64_t>(
      1, std::min<int64_t>(n, static_cast<int64_t>(std::ceil(options_.topk_ratio * n))));
}

int64_t Runtime::PayloadBytes(const TensorMeta& m) const {
  const int64_t n = NumElements(m.shape);
  switch (m.compression) {
    case kCompressFp16:
      return 2 * n;
    case kCompressMixed:  // what crosses hosts
      return (transport_ && transport_->hierarchical() ? 2 : 4) * n;
    case kCompressTopk:
      return TopkCount(n) * (4 + (options_.topk_fp16 ? 2 : 4));
    case kCompressDownsample:
      return 4 * ((n + options_.downsample_n - 1) / options_.downsample_n);
    default:
      return n * static_cast<int64_t>(DataTypeSize(m.dtype));
  }
}

// Top-k with error feedback, one tensor: acc = gradient * prescale +
// residual; this rank sends the k entries of acc largest in magnitude
// (index, value; the value optionally float16 times the gradient scale),
// keeps everything it did not send (including float16 rounding) as the next
// residual, and sums what every rank sent into a dense output.
bool Runtime::ExecuteTopk(int stream, const Response& r, Request& q) {
  const TensorMeta& m = r.metas[0];
  const size_t n = static_cast<size_t>(NumElements(m.shape));
  const size_t k = static_cast<size_t>(TopkCount(NumElements(m.shape)));
  SparseState& st = SparseFor(m);
  std::vector<int32_t>& idx = streams_[stream]->index;
  const float pre = static_cast<float>(m.prescale);
  const float* in = static_cast<const float*>(q.input);
  const bool half = options_.topk_fp16;
  const float scale = static_cast<float>(options_.gradient_scale);
  const size_t value_bytes = half ? 2 : 4;
  const size_t record = k * (4 + value_bytes);
  std::vector<char> send(record);
  {
    TimelineSpan span(timeline_, 1 + stream, "top-k select", "compression");
    // The residual becomes acc in place; what is sent leaves it below.
    float* acc = st.residual.data();
    for (size_t e = 0; e < n; ++e) acc[e] = in[e] * pre + acc[e];
    // Candidates: elements at least as large as a threshold taken from an
    // evenly spaced sample, set low enough that the candidates almost
    // always hold k or more; the exact top k is then chosen among them
    // (an element below the threshold can never beat k candidates). Too
    // few candidates: retry with every element.
    float threshold = 0.0f;
    const size_t samples = std::min<size_t>(n, 16384);
    if (k < n && samples >= 256) {
      std::vector<float> sample(samples);
      for (size_t j = 0; j < samples; ++j) sample[j] = std::fabs(acc[j * (n / samples)]);
      const double want = static_cast<double>(k) / n * samples * 1.5 + 16;
      const size_t at = std::min(samples - 1, static_cast<size_t>(want));
      std::nth_element(sample.begin(), sample.begin() + static_cast<std::ptrdiff_t>(at),
                       sample.end(), std::greater<float>());
      threshold = sample[at];
    }
    for (int attempt = 0; attempt < 2; ++attempt) {
      idx.clear();
      for (size_t e = 0; e < n; ++e) {
        if (std::fabs(acc[e]) >= threshold) idx.push_back(static_cast<int32_t>(e));
      }
      if (idx.size() >= k) break;
      threshold = 0.0f;  // |x| >= 0 holds for every element but NaN
    }
    if (idx.size() < k) throw std::runtime_error("top-k: tensor holds NaN");
    // Largest magnitude first; ties to the lower index (the numpy model's order).
    std::nth_element(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k - 1), idx.end(),
                     [acc](int32_t a, int32_t b) {
                       const float fa = std::fabs(acc[a]), fb = std::fabs(acc[b]);
                       return fa > fb || (fa == fb && a < b);
                     });
    std::sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k));
    int32_t* send_idx = reinterpret_cast<int32_t*>(send.data());
    char* values = send.data() + k * 4;
    for (size_t j = 0; j < k; ++j) {
      const int32_t e = idx[j];
      send_idx[j] = e;
      float sent = acc[e];
      if (half) {
        uint16_t h;
        FloatToHalfScaled(&acc[e], &h, 1, scale);
        HalfToFloatScaled(&h, &sent, 1, 1.0f / scale);
        std::memcpy(values + 2 * j, &h, 2);
      } else {
        std::memcpy(values + 4 * j, &sent, 4);
      }
      acc[e] -= sent;
    }
  }
  std::vector<char> all(record * static_cast<size_t>(options_.size));
  {
    TimelineSpan ring(timeline_, 1 + stream, "gloo allgather (top-k)", "communication");
    transport_->Allgatherv(stream, send.data(), all.data(),
                         std::vector<size_t>(static_cast<size_t>(options_.size), record));
  }
  const double post =
      m.postscale * (m.reduce_op == ReduceOp::kAverage ? 1.0 / options_.size : 1.0);
  float* out = static_cast<float*>(q.output);
  if (n) std::memset(out, 0, n * sizeof(float));
  for (int rank = 0; rank < options_.size; ++rank) {
    const char* at = all.data() + record * static_cast<size_t>(rank);
    const int32_t* got_idx = reinterpret_cast<const int32_t*>(at);
    const char* values = at + k * 4;
    for (size_t j = 0; j < k; ++j) {
      float v;
      if (half) {
        uint16_t h;
        std::memcpy(&h, values + 2 * j, 2);
        HalfToFloatScaled(&h, &v, 1, 1.0f / scale);
      } else {
        std::memcpy(&v, values + 4 * j, 4);
      }
      out[got_idx[j]] += v;
    }
  }
  ScaleBuffer(out, DataType::kFloat32, n, post);
  return true;
}

// float32 in, float16 on the wire: each input is multiplied by prescale *
// gradient_scale while it is converted into the bucket, the bucket is summed
// in float16 (F16C), and the sum is converted back multiplied by
// postscale / gradient_scale (and 1/size for an average). The scale keeps
// small gradients out of float16's subnormal range.
bool Runtime::ExecuteCompressedAllreduce(int stream, const Response& r,
                                         std::vector<std::shared_ptr<Request>>& requests) {
  const TensorMeta& m0 = r.metas[0];
  size_t total = 0;
  for (auto& q : requests) total += static_cast<size_t>(NumElements(q->meta.shape));
  const bool carrier = r.carrier_vote >= 0;
  std::vector<uint16_t>& half = streams_[stream]->half_buffer;
  const size_t extras = ExtraSlots(r);
  if (half.size() < total + extras) half.resize(total + extras);
  const float in_scale = static_cast<float>(m0.prescale * options_.gradient_scale);
  size_t offset = 0;
  {
    TimelineSpan pack(timeline_, 1 + stream, "fp16 compress", "compression");
    for (auto& q : requests) {
      size_t n = static_cast<size_t>(NumElements(q->meta.shape));
      FloatToHalfScaled(static_cast<const float*>(q->input), half.data() + offset, n, in_scale);
      offset += n;
    }
  }
  if (carrier) {
    WriteExtras(reinterpret_cast<char*>(half.data() + total), DataType::kFloat16, r, options_.rank);
  }
  {
    AllreduceBuffer(stream, half.data(), total + extras, DataType::kFloat16,
                    GetReduceFn(DataType::kFloat16, ReduceOp::kSum));
  }
  const char* extra_at = reinterpret_cast<const char*>(half.data() + total);
  if (carrier && !Deliver(r, ReadOutcome(extra_at, DataType::kFloat16, r))) return false;
  const double post =
      m0.postscale * (m0.reduce_op == ReduceOp::kAverage ? 1.0 / options_.size : 1.0);
  const float out_scale = static_cast<float>(post / options_.gradient_scale);
  offset = 0;
  TimelineSpan unpack(timeline_, 1 + stream, "fp16 decompress", "compression");
  for (auto& q : requests) {
    size_t n = static_cast<size_t>(NumElements(q->meta.shape));
    HalfToFloatScaled(half.data() + offset, static_cast<float*>(q->output), n, out_scale);
    offset += n;
  }
  return true;
}

void Runtime::ExecuteAllgather(int stream, const Response& r, Request& q) {
  const std::vector<int64_t>& dims = r.first_dims[0];
  std::vector<int64_t> trailing = Trailing(q.meta.shape);
  size_t row = static_cast<size_t>(NumElements(trailing)) * DataTypeSize(q.meta.dtype);
  int64_t rows = 0;
  std::vector<size_t> bytes;
  for (int64_t d : dims) {
    rows += d;
    bytes.push_back(static_cast<size_t>(d) * row);
  }
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  void* out = q.allocate(shape);
  if (out == nullptr && rows * row > 0) throw std::runtime_error("could not allocate the output");
  transport_->Allgatherv(stream, q.input, out, bytes);
}

void Runtime::ExecuteAlltoall(int stream, const Response& r, Request& q) {
  const int me = options_.rank;
  std::vector<int64_t> trailing = Trailing(q.meta.shape);
  int64_t row = NumElements(trailing) * static_cast<int64_t>(DataTypeSize(q.meta.dtype));
  std::vector<int64_t> send(options_.size), recv(options_.size);
  int64_t rows = 0;
  q.received_splits.assign(options_.size, 0);
  for (int p = 0; p < options_.size; ++p) {
    send[p] = r.splits[me][p] * row;
    recv[p] = r.splits[p][me] * row;
    q.received_splits[p] = r.splits[p][me];
    rows += r.splits[p][me];
  }
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  void* out = q.allocate(shape);
  if (out == nullptr && rows * row > 0) throw std::runtime_error("could not allocate the output");
  bool any = false;
  for (const auto& sent_by : r.splits) {
    for (int64_t rows_sent : sent_by) any |= rows_sent > 0;
  }
  transport_->Alltoallv(stream, q.input, send, out, recv, any && row > 0);
}

void Runtime::ExecuteReducescatter(int stream, const Response& r, Request& q) {
  const TensorMeta& m = r.metas[0];
  const DataType dtype = m.dtype;
  const size_t esize = DataTypeSize(dtype);
  size_t n = static_cast<size_t>(NumElements(q.meta.shape));
  std::vector<char>& buf = streams_[stream]->fusion_buffer;
  if (buf.size() < n * esize) buf.resize(n * esize);
  if (n) std::memcpy(buf.data(), q.input, n * esize);
  ScaleBuffer(buf.data(), dtype, n, m.prescale);
  transport_->Allreduce(stream, buf.data(), n, dtype, GetReduceFn(dtype, m.reduce_op));
  // Rows are dealt out as evenly as possible, lower ranks taking the rest.
  const int64_t dim0 = q.meta.shape[0];
  const int64_t base = dim0 / options_.size, extra = dim0 % options_.size;
  const int64_t me = options_.rank;
  const int64_t my_rows = base + (me < extra ? 1 : 0);
  const int64_t first_row = me * base + std::min(me, extra);
  std::vector<int64_t> trailing = Trailing(q.meta.shape);
  size_t row = static_cast<size_t>(NumElements(trailing)) * esize;
  std::vector<int64_t> shape{my_rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  void* out = q.allocate(shape);
  if (out == nullptr && my_rows * row > 0) throw std::runtime_error("could not allocate the output");
  if (my_rows) std::memcpy(out, buf.data() + first_row * row, my_rows * row);
  const double post =
      m.postscale * (m.reduce_op == ReduceOp::kAverage ? 1.0 / options_.size : 1.0);
  ScaleBuffer(out, dtype, static_cast<size_t>(my_rows * NumElements(trailing)), post);
}

void Runtime::Fail(const std::string& what) {
  static std::mutex fail_mu;
  std::lock_guard<std::mutex> fail_lock(fail_mu);
  if (state_.load() != State::kRunning) return;
  std::string who = IdentifyFailedRanks();
  std::ostringstream msg;
  msg << "Perseus rank " << options_.rank << ": ";
  if (!who.empty()) msg << who << "; ";
  msg << what << ". Collectives cannot continue; restart the job.";
  Status status = Status::Error(StatusCode::kUnavailable, msg.str());
  if (shm_) shm_->Abort();  // ranks waiting in a shared-memory barrier stop waiting
  {
    std::lock_guard<std::mutex> lock(mu_);
    failure_ = status;
    state_ = State::kFailed;
  }
  queue_cv_.notify_all();
  FailAllPending(status);
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
  heartbeat_ = std::thread([this, key] {
    std::unique_lock<std::mutex> lock(heartbeat_mu_);
    while (!heartbeat_stop_) {
      lock.unlock();
      try {
        heartbeat_store_->Add(key, 1);
      } catch (const std::exception&) {
        return;  // the store is gone: nothing left to tell
      }
      lock.lock();
      heartbeat_cv_.wait_for(lock, std::chrono::milliseconds(250),
                             [this] { return heartbeat_stop_; });
    }
  });
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

std::string Runtime::IdentifyFailedRanks() {
  if (!store_) return "";
  try {
    const std::string& job = options_.job_id;
    const std::string group =
        options_.process_set_id ? "/ps" + std::to_string(options_.process_set_id) : "";
    const std::string census =
        job + group + "/gen" + std::to_string(generation_) + "/census/rank";
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
    // A rank that died closed its store connection; the store may take a
    // moment to notice, so look for up to a second.
    auto deadline = Clock::now() + std::chrono::seconds(1);
    std::vector<int> dead;
    while (dead.empty()) {
      for (int r = 0; r < options_.size; ++r) {
        // A rank that noticed the failure itself (census key written) and
        // then exited is a survivor, not the cause.
        if (r != options_.rank &&
            store_->TryGet(ClosedKey(job, WorldRank(r)), std::chrono::milliseconds(0), &ignored) &&
            !store_->TryGet(census + std::to_string(r), std::chrono::milliseconds(0), &ignored)) {
          dead.push_back(WorldRank(r));
        }
      }
      if (!dead.empty() || Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
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

void Runtime::StartTimeline(const std::string& path) {
  timeline_.Start(path, WorldRank(options_.rank), "rank " + std::to_string(WorldRank(options_.rank)));
}

bool Runtime::StopTimeline(std::string* error) { return timeline_.Write(error); }

Stats Runtime::GetStats() {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

Status Runtime::RawAllreduce(void* data, size_t count, DataType dtype) {
  if (state_.load() != State::kRunning) {
    return Status::Error(StatusCode::kFailedPrecondition, "Perseus is not initialized");
  }
  std::lock_guard<std::mutex> lock(raw_mu_);
  try {
    if (store_) transport_->CreateRawChannel(*store_);
    transport_->Allreduce(GlooTransport::kRawChannel, data, count, dtype,
                        GetReduceFn(dtype, ReduceOp::kSum));
  } catch (const std::exception& e) {
    return Status::Error(StatusCode::kUnavailable, std::string("raw allreduce failed: ") + e.what());
  }
  return Status::OK();
}

}  // namespace perseus
