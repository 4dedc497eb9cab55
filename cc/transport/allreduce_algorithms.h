// Which way an allreduce travels, decided in one place (ChooseAllreduce),
// apart from the transports that carry it:
//   kShm       every rank is on this host: shared memory only;
//   kFlatRing  Gloo's ring among all ranks;
//   kFlatDoubling  recursive doubling among all ranks (Transport::
//              AllreduceDoubling), for buckets up to
//              PERSEUS_ALLREDUCE_DOUBLING_BYTES: about log2(N) waits on the
//              network where a ring has 2(N - 1);
//   kTwoLevel  reduce inside each host (shared memory or TCP), allreduce
//              among the hosts' leaders (doubling or the ring, by the line
//              for their number), broadcast inside each host, pipelined in
//              4 MiB chunks.
//   kNccl          device memory: NCCL among all ranks, where the buffer is;
//   kNcclTwoLevel  device memory: NCCL reduces inside each host to its
//              leader's device, the leaders allreduce host-staged copies (as
//              float16 times the gradient scale, cast on the device, for
//              mixed compression) over the CPU transport, and NCCL
//              broadcasts the result inside each host (the executor runs both
//              NCCL algorithms: they need the data plane and communicators).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cc/core/timeline.h"
#include "cc/transport/cost_model.h"
#include "cc/transport/transport.h"

namespace perseus {

enum class AllreduceAlgorithm { kShm, kFlatRing, kFlatDoubling, kTwoLevel, kNccl, kNcclTwoLevel };

// Where the buffer lives, as far as the choice goes: host memory (device
// memory staged through the host counts as host), or device memory that NCCL
// reduces where it is.
enum class AllreduceMemory { kHost, kNcclDevice };

// What the choice depends on besides the size.
struct AllreduceTopology {
  bool one_host_shm = false;  // every rank is on this host and shares memory
  bool two_level = false;     // host and leader groups are connected
  int mode = -1;              // PERSEUS_ALLREDUCE_MODE: 0 flat, 1 two levels, -1 choose
  size_t doubling_bytes = 0;  // PERSEUS_ALLREDUCE_DOUBLING_BYTES: flat buckets up to this
                              // size double instead of taking the ring (0: never)
  int ranks = 0;              // the flat group's size (world or process set)
  // kTwoLevel: chunks up to this size cross among the hosts' leaders by
  // recursive doubling (the line for cross_size ranks), larger ones by the
  // ring.
  size_t leaders_doubling_bytes = 0;
  int hosts = 1;
  // Mode -1 with two levels: the cost model's inputs (cost_model.h), which
  // decide per bucket; unmeasured (two_level_cost.cross.beta 0), buckets of
  // 256 KiB and more take two levels.
  LinkCost flat_cost;
  TwoLevelCost two_level_cost;
};

// mixed: part of the buffer crosses hosts as float16 (needs two levels).
AllreduceAlgorithm ChooseAllreduce(size_t bytes, bool mixed, const AllreduceTopology& topology,
                                   AllreduceMemory memory = AllreduceMemory::kHost);

// The groups an algorithm may use; null where absent.
struct AllreduceGroups {
  Transport* world = nullptr;          // kFlatRing, kFlatDoubling
  GroupCollectives* host = nullptr;    // kShm (all ranks), kTwoLevel's host phases
  GroupCollectives* leaders = nullptr; // kTwoLevel, on a host's leader only
};

struct AllreduceCall {
  int channel = 0;  // the stream
  void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  // Mixed compression (float32, kTwoLevel only): between hosts, the first
  // half_across elements travel as float16 times `scale`, the rest as plain
  // float16, through `half` (grown as needed).
  size_t half_across = 0;
  float scale = 1.0f;
  std::vector<uint16_t>* half = nullptr;
  // kTwoLevel: AllreduceTopology's leaders_doubling_bytes and hosts.
  size_t cross_doubling_bytes = 0;
  int hosts = 1;
};

// Runs a host algorithm's call on the calling thread (kTwoLevel adds a helper thread on
// leaders). Throws like the transports do. Spans go to `timeline` on
// thread 1 + channel.
void RunAllreduce(AllreduceAlgorithm algorithm, const AllreduceGroups& groups,
                  const AllreduceCall& call, Timeline& timeline);

}  // namespace perseus
