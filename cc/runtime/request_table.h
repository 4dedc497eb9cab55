// The request table: what this rank has asked for and not yet run. It holds
// the queue of metas not yet sent in a negotiation cycle, the pending
// requests by name, the names given up when their grouped call failed, the
// rank's join, the shutdown request, and the request side of the offline
// plan (OfflinePlan, plan/plan.h), under one mutex with one condition variable.
//
// Callers submit (Runtime::Enqueue), the controller takes what a cycle made
// ready or what a plan step can run, and the runtime closes the table when
// the round fails or stops, failing everything pending. Nothing else reads
// these fields: every method takes the lock, and the controller's waits
// happen inside it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cc/core/common.h"
#include "cc/runtime/message.h"
#include "cc/runtime/negotiation.h"
#include "cc/runtime/plan/plan.h"
#include "cc/runtime/request.h"

namespace perseus {

// A request of a joined rank that lacks the tensor: zeros in (neutral for a
// sum), result discarded; for allgather, no rows.
std::shared_ptr<Request> StandIn(const Response& response, size_t index);

class RequestTable {
 public:
  using Clock = std::chrono::steady_clock;

  // A new round: empty, accepting requests. world_rank: this rank, for
  // messages.
  void Open(int world_rank);
  // The round failed or stopped: refuses later submits (Submit says so) and
  // completes every pending request with `status`. Any number of times.
  void Close(const Status& status);

  // A call of one or more requests: all queued, or none. Returns an error
  // for a name twice in the call, a second join, or a name still in flight
  // (submitted and not yet completed, whether negotiating or running): two
  // threads calling one name at once, which the ranks could pair
  // differently. That name fails on every rank: the call in flight
  // completes with an error too, and the others hear of it as a refusal
  // (kMetaRejected). *closed (nothing done) when the table is closed.
  Status Submit(const Requests& requests, Clock::time_point now, bool* closed);
  // A call refused here for a bad argument: its names go to the others as
  // rejected (kMetaRejected), so their requests fail at once.
  void Reject(const Requests& requests, const std::string& why);
  // This rank asks to shut down (sent with the next cycle).
  void RequestShutdown();
  // A shutdown was asked here or agreed in a cycle.
  bool ShuttingDown();
  // Who ended the round by shutdown ("" if nobody), and that rank (in this
  // runtime; -1 if none).
  std::string shutdown_by();
  int shutdown_by_rank();
  bool HasPending();

  // ---- Online cycles (the controller) ----
  struct Queued {
    std::vector<TensorMeta> requests;
    bool shutdown = false;
    bool in_plan = false;
  };
  // Waits until `wake_by` for a queued request or a shutdown; when a request
  // is queued, sends no earlier than `send_at`. Takes the queue.
  Queued TakeQueued(Clock::time_point wake_by, Clock::time_point send_at);
  // A cycle showed `rank` (in this runtime) asking to shut down.
  void ShutdownAgreed(int rank, const std::string& who);
  // Whether this rank is in join() (may lack names of a response).
  bool joined();
  // The local requests a response covers, taken out of pending. A joined
  // rank gets stand-ins for names it lacks; any other rank that lacks one
  // gets `fatal` (its requests stay pending, to fail with the job). For a
  // failed response, the rest of each failed grouped call: run with it
  // (siblings_run) or given up and returned in `siblings`.
  struct Taken {
    Requests requests;
    Requests siblings;
    std::string fatal;
  };
  Taken TakeResponse(const Response& response, bool joined);

  // ---- Offline plans (the controller) ----
  bool InPlan();
  // Every rank took `plan`: plannable requests run from it from now on.
  void EnterPlan(Plan plan);
  // A rank's wait for plan work. wake_also: the controller's own reason to
  // stop waiting (negotiation pending). deadline: how long plannable
  // requests wait for a bucket this rank cannot complete. Returns the
  // timeout's report when this rank voted to leave after it, else "".
  std::string WaitForPlanWork(const std::function<bool()>& wake_also,
                              std::chrono::milliseconds deadline);
  // What a rank of a plan does next, all decided under one lock.
  struct PlanWork {
    bool closed = false;       // the round failed: stop
    bool leave_job = false;    // shut down between steps: leave the job
    bool left_plan = false;    // the step's buckets are done after a vote: left
    bool online = false;       // something to negotiate online too
    std::shared_ptr<PlanDigest> check;  // the plan check before this step
    // (bucket index, response, its requests), in dispatch order.
    std::vector<std::pair<size_t, Response>> buckets;
    std::vector<Requests> work;
    int64_t offline_steps = 0;  // steps whose dispatch ended here with no vote
  };
  // check_every: PERSEUS_OFFLINE_NEG_CHECK_N_STEPS; perf_slots > 0: the
  // step's first bucket carries this rank's time outside communication;
  // negotiating: the controller has online work pending; on_plan_step: a
  // test hook at each step's first bucket (may be empty).
  PlanWork TakePlanWork(int64_t check_every, int perf_slots, bool negotiating,
                        const std::function<void(int64_t step, Plan* plan)>& on_plan_step);
  // A plan bucket's collective finished with `votes`; false: not delivered
  // (its real requests are pending again; those whose name came again
  // meanwhile go to *twice).
  bool FinishPlanBucket(int64_t votes, const Requests& requests, int plan_index,
                        Requests* twice);

 private:
  // Leaves the plan: pending plannable requests queue for online cycles.
  void LeavePlanLocked();

  std::mutex mu_;
  std::condition_variable cv_;
  int world_rank_ = 0;
  bool closed_ = true;
  Status closed_status_;
  std::deque<TensorMeta> queue_;
  std::unordered_map<std::string, std::shared_ptr<Request>> pending_;
  // Every name submitted here whose call has not completed (its `done` has
  // not run): pending, in a plan bucket, or running on a stream. A finished
  // entry is replaced by the next call of its name, or swept.
  struct Flight;
  std::unordered_map<std::string, std::shared_ptr<Flight>> flight_;
  size_t sweep_at_ = 64;
  // A second call of `m.name` came while one was in flight (Submit): fails
  // the one in flight and tells the others; returns the new call's error.
  Status InFlightTwiceLocked(const TensorMeta& m, Flight* flying);
  // Names this rank sent but gave up (their grouped call failed): if the
  // others still run one, the job fails naming it.
  std::unordered_set<std::string> abandoned_;
  bool joined_ = false;  // this rank called join() and it has not completed
  bool shutdown_requested_ = false;
  std::string shutdown_by_;
  int shutdown_by_rank_ = -1;
  OfflinePlan plan_;
  // The controller waits with a deadline for plannable requests that cannot
  // run yet (Submit wakes it when one arrives and it is not).
  bool plan_waiting_ = false;
  // When this rank's previous plan step finished its last bucket.
  Clock::time_point last_step_done_{};
};

}  // namespace perseus
