// Test-only faults, read from the environment once, at Init. In production
// none is set, FaultInjector::FromEnv returns null, and the runtime's paths
// test only that pointer:
//   PERSEUS_TEST_EXIT_BEFORE_SHM=R  world rank R exits (status 7) while the
//                                   others set up shared memory;
//   PERSEUS_TEST_PLAN_SWAP=R:S      world rank R swaps two same-shaped tensors
//                                   of a bucket in its copy of the plan when
//                                   plan step S starts (a divergence the votes
//                                   cannot see; the plan check must).
//   PERSEUS_TEST_ERROR_DISPATCH_DELAY_MS=N
//                                   every rank pauses N ms after completing
//                                   requests with an error response, so that
//                                   a caller woken by it submits its next
//                                   request before the cycle's later
//                                   responses are dispatched.
//   PERSEUS_TEST_ENQUEUE_PAUSE=PATH the first Enqueue that gets past its
//                                   checks creates the file PATH, then waits
//                                   (up to 60 s) until the runtime has shut
//                                   down before it queues the call: a shutdown
//                                   lands in between.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "cc/runtime/plan/plan.h"

namespace perseus {

class FaultInjector {
 public:
  // Null when no fault applies to this runtime (process sets never get one).
  static std::unique_ptr<FaultInjector> FromEnv(int world_rank, int process_set_id);

  void BeforeSharedMemory() const;
  void OnPlanStep(int64_t step, Plan* plan) const;
  void AfterErrorResponse() const;
  // `shut_down` says whether the runtime has finished shutting down.
  void BeforeQueuing(const std::function<bool()>& shut_down) const;

 private:
  bool exit_before_shm_ = false;
  int64_t swap_step_ = -1;
  int error_dispatch_delay_ms_ = 0;
  std::string enqueue_pause_file_;
  mutable std::atomic<bool> enqueue_paused_{false};
};

}  // namespace perseus
