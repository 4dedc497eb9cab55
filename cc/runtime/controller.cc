// The controller (controller.h): the negotiation thread's loop, one
// negotiation cycle (the control allgather and its header), the stall
// budget, and dispatching what a cycle made ready.
#include "cc/runtime/controller.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>
#include <unordered_set>

#include "cc/core/reduce.h"
#include "cc/rendezvous/store_client.h"
#include "cc/runtime/executor.h"
#include "cc/runtime/faults.h"
#include "cc/runtime/fusion.h"
#include "cc/runtime/runtime.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/factory.h"

namespace perseus {
namespace {

// How long an idle rank waits before joining the next (empty) cycle. A rank
// with work joins at once; the others join within this bound.
constexpr auto kIdleWait = std::chrono::milliseconds(5);

// Bytes each rank contributes to a cycle's first control allgather.
constexpr size_t kControlSlot = 512;

}  // namespace

Controller::Controller(Runtime& runtime) : rt_(runtime) {
  const InitOptions& o = rt_.options_;
  negotiator_.reset(new Negotiator(o.size, o.fusion_threshold_bytes, o.global_ranks,
                                   [granularity = o.fusion_granularity,
                                    threshold = o.fusion_threshold_bytes](int64_t b) {
                                     return PlanBucketBytes(b, granularity, threshold);
                                   }));
  started_ = last_cycle_ = Clock::now();
}

Controller::~Controller() { Join(); }

void Controller::Start() { thread_ = std::thread(&Controller::Loop, this); }

void Controller::Join() {
  if (thread_.joinable()) thread_.join();
}

void Controller::Loop() {
  NameThisThread("perseus-control");
  bool stop = false;
  while (!stop) {
    if (rt_.state_.load() != Runtime::State::kRunning) return;
    try {
      if (rt_.plan_.active()) {
        RunOffline(&stop);
      } else {
        RunCycle(&stop);
      }
    } catch (const std::exception& e) {
      rt_.Fail(std::string("negotiation failed: ") + e.what());
      return;
    }
  }
  // Every rank saw the same shutdown flag in the same cycle: drain and stop.
  rt_.executor_->Stop();
  {
    std::lock_guard<std::mutex> lock(rt_.mu_);
    if (rt_.state_.load() == Runtime::State::kRunning) rt_.state_ = Runtime::State::kShutdown;
  }
  const std::string message = "Perseus was shut down (" + rt_.shutdown_by_ +
                              ") before this collective ran on every rank";
  bool stranded;
  {
    std::lock_guard<std::mutex> lock(rt_.mu_);
    stranded = !rt_.pending_.empty();
  }
  // Collectives of this rank left unfinished by another rank's shutdown:
  // that rank is the cause.
  if (stranded && rt_.shutdown_by_rank_ >= 0 && rt_.shutdown_by_rank_ != rt_.options_.rank) {
    RecordFirstFailure({rt_.WorldRank(rt_.shutdown_by_rank_)}, message);
  }
  rt_.FailAllPending(Status::Error(StatusCode::kUnavailable, message));
}

void Controller::RunCycle(bool* stop) {
  const auto cycle_time = std::chrono::microseconds(
      static_cast<int64_t>(rt_.options_.cycle_time_ms * 1000));
  CycleMessage mine;
  bool in_plan = false;
  {
    std::unique_lock<std::mutex> lock(rt_.mu_);
    auto max_wait = negotiator_->HasPending() || idle_cycles_ == 0
                        ? std::chrono::duration_cast<Clock::duration>(cycle_time)
                        : std::chrono::duration_cast<Clock::duration>(kIdleWait);
    rt_.queue_cv_.wait_until(lock, last_cycle_ + max_wait,
                         [&] { return !rt_.queue_.empty() || rt_.shutdown_requested_; });
    if (!rt_.queue_.empty()) {
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
    mine.requests.assign(rt_.queue_.begin(), rt_.queue_.end());
    rt_.queue_.clear();
    mine.shutdown = rt_.shutdown_requested_;
    in_plan = rt_.plan_.active();
  }
  last_cycle_ = Clock::now();
  const int64_t my_clock =
      std::chrono::duration_cast<std::chrono::milliseconds>(last_cycle_ - started_).count();

  const int size = rt_.options_.size;
  const auto exchange_start = Clock::now();
  const size_t my_requests = mine.requests.size();
  Exchanged x = ExchangeControl(std::move(mine), my_clock, in_plan);
  std::vector<CycleMessage>& all = x.all;
  const bool any_in_plan = x.any_in_plan;
  const int64_t sent = x.control_bytes;

  if (rt_.timeline_.enabled() && rt_.mark_cycles_ && (my_requests > 0 || size == 1)) {
    rt_.timeline_.Record(0, "negotiate", "negotiation", exchange_start, Clock::now(),
                     "\"requests\": " + std::to_string(my_requests) +
                         ", \"control_bytes\": " + std::to_string(sent));
  }
  negotiator_->BeginCycle(x.clock, any_in_plan);
  bool any_requests = false;
  for (int r = 0; r < size; ++r) {
    for (const TensorMeta& m : all[r].requests) {
      negotiator_->Add(r, m);
      any_requests = true;
    }
    if (all[r].shutdown && !*stop) {
      *stop = true;
      std::lock_guard<std::mutex> lock(rt_.mu_);
      rt_.shutdown_by_ = "rank " + std::to_string(r) + " called shutdown";
      rt_.shutdown_by_rank_ = r;
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
      negotiator_->StallReport(static_cast<int64_t>(rt_.options_.stall_check_seconds * 1000));
  ReportStalls(stalls);
  for (Response& r : negotiator_->TakeStalled(
           static_cast<int64_t>(rt_.options_.stall_timeout_seconds * 1000))) {
    ready.push_back(std::move(r));
  }
  idle_cycles_ = (any_requests || !ready.empty()) ? 0 : idle_cycles_ + 1;
  {
    std::lock_guard<std::mutex> lock(rt_.stats_mu_);
    ++rt_.stats_.cycles;
    rt_.stats_.control_bytes_sent += sent;
    rt_.stats_.responses += static_cast<int64_t>(ready.size());
    for (const Response& r : ready) {
      if (r.names.size() > 1) ++rt_.stats_.fused_responses;
    }
  }
  const bool lone = ready.size() == 1;
  // Whether this rank was in join() when the cycle's message left: a
  // response of this cycle that it lacks may come after the join's own
  // (responses are in the order tensors were first seen), and it still
  // takes part in that one with zeros.
  bool joined;
  {
    std::lock_guard<std::mutex> lock(rt_.mu_);
    joined = rt_.joined_;
  }
  for (Response& r : ready) Dispatch(std::move(r), lone, any_in_plan, joined);
  if (!rt_.plan_.active() && !*stop && negotiator_->PlanReady()) EnterOffline();
}

Controller::Exchanged Controller::ExchangeControl(CycleMessage mine, int64_t my_clock,
                                                  bool in_plan) {
  const int size = rt_.options_.size;
  Exchanged x;
  std::vector<CycleMessage>& all = x.all;
  all.resize(size);
  int64_t& sent = x.control_bytes;
  bool& any_in_plan = x.any_in_plan;
  any_in_plan = in_plan;
  int64_t& clock = x.clock;
  clock = my_clock;
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
    rt_.transport_->Allgatherv(Transport::kControl, slot.data(), slots.data(),
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
      rt_.transport_->Allgatherv(Transport::kControl, tail, gathered.data(), rest);
      sent += static_cast<int64_t>(rest[rt_.options_.rank]);
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
  return x;
}

void Controller::ReportStalls(const std::vector<std::string>& stalls) const {
  if (stalls.empty() || rt_.WorldRank(rt_.options_.rank) != 0) return;
    std::ostringstream msg;
    msg << "Perseus stall inspector (rank 0): " << stalls.size()
        << (stalls.size() == 1 ? " collective has" : " collectives have")
        << " waited more than " << rt_.options_.stall_check_seconds
        << " s (PERSEUS_STALL_CHECK_TIME_SECONDS) for ranks that have not submitted them";
    if (rt_.options_.stall_timeout_seconds > 0) {
      msg << "; the job fails after PERSEUS_STALL_TIMEOUT_SECONDS="
          << rt_.options_.stall_timeout_seconds << " s";
    }
    msg << ":\n";
    for (size_t i = 0; i < stalls.size() && i < 20; ++i) msg << "  " << stalls[i] << "\n";
    if (stalls.size() > 20) msg << "  ... and " << stalls.size() - 20 << " more\n";
    std::fputs(msg.str().c_str(), stderr);
    std::fflush(stderr);
  }

void Controller::Dispatch(Response response, bool lone, bool any_in_plan, bool joined) {
  if (!response.real_request.empty() && !response.real_request[rt_.options_.rank]) {
    // The refusal of a call this rank refused too: its request of the name,
    // if any, is a later call.
    return;
  }
  std::vector<std::shared_ptr<Request>> requests;
  std::vector<std::shared_ptr<Request>> siblings;  // of a failed grouped call
  std::string not_submitted, fatal;
  {
    std::lock_guard<std::mutex> lock(rt_.mu_);
    for (size_t i = 0; i < response.names.size(); ++i) {
      auto it = rt_.pending_.find(response.names[i]);
      if (it == rt_.pending_.end()) {
        const bool abandoned = rt_.abandoned_.erase(response.names[i]) > 0;
        if (!response.error.ok()) continue;
        // Only a rank in join() may lack a name: it takes part with zeros.
        // Any other rank would add zeros nobody asked for to the result.
        if (!joined) {
          not_submitted = response.names[i];
          fatal = abandoned
                      ? "the others ran " + std::string(OpTypeName(response.op)) + " of '" +
                            not_submitted + "', which rank " +
                            std::to_string(rt_.WorldRank(rt_.options_.rank)) +
                            " gave up when another tensor of its grouped call failed"
                      : "internal error: negotiation started " +
                            std::string(OpTypeName(response.op)) + " of '" + not_submitted +
                            "', which rank " + std::to_string(rt_.WorldRank(rt_.options_.rank)) +
                            " has not submitted and it is not in join()";
          break;
        }
        requests.push_back(StandIn(response, i));
        continue;
      }
      requests.push_back(it->second);
      rt_.pending_.erase(it);
    }
    if (!response.error.ok()) {
      // Names this rank has not sent yet (still queued for the next cycle).
      std::unordered_set<std::string> unsent;
      for (const TensorMeta& m : rt_.queue_) unsent.insert(m.name);
      // What fails here leaves the queue: a request failed here may have
      // arrived after this cycle's message was sent, and its queued copy
      // would pair with another rank's retry of that name in the next cycle
      // while no request of this rank is left to take part.
      std::unordered_set<std::string> drop;
      for (const auto& q : requests) drop.insert(q->meta.name);
      // The rest of a failed grouped call fails with it: its caller waits
      // for all of its tensors, and the others would wait for these forever
      // (a rank whose call held fewer tensors has none of them).
      for (const auto& q : requests) {
        if (!q->call) continue;
        for (const std::string& name : *q->call) {
          auto it = rt_.pending_.find(name);
          if (it == rt_.pending_.end() || it->second->call != q->call) continue;
          if (response.siblings_run) {
            // Every rank has this tensor of the call: it runs as negotiated
            // (queued or sent, it stays so) and then fails with the call.
            Request& sibling = *it->second;
            if (sibling.failed_with_call.ok()) {
              sibling.failed_with_call = Status::Error(
                  response.error.code, std::string("Perseus ") + OpTypeName(sibling.meta.op) +
                                           " of tensor '" + name + "' is not applied: '" +
                                           response.names[0] +
                                           "' of the same grouped call failed: " +
                                           response.error.message);
              auto done = std::move(sibling.done);
              const Status failed = sibling.failed_with_call;
              sibling.done = [done, failed](const Status& status) {
                done(status.ok() ? failed : status);
              };
            }
            continue;
          }
          if (rt_.plan_.active() && (it->second->meta.flags & kMetaPlannable)) continue;
          if (!unsent.count(name)) rt_.abandoned_.insert(name);  // the others know of it
          drop.insert(name);
          siblings.push_back(it->second);
          rt_.pending_.erase(it);
        }
      }
      if (!unsent.empty()) {
        rt_.queue_.erase(std::remove_if(rt_.queue_.begin(), rt_.queue_.end(),
                                    [&](const TensorMeta& m) { return drop.count(m.name); }),
                     rt_.queue_.end());
      }
    }
    if (!not_submitted.empty()) {
      // Back where Fail() finds them: they fail with the job.
      for (auto& q : requests) rt_.pending_.emplace(q->meta.name, q);
    } else if (response.op == OpType::kJoin) {
      rt_.joined_ = false;
    }
  }
  if (!not_submitted.empty()) {
    rt_.Fail(fatal);
    return;
  }

  if (response.op == OpType::kJoin) {
    for (auto& q : requests) q->result = response.metas[0].root;
  }
  if (!response.error.ok() || response.op == OpType::kBarrier || response.op == OpType::kJoin) {
    for (auto& q : requests) q->done(response.error);
    for (auto& q : siblings) {
      q->done(Status::Error(response.error.code,
                            std::string("Perseus ") + OpTypeName(q->meta.op) + " of tensor '" +
                                q->meta.name + "' did not run: '" + response.names[0] +
                                "' of the same grouped call failed: " + response.error.message));
    }
    if (rt_.faults_ && !response.error.ok()) rt_.faults_->AfterErrorResponse();
    return;
  }
  // Online work uses the first `streams` streams in turn; while any rank
  // runs a plan, it goes to the extra stream so that the two orders never
  // mix. Every rank decides from what the cycle told all of them (not from
  // its own plan state: ranks leave a plan at their own pace), so each
  // collective runs on the same stream everywhere.
  int stream = any_in_plan
                   ? rt_.options_.streams
                   : static_cast<int>(dispatched_++ % static_cast<uint64_t>(rt_.options_.streams));
  if (lone && rt_.executor_->RunHereIfIdle(stream, response, requests)) return;
  rt_.executor_->Submit(stream, std::move(response), std::move(requests));
}

std::shared_ptr<Request> Controller::StandIn(const Response& response, size_t index) {
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

}  // namespace perseus
