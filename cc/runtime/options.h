// InitOptions: what Runtime::Init needs, set by the front ends from the
// parsed configuration.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cc/core/common.h"
#include "cc/runtime/settings.h"

namespace perseus {

// Who this process is and how to reach the others (the launcher's env
// contract, already parsed and validated in Python: perseus_tf/config/).
struct Topology {
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
  // A process set (sub-group) runtime: its id and the world ranks of its
  // members, in order (this process is member `rank`). Empty: the world.
  int process_set_id = 0;
  std::vector<int> global_ranks;
};

// What Runtime::Init takes: the topology, every setting (settings.h, one
// struct per part, made from perseus_tf/config/spec.py), and what the front
// end derives from the settings for this process.
struct InitOptions : Topology,
                     TransportSettings,
                     NegotiationSettings,
                     CompressionSettings,
                     HealthSettings {
  // Settings every rank must share, as "NAME=value" lines; compared at
  // init (the world only) before any connection is made.
  std::string settings;
  // This rank's file of PERSEUS_TIMELINE; empty: off.
  std::string timeline_path;
  // Tensors on CUDA devices: reduced and broadcast by NCCL where they are
  // (PERSEUS_GPU_TRANSPORT resolved to nccl), else staged through pinned
  // host memory for the CPU transports. nccl_dirs: where the nvidia-nccl
  // wheels keep libnccl.so.2 (NcclLibrary::Load).
  bool nccl = false;
  std::vector<std::string> nccl_dirs;
  // Top-k: tensors under topk_threshold bytes use this compression (the
  // code PERSEUS_ALLREDUCE_DTYPE stands for) instead.
  int topk_fallback = 0;
};

// The world rank of member `r` of the runtime `o` configures (names in
// error messages are world ranks).
inline int WorldRankOf(const Topology& o, int r) {
  return o.global_ranks.empty() ? r : o.global_ranks[r];
}

}  // namespace perseus
