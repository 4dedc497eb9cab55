// CPU collectives over Gloo's TCP transport.
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

#include "cc/runtime/common.h"
#include "cc/runtime/reduce.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}
}  // namespace gloo

namespace perseus {

struct GlooBackendOptions {
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

class GlooBackend {
 public:
  // Connects every context as a full mesh through the store (unused, and
  // may be null, for world size 1).
  // Throws std::exception with a descriptive message on failure.
  GlooBackend(const GlooBackendOptions& options, gloo::rendezvous::Store* store);
  ~GlooBackend();

  int rank() const { return options_.rank; }
  int size() const { return options_.size; }
  int streams() const { return options_.streams; }

  // Channel -1 is the control context, 0..streams-1 the stream contexts,
  // kRawChannel a separate context for benchmarking raw Gloo.
  static constexpr int kControl = -1;
  static constexpr int kRawChannel = 1000;
  void CreateRawChannel(gloo::rendezvous::Store& store);

  // All collectives throw gloo::Exception (or std::exception) on failure.
  void Allreduce(int channel, void* data, size_t count, DataType dtype, ReduceFn fn);
  void Broadcast(int channel, void* data, size_t bytes, int root);
  // out receives bytes_per_rank[r] bytes from each rank r, in rank order.
  void Allgatherv(int channel, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank);
  // any_rank_moves_data: false only when every rank's splits are all zero
  // (then no rank runs the collective).
  void Alltoallv(int channel, const void* in, const std::vector<int64_t>& send_bytes,
                 void* out, const std::vector<int64_t>& recv_bytes, bool any_rank_moves_data);

  // Two-level collectives (only when hierarchical() is true). Local rank 0
  // of each host is its leader.
  bool hierarchical() const { return !local_.empty(); }
  bool is_local_leader() const { return options_.local_rank == 0; }
  // Sums (with fn) the host's buffers into the leader's.
  void LocalReduce(int channel, void* data, size_t count, DataType dtype, ReduceFn fn);
  void LocalBroadcast(int channel, void* data, size_t bytes);
  // Allreduce among the hosts' leaders (called on leaders only).
  void CrossAllreduce(int channel, void* data, size_t count, DataType dtype, ReduceFn fn);

 private:
  std::shared_ptr<gloo::Context> Connect(gloo::rendezvous::Store& store,
                                         const std::string& name, int rank, int size);
  const std::shared_ptr<gloo::Context>& Channel(int channel);

  GlooBackendOptions options_;
  std::shared_ptr<gloo::Context> control_;
  std::vector<std::shared_ptr<gloo::Context>> streams_;
  std::vector<std::shared_ptr<gloo::Context>> local_, cross_;  // per stream
  std::shared_ptr<gloo::Context> raw_;
};

}  // namespace perseus
