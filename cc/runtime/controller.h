// The controller: one round's control plane. A round (Runtime::Init to
// Shutdown) owns one Controller, which owns what only the negotiation thread
// uses: the thread itself, the negotiator (what every rank has asked for and
// what is ready), the cycle clock, and the offline mode's loop over plan
// buckets. Shutdown joins the thread and destroys the controller whole, so
// no negotiation state, thread or learned plan outlives its round.
//
// The controller works on its runtime's request-side state (the queue, the
// pending requests, the offline plan, all guarded by Runtime::mu_), which
// Enqueue shares, and hands ready work to the runtime's executor.
//   controller.cc  the loop, one negotiation cycle, dispatching responses
//   offline.cc     entering, running and leaving an offline plan
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cc/runtime/message.h"
#include "cc/runtime/negotiation.h"
#include "cc/runtime/request.h"

namespace perseus {

class Runtime;

class Controller {
 public:
  explicit Controller(Runtime& runtime);
  // Joins the thread if Join was not called.
  ~Controller();
  Controller(const Controller&) = delete;
  Controller& operator=(const Controller&) = delete;

  // Starts the negotiation thread; it runs until every rank asked to shut
  // down (in the same cycle) or the runtime failed.
  void Start();
  void Join();

 private:
  using Clock = std::chrono::steady_clock;

  // What one cycle's control exchange brought: every rank's message, rank
  // 0's clock, and whether any rank runs an offline plan.
  struct Exchanged {
    std::vector<CycleMessage> all;
    int64_t clock = 0;
    bool any_in_plan = false;
    int64_t control_bytes = 0;
  };

  void Loop();
  void RunCycle(bool* stop);
  // The cycle's control allgather (one fixed slot per rank, a second
  // allgather for what did not fit).
  Exchanged ExchangeControl(CycleMessage mine, int64_t my_clock, bool in_plan);
  // Rank 0 prints the stall inspector's report.
  void ReportStalls(const std::vector<std::string>& stalls) const;
  // Hands a response with its local requests to the executor. lone: the
  // cycle's only response, which may run on this thread. any_in_plan: some
  // rank runs an offline plan in this cycle (then online work takes the
  // extra stream on every rank). joined: this rank was in join() when the
  // cycle began (it may lack names).
  void Dispatch(Response response, bool lone, bool any_in_plan, bool joined);
  std::shared_ptr<Request> StandIn(const Response& response, size_t index);

  // Offline mode (offline.cc): runs the plan's buckets, negotiates the rest.
  void RunOffline(bool* stop);
  // How long plannable requests wait for a plan bucket this rank cannot
  // complete before it votes to leave the plan.
  std::chrono::milliseconds PlanDeadline() const;
  void ReportPlanTimeoutLocked(Clock::time_point oldest);
  void EnterOffline();
  void LeaveOfflineLocked();
  // A plan bucket's collective finished with `votes`; false: do not deliver
  // (the real requests go back to pending, to be negotiated online). Runs
  // on a stream's thread.
  bool PlanBucketFinished(int64_t votes, const std::vector<std::shared_ptr<Request>>& requests,
                          int plan_index);

  Runtime& rt_;
  std::unique_ptr<Negotiator> negotiator_;
  std::thread thread_;
  Clock::time_point started_;  // this rank's clock origin
  Clock::time_point last_cycle_;
  int idle_cycles_ = 0;
  uint64_t dispatched_ = 0;  // online responses, for their streams in turn
};

}  // namespace perseus
