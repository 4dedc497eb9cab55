// The controller's offline mode: entering a plan, dispatching a step's
// buckets, the plan check, deadlines, leaving. The request table
// (request_table_plan.cc, where the protocol is explained) decides under
// its lock what a step runs; this thread attaches what it owns and hands
// the buckets to their streams.
#include "cc/runtime/controller.h"

#include <algorithm>
#include <cstdio>

#include "cc/runtime/executor.h"
#include "cc/runtime/faults.h"
#include "cc/runtime/health.h"
#include "cc/runtime/plan/plan.h"
#include "cc/runtime/runtime_internal.h"

namespace perseus {

void Controller::EnterOffline() {
  table_.EnterPlan(negotiator_->TakePlan());
  c_.stats->Update([](Stats& s) { ++s.plans; });
}

std::chrono::milliseconds Controller::PlanDeadline() const {
  // Well inside GLOO_TIMEOUT_SECONDS: a rank that had its data entered the
  // bucket's collective and waits there for this rank's vote.
  const double seconds = std::min(10.0, std::max(0.5, c_.timeout_seconds / 4));
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

bool Controller::PlanBucketFinished(int64_t votes, const Requests& requests, int plan_index) {
  Requests twice;
  const bool deliver = table_.FinishPlanBucket(votes, requests, plan_index, &twice);
  for (auto& q : twice) {
    q->done(Status::Error(StatusCode::kInvalidArgument,
                          "Perseus allreduce of tensor '" + q->meta.name + "': rank " +
                              std::to_string(WorldRank(c_.ranks.rank)) +
                              " called it again before this call finished; concurrent "
                              "collectives need distinct names"));
  }
  return deliver;
}

void Controller::Attach(RequestTable::PlanWork& work) {
  if (work.check) {
    // The check runs on the first stream, after the work already queued
    // there, so its collectives line up with the buckets on every rank; it
    // runs on the stream's thread: this thread must stay free to negotiate
    // online.
    Response check;
    check.op = OpType::kAllreduce;
    check.names.push_back("perseus.plan_check");
    check.control = [this, digest = work.check](const BufferAllreduce& allreduce) {
      CheckPlans(*digest, allreduce, c_.ranks, c_.negotiation.offline_neg_check_n_steps,
                 *c_.timeline);
      c_.stats->Update([](Stats& s) { ++s.plan_checks; });
    };
    work.buckets.insert(work.buckets.begin(), {0, std::move(check)});
    work.work.insert(work.work.begin(), Requests());
  }
  for (size_t i = 0; i < work.buckets.size(); ++i) {
    Response& r = work.buckets[i].second;
    if (r.control) continue;
    // The bucket reports its outcome; the plan decides here what it means.
    r.envelope.on_outcome = [this, held = work.work[i],
                             index = r.envelope.plan_index](const BucketOutcome& o) {
      if (!o.perf_ms.empty()) c_.health->PerfCheckStep(o.perf_ms);
      return PlanBucketFinished(o.votes, held, index);
    };
  }
  c_.stats->Update([&](Stats& s) {
    for (const auto& b : work.buckets) {
      if (b.second.control) continue;
      ++s.responses;
      if (b.second.names.size() > 1) ++s.fused_responses;
    }
    s.offline_steps += work.offline_steps;
  });
}

void Controller::RunOffline(bool* stop) {
  Doing("waiting for this rank's tensors of an offline plan step, or for online requests");
  const std::string late = table_.WaitForPlanWork(
      [this] { return !c_.running() || negotiator_->HasPending(); }, PlanDeadline());
  Doing(nullptr);
  if (!late.empty()) {
    std::fputs(late.c_str(), stderr);
    std::fflush(stderr);
    c_.stats->Update([](Stats& s) { ++s.plan_timeouts; });
  }
  RequestTable::PlanWork work =
      table_.TakePlanWork(c_.negotiation.offline_neg_check_n_steps,
                          c_.perf_check_n_steps > 0 ? c_.ranks.size : 0,
                          negotiator_->HasPending(), on_plan_step_);
  if (work.closed) return;
  if (work.leave_job) {
    c_.health->AnnounceLeaving(/*aborted=*/false);
    *stop = true;
    return;
  }
  if (work.left_plan) {
    // The negotiator restarts learning by itself once every rank reports,
    // in a cycle, that it has left (Negotiator::BeginCycle).
    last_cycle_ = Clock::now() - std::chrono::hours(1);  // next cycle at once
    c_.stats->Update([](Stats& s) { ++s.plan_exits; });
    return;
  }
  Attach(work);
  // Plan buckets always run on their streams' threads, never on this one: a
  // rank whose negotiation thread sat in a bucket's collective could not
  // join the online cycle another rank waits in before its own bucket.
  const int plan_streams = c_.streams;
  for (size_t i = 0; i < work.buckets.size(); ++i) {
    c_.executor->Submit(static_cast<int>(work.buckets[i].first % plan_streams),
                        std::move(work.buckets[i].second), std::move(work.work[i]));
  }
  if (work.online) RunCycle(stop);
}

}  // namespace perseus
