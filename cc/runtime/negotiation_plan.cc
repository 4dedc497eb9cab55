// The offline plan's side of negotiation: a Negotiator watches the
// responses of plannable allreduces, records one training step's tensors,
// verifies that the next steps repeat it, and hands the step over as a plan
// of buckets (see plan.h). The rest of the Negotiator is in negotiation.cc.
#include "cc/runtime/negotiation.h"

#include <iterator>

namespace perseus {

bool MatchesPlan(const TensorMeta& a, const TensorMeta& b) {
  return a.op == b.op && a.dtype == b.dtype && a.reduce_op == b.reduce_op && a.group == b.group &&
         a.shape == b.shape && a.prescale == b.prescale && a.postscale == b.postscale &&
         a.compression == b.compression && (a.flags & kMetaPlannable) &&
         !(a.flags & kMetaNonFinite);
}

bool Negotiator::PlannableInTable() const {
  for (const auto& kv : table_) {
    for (int r = 0; r < size_; ++r) {
      if (kv.second.have[r] && (kv.second.metas[r].flags & kMetaPlannable)) return true;
    }
  }
  return false;
}

void Negotiator::ResetPlanning() {
  plan_state_ = PlanState::kWait;
  step_order_.clear();
  step_.clear();
  step_cycle_.clear();
  seen_.clear();
  verified_steps_ = 0;
}

void Negotiator::WatchForPlan(const Response& r) {
  bool plannable = r.error.ok() && r.op == OpType::kAllreduce;
  for (const TensorMeta& m : r.metas) {
    plannable = plannable && (m.flags & kMetaPlannable) &&
                (m.reduce_op == ReduceOp::kSum || m.reduce_op == ReduceOp::kAverage);
  }
  if (!plannable) return;  // other collectives neither join nor break a plan
  for (size_t i = 0; i < r.names.size(); ++i) {
    const std::string& name = r.names[i];
    const TensorMeta& meta = r.metas[i];
    if (plan_state_ == PlanState::kWait) return;
    if (plan_state_ == PlanState::kRecord) {
      if (!step_.count(name)) {
        step_order_.push_back(name);
        step_[name] = meta;
        step_cycle_[name] = ready_cycles_;
        continue;
      }
      plan_state_ = PlanState::kVerify;  // a name came back: the step ended
      seen_.clear();
    }
    // Verifying (or ready, which keeps verifying every later step).
    auto it = step_.find(name);
    if (it == step_.end() || seen_.count(name) || !MatchesPlan(meta, it->second)) {
      ResetPlanning();  // the step changed: learn it again from the next boundary
      return;
    }
    seen_[name] = true;
    if (seen_.size() == step_.size()) {
      seen_.clear();
      ++verified_steps_;
      plan_state_ = PlanState::kReady;
    }
  }
}

Plan Negotiator::TakePlan() {
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
  int64_t threshold = plan_bucket_bytes_ ? plan_bucket_bytes_(step_bytes) : -1;
  for (auto& run : runs) {
    for (Response& b : Fuse(std::move(run), threshold < 0 ? fusion_threshold_ : threshold)) {
      plan.buckets.push_back(std::move(b));
    }
  }
  plan.metas = step_;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    for (const std::string& name : plan.buckets[b].names) plan.bucket_of[name] = b;
  }
  // Plannable entries still being negotiated are dropped on every rank alike.
  for (auto it = table_.begin(); it != table_.end();) {
    bool plannable = false;
    for (int r = 0; r < size_; ++r) {
      plannable |= it->second.have[r] && (it->second.metas[r].flags & kMetaPlannable);
    }
    if (plannable) {
      auto over = it++;
      Forget(over);  // every rank runs this call from the plan
    } else {
      ++it;
    }
  }
  ResetPlanning();
  return plan;
}

}  // namespace perseus
