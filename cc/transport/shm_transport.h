// Collectives through shared memory among the ranks of one host.
//
// Between the ranks of one host, TCP over loopback is the slowest way to add
// up a buffer: each ring step copies through the
// kernel twice and needs every process scheduled in turn. Here each stream
// owns a shared segment with one slot per rank, in two sets (alternate chunks
// use alternate sets, so a chunk's results can be read while the next is
// written). Per chunk: every rank copies its part into its slot; barrier;
// rank p adds up portion p of all slots in rank order and publishes it;
// barrier; every rank copies the other portions out. Each portion is summed
// by one rank in one order, so every rank gets identical bits. A
// reduce-scatter and an allgather take one barrier a chunk: each rank writes
// its slot, and after the barrier reads what it needs from the others'.
//
// Waiting is a short spin and then a futex on the shared generation counter.
// A wait gives up with an error when a rank's process is gone, when another
// rank aborted, or after the timeout.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cc/transport/transport.h"

namespace perseus {

class ShmTransport : public GroupCollectives {
 public:
  // Agrees on the minimum of every rank's value (a collective over the
  // whole world, e.g. on the control channel of its transport).
  using AgreeMin = std::function<int32_t(int32_t)>;

  // Collective over the whole world (through agree_min): each host's ranks
  // (this one, world rank world_rank, is local_rank of local_size on host
  // cross_rank) map segments of their own. Returns null on every rank
  // when any rank cannot map them (no /dev/shm, too little space): then all
  // ranks keep using Gloo, so that they still run the same algorithm. The
  // ranks that failed say why in *why_not; the others leave it empty.
  static std::unique_ptr<ShmTransport> Connect(const AgreeMin& agree_min, int world_rank,
                                               const std::string& key, int local_rank,
                                               int local_size, int cross_rank, int streams,
                                               std::chrono::milliseconds timeout,
                                               std::string* why_not);
  ~ShmTransport() override;

  // Among the host's ranks. All throw std::runtime_error naming the rank
  // that is gone or late.
  void Allreduce(int stream, void* data, size_t count, DataType dtype, ReduceOp op) override;
  // The sum (fn) lands in local rank 0's buffer; the others' are clobbered.
  void Reduce(int stream, void* data, size_t count, DataType dtype, ReduceOp op) override;
  // Local rank 0's bytes to every rank of the host.
  void Broadcast(int stream, void* data, size_t bytes) override;
  // Each rank copies its buffer's span of every block in, and sums its own
  // block from every slot, in rank order (the bits the allreduce gives):
  // one barrier a chunk, nothing copied out.
  void ReduceScatter(int stream, void* data, const std::vector<size_t>& counts, DataType dtype,
                     ReduceOp op) override;
  // Each rank copies its part in and the others' parts out.
  bool Allgatherv(int stream, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank) override;
  // Wakes every waiting rank with an error (this rank failed or left).
  void Abort() override;

  size_t slot_bytes() const { return slot_bytes_; }

  struct Segment;

 private:
  ShmTransport() = default;
  void Barrier(Segment& s);
  void Reduction(int stream, void* data, size_t count, DataType dtype, ReduceFn fn, bool all);

  int rank_ = 0;
  int size_ = 1;
  size_t slot_bytes_ = 0;
  int spin_ = 0;
  std::chrono::milliseconds timeout_{60000};
  std::vector<std::unique_ptr<Segment>> segments_;  // one per stream
};

}  // namespace perseus
