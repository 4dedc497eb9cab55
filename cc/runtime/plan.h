// The offline plan's state machine, for one rank: which bucket runs next,
// which of its tensors are pending here, whether this rank votes to leave,
// and when a step starts and ends. Learning the plan is the Negotiator's job
// (negotiation.h); running its buckets is the executor's. The request table
// (request_table.h) drives this object under its lock and keeps the
// requests themselves.
//
// Leaving is agreed in-band (request_table_plan.cc explains the protocol): every bucket
// carries this rank's vote; a voted-down bucket is delivered nowhere, and
// once the step's buckets are all finished every rank leaves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cc/runtime/negotiation.h"

namespace perseus {

class OfflinePlan {
 public:
  // Starts running `plan` (every rank took the same one).
  void Enter(Plan plan);
  void Leave();
  bool active() const { return active_; }
  const Plan& plan() const { return plan_; }
  Plan& mutable_plan() { return plan_; }  // test faults only (faults.h)

  // A plannable request was queued on this rank (or was pending at Enter).
  // False when it does not fit the plan: this rank then votes to leave.
  // *completes: it was the last missing tensor of its bucket.
  bool Arrive(const TensorMeta& m, bool* completes);
  // It fits: a planned name with a matching meta, of a bucket not yet run
  // in this step, or the next step's call of an earlier bucket arriving
  // while this step's remaining buckets are complete here.
  bool Fits(const TensorMeta& m) const;
  void VoteToLeave() { leave_vote_ = true; }

  // The next bucket may be dispatched now (shutting_down: this rank votes).
  bool CanDispatch(bool shutting_down) const;
  // The plan check (every n steps, 0: off) is due before the next step.
  bool CheckDue(int64_t every_n) const;
  void Checked() { checked_ = steps_; }
  // This rank voted a bucket down and every bucket of the step finished:
  // time to leave.
  bool DoneLeaving() const { return aborting_ && !step_started_ && in_flight_ == 0; }
  // Between steps with nothing in flight: a rank that shuts down stops here.
  bool AtStepBoundary() const { return !step_started_ && in_flight_ == 0; }
  // Between steps, the previous step's buckets still running: the next
  // step waits for their outcome (CanDispatch), and its requests are not late.
  bool PreviousStepRunning() const { return !step_started_ && in_flight_ > 0; }

  // The bucket to dispatch next, and its index.
  const Response& next() const { return plan_.buckets[pos_]; }
  size_t position() const { return pos_; }
  int64_t steps() const { return steps_; }
  // This rank's vote for the bucket being dispatched (lacking: it could not
  // fill it with its own data).
  bool Vote(bool lacking, bool shutting_down) const {
    return lacking || leave_vote_ || aborting_ || shutting_down;
  }
  // The bucket at position() was dispatched; true when that ended a step.
  bool Dispatched();
  // A dispatched bucket finished with `votes` summed over the ranks; false:
  // do not deliver it (the step is being aborted).
  bool Finished(int64_t votes);

 private:
  bool EarlyForNextStep() const;

  bool active_ = false;
  Plan plan_;
  size_t pos_ = 0;
  bool leave_vote_ = false;    // a plannable request does not fit the plan
  bool aborting_ = false;      // a bucket of this step was voted down
  bool step_started_ = false;  // a bucket of the current step was dispatched
  int in_flight_ = 0;          // buckets dispatched, not finished
  std::vector<size_t> have_;   // per bucket: fitting requests pending here
  std::vector<size_t> next_have_;  // per bucket: the next step's, arrived early
  int64_t steps_ = 0;          // steps of this plan started
  int64_t checked_ = -1;       // the step whose plan check passed
};

}  // namespace perseus
