// The request table's offline side (request_table.h): entering a plan,
// waiting for a step's tensors, taking the buckets a step can run, a
// bucket's outcome, leaving. OfflinePlan (plan.h) keeps the plan's state;
// this file pairs it with the pending requests.
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
// differs, or that arrives for a bucket already run this step while the
// step's later buckets still lack tensors here (with them all present, it is
// the next step's call, come early), or when it is shutting down. A voting
// rank runs the rest of the step's buckets at once with zeros for what it
// lacks; a bucket with votes is delivered nowhere (its requests go back to
// pending), and once the step's buckets are done every rank leaves the plan
// and sends its pending requests online, where a real mismatch is reported
// by name and a changed step is learned again. Every rank runs every bucket
// of the step exactly once, so no rank waits forever.
#include <algorithm>
#include <sstream>

#include "cc/runtime/plan/plan.h"
#include "cc/runtime/request_table.h"

namespace perseus {

bool RequestTable::InPlan() {
  std::lock_guard<std::mutex> lock(mu_);
  return plan_.active();
}

void RequestTable::EnterPlan(Plan plan) {
  std::lock_guard<std::mutex> lock(mu_);
  plan_.Enter(std::move(plan));
  // Plannable requests not yet sent run from the plan instead.
  std::deque<TensorMeta> keep;
  for (TensorMeta& m : queue_) {
    if (!(m.flags & kMetaPlannable)) {
      keep.push_back(std::move(m));
    } else if (!plan_.Fits(m)) {
      plan_.VoteToLeave();
    }
  }
  queue_.swap(keep);
  bool completes;
  for (const auto& kv : pending_) {
    const TensorMeta& m = kv.second->meta;
    if ((m.flags & kMetaPlannable) && plan_.Fits(m)) plan_.Arrive(m, &completes);
  }
}

void RequestTable::LeavePlanLocked() {
  plan_.Leave();
  // Pending plannable requests were never sent: negotiate them now.
  std::vector<const TensorMeta*> resend;
  for (const auto& kv : pending_) {
    if (kv.second->meta.flags & kMetaPlannable) resend.push_back(&kv.second->meta);
  }
  std::sort(resend.begin(), resend.end(),
            [](const TensorMeta* a, const TensorMeta* b) { return a->name < b->name; });
  for (const TensorMeta* m : resend) queue_.push_back(*m);
}

std::string RequestTable::WaitForPlanWork(const std::function<bool()>& wake_also,
                                          std::chrono::milliseconds deadline_after) {
  std::unique_lock<std::mutex> lock(mu_);
  auto runnable = [&] {
    return closed_ || !queue_.empty() || wake_also() || plan_.CanDispatch(shutdown_requested_) ||
           plan_.DoneLeaving() || (shutdown_requested_ && plan_.AtStepBoundary());
  };
  std::string report;
  while (!runnable()) {
    // Plannable requests waiting here for the plan (their bucket, or an
    // earlier one, lacks tensors this rank has not submitted) wait at most
    // deadline_after; then this rank votes to leave the plan.
    Clock::time_point oldest = Clock::time_point::max();
    for (const auto& kv : pending_) {
      if (kv.second->meta.flags & kMetaPlannable) oldest = std::min(oldest, kv.second->enqueued);
    }
    if (oldest == Clock::time_point::max() || plan_.PreviousStepRunning()) {
      // Between steps: nothing of ours is waiting, or it waits for the
      // previous step's collectives, which have deadlines of their own.
      plan_waiting_ = false;
      cv_.wait_for(lock, std::chrono::seconds(1));
      continue;
    }
    plan_waiting_ = true;
    // Counted from when the previous step ended, if it ended later.
    const auto deadline = std::max(oldest, last_step_done_) + deadline_after;
    if (Clock::now() >= deadline) {
      const Response& b = plan_.next();
      std::vector<std::string> missing;
      for (const std::string& name : b.names) {
        if (!pending_.count(name)) missing.push_back(name);
      }
      std::ostringstream msg;
      msg << "Perseus rank " << world_rank_ << ": offline plan bucket " << plan_.position()
          << " of " << plan_.plan().buckets.size() << " (plan step " << plan_.steps()
          << ") has waited "
          << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - oldest).count() /
                 1000.0
          << " s for ";
      for (size_t i = 0; i < missing.size() && i < 3; ++i) {
        msg << (i ? ", '" : "'") << missing[i] << "'";
      }
      if (missing.size() > 3) msg << " and " << missing.size() - 3 << " more";
      msg << (missing.empty() ? "an earlier bucket" : "") << ", which this rank has not submitted, "
          << "while later gradients wait: this step's calls do not come in the plan's order. "
             "Leaving the plan; online negotiation takes over and learns the step again.\n";
      report = msg.str();
      plan_.VoteToLeave();
      break;
    }
    cv_.wait_until(lock, deadline);
  }
  plan_waiting_ = false;
  return report;
}

