// What Runtime::GetStats reports, and the book the round keeps them in.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "cc/core/common.h"

namespace perseus {

struct StreamStats {
  int64_t responses = 0;
  int64_t tensors = 0;
  int64_t bytes = 0;
  double busy_seconds = 0;
  // Summed over this stream's collectives: how long the oldest request of
  // each had waited (for the other ranks, negotiation, a free stream) when
  // it started.
  double wait_seconds = 0;
};

struct Stats {
  int64_t perf_reports = 0;      // slow-rank checks made (PERSEUS_PERF_CHECK_N_STEPS)
  std::vector<int> slow_ranks;   // flagged by the latest check (world ranks)
  bool hierarchical = false;  // two-level allreduce is available (and not turned off)
  bool shm = false;           // ranks of a host allreduce through shared memory
  int64_t round = 0;          // the job's round this runtime runs (0, then one per init)
  int64_t plans = 0;          // offline plans entered
  int64_t plan_exits = 0;     // plans left (a step changed, or shutdown)
  int64_t offline_steps = 0;  // steps run from a plan, without control messages
  int64_t plan_checks = 0;    // plan checksums compared (PERSEUS_OFFLINE_NEG_CHECK_N_STEPS)
  int64_t plan_timeouts = 0;  // plans this rank voted to leave after waiting for its own data
  // Init's parts: joining the round through the store (connecting to it,
  // the roll call) and connecting the transports (Gloo's contexts, shared
  // memory).
  double startup_store_seconds = 0;
  double startup_connect_seconds = 0;
  // The line between recursive doubling and the ring for flat buckets
  // across hosts (bytes), and the cost model's inputs it was drawn from
  // (zeros when nothing measured them: the line was set by
  // PERSEUS_ALLREDUCE_DOUBLING_BYTES and the model does not choose two
  // levels, or no bucket crosses hosts flat): a hop's latency, a link's
  // bandwidth, and
  // this host's float32 sum, in MB (10^6 bytes) a second.
  int64_t allreduce_doubling_bytes = 0;
  double link_latency_us = 0;
  double link_bandwidth_mbytes = 0;
  double reduce_mbytes = 0;
  // With two levels and PERSEUS_ALLREDUCE_MODE unset, what decides per
  // bucket between them and the flat allreduce (cost_model.h): the host
  // phases' fixed time and speed, a hop across hosts' latency and bandwidth
  // (zeros otherwise); and the line up to which the leaders double.
  double host_phase_us = 0;
  double host_phase_mbytes = 0;
  double cross_latency_us = 0;
  double cross_bandwidth_mbytes = 0;
  int64_t leaders_doubling_bytes = 0;
  int64_t cycles = 0;
  int64_t control_bytes_sent = 0;
  int64_t requests = 0;
  int64_t responses = 0;
  int64_t fused_responses = 0;
  // The runtime's own buffers for tensors on devices (fusion, float16,
  // lifted host tensors, copy tables) and the pinned host memory staging
  // them, over every device plane; they grow to the largest bucket seen.
  int64_t device_buffer_bytes = 0;
  int64_t staging_buffer_bytes = 0;
  std::vector<StreamStats> streams;
};

// A round's counters, shared by the threads that add to them.
class StatsBook {
 public:
  // Runs f(stats) under the book's lock.
  template <typename F>
  void Update(F f) {
    std::lock_guard<std::mutex> lock(mu_);
    f(stats_);
  }
  Stats Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  mutable std::mutex mu_;
  Stats stats_;
};

}  // namespace perseus
