// CPU collectives over Gloo's TCP transport (see transport.h).
//
// The backend owns one Gloo context for negotiation ("control") and one per
// communication stream. Each context gets its own tcp device, because a
// device has a single I/O thread: separate devices are what make streams
// run in parallel. With world size 1 no context exists and every collective
// is a local copy.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cc/transport/transport.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}
}  // namespace gloo

namespace gloo {
namespace transport {
class Pair;
}  // namespace transport
}  // namespace gloo

namespace perseus {

// Fails one of Gloo's TCP connections as its own timeout would: every wait
// of this process on it throws now, later operations throw, and its socket
// closes (gloo_abort.cc).
void FailGlooPair(gloo::transport::Pair* pair, const std::string& why);

class GlooTransport : public Transport {
 public:
  // Connects every context as a full mesh through the store (unused, and
  // may be null, for world size 1).
  // Throws std::exception with a descriptive message on failure.
  GlooTransport(const TransportOptions& options, gloo::rendezvous::Store* store);
  ~GlooTransport() override;

  int rank() const override { return options_.rank; }
  int size() const override { return options_.size; }

  // Channel -1 is the control context, 0..streams-1 the stream contexts,
  // kRawChannel a separate context for benchmarking raw Gloo.
  static constexpr int kRawChannel = 1000;
  void CreateRawChannel(gloo::rendezvous::Store& store);

  // All collectives throw gloo::Exception (or std::exception) on failure.
  void Allreduce(int channel, void* data, size_t count, DataType dtype, ReduceOp op) override;
  // Recursive doubling (transport.h). With size not a power of two, the
  // first 2 * (size - p) ranks (p the largest power of two below size) pair
  // up: each even one hands its buffer to the odd one above it and gets the
  // result back at the end, while p ranks double. At each step both
  // partners combine the lower-placed rank's buffer first, so every rank
  // computes the same expression (NaN under min and max included).
  void AllreduceDoubling(int channel, void* data, size_t count, DataType dtype,
                         ReduceOp op) override;
  void Broadcast(int channel, void* data, size_t bytes, int root) override;
  void Allgatherv(int channel, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank) override;
  // Bruck's allgather: in round k each rank sends the blocks it holds (its
  // own and the next 2^k - 1 ranks', at most size - 2^k of them) to the rank
  // 2^k below it and receives as many from the rank 2^k above, so after
  // ceil(log2(size)) rounds it holds all, which it puts in rank order.
  void AllgatherBlocks(int channel, const void* in, void* out, size_t block) override;
  void Alltoallv(int channel, const void* in, const std::vector<int64_t>& send_bytes,
                 void* out, const std::vector<int64_t>& recv_bytes,
                 bool any_rank_moves_data) override;
  // A ring: size - 1 steps, each sending one block to the next rank and
  // reducing the block received from the previous one (half the bytes of a
  // ring allreduce).
  void ReduceScatter(int channel, void* data, const std::vector<size_t>& counts, DataType dtype,
                     ReduceOp op) override;

  // Two-level collectives (only when hierarchical() is true). Local rank 0
  // of each host is its leader.
  bool hierarchical() const { return !local_.empty(); }
  bool is_local_leader() const { return options_.local_rank == 0; }
  // The host's ranks over TCP (null unless hierarchical()), and the hosts'
  // leaders (null unless hierarchical() on a leader).
  GroupCollectives* host() { return host_.get(); }
  GroupCollectives* leaders() { return leaders_.get(); }
  // Fails every connection of every context at once: each wait of this
  // process on one of them throws now (not at GLOO_TIMEOUT_SECONDS), later
  // calls throw, and the sockets close, so the peers' waits fail as well.
  // Any thread, any number of times; the transport is then only destroyed.
  void CloseAll(const std::string& why);

 private:
  // Recursive doubling (AllreduceDoubling) among a context's ranks.
  static void DoublingOn(const std::shared_ptr<gloo::Context>& context, void* data, size_t count,
                         DataType dtype, ReduceOp op);
  std::shared_ptr<gloo::Context> Connect(gloo::rendezvous::Store& store,
                                         const std::string& name, int rank, int size);
  const std::shared_ptr<gloo::Context>& Channel(int channel);

  class Group;
  TransportOptions options_;
  std::shared_ptr<gloo::Context> control_;
  std::vector<std::shared_ptr<gloo::Context>> streams_;
  std::vector<std::shared_ptr<gloo::Context>> local_, cross_;  // per stream
  std::shared_ptr<gloo::Context> raw_;
  std::unique_ptr<GroupCollectives> host_, leaders_;
};

}  // namespace perseus