RequestTable::PlanWork RequestTable::TakePlanWork(
    int64_t check_every, int perf_slots, bool negotiating,
    const std::function<void(int64_t step, Plan* plan)>& on_plan_step) {
  PlanWork out;
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    out.closed = true;
    return out;
  }
  if (shutdown_requested_ && plan_.AtStepBoundary() && queue_.empty() && !negotiating) {
    // Between steps, nothing of this rank in flight: leave the job here.
    // A cycle to say so could wait for ranks that run a plan step and never
    // negotiate; instead the store says so, and the others' collectives
    // with this rank fail at once on its closed connections.
    shutdown_by_ = "rank " + std::to_string(world_rank_) + " called shutdown";
    out.leave_job = true;
    return out;
  }
  if (plan_.CanDispatch(shutdown_requested_) && plan_.CheckDue(check_every)) {
    // Every rank checks before dispatching the same plan step, on the first
    // stream, after the work already queued there, so the check's
    // collectives line up with the buckets on every rank.
    out.check = DigestPlan(plan_.plan(), plan_.steps());
    plan_.Checked();
  }
  while (plan_.CanDispatch(shutdown_requested_)) {
    if (plan_.CheckDue(check_every)) break;  // this step is checked first (next pass)
    const size_t index = plan_.position();
    if (on_plan_step && index == 0) on_plan_step(plan_.steps(), &plan_.mutable_plan());
    Response r = plan_.next();
    Requests requests;
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
    const bool vote = plan_.Vote(stand_in, shutdown_requested_);
    r.envelope.vote = vote ? 1 : 0;
    r.envelope.plan_index = static_cast<int>(index);
    if (index == 0 && perf_slots > 0) {
      // This rank's time outside communication since its last step ended.
      r.envelope.perf_slots = perf_slots;
      if (last_step_done_ != Clock::time_point{}) {
        r.envelope.perf_value =
            std::chrono::duration<double, std::milli>(Clock::now() - last_step_done_).count();
      }
    }
    out.buckets.emplace_back(index, std::move(r));
    out.work.push_back(std::move(requests));
    if (plan_.Dispatched() && !vote) ++out.offline_steps;
  }
  if (out.buckets.empty() && !out.check && plan_.DoneLeaving()) {
    LeavePlanLocked();
    out.left_plan = true;
    return out;
  }
  out.online = !queue_.empty() || negotiating;
  return out;
}

bool RequestTable::FinishPlanBucket(int64_t votes, const Requests& requests, int plan_index,
                                    Requests* twice) {
  bool deliver;
  {
    std::lock_guard<std::mutex> lock(mu_);
    deliver = plan_.Finished(votes);
    if (plan_index + 1 == static_cast<int>(plan_.plan().buckets.size())) {
      last_step_done_ = Clock::now();
    }
    if (!deliver) {
      for (auto& q : requests) {
        // Real ones only. A later call of the same name may have come in
        // meanwhile (the caller did not wait for this one): this one fails
        // rather than being lost.
        if (q->scratch.empty() && !pending_.emplace(q->meta.name, q).second) {
          twice->push_back(q);
        }
      }
    }
  }
  cv_.notify_all();
  return deliver;
}

}  // namespace perseus
