#include "cc/transport/factory.h"

#include <cstdio>

#include "cc/transport/cost_model.h"
#include "cc/transport/gloo_transport.h"
#include "cc/transport/shm_transport.h"

namespace perseus {

TransportSet::~TransportSet() = default;

void TransportSet::Abort() {
  if (shm_) shm_->Abort();
  if (world_) world_->Abort();
}

std::unique_ptr<TransportSet> BuildTransports(GlooTransport& world, const TransportTopology& t,
                                              const std::function<void()>& before_shm) {
  std::unique_ptr<TransportSet> set(new TransportSet());
  set->world_ = &world;
  // Shared memory inside each host: for the whole allreduce when the job is
  // one host, for the host phases of the two-level one otherwise.
  if (t.shm_allowed && t.world_group && t.local_size > 1 &&
      (t.cross_size == 1 || world.hierarchical())) {
    std::string why_not;
    if (before_shm) before_shm();
    auto agree_min = [&world](int32_t value) {
      world.Allreduce(Transport::kControl, &value, 1, DataType::kInt32, ReduceOp::kMin);
      return value;
    };
    set->shm_ = ShmTransport::Connect(agree_min, t.rank, t.key_prefix, t.local_rank, t.local_size,
                                      t.cross_rank, t.streams, t.timeout, &why_not);
    if (!set->shm_ && (t.rank == 0 || !why_not.empty())) {
      std::fprintf(stderr,
                   "Perseus rank %d: allreduce uses Gloo over TCP, not shared memory: %s "
                   "(PERSEUS_SHM_ALLREDUCE=0 turns shared memory off)\n",
                   t.rank,
                   why_not.empty() ? "another rank could not map the shared segments"
                                   : why_not.c_str());
    }
  }
  set->topology_.one_host_shm = set->shm_ && t.cross_size == 1;
  set->topology_.two_level = world.hierarchical();
  set->topology_.mode = t.allreduce_mode;
  set->topology_.ranks = t.size;
  set->topology_.hosts = t.cross_size;
  if (t.allreduce_doubling_bytes >= 0) {
    set->topology_.doubling_bytes = static_cast<size_t>(t.allreduce_doubling_bytes);
    set->topology_.leaders_doubling_bytes = set->topology_.doubling_bytes;
  } else if (t.size > 1 && !set->topology_.one_host_shm) {
    // The cost model's line between doubling and the ring, from the links
    // as measured now (or as given), the same on every rank; among the
    // hosts' leaders the same links, fewer ranks.
    set->cost_ = MeasureLinkCost(world, Transport::kControl, t.link_cost);
    set->topology_.doubling_bytes = static_cast<size_t>(DoublingCrossover(t.size, set->cost_));
    set->topology_.leaders_doubling_bytes =
        static_cast<size_t>(DoublingCrossover(t.cross_size, set->cost_));
  }
  set->groups_.world = &world;
  set->groups_.host =
      set->shm_ ? static_cast<GroupCollectives*>(set->shm_.get()) : world.host();
  set->groups_.leaders = world.leaders();
  if (set->topology_.two_level && t.allreduce_mode < 0 && set->groups_.host != nullptr) {
    // Two link classes: each bucket takes two levels or not by the flat
    // group's costs and the two-level path's, measured on the groups that
    // carry them (stream 0: nothing runs there yet).
    if (set->cost_.beta <= 0) set->cost_ = MeasureLinkCost(world, Transport::kControl, t.link_cost);
    set->two_level_cost_ = MeasureTwoLevelCost(
        world, *set->groups_.host, set->groups_.leaders, t.cross_size, 0, t.link_cost,
        set->cost_.gamma, t.allreduce_doubling_bytes);
    set->topology_.leaders_doubling_bytes =
        static_cast<size_t>(set->two_level_cost_.cross_line);
    set->topology_.flat_cost = set->cost_;
    set->topology_.two_level_cost = set->two_level_cost_;
  }
  return set;
}

}  // namespace perseus
