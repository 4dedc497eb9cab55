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
#include "cc/runtime/executor.h"
#include "cc/runtime/faults.h"
#include "cc/runtime/plan/plan.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/transport.h"

namespace perseus {
namespace {

// How long an idle rank waits before joining the next (empty) cycle. A rank
// with work joins at once; the others join within this bound.
constexpr auto kIdleWait = std::chrono::milliseconds(5);

// Each empty cycle costs every rank an exchange: at one cycle a millisecond
// while some ranks waited for a late one (a collective half asked for), that
// was about a fifth of a core per rank, and an idle rank's cycle every 5 ms
// took 5 to 9% of one, taken from the ranks' own work on a shared host.
// After a quiet spell (no request, no response) of kQuietPending (requests
// pending) or kQuietIdle (none), cycles come at most a tenth of the quiet
// time apart, so a call is seen at most 10% later than it came after that
// long a wait, and never more than kQuietCap later.
constexpr auto kQuietPending = std::chrono::milliseconds(50);
constexpr auto kQuietIdle = std::chrono::milliseconds(1000);
constexpr auto kQuietCap = std::chrono::milliseconds(20);

// How long a rank waits for a request before joining the next cycle.
Clock::duration CycleWait(Clock::duration base, Clock::duration quiet, Clock::duration full_for) {
  if (quiet < full_for) return base;
  return std::max(base, std::min<Clock::duration>(quiet / 10, kQuietCap));
}

// Bytes each rank contributes to a cycle's first control allgather.
constexpr size_t kControlSlot = 512;

}  // namespace

Controller::Controller(ControllerContext context)
    : c_(std::move(context)), table_(*c_.requests) {
  const NegotiationSettings& n = c_.negotiation;
  negotiator_.reset(new Negotiator(c_.ranks.size, n.fusion_threshold_bytes, c_.ranks.global_ranks,
                                   [granularity = n.fusion,
                                    threshold = n.fusion_threshold_bytes](int64_t b) {
                                     return PlanBucketBytes(b, granularity, threshold);
                                   }));
  started_ = last_cycle_ = Clock::now();
  if (c_.faults) {
    on_plan_step_ = [faults = c_.faults](int64_t step, Plan* plan) {
      faults->OnPlanStep(step, plan);
    };
  }
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
    if (!c_.running()) return;
    try {
      if (table_.InPlan()) {
        RunOffline(&stop);
      } else {
        RunCycle(&stop);
      }
    } catch (const std::exception& e) {
      c_.fail(std::string("negotiation failed: ") + e.what());
      return;
    }
  }
  // Every rank saw the same shutdown flag in the same cycle: drain and stop.
  c_.executor->Stop();
  c_.stopped();
}

