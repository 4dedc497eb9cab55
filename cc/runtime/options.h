// InitOptions: what Runtime::Init needs, set by the front ends from the
// parsed configuration.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cc/core/common.h"

namespace perseus {

// Who this process is and how to reach the others (the launcher's env
// contract, already parsed and validated in Python: perseus_tf/config/).
struct InitOptions {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int cross_rank = 0;
  int cross_size = 1;
  std::string store_addr;
  int store_port = 0;
  std::string secret;
  std::string job_id = "local";
  std::string host_addr;
  std::string gloo_iface;
  int streams = 4;
  double timeout_seconds = 60;
  int64_t fusion_threshold_bytes = 64 << 20;
  // PERSEUS_ALLREDUCE_FUSION: an offline plan's buckets hold about 1/N of
  // the step's gradient bytes (0: one tensor per bucket); -1: choose.
  int fusion_granularity = -1;
  double cycle_time_ms = 1.0;
  // A collective some ranks submitted and others did not: rank 0 reports it
  // after stall_check_seconds (again every interval), and it fails on every
  // rank after stall_timeout_seconds (0: never).
  double stall_check_seconds = 60;
  double stall_timeout_seconds = 0;
  // Compressed allreduces send x * gradient_scale as float16 and divide after.
  double gradient_scale = 10.0;
  bool nancheck = false;  // reject reductions whose input holds NaN/Inf
  std::string timeline_path;  // PERSEUS_TIMELINE (this rank's file); empty: off
  int perf_check_n_steps = 0;  // report slow ranks every N offline steps (0: off)
  // PERSEUS_OFFLINE_NEG_CHECK_N_STEPS: compare every rank's copy of the
  // offline plan when it is entered and then every N plan steps (0: off).
  int plan_check_n_steps = 0;
  // PERSEUS_ALLREDUCE_MODE: 0 flat ring, 1 hierarchical (reduce in the host,
  // allreduce among hosts' leaders, broadcast in the host), -1 choose.
  // Hierarchy needs several hosts of several ranks each (launcher topology).
  int allreduce_mode = -1;
  // PERSEUS_SHM_ALLREDUCE: allreduce through shared memory instead of TCP
  // over loopback between the ranks of a host (the whole allreduce when the
  // world is one host; the host phases of the two-level one otherwise).
  bool shm = true;
  // Top-k (kCompressTopk): each rank sends its ceil(ratio * n) largest
  // |gradient + residual| elements; tensors under threshold bytes use
  // `topk_fallback` (the PERSEUS_ALLREDUCE_DTYPE code) instead.
  double topk_ratio = 0.01;
  // Settings every rank must share, as "NAME=value" lines; compared at
  // init (the world only) before any connection is made.
  std::string settings;
  int64_t topk_threshold_bytes = 1 << 20;
  bool topk_fp16 = false;
  int topk_fallback = 0;
  // Downsampling (kCompressDownsample): 1/N of each tensor per step.
  int downsample_n = 1;
  double gradient_momentum = 1.0;
  // Tensors on CUDA devices: reduced and broadcast by NCCL where they are
  // (PERSEUS_GPU_TRANSPORT resolved to nccl), else staged through pinned
  // host memory for the CPU transports. nccl_dirs: where the nvidia-nccl
  // wheels keep libnccl.so.2 (NcclLibrary::Load).
  bool nccl = false;
  std::vector<std::string> nccl_dirs;
  // A process set (sub-group) runtime: its id and the world ranks of its
  // members, in order (this process is member `rank`). Empty: the world.
  int process_set_id = 0;
  std::vector<int> global_ranks;
};

// The world rank of member `r` of the runtime `o` configures (names in
// error messages are world ranks).
inline int WorldRankOf(const InitOptions& o, int r) {
  return o.global_ranks.empty() ? r : o.global_ranks[r];
}

}  // namespace perseus
