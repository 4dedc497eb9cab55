// Learning a plan (plan.h): the responses of plannable allreduces are
// watched, one training step's tensors recorded, the next steps verified to
// repeat it, and the step handed over as a plan of buckets. The Negotiator
// (negotiation.cc) feeds it each cycle's ready work.
#include <algorithm>

#include "cc/runtime/plan/plan.h"

namespace perseus {

bool MatchesPlan(const TensorMeta& a, const TensorMeta& b) {
  return a.op == b.op && a.dtype == b.dtype && a.reduce_op == b.reduce_op && a.group == b.group &&
         a.shape == b.shape && a.prescale == b.prescale && a.postscale == b.postscale &&
         a.compression == b.compression && (a.flags & kMetaPlannable) &&
         !(a.flags & kMetaNonFinite);
}

int64_t PlanBucketBytes(int64_t step_bytes, int g, int64_t fusion_threshold_bytes) {
  if (g == 0) return 0;
  if (g > 0) return std::max<int64_t>(1, (step_bytes + g - 1) / g);
  // Automatic: the step in two buckets (two streams reduce at once;
  // on the 2-vCPU machine ResNet-50's step took 1.14x a raw allreduce this
  // way, against 1.24x with 64 MiB + rest and 1.2-1.34x with 4 or more
  // buckets), none under 4 MiB and none over the fusion threshold.
  // A little over half: buckets are filled tensor by tensor, in order.
  const int64_t half = step_bytes / 20 * 11 + 1;
  return std::min<int64_t>(fusion_threshold_bytes,
                           std::max<int64_t>(half, int64_t{4} << 20));
}

void PlanLearner::Reset() {
  state_ = State::kWait;
  step_order_.clear();
  step_.clear();
  step_cycle_.clear();
  seen_.clear();
  verified_steps_ = 0;
}

void PlanLearner::Watch(const std::vector<Response>& ready) {
  ++cycles_;
  // A plan is taken only at a cycle that ends exactly where the recorded
  // step does. A recorded step whose end shares a cycle with the next
  // step's first tensors did not start at a training step's boundary (no
  // training step's tensor can complete in the cycle that ends the one
  // before: its caller waits for those results): recording began at a
  // quiet cycle inside a step. Learning starts again at the next quiet
  // cycle, rather than waiting for a cycle to end at that point by chance.
  for (const Response& r : ready) {
    if (state_ == State::kReady && !seen_.empty()) Reset();
    WatchOne(r);
  }
  if (state_ == State::kReady && !seen_.empty()) Reset();
}

void PlanLearner::EndCycle(bool any_in_plan, const std::function<bool()>& plannable_in_table) {
  if (any_in_plan) {
    Reset();  // learning starts again once every rank has left the plan
  } else if (state_ == State::kWait && !plannable_in_table()) {
    state_ = State::kRecord;
  }
}

void PlanLearner::WatchOne(const Response& r) {
  bool plannable = r.error.ok() && r.op == OpType::kAllreduce;
  for (const TensorMeta& m : r.metas) {
    plannable = plannable && (m.flags & kMetaPlannable) &&
                (m.reduce_op == ReduceOp::kSum || m.reduce_op == ReduceOp::kAverage);
  }
  if (!plannable) return;  // other collectives neither join nor break a plan
  for (size_t i = 0; i < r.names.size(); ++i) {
    const std::string& name = r.names[i];
    const TensorMeta& meta = r.metas[i];
    if (state_ == State::kWait) return;
    if (state_ == State::kRecord) {
      if (!step_.count(name)) {
        step_order_.push_back(name);
        step_[name] = meta;
        step_cycle_[name] = cycles_;
        continue;
      }
      state_ = State::kVerify;  // a name came back: the step ended
      seen_.clear();
    }
    // Verifying (or ready, which keeps verifying every later step).
    auto it = step_.find(name);
    if (it == step_.end() || seen_.count(name) || !MatchesPlan(meta, it->second)) {
      Reset();  // the step changed: learn it again from the next boundary
      return;
    }
    seen_[name] = true;
    if (seen_.size() == step_.size()) {
      seen_.clear();
      ++verified_steps_;
      state_ = State::kReady;
    }
  }
}

Plan PlanLearner::Build(const Fuse& fuse,
                        const std::function<int64_t(int64_t step_bytes)>& bucket_bytes) {
  Plan plan;
  // Runs of the step's tensors that completed in the same negotiation cycle
  // (step order), fused separately: a bucket never holds tensors that
  // completed in different cycles. Tensors that complete together were all
  // submitted by every rank before any of them ran, so none of their calls
  // waits for another's result; a call submitted only after another
  // finished (TF runs a tf.function's stateful ops in program order) never
  // completes with it, and a bucket that held both could never fill.
  std::vector<std::vector<Response>> runs;
  int64_t step_bytes = 0;
  int64_t run_cycle = -1;
  for (const std::string& name : step_order_) {
    const TensorMeta& m = step_[name];
    Response r;
    r.op = OpType::kAllreduce;
    r.names.push_back(name);
    r.metas.push_back(m);
    step_bytes += NumElements(m.shape) * static_cast<int64_t>(DataTypeSize(m.dtype));
    if (runs.empty() || step_cycle_[name] != run_cycle) runs.emplace_back();
    run_cycle = step_cycle_[name];
    runs.back().push_back(std::move(r));
  }
  const int64_t threshold = bucket_bytes(step_bytes);
  for (auto& run : runs) {
    for (Response& b : fuse(std::move(run), threshold)) plan.buckets.push_back(std::move(b));
  }
  plan.metas = step_;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (const std::string& name : plan.buckets[b].names) plan.bucket_of[name] = b;
  }
  Reset();
  return plan;
}

}  // namespace perseus
