// The offline plan (PERSEUS_OFFLINE_NEG): one interface for the folder
// cc/runtime/plan/, which holds all of it. A training step's allreduces are
// learned from online negotiation (PlanLearner, learner.cc, owned by the
// Negotiator), then every rank replays the step's buckets with no control
// messages (OfflinePlan, state.cc, driven by the request table:
// request_table_plan.cc; the controller's loop: offline.cc). The ranks
// compare their copies of the plan every few steps (DigestPlan and
// CheckPlans, check.cc). A bucket carries the plan's extras in its envelope
// (envelope.h, the one plan header the data path sees).
//
// Leaving is agreed in-band (request_table_plan.cc explains the protocol):
// every bucket carries this rank's vote; a voted-down bucket is delivered
// nowhere, and once the step's buckets are all finished every rank leaves.
//
// Outside this folder only plan.h and envelope.h are included
// (tests/test_layout.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cc/core/common.h"
#include "cc/core/timeline.h"
#include "cc/runtime/message.h"
#include "cc/runtime/options.h"
#include "cc/runtime/response.h"

namespace perseus {

// A training step's communication, learned online and then replayed with no
// control messages: allreduce buckets in a fixed order. Every rank builds the
// same plan from the same negotiation results.
struct Plan {
  std::vector<Response> buckets;
  std::unordered_map<std::string, TensorMeta> metas;  // every planned name
  std::unordered_map<std::string, size_t> bucket_of;  // name -> bucket index
};

// True when a locally enqueued request can run as the planned `planned`.
bool MatchesPlan(const TensorMeta& local, const TensorMeta& planned);

// Bucket size of an offline plan whose step holds step_bytes, from
// PERSEUS_ALLREDUCE_FUSION (granularity): 0 one tensor per bucket (returns
// 0), N > 0 about step/N, -1 automatic (see learner.cc).
int64_t PlanBucketBytes(int64_t step_bytes, int granularity, int64_t fusion_threshold_bytes);

// Learning a plan, identically on every rank. Plannable allreduces
// (kMetaPlannable, every rank) are watched as negotiation completes them:
// the names between two repetitions form a step; once the next step has
// exactly the same names and metas, and a cycle ends exactly at a step
// boundary, Ready() turns true.
class PlanLearner {
 public:
  // One negotiation cycle's ready responses, in order.
  void Watch(const std::vector<Response>& ready);
  // The cycle ended. any_in_plan: some rank still runs a plan (learning
  // pauses until every rank has left); plannable_in_table: a plannable call
  // is half-negotiated (asked only while learning waits for a quiet cycle).
  void EndCycle(bool any_in_plan, const std::function<bool()>& plannable_in_table);
  bool Ready() const { return state_ == State::kReady; }
  // The plan: buckets in the first step's order, each run of tensors that
  // completed in one cycle fused by `fuse` up to bucket_bytes(step bytes).
  // Learning starts again afterwards.
  using Fuse = std::function<std::vector<Response>(std::vector<Response>, int64_t threshold)>;
  Plan Build(const Fuse& fuse, const std::function<int64_t(int64_t step_bytes)>& bucket_bytes);
  // Starts learning again from the next quiet cycle.
  void Reset();

 private:
  void WatchOne(const Response& r);

  // kWait: after a change, wait for a quiet moment (no plannable request
  // half-negotiated) so that recording starts at a step boundary.
  enum class State { kWait, kRecord, kVerify, kReady };
  State state_ = State::kRecord;
  std::vector<std::string> step_order_;               // first recorded step
  std::unordered_map<std::string, TensorMeta> step_;  // its names
  std::unordered_map<std::string, int64_t> step_cycle_;  // the cycle each completed in
  int64_t cycles_ = 0;                                // Watch calls
  std::unordered_map<std::string, bool> seen_;        // names of the step being checked
  int verified_steps_ = 0;
};

// What the plan check compares: one digest and one description per
// position of a rank's copy of the plan, taken when the step starts.
struct PlanDigest {
  int64_t step = 0;
  std::vector<int64_t> digests;
  std::vector<std::string> described;
};

// The plan check (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS): this rank's digest of
// `plan` before plan step `step`, and the comparison with every rank's
// through `allreduce` (collective: every rank calls it before the same
// step). CheckPlans throws, naming the ranks and what each holds at the
// first position where the plans differ (check.cc explains why).
std::shared_ptr<PlanDigest> DigestPlan(const Plan& plan, int64_t step);
void CheckPlans(const PlanDigest& mine, const BufferAllreduce& allreduce,
                const Topology& ranks, int check_n_steps, Timeline& timeline);

// Running a plan, for one rank: which bucket runs next, which of its
// tensors are pending here, whether this rank votes to leave, and when a
// step starts and ends. The request table (request_table.h) drives this
// object under its lock and keeps the requests themselves.
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
