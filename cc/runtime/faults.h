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
#pragma once

#include <cstdint>
#include <memory>

#include "cc/runtime/negotiation.h"

namespace perseus {

class FaultInjector {
 public:
  // Null when no fault applies to this runtime (process sets never get one).
  static std::unique_ptr<FaultInjector> FromEnv(int world_rank, int process_set_id);

  void BeforeSharedMemory() const;
  void OnPlanStep(int64_t step, Plan* plan) const;
  void AfterErrorResponse() const;

 private:
  bool exit_before_shm_ = false;
  int64_t swap_step_ = -1;
  int error_dispatch_delay_ms_ = 0;
};

}  // namespace perseus
