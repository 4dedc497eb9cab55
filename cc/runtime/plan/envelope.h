// What an offline plan bucket carries around its data: extra elements after
// the bucket's tensors, summed with them in the same allreduce and in the
// bucket's dtype. First this rank's vote to leave the plan (0 or 1); then,
// on the first bucket of a step with PERSEUS_PERF_CHECK_N_STEPS, one slot per
// rank for its time outside communication (each rank fills its own, zeros
// the rest). The plan fills the envelope when it dispatches the bucket and
// attaches its verdict on the sum (request_table_plan.cc, offline.cc).
//
// This is the only plan header the data path sees: a compressor or the
// executor leaves slots() elements free after its packed buffer and hands
// its reduce to Around(); it never reads a vote.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "cc/core/common.h"
#include "cc/device/data_plane.h"

namespace perseus {

// An offline plan bucket's extras summed over the ranks: the votes to leave
// the plan, and each rank's perf-check time (ms; empty unless carried).
struct BucketOutcome {
  int64_t votes = 0;
  std::vector<double> perf_ms;
};

struct Envelope {
  int vote = -1;          // >= 0: an offline plan bucket; this rank's vote
  int plan_index = -1;    // the bucket's index in its plan
  int perf_slots = 0;     // > 0: one slot per rank for the perf check
  double perf_value = 0;  // this rank's time outside communication (ms)
  // The plan's verdict on the summed extras. False: do not deliver the
  // bucket's results (the plan took its requests back).
  std::function<bool(const BucketOutcome&)> on_outcome;

  bool empty() const { return vote < 0; }
  // Elements after the bucket's data.
  size_t slots() const { return empty() ? 0 : 1 + static_cast<size_t>(perf_slots); }
  // Reduces the `count` elements at `data` with the envelope's slots after
  // them (`data` holds count + slots() elements of `dtype`): writes this
  // rank's extras, runs reduce(count + slots()), reads the sums back and
  // returns the verdict (true without an envelope). `plane`: `data` is its
  // buffer on `stream`; nullptr: host memory.
  bool Around(void* data, size_t count, DataType dtype, int rank, DataPlane* plane, int stream,
              const std::function<void(size_t total)>& reduce) const;
};

// One value in a buffer's dtype, and back (integers round to nearest).
void WriteValue(void* p, DataType dtype, double v);
double ReadValue(const void* p, DataType dtype);

}  // namespace perseus
