// Fusion of a plan's buckets: how large they are, and the extra elements a
// plan bucket carries after its tensors, summed with them in the same
// allreduce: this rank's vote to leave the plan (0 or 1), then, on the first
// bucket of a step with PERSEUS_PERF_CHECK_N_STEPS, one slot per rank for
// its time outside communication (each rank fills its own, zeros the rest).
#pragma once

#include <cstdint>
#include <vector>

#include "cc/core/common.h"
#include "cc/runtime/negotiation.h"

namespace perseus {

// Bucket size of an offline plan whose step holds step_bytes, from
// PERSEUS_ALLREDUCE_FUSION (granularity): 0 one tensor per bucket (returns
// 0), N > 0 about step/N, -1 automatic (see fusion.cc).
int64_t PlanBucketBytes(int64_t step_bytes, int granularity, int64_t fusion_threshold_bytes);

// One value in a bucket's dtype, and back (integers round to nearest).
void WriteValue(void* p, DataType dtype, double v);
double ReadValue(const void* p, DataType dtype);

// Elements after a bucket's tensors (1 + r.perf_slots when r carries a vote).
inline size_t ExtraSlots(const Response& r) {
  return r.carrier_vote >= 0 ? 1 + static_cast<size_t>(r.perf_slots) : 0;
}
// Writes r's vote and this rank's perf slot at `at`, zeros the other slots.
void WriteExtras(char* at, DataType dtype, const Response& r, int rank);
// Reads the summed extras back.
BucketOutcome ReadOutcome(const char* at, DataType dtype, const Response& r);
// Whether to deliver a bucket's results: yes, unless the plan that
// dispatched it says not to.
inline bool Deliver(const Response& r, const BucketOutcome& outcome) {
  return !r.on_outcome || r.on_outcome(outcome);
}

}  // namespace perseus
