// Online negotiation: deciding, identically on every rank, which requested
// collectives are ready and in which order they run.
//
// Every rank feeds the Negotiator the same sequence of (rank, TensorMeta)
// pairs (the allgathered cycle messages, in rank order), so every rank's
// Negotiator reaches the same decisions without a coordinator reply. A name
// is ready once every rank has asked for it; ready names run in the order in
// which they first appeared. Requests that disagree across ranks become error
// responses that every rank raises, so a mismatch never hangs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cc/core/common.h"
#include "cc/core/reduce.h"
#include "cc/runtime/message.h"
#include "cc/runtime/plan/plan.h"
#include "cc/runtime/response.h"

namespace perseus {

class Negotiator {
 public:
  // world_ranks: how error messages name each member (default 0..size-1).
  // plan_bucket_bytes: bucket size of offline plans (PERSEUS_ALLREDUCE_FUSION
  // decides it from the step's total); 0: no fusion; < 0: fusion_threshold_bytes.
  Negotiator(int size, int64_t fusion_threshold_bytes, std::vector<int> world_ranks = {},
             std::function<int64_t(int64_t step_bytes)> plan_bucket_bytes = nullptr);

  // Starts a cycle. now_ms: the negotiation clock, rank 0's milliseconds
  // since its runtime started, which every rank receives in the cycle, so
  // time-based verdicts (stall timeout, stall report) agree on every rank.
  // any_in_plan: some rank still runs an offline plan this cycle; plan
  // learning pauses until every rank has left (ranks leave a plan at their
  // own pace, so learning must restart at a cycle they all see).
  void BeginCycle(int64_t now_ms, bool any_in_plan);
  void Add(int rank, const TensorMeta& meta);
  // Ready work, fused and ordered. Identical on every rank.
  std::vector<Response> TakeReady();
  // Names some but not all ranks have requested.
  bool HasPending() const {
    for (const auto& kv : table_) {
      if (kv.second.refusal.empty()) return true;  // nobody waits on a refused call
    }
    return false;
  }
  // Names whose call numbers are kept: those with a call open (memory stays
  // bounded by the names in flight, however many distinct names a job uses).
  size_t NamesTracked() const { return next_call_.size(); }
  // Describes stalled requests: which ranks have not asked yet.
  std::string DescribePending() const;
  // Names requested by some ranks for more than timeout_ms of negotiation
  // clock become error responses naming who asked and who did not (every
  // rank computes the same list). Ranks that never asked ignore them.
  std::vector<Response> TakeStalled(int64_t timeout_ms);
  // The stall inspector: one line per name that some ranks have requested
  // for at least check_ms and others have not, each name again every
  // check_ms while it waits. Oldest first.
  std::vector<std::string> StallReport(int64_t check_ms);

  // Offline planning (plan.h): every cycle's ready work is watched by the
  // plan learner; PlanReady() once a step has repeated and a cycle ended at
  // its boundary.
  bool PlanReady() const { return learner_.Ready(); }
  // Builds the plan (buckets in the first step's order, fused up to the
  // plan's bucket size) and forgets plannable requests still being
  // negotiated: the ranks that sent them have them pending and will run
  // them from the plan.
  Plan TakePlan();
  // Starts learning again (after the ranks left a plan).
  void ResetPlanning() { learner_.Reset(); }

 private:
  // A rank's calls of one name are numbered in the order the others receive
  // them (each rank's cycle messages keep its submit order), so the k-th
  // call of a name on one rank pairs with the k-th call on every other, a
  // refused call included: a refusal fails exactly the call it refuses, and
  // the ranks' later calls of the name stay in step whatever order their
  // refusals and calls arrive in.
  using Key = std::pair<std::string, uint64_t>;  // (name, call number)
  struct Entry {
    uint64_t seq = 0;
    int64_t first_ms = 0;     // negotiation clock when a rank first asked
    int64_t reported_ms = 0;  // last stall report of it (0: none)
    int count = 0;
    std::vector<bool> have;
    std::vector<TensorMeta> metas;  // indexed by rank
    // Non-empty: a rank refused this call (kMetaRejected), and every rank's
    // request of it fails with this message as it arrives; the entry stays
    // until every rank has answered it, so that their next calls pair.
    std::string refusal;
    std::vector<bool> failed;  // the ranks whose request of it has failed already
  };

  // Every rank either asked for it or has joined (and at least one asked).
  bool Complete(const Entry& e) const;
  // Every rank has made the call or has joined (a refused call is over then).
  bool Answered(const Entry& e) const;
  // Marks the call refused by `rank` (the first refusal's reason stands) and
  // queues the failure of the requests that have come; each later asker of
  // a refused call comes through here too.
  void Refuse(const Key& key, Entry& e, int rank, const TensorMeta& meta);
  // Removes a call that is over: a rank that never made it (joined, or
  // silent until a stall timeout, or running it from a plan) skips it, so
  // its next call of the name pairs with the others' next.
  void Forget(std::map<Key, Entry>::iterator it);
  // Names (by seq) some ranks have waited on for at least age_ms; joins
  // and refused calls (nobody waits on those) excepted.
  std::map<uint64_t, Key> WaitingSince(int64_t age_ms) const;
  // "ranks 0, 2 have submitted it; rank 1 has not".
  std::string WhoAsked(const Entry& e) const;
  Status Validate(const std::string& name, const Entry& e) const;
  bool PlannableInTable() const;
  Response MakeResponse(const std::string& name, Entry&& e) const;
  // The failure of a refused call for the ranks whose request of it has
  // arrived since the last one (false: none has).
  bool TakeRefusedFailure(const std::string& name, Entry& e, Response* out);
  std::vector<Response> Fuse(std::vector<Response> ready, int64_t threshold) const;

  int size_;
  std::vector<int> world_;
  int64_t fusion_threshold_;
  std::function<int64_t(int64_t)> plan_bucket_bytes_;
  uint64_t next_seq_ = 0;
  int64_t now_ms_ = 0;
  bool any_in_plan_ = false;
  std::vector<bool> joined_;
  std::vector<uint64_t> join_order_;  // when each rank joined (Add count)
  uint64_t adds_ = 0;
  std::map<Key, Entry> table_;
  std::map<uint64_t, Key> complete_;  // seq -> call, this cycle
  // Per name with a call open: each rank's number for its next call of it.
  // A name none has open is forgotten (every rank's count is equal then, and
  // numbers only pair calls, so they start again from 0 alike).
  std::unordered_map<std::string, std::vector<uint64_t>> next_call_;

  PlanLearner learner_;
};

}  // namespace perseus
