// Running a plan, for one rank (OfflinePlan, plan.h).
#include "cc/runtime/plan/plan.h"

#include <utility>

namespace perseus {

void OfflinePlan::Enter(Plan plan) {
  plan_ = std::move(plan);
  active_ = true;
  pos_ = 0;
  in_flight_ = 0;
  steps_ = 0;
  checked_ = -1;
  leave_vote_ = aborting_ = step_started_ = false;
  have_.assign(plan_.buckets.size(), 0);
  next_have_.assign(plan_.buckets.size(), 0);
}

void OfflinePlan::Leave() {
  active_ = false;
  leave_vote_ = aborting_ = step_started_ = false;
}

bool OfflinePlan::Fits(const TensorMeta& m) const {
  auto it = plan_.metas.find(m.name);
  if (it == plan_.metas.end() || !MatchesPlan(m, it->second)) return false;
  return !(step_started_ && plan_.bucket_of.at(m.name) < pos_) || EarlyForNextStep();
}

bool OfflinePlan::EarlyForNextStep() const {
  // A name of a bucket already run in this step is the next step's call
  // when this rank holds every tensor of the step's remaining buckets
  // (they wait only to be dispatched). A plan learned from a step that
  // began mid-way through a training step (learning restarts at the first
  // quiet cycle, which may fall inside a backward pass) ends inside the
  // next training step, whose later tensors then arrive before the plan's
  // last bucket has gone. Otherwise the step changed: a vote.
  if (!step_started_ || leave_vote_ || aborting_) return false;
  for (size_t b = pos_; b < plan_.buckets.size(); ++b) {
    if (have_[b] != plan_.buckets[b].names.size()) return false;
  }
  return true;
}

bool OfflinePlan::Arrive(const TensorMeta& m, bool* completes) {
  *completes = false;
  if (!Fits(m)) {
    leave_vote_ = true;
    return false;
  }
  const size_t b = plan_.bucket_of.at(m.name);
  if (step_started_ && b < pos_) {
    ++next_have_[b];  // counted once the step ends (Dispatched)
    return true;
  }
  *completes = ++have_[b] == plan_.buckets[b].names.size();
  return true;
}

bool OfflinePlan::CanDispatch(bool shutting_down) const {
  if (plan_.buckets.empty()) return false;
  // have_ counts the bucket's fitting requests pending on this rank.
  const bool ready = have_[pos_] == plan_.buckets[pos_].names.size();
  const bool voting = leave_vote_ || aborting_ || shutting_down;
  if (step_started_) return voting || ready;
  // A rank that shuts down starts no step: the others may never run it
  // (they go on to other work, or save, or stop too). It leaves once its
  // buckets in flight are done (AtStepBoundary), and they find out from
  // its closed connections.
  if (shutting_down) return false;
  // A new step starts only once every bucket of the previous step has
  // finished here: their summed votes are then known, alike on every rank,
  // so either no rank starts it (a vote came back: all leave) or every rank
  // does (with real data, or with a vote: the step that leaves). A step
  // started while the last bucket was in flight could hold a bucket that
  // ranks leaving on that bucket's votes never run: the starter then waited
  // in its collective until GLOO_TIMEOUT_SECONDS (the soak's shared-memory
  // timeout).
  if (in_flight_ != 0 || aborting_) return false;
  return voting || ready;
}

bool OfflinePlan::CheckDue(int64_t n) const {
  return n > 0 && !step_started_ && steps_ % n == 0 && checked_ != steps_;
}

bool OfflinePlan::Dispatched() {
  have_[pos_] = 0;
  ++in_flight_;
  step_started_ = true;
  pos_ = (pos_ + 1) % plan_.buckets.size();
  if (pos_ != 0) return false;
  step_started_ = false;
  have_.swap(next_have_);  // the next step's early arrivals
  next_have_.assign(plan_.buckets.size(), 0);
  ++steps_;
  return true;
}

bool OfflinePlan::Finished(int64_t votes) {
  --in_flight_;
  if (votes != 0) aborting_ = true;
  return votes == 0;
}

}  // namespace perseus
