// The controller: one round's control plane. A round (Runtime::Init to
// Shutdown) owns one Controller, which owns what only the negotiation thread
// uses: the thread itself, the negotiator (what every rank has asked for and
// what is ready), the cycle clock, and the offline mode's loop over plan
// buckets. Shutdown joins the thread and destroys the controller whole, so
// no negotiation state, thread or learned plan outlives its round.
//
// It reaches the rest of the round only through ControllerContext: it takes
// requests from the request table (request_table.h), hands ready work to the
// executor, and reports a failure through one callback.
//   controller.cc  the loop, one negotiation cycle, dispatching responses
//   plan/offline.cc  running an offline plan's steps
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cc/core/timeline.h"
#include "cc/runtime/activity.h"
#include "cc/runtime/message.h"
#include "cc/runtime/negotiation.h"
#include "cc/runtime/options.h"
#include "cc/runtime/request.h"
#include "cc/runtime/request_table.h"
#include "cc/runtime/stats.h"

namespace perseus {

class Executor;
class FaultInjector;
class HealthMonitor;
class Transport;

struct ControllerContext {
  Topology ranks;                   // this runtime's members and this rank among them
  NegotiationSettings negotiation;  // cycles, fusion, stalls, the offline plan's check
  int streams = 4;                  // TransportSettings::streams: where responses run
  double timeout_seconds = 60;      // TransportSettings::timeout_seconds: the plan's deadline
  int perf_check_n_steps = 0;       // HealthSettings::perf_check_n_steps: plan steps carry times
  RequestTable* requests = nullptr;
  Executor* executor = nullptr;
  Transport* control = nullptr;  // the control context (Transport::kControl)
  HealthMonitor* health = nullptr;
  StatsBook* stats = nullptr;
  Timeline* timeline = nullptr;
  const std::atomic<bool>* mark_cycles = nullptr;  // the timeline records cycles
  // The negotiation thread says here what it waits for (failure reports).
  std::shared_ptr<Activity> activity;
  FaultInjector* faults = nullptr;                 // test-only; null in production
  // Whether the round still runs (not failed, not shut down).
  std::function<bool()> running;
  // Fails the round with this description.
  std::function<void(const std::string& what)> fail;
  // Every rank agreed to shut down and the executor has drained.
  std::function<void()> stopped;
};

class Controller {
 public:
  explicit Controller(ControllerContext context);
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
  // Records in the activity board what this thread waits for (null: done).
  void Doing(const char* what);
  void RunCycle(bool* stop);
  // The cycle's control allgather (one fixed slot per rank, a second
  // allgather for what did not fit).
  Exchanged ExchangeControl(CycleMessage mine, int64_t my_clock, bool in_plan);
  // Rank 0 prints the stall inspector's report: what it means once, then
  // only what still waits.
  void ReportStalls(const std::vector<std::string>& stalls);
  // Hands a response with its local requests to the executor. lone: the
  // cycle's only response, which may run on this thread. any_in_plan: some
  // rank runs an offline plan in this cycle (then online work takes the
  // extra stream on every rank). joined: this rank was in join() when the
  // cycle began (it may lack names).
  void Dispatch(Response response, bool lone, bool any_in_plan, bool joined);
  // Stream threads complete these with `status` (a failed response) and the
  // rest of its grouped calls with the reason they did not run.
  void Complete(const Response& response, const Requests& requests, const Requests& siblings);
  int WorldRank(int r) const { return WorldRankOf(c_.ranks, r); }

  // Offline mode (plan/offline.cc): runs the plan's buckets, negotiates the rest.
  void RunOffline(bool* stop);
  // How long plannable requests wait for a plan bucket this rank cannot
  // complete before it votes to leave the plan.
  std::chrono::milliseconds PlanDeadline() const;
  void EnterOffline();
  // Attaches to a plan step's buckets what only this thread knows: the plan
  // check's work and each bucket's outcome.
  void Attach(RequestTable::PlanWork& work);
  // A plan bucket's collective finished with `votes`; false: do not deliver
  // (the real requests go back to pending, to be negotiated online). Runs
  // on a stream's thread.
  bool PlanBucketFinished(int64_t votes, const Requests& requests, int plan_index);

  ControllerContext c_;
  bool stalls_explained_ = false;  // the stall inspector's header was printed
  RequestTable& table_;
  std::unique_ptr<Negotiator> negotiator_;
  std::thread thread_;
  Clock::time_point started_;  // this rank's clock origin
  Clock::time_point last_cycle_;
  int idle_cycles_ = 0;
  // The end of the last cycle that brought a request or a response.
  Clock::time_point last_progress_ = Clock::now();
  uint64_t dispatched_ = 0;  // online responses, for their streams in turn
  // The test faults' hook at each plan step's first bucket (empty without).
  std::function<void(int64_t step, Plan* plan)> on_plan_step_;
};

}  // namespace perseus