void Controller::RunCycle(bool* stop) {
  const auto cycle_time = std::chrono::microseconds(
      static_cast<int64_t>(c_.negotiation.cycle_time_ms * 1000));
  // Cycles are at least one cycle time apart, so requests that arrive
  // together (a backward pass) travel, and fuse, in few cycles; a request
  // after a quiet spell goes at once.
  const auto quiet = Clock::now() - last_progress_;
  const auto base = std::chrono::duration_cast<Clock::duration>(cycle_time);
  const auto max_wait =
      negotiator_->HasPending() ? CycleWait(base, quiet, kQuietPending)
      : idle_cycles_ == 0       ? base
                                : CycleWait(std::chrono::duration_cast<Clock::duration>(kIdleWait),
                                            quiet, kQuietIdle);
  RequestTable::Queued queued = table_.TakeQueued(last_cycle_ + max_wait, last_cycle_ + cycle_time);
  CycleMessage mine;
  mine.requests = std::move(queued.requests);
  mine.shutdown = queued.shutdown;
  const bool in_plan = queued.in_plan;
  last_cycle_ = Clock::now();
  const int64_t my_clock =
      std::chrono::duration_cast<std::chrono::milliseconds>(last_cycle_ - started_).count();

  const int size = c_.ranks.size;
  const auto exchange_start = Clock::now();
  const size_t my_requests = mine.requests.size();
  Doing("waiting in a negotiation cycle's exchange with the other ranks");
  Exchanged x = ExchangeControl(std::move(mine), my_clock, in_plan);
  Doing(nullptr);
  std::vector<CycleMessage>& all = x.all;
  const bool any_in_plan = x.any_in_plan;
  const int64_t sent = x.control_bytes;

  if (c_.timeline->enabled() && c_.mark_cycles->load() && (my_requests > 0 || size == 1)) {
    c_.timeline->Record(0, "negotiate", "negotiation", exchange_start, Clock::now(),
                        TimelineArgs()
                            .Int("requests", static_cast<int64_t>(my_requests))
                            .Int("control_bytes", sent)
                            .str());
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
      table_.ShutdownAgreed(r, "rank " + std::to_string(r) + " called shutdown");
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
      negotiator_->StallReport(static_cast<int64_t>(c_.negotiation.stall_check_seconds * 1000));
  ReportStalls(stalls);
  for (Response& r : negotiator_->TakeStalled(
           static_cast<int64_t>(c_.negotiation.stall_timeout_seconds * 1000))) {
    ready.push_back(std::move(r));
  }
  idle_cycles_ = (any_requests || !ready.empty()) ? 0 : idle_cycles_ + 1;
  if (idle_cycles_ == 0) last_progress_ = last_cycle_;
  c_.stats->Update([&](Stats& st) {
    ++st.cycles;
    st.control_bytes_sent += sent;
    st.responses += static_cast<int64_t>(ready.size());
    for (const Response& r : ready) {
      if (r.names.size() > 1) ++st.fused_responses;
    }
  });
  const bool lone = ready.size() == 1;
  // Whether this rank was in join() when the cycle's message left: a
  // response of this cycle that it lacks may come after the join's own
  // (responses are in the order tensors were first seen), and it still
  // takes part in that one with zeros.
  const bool joined = table_.joined();
  for (Response& r : ready) Dispatch(std::move(r), lone, any_in_plan, joined);
  if (!table_.InPlan() && !*stop && negotiator_->PlanReady()) EnterOffline();
}

Controller::Exchanged Controller::ExchangeControl(CycleMessage mine, int64_t my_clock,
                                                  bool in_plan) {
  const int size = c_.ranks.size;
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
    c_.control->AllgatherBlocks(Transport::kControl, slot.data(), slots.data(), kControlSlot);
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
      c_.control->Allgatherv(Transport::kControl, tail, gathered.data(), rest);
      sent += static_cast<int64_t>(rest[c_.ranks.rank]);
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

void Controller::ReportStalls(const std::vector<std::string>& stalls) {
  if (stalls.empty() || WorldRank(c_.ranks.rank) != 0) return;
  std::ostringstream msg;
  if (stalls_explained_) {
    msg << "Perseus stall inspector (rank 0): still waiting";
  } else {
    stalls_explained_ = true;
    msg << "Perseus stall inspector (rank 0): " << stalls.size()
        << (stalls.size() == 1 ? " collective has" : " collectives have")
        << " waited more than " << c_.negotiation.stall_check_seconds
        << " s (PERSEUS_STALL_CHECK_TIME_SECONDS) for ranks that have not submitted them";
    if (c_.negotiation.stall_timeout_seconds > 0) {
      msg << "; the job fails after PERSEUS_STALL_TIMEOUT_SECONDS="
          << c_.negotiation.stall_timeout_seconds << " s";
    }
  }
  msg << ":\n";
  for (size_t i = 0; i < stalls.size() && i < 20; ++i) msg << "  " << stalls[i] << "\n";
  if (stalls.size() > 20) msg << "  ... and " << stalls.size() - 20 << " more\n";
  std::fputs(msg.str().c_str(), stderr);
  std::fflush(stderr);
}

void Controller::Doing(const char* what) {
  if (!c_.activity) return;
  if (what) {
    c_.activity->Set(Activity::kNegotiation, what);
  } else {
    c_.activity->Clear(Activity::kNegotiation);
  }
}

void Controller::Dispatch(Response response, bool lone, bool any_in_plan, bool joined) {
  if (!response.real_request.empty() && !response.real_request[c_.ranks.rank]) {
    // The refusal of a call this rank refused too: its request of the name,
    // if any, is a later call.
    return;
  }
  RequestTable::Taken taken = table_.TakeResponse(response, joined);
  if (!taken.fatal.empty()) {
    c_.fail(taken.fatal);
    return;
  }
  Requests& requests = taken.requests;
  if (response.op == OpType::kJoin) {
    for (auto& q : requests) q->result = response.metas[0].root;
  }
  if (!response.error.ok() || response.op == OpType::kBarrier || response.op == OpType::kJoin) {
    Complete(response, requests, taken.siblings);
    return;
  }
  // Online work uses the first `streams` streams in turn; while any rank
  // runs a plan, it goes to the extra stream so that the two orders never
  // mix. Every rank decides from what the cycle told all of them (not from
  // its own plan state: ranks leave a plan at their own pace), so each
  // collective runs on the same stream everywhere.
  int stream = any_in_plan
                   ? c_.streams
                   : static_cast<int>(dispatched_++ % static_cast<uint64_t>(c_.streams));
  if (lone && c_.executor->RunHereIfIdle(stream, response, requests)) return;
  c_.executor->Submit(stream, std::move(response), std::move(requests));
}

void Controller::Complete(const Response& response, const Requests& requests,
                          const Requests& siblings) {
  for (auto& q : requests) q->done(response.error);
  for (auto& q : siblings) {
    q->done(Status::Error(response.error.code,
                          std::string("Perseus ") + OpTypeName(q->meta.op) + " of tensor '" +
                              q->meta.name + "' did not run: '" + response.names[0] +
                              "' of the same grouped call failed: " + response.error.message));
  }
  if (c_.faults && !response.error.ok()) c_.faults->AfterErrorResponse();
}

}  // namespace perseus
