// Building the transports an allreduce may use, from the topology.
//
// The runtime connects the world's Gloo transport first (it also carries
// negotiation, with its own retries: runtime/connect.cc). From there,
// BuildTransports decides from the topology what else this rank needs, and
// connects it: shared memory among the ranks of a host when they are more
// than one and either the job is one host or the two-level path runs. The
// result says which algorithm inputs hold (AllreduceTopology) and which
// groups carry them (AllreduceGroups), and aborts all of them at once.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "cc/transport/allreduce_algorithms.h"
#include "cc/transport/cost_model.h"
#include "cc/transport/transport.h"

namespace perseus {

class GlooTransport;
class ShmTransport;

// Where this rank sits, and what the settings allow.
struct TransportTopology {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int cross_rank = 0;
  int cross_size = 1;
  int streams = 1;            // stream channels, as connected for the world
  bool world_group = true;    // false for a process set (no host groups)
  bool shm_allowed = true;    // PERSEUS_SHM_ALLREDUCE
  int allreduce_mode = -1;    // PERSEUS_ALLREDUCE_MODE
  // PERSEUS_ALLREDUCE_DOUBLING_BYTES; -1: the cost model's (cost_model.h),
  // from link_cost where it is given (PERSEUS_LINK_*; 0: measure).
  int64_t allreduce_doubling_bytes = 0;
  LinkCost link_cost;
  std::string key_prefix;     // unique per job, process set and generation
  std::chrono::milliseconds timeout{60000};
};

// The data-plane transports of one runtime. The world transport is borrowed
// (the runtime owns it: it is also the control plane); the others are owned.
class TransportSet {
 public:
  ~TransportSet();
  const AllreduceTopology& topology() const { return topology_; }
  const AllreduceGroups& groups() const { return groups_; }
  bool shm() const { return shm_ != nullptr; }
  // The flat group's link cost the doubling line was drawn from (zeros: not
  // measured, the line was set and two levels are not modelled, or no
  // bucket crosses hosts flat).
  const LinkCost& cost() const { return cost_; }
  // What decides between two levels and flat (zeros: not measured, no two
  // levels or PERSEUS_ALLREDUCE_MODE set).
  const TwoLevelCost& two_level_cost() const { return two_level_cost_; }
  // Wakes every wait of every transport with an error; any thread may call
  // it, at any time, any number of times.
  void Abort();

 private:
  friend std::unique_ptr<TransportSet> BuildTransports(GlooTransport& world,
                                                       const TransportTopology& t,
                                                       const std::function<void()>& before_shm);
  TransportSet() = default;
  GlooTransport* world_ = nullptr;
  std::unique_ptr<ShmTransport> shm_;
  AllreduceTopology topology_;
  AllreduceGroups groups_;
  LinkCost cost_;
  TwoLevelCost two_level_cost_;
};

// Collective over every rank of the world. `before_shm` runs just before
// shared memory is mapped (a fault-injection point for tests). Throws
// std::exception when a connection fails; shared memory that cannot be
// mapped is not an error (Gloo over TCP then carries the host's phases on
// every rank alike, said once on stderr).
std::unique_ptr<TransportSet> BuildTransports(GlooTransport& world, const TransportTopology& t,
                                              const std::function<void()>& before_shm);

}  // namespace perseus
