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

namespace perseus {

// What the plan check compares (plan_check.h): one digest and one description
// per position of a rank's copy of the plan, taken when the step starts.
struct PlanDigest {
  int64_t step = 0;
  std::vector<int64_t> digests;
  std::vector<std::string> described;
};

// What an offline plan bucket's collective reported, summed over the ranks:
// the votes to leave the plan, and each rank's perf-check time (ms; empty
// unless the bucket carried them).
struct BucketOutcome {
  int64_t votes = 0;
  std::vector<double> perf_ms;
};

// A stream's allreduce of a buffer (its algorithm chosen as for any bucket).
using BufferAllreduce = std::function<void(void* data, size_t count, DataType dtype, ReduceOp op)>;

// One unit of work that every rank executes in the same order.
struct Response {
  OpType op = OpType::kAllreduce;
  // Tensor names; more than one for a fused allreduce bucket.
  std::vector<std::string> names;
  // Meta of each tensor as rank 0 sent it (identical on all ranks once
  // validated, except first dimensions and splits, kept below). For a join,
  // metas[0].root is the rank that joined last.
  std::vector<TensorMeta> metas;
  // allgather: first dimension of each rank's tensor, per name.
  std::vector<std::vector<int64_t>> first_dims;
  // alltoall: splits[r][d] = rows rank r sends to rank d.
  std::vector<std::vector<int64_t>> splits;
  // Non-OK: every rank completes these names with this error.
  Status error;
  // A refused call's failure (kMetaRejected): per rank, whether this
  // response fails its request of the name. The others ignore it: a rank
  // that refused the call, or whose request of it failed already, may have
  // its next call of the name pending. Empty: every rank.
  std::vector<bool> real_request;
  // An error response whose every rank sent the name in a grouped call of
  // the same size (and none refused it or has joined): every rank holds the
  // call's other tensors too, so they still run everywhere and fail with
  // this error afterwards, instead of being given up on some ranks while
  // the others run them.
  bool siblings_run = false;
  // Offline plan bucket: >= 0 is this rank's vote, carried as one extra
  // summed element (1 = this rank's data does not fit: abort and leave).
  int carrier_vote = -1;
  // Offline plan bucket: its index in the plan, and (first bucket of a step,
  // with PERSEUS_PERF_CHECK_N_STEPS) one more summed slot per rank carrying
  // each rank's time outside communication (ms); this rank fills its own.
  int plan_index = -1;
  int perf_slots = 0;
  double perf_value = 0;
  // Set: not a collective of tensors but work the plan attached (its
  // check), run in this stream's order on every rank, given the stream's
  // allreduce of a buffer.
  std::function<void(const BufferAllreduce&)> control;
  // A plan bucket's verdict: what the plan does with the bucket's outcome,
  // attached when the plan dispatches it (the executor only reports). False:
  // do not deliver; the plan took the requests back.
  std::function<bool(const BucketOutcome&)> on_outcome;
};

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

  // Offline planning. Plannable allreduces (kMetaPlannable, every rank) are
  // watched as they complete: the names between two repetitions form a step;
  // once the next step has exactly the same names and metas, and a cycle ends
  // exactly at a step boundary, PlanReady() turns true.
  bool PlanReady() const { return plan_state_ == PlanState::kReady; }
  // Builds the plan (buckets in the first step's order, fused up to the
  // threshold) and forgets plannable requests still being negotiated: the
  // ranks that sent them have them pending and will run them from the plan.
  Plan TakePlan();
  // Starts learning again (after the ranks left a plan).
  void ResetPlanning();

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
  void WatchForPlan(const Response& r);
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

  // kWait: after a change, wait for a quiet moment (no plannable request
  // half-negotiated) so that recording starts at a step boundary.
  enum class PlanState { kWait, kRecord, kVerify, kReady };
  PlanState plan_state_ = PlanState::kRecord;
  std::vector<std::string> step_order_;               // first recorded step
  std::unordered_map<std::string, TensorMeta> step_;  // its names
  std::unordered_map<std::string, int64_t> step_cycle_;  // the cycle each completed in
  int64_t ready_cycles_ = 0;  // TakeReady calls
  std::unordered_map<std::string, bool> seen_;        // names of the step being checked
  int verified_steps_ = 0;
};

}  // namespace perseus
