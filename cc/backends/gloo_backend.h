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
  void Alltoallv(int channel, const void* in, const std::vector<int64_t>& send_bytes,
                 void* out, const std::vector<int64_t>& recv_bytes);

 private:
  std::shared_ptr<gloo::Context> Connect(gloo::rendezvous::Store& store,
                                         const std::string& name);
  const std::shared_ptr<gloo::Context>& Channel(int channel);

  GlooBackendOptions options_;
  std::shared_ptr<gloo::Context> control_;
  std::vector<std::shared_ptr<gloo::Context>> streams_;
  std::shared_ptr<gloo::Context> raw_;
};

}  // namespace perseus
