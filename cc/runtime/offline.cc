// The controller's offline mode: entering a plan, dispatching a step's buckets
// (OfflinePlan, plan.h, keeps the state), deadlines, leaving.
#include "cc/runtime/controller.h"
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
#include "cc/runtime/faults.h"
#include "cc/runtime/fusion.h"
#include "cc/runtime/plan.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/factory.h"

namespace perseus {
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
// differs, or that arrives for a bucket already run this step while the
// step's later buckets still lack tensors here (with them all present, it is
// the next step's call, come early), or when it is shutting down. A voting rank runs the rest of the step's buckets at once
// with zeros for what it lacks; a bucket with votes is delivered nowhere (its
// requests go back to pending), and once the step's buckets are done every
// rank leaves the plan and sends its pending requests online, where a real
// mismatch is reported by name and a changed step is learned again. Every
// rank runs every bucket of the step exactly once, so no rank waits forever.

void Controller::EnterOffline() {
  std::lock_guard<std::mutex> lock(rt_.mu_);
  rt_.plan_.Enter(negotiator_->TakePlan());
  // Plannable requests not yet sent run from the plan instead.
  std::deque<TensorMeta> keep;
  for (TensorMeta& m : rt_.queue_) {
    if (!(m.flags & kMetaPlannable)) {
      keep.push_back(std::move(m));
    } else if (!rt_.plan_.Fits(m)) {
      rt_.plan_.VoteToLeave();
    }
  }
  rt_.queue_.swap(keep);
  bool completes;
  for (const auto& kv : rt_.pending_) {
    const TensorMeta& m = kv.second->meta;
    if ((m.flags & kMetaPlannable) && rt_.plan_.Fits(m)) rt_.plan_.Arrive(m, &completes);
  }
  std::lock_guard<std::mutex> stats_lock(rt_.stats_mu_);
  ++rt_.stats_.plans;
}

void Controller::LeaveOfflineLocked() {
  rt_.plan_.Leave();
  // Pending plannable requests were never sent: negotiate them now.
  std::vector<const TensorMeta*> resend;
  for (const auto& kv : rt_.pending_) {
    if (kv.second->meta.flags & kMetaPlannable) resend.push_back(&kv.second->meta);
  }
  std::sort(resend.begin(), resend.end(),
            [](const TensorMeta* a, const TensorMeta* b) { return a->name < b->name; });
  for (const TensorMeta* m : resend) rt_.queue_.push_back(*m);
  // The negotiator restarts learning by itself once every rank reports,
  // in a cycle, that it has left (Negotiator::BeginCycle).
  last_cycle_ = Clock::now() - std::chrono::hours(1);  // next cycle at once
  std::lock_guard<std::mutex> stats_lock(rt_.stats_mu_);
  ++rt_.stats_.plan_exits;
}

std::chrono::milliseconds Controller::PlanDeadline() const {
  // Well inside GLOO_TIMEOUT_SECONDS: a rank that had its data entered the
  // bucket's collective and waits there for this rank's vote.
  const double seconds = std::min(10.0, std::max(0.5, rt_.options_.timeout_seconds / 4));
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

void Controller::ReportPlanTimeoutLocked(Clock::time_point oldest) {
  const Response& b = rt_.plan_.next();
  std::vector<std::string> missing;
  for (const std::string& name : b.names) {
    if (!rt_.pending_.count(name)) missing.push_back(name);
  }
  std::ostringstream msg;
  msg << "Perseus rank " << rt_.WorldRank(rt_.options_.rank) << ": offline plan bucket "
      << rt_.plan_.position() << " of " << rt_.plan_.plan().buckets.size() << " (plan step "
      << rt_.plan_.steps() << ") has waited "
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
  std::lock_guard<std::mutex> stats_lock(rt_.stats_mu_);
  ++rt_.stats_.plan_timeouts;
}

bool Controller::PlanBucketFinished(int64_t votes,
                                 const std::vector<std::shared_ptr<Request>>& requests,
                                 int plan_index) {
  bool deliver;
  std::vector<std::shared_ptr<Request>> twice;
  {
    std::lock_guard<std::mutex> lock(rt_.mu_);
    deliver = rt_.plan_.Finished(votes);
    if (plan_index + 1 == static_cast<int>(rt_.plan_.plan().buckets.size())) {
      rt_.last_step_done_ = Clock::now();
    }
    if (!deliver) {
      for (auto& q : requests) {
        // Real ones only. A later call of the same name may have come in
        // meanwhile (the caller did not wait for this one): this one fails
        // rather than being lost.
        if (q->scratch.empty() && !rt_.pending_.emplace(q->meta.name, q).second) twice.push_back(q);
      }
    }
  }
  for (auto& q : twice) {
    q->done(Status::Error(StatusCode::kInvalidArgument,
                          "Perseus allreduce of tensor '" + q->meta.name + "': rank " +
                              std::to_string(rt_.WorldRank(rt_.options_.rank)) +
                              " called it again before this call finished; concurrent "
                              "collectives need distinct names"));
  }
  rt_.queue_cv_.notify_all();
  return deliver;
}

void Controller::RunOffline(bool* stop) {
  std::vector<std::pair<size_t, Response>> buckets;
  std::vector<std::vector<std::shared_ptr<Request>>> work;
  bool online = false;
  {
    std::unique_lock<std::mutex> lock(rt_.mu_);
    auto runnable = [&] {
      return rt_.state_.load() != Runtime::State::kRunning || !rt_.queue_.empty() ||
             negotiator_->HasPending() || rt_.plan_.CanDispatch(rt_.shutdown_requested_) ||
             rt_.plan_.DoneLeaving() || (rt_.shutdown_requested_ && rt_.plan_.AtStepBoundary());
    };
    while (!runnable()) {
      // Plannable requests waiting here for the plan (their bucket, or an
      // earlier one, lacks tensors this rank has not submitted) wait at
      // most PlanDeadline(); then this rank votes to leave the plan.
      Clock::time_point oldest = Clock::time_point::max();
      for (const auto& kv : rt_.pending_) {
        if (kv.second->meta.flags & kMetaPlannable) oldest = std::min(oldest, kv.second->enqueued);
      }
      if (oldest == Clock::time_point::max() || rt_.plan_.PreviousStepRunning()) {
        // Between steps: nothing of ours is waiting, or it waits for the
        // previous step's collectives, which have deadlines of their own.
        rt_.plan_waiting_ = false;
        rt_.queue_cv_.wait_for(lock, std::chrono::seconds(1));
        continue;
      }
      rt_.plan_waiting_ = true;
      // Counted from when the previous step ended, if it ended later.
      const auto deadline = std::max(oldest, rt_.last_step_done_) + PlanDeadline();
      if (Clock::now() >= deadline) {
        ReportPlanTimeoutLocked(oldest);
        rt_.plan_.VoteToLeave();
        break;
      }
      rt_.queue_cv_.wait_until(lock, deadline);
    }
    rt_.plan_waiting_ = false;
    if (rt_.state_.load() != Runtime::State::kRunning) return;
    if (rt_.shutdown_requested_ && rt_.plan_.AtStepBoundary() && rt_.queue_.empty() &&
        !negotiator_->HasPending()) {
      // Between steps, nothing of this rank in flight: leave the job here.
      // A cycle to say so could wait for ranks that run a plan step and
      // never negotiate; instead the store says so, and the others'
      // collectives with this rank fail at once on its closed connections.
      rt_.shutdown_by_ = "rank " + std::to_string(rt_.WorldRank(rt_.options_.rank)) + " called shutdown";
      lock.unlock();
      rt_.AnnounceLeaving();
      *stop = true;
      return;
    }
    const int64_t check_every = rt_.options_.plan_check_n_steps;
    if (rt_.plan_.CanDispatch(rt_.shutdown_requested_) && rt_.plan_.CheckDue(check_every)) {
      // Every rank checks before dispatching the same plan step, on the
      // first stream, after the work already queued there, so the check's
      // collectives line up with the buckets on every rank. It runs on the
      // stream's thread: this thread must stay free to negotiate online.
      Response check;
      check.op = OpType::kAllreduce;
      check.names.push_back("perseus.plan_check");
      std::shared_ptr<PlanDigest> digest = rt_.DigestPlanLocked(rt_.plan_.steps());
      check.control = [this, digest](const BufferAllreduce& allreduce) {
        rt_.CheckPlan(*digest, allreduce);
      };
      rt_.plan_.Checked();
      buckets.emplace_back(0, std::move(check));
      work.emplace_back();
    }
    while (rt_.plan_.CanDispatch(rt_.shutdown_requested_)) {
      if (rt_.plan_.CheckDue(check_every)) break;  // this step is checked first (next pass)
      const size_t index = rt_.plan_.position();
      if (rt_.faults_ && index == 0) rt_.faults_->OnPlanStep(rt_.plan_.steps(), &rt_.plan_.mutable_plan());
      Response r = rt_.plan_.next();
      std::vector<std::shared_ptr<Request>> requests;
      bool stand_in = false;
      for (size_t i = 0; i < r.names.size(); ++i) {
        auto it = rt_.pending_.find(r.names[i]);
        if (it != rt_.pending_.end() && MatchesPlan(it->second->meta, r.metas[i])) {
          requests.push_back(it->second);
          rt_.pending_.erase(it);
        } else {
          requests.push_back(StandIn(r, i));  // zeros; this bucket is voted down
          stand_in = true;
        }
      }
      const bool vote = rt_.plan_.Vote(stand_in, rt_.shutdown_requested_);
      r.carrier_vote = vote ? 1 : 0;
      r.plan_index = static_cast<int>(index);
      if (index == 0 && rt_.options_.perf_check_n_steps > 0) {
        // This rank's time outside communication since its last step ended.
        r.perf_slots = rt_.options_.size;
        if (rt_.last_step_done_ != Clock::time_point{}) {
          r.perf_value =
              std::chrono::duration<double, std::milli>(Clock::now() - rt_.last_step_done_).count();
        }
      }
      // The bucket reports its outcome; the plan decides here what it means.
      r.on_outcome = [this, held = requests, index = r.plan_index](const BucketOutcome& o) {
        if (!o.perf_ms.empty()) rt_.PerfCheckStep(o.perf_ms);
        return PlanBucketFinished(o.votes, held, index);
      };
      buckets.emplace_back(index, std::move(r));
      work.push_back(std::move(requests));
      const bool step_ended = rt_.plan_.Dispatched();
      std::lock_guard<std::mutex> stats_lock(rt_.stats_mu_);
      ++rt_.stats_.responses;
      if (buckets.back().second.names.size() > 1) ++rt_.stats_.fused_responses;
      if (step_ended && !vote) ++rt_.stats_.offline_steps;
    }
    if (buckets.empty() && rt_.plan_.DoneLeaving()) {
      LeaveOfflineLocked();
      return;
    }
    online = !rt_.queue_.empty() || negotiator_->HasPending();
  }
  // Plan buckets always run on their streams' threads, never on this one: a
  // rank whose negotiation thread sat in a bucket's collective could not
  // join the online cycle another rank waits in before its own bucket.
  const int plan_streams = rt_.options_.streams;
  for (size_t i = 0; i < buckets.size(); ++i) {
    rt_.executor_->Submit(static_cast<int>(buckets[i].first % plan_streams),
                      std::move(buckets[i].second), std::move(work[i]));
  }
  if (online) RunCycle(stop);
}

}  // namespace perseus
