// The seam between the runtime and the ways bytes move between ranks.
//
// A transport is connected once and then runs collectives on numbered
// channels: kControl for negotiation, 0..streams-1 for the stream threads.
// A channel is used by one thread at a time. Options are plain structs, set
// before connecting. Every collective throws std::exception with a message
// naming what failed; the runtime turns that into a Status.
//
// Implementations: GlooTransport (TCP among all ranks, plus the contexts of
// the two-level topology) and ShmTransport (shared memory among the ranks of
// one host), built from the topology by factory.h. Which of them runs an
// allreduce is chosen in one place, allreduce_algorithms.h. A collective
// names its reduction as an operation on a dtype (ReduceOp); how to carry it
// out on the memory it is given is the transport's business.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cc/core/common.h"
#include "cc/core/reduce.h"

namespace perseus {

struct TransportOptions {
  int rank = 0;
  int size = 1;
  int streams = 1;
  std::string host_addr;  // address to bind, e.g. 127.0.0.2
  std::string iface;      // PERSEUS_GLOO_NETWORK_INTERFACE; wins over host_addr
  std::chrono::milliseconds timeout{60000};
  std::string key_prefix;  // unique per job and per runtime generation
  // Two-level topology (world only): ranks are placed host by host, so rank
  // = cross_rank * local_size + local_rank. With `hierarchy` set and several
  // hosts of several ranks each, every stream also gets a context among the
  // ranks of its host ("local"), and each host's leader (local rank 0) one
  // among the leaders ("cross").
  int local_rank = 0;
  int local_size = 1;
  int cross_rank = 0;
  int cross_size = 1;
  bool hierarchy = false;
};

// Collectives among every rank of the job (or of a process set).
class Transport {
 public:
  static constexpr int kControl = -1;
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Wakes every collective of this transport that is waiting for another
  // rank, with an error, and fails the later ones. Any thread may call it,
  // at any time. The default does nothing: the waits of such a transport
  // end by its own timeout (Gloo's, GLOO_TIMEOUT_SECONDS).
  virtual void Abort() {}
  virtual void Allreduce(int channel, void* data, size_t count, DataType dtype, ReduceOp op) = 0;
  // The same reduction by recursive doubling, for small buffers: about
  // log2(size) exchanges of the whole buffer, each with one peer, where a
  // ring waits on 2(size - 1) steps in sequence (more bytes, fewer waits).
  // Every rank ends with the same bits. The default runs Allreduce.
  virtual void AllreduceDoubling(int channel, void* data, size_t count, DataType dtype,
                                 ReduceOp op) {
    Allreduce(channel, data, count, dtype, op);
  }
  virtual void Broadcast(int channel, void* data, size_t bytes, int root) = 0;
  // out receives bytes_per_rank[r] bytes from each rank r, in rank order.
  virtual void Allgatherv(int channel, const void* in, void* out,
                          const std::vector<size_t>& bytes_per_rank) = 0;
  // Every rank gives `block` bytes and out receives them in rank order, in
  // about log2(size) rounds where a ring waits on size - 1 steps: for small
  // blocks, as the negotiation cycle's. The default runs Allgatherv.
  virtual void AllgatherBlocks(int channel, const void* in, void* out, size_t block) {
    Allgatherv(channel, in, out, std::vector<size_t>(size(), block));
  }
  // any_rank_moves_data: false only when every rank's splits are all zero
  // (then no rank runs the collective).
  virtual void Alltoallv(int channel, const void* in, const std::vector<int64_t>& send_bytes,
                         void* out, const std::vector<int64_t>& recv_bytes,
                         bool any_rank_moves_data) = 0;
  // Each rank r ends with the reduction (fn) over all ranks of block r of
  // `data`: counts[r] elements starting at counts[0] + ... + counts[r-1],
  // left in place. Every rank passes the same counts; the other blocks of
  // `data` are clobbered.
  virtual void ReduceScatter(int channel, void* data, const std::vector<size_t>& counts,
                             DataType dtype, ReduceOp op) = 0;
};

// Collectives among a fixed group of ranks whose first member leads: the
// ranks of one host (the host phases of the two-level allreduce), or the
// hosts' leaders (its middle phase).
class GroupCollectives {
 public:
  virtual ~GroupCollectives() = default;
  // Wakes every collective of this transport that is waiting for another
  // rank, with an error, and fails the later ones. Any thread may call it,
  // at any time. The default does nothing: the waits of such a transport
  // end by its own timeout (Gloo's, GLOO_TIMEOUT_SECONDS).
  virtual void Abort() {}
  virtual void Allreduce(int channel, void* data, size_t count, DataType dtype, ReduceOp op) = 0;
  // Recursive doubling (Transport::AllreduceDoubling) where the group has
  // it; the default is Allreduce.
  virtual void AllreduceDoubling(int channel, void* data, size_t count, DataType dtype,
                                 ReduceOp op) {
    Allreduce(channel, data, count, dtype, op);
  }
  // The sum (fn) lands in the leader's buffer; the others' may be clobbered.
  virtual void Reduce(int channel, void* data, size_t count, DataType dtype, ReduceOp op) = 0;
  // The leader's bytes to every rank of the host.
  virtual void Broadcast(int channel, void* data, size_t bytes) = 0;
  // Each member r ends with the reduction over the group of block r of
  // `data` (counts as Transport::ReduceScatter; other blocks clobbered).
  // The default reduces the whole buffer.
  virtual void ReduceScatter(int channel, void* data, const std::vector<size_t>& counts,
                             DataType dtype, ReduceOp op) {
    size_t total = 0;
    for (size_t c : counts) total += c;
    Allreduce(channel, data, total, dtype, op);
  }
  // out receives bytes_per_rank[r] bytes from each member r, in order (as
  // Transport::Allgatherv). Returns false, having done nothing, where the
  // group has no allgather of its own (the caller uses the world's).
  virtual bool Allgatherv(int channel, const void* in, void* out,
                          const std::vector<size_t>& bytes_per_rank) {
    (void)channel, (void)in, (void)out, (void)bytes_per_rank;
    return false;
  }
};

}  // namespace perseus
