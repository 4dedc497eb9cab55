#include "cc/transport/gloo_transport.h"

#include "cc/transport/gloo_abortable.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/broadcast.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

namespace perseus {
namespace {

// Gloo sizes elements by sizeof(T); these stand in for each element width.
template <size_t N>
struct Bytes {
  char b[N];
};

template <typename T>
void RunAllreduce(const std::shared_ptr<gloo::Context>& ctx, void* data,
                  size_t count, ReduceFn fn) {
  gloo::AllreduceOptions opts(ctx);
  opts.setOutput(static_cast<T*>(data), count);
  opts.setReduceFunction(gloo::AllreduceOptions::Func(fn));
  opts.setTag(1);
  gloo::allreduce(opts);
}

template <typename T>
void RunReduce(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t count,
               ReduceFn fn) {
  gloo::ReduceOptions opts(ctx);
  opts.setOutput(static_cast<T*>(data), count);
  opts.setRoot(0);
  opts.setReduceFunction(gloo::ReduceOptions::Func(fn));
  opts.setTag(5);
  gloo::reduce(opts);
}

template <template <typename> class Run>
void BySize(DataType dtype, const std::shared_ptr<gloo::Context>& ctx, void* data,
            size_t count, ReduceFn fn) {
  switch (DataTypeSize(dtype)) {
    case 1: Run<Bytes<1>>::Go(ctx, data, count, fn); break;
    case 2: Run<Bytes<2>>::Go(ctx, data, count, fn); break;
    case 4: Run<Bytes<4>>::Go(ctx, data, count, fn); break;
    case 8: Run<Bytes<8>>::Go(ctx, data, count, fn); break;
    default: throw std::runtime_error("unsupported element size");
  }
}

template <typename T>
struct AllreduceRun {
  static void Go(const std::shared_ptr<gloo::Context>& c, void* d, size_t n, ReduceFn f) {
    RunAllreduce<T>(c, d, n, f);
  }
};

template <typename T>
struct ReduceRun {
  static void Go(const std::shared_ptr<gloo::Context>& c, void* d, size_t n, ReduceFn f) {
    RunReduce<T>(c, d, n, f);
  }
};

}  // namespace

// A group's collectives over its per-stream contexts.
class GlooTransport::Group : public GroupCollectives {
 public:
  explicit Group(const std::vector<std::shared_ptr<gloo::Context>>& contexts) : contexts_(contexts) {}
  void Allreduce(int channel, void* data, size_t count, DataType dtype, ReduceOp op) override {
    if (count == 0) return;
    BySize<AllreduceRun>(dtype, contexts_.at(static_cast<size_t>(channel)), data, count,
                         HostReduceFn(dtype, op));
  }
  void Reduce(int channel, void* data, size_t count, DataType dtype, ReduceOp op) override {
    if (count == 0) return;
    BySize<ReduceRun>(dtype, contexts_.at(static_cast<size_t>(channel)), data, count,
                      HostReduceFn(dtype, op));
  }
  void AllreduceDoubling(int channel, void* data, size_t count, DataType dtype,
                         ReduceOp op) override {
    DoublingOn(contexts_.at(static_cast<size_t>(channel)), data, count, dtype, op);
  }
  void Broadcast(int channel, void* data, size_t bytes) override {
    if (bytes == 0) return;
    gloo::BroadcastOptions opts(contexts_.at(static_cast<size_t>(channel)));
    opts.setOutput(static_cast<uint8_t*>(data), bytes);
    opts.setRoot(0);
    opts.setTag(6);
    gloo::broadcast(opts);
  }

 private:
  const std::vector<std::shared_ptr<gloo::Context>>& contexts_;  // per stream
};

GlooTransport::GlooTransport(const TransportOptions& options,
                             gloo::rendezvous::Store* store)
    : options_(options) {
  if (options_.size <= 1) return;
  control_ = Connect(*store, "control", options_.rank, options_.size);
  for (int s = 0; s < options_.streams; ++s) {
    streams_.push_back(Connect(*store, "stream" + std::to_string(s), options_.rank,
                               options_.size));
  }
  const TransportOptions& o = options_;
  if (o.hierarchy && o.local_size > 1 && o.cross_size > 1 &&
      o.local_size * o.cross_size == o.size &&
      o.rank == o.cross_rank * o.local_size + o.local_rank) {
    for (int s = 0; s < o.streams; ++s) {
      const std::string tag = "/stream" + std::to_string(s);
      local_.push_back(Connect(*store, "host" + std::to_string(o.cross_rank) + tag,
                               o.local_rank, o.local_size));
      // Only the leaders talk across hosts.
      if (o.local_rank == 0) {
        cross_.push_back(Connect(*store, "leaders" + tag, o.cross_rank, o.cross_size));
      }
    }
    host_.reset(new Group(local_));
    if (o.local_rank == 0) leaders_.reset(new Group(cross_));
  }
}

GlooTransport::~GlooTransport() = default;

namespace {

void CloseContext(const std::shared_ptr<gloo::Context>& context, const std::string& why) {
  if (!context) return;
  AbortGlooDevice(context->getDevice(), why);  // waits Gloo would not wake (gloo_abortable.h)
  for (int peer = 0; peer < context->size; ++peer) {
    if (peer == context->rank) continue;
    if (gloo::transport::Pair* pair = context->getPair(peer).get()) FailGlooPair(pair, why);
  }
}

}  // namespace

void GlooTransport::CloseAll(const std::string& why) {
  CloseContext(control_, why);
  for (const auto& c : streams_) CloseContext(c, why);
  for (const auto& c : local_) CloseContext(c, why);
  for (const auto& c : cross_) CloseContext(c, why);
  CloseContext(raw_, why);
}

std::shared_ptr<gloo::Context> GlooTransport::Connect(gloo::rendezvous::Store& store,
                                                      const std::string& name, int rank,
                                                      int size) {
  gloo::transport::tcp::attr attr;
  if (!options_.iface.empty()) {
    attr.iface = options_.iface;
  } else {
    attr.hostname = options_.host_addr.empty() ? "127.0.0.1" : options_.host_addr;
  }
  auto device = WrapGlooDevice(gloo::transport::tcp::CreateDevice(attr), options_.timeout);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
  ctx->setTimeout(options_.timeout);
  gloo::rendezvous::PrefixStore prefixed(options_.key_prefix + "/" + name, store);
  ctx->connectFullMesh(prefixed, device);
  return ctx;
}

void GlooTransport::CreateRawChannel(gloo::rendezvous::Store& store) {
  if (options_.size > 1 && !raw_) raw_ = Connect(store, "raw", options_.rank, options_.size);
}

const std::shared_ptr<gloo::Context>& GlooTransport::Channel(int channel) {
  if (channel == kControl) return control_;
  if (channel == kRawChannel) {
    if (!raw_) throw std::runtime_error("raw benchmark channel was not created");
    return raw_;
  }
  return streams_.at(static_cast<size_t>(channel));
}

void GlooTransport::Allreduce(int channel, void* data, size_t count, DataType dtype,
                            ReduceOp op) {
  if (options_.size <= 1 || count == 0) return;
  BySize<AllreduceRun>(dtype, Channel(channel), data, count, HostReduceFn(dtype, op));
}

void GlooTransport::Broadcast(int channel, void* data, size_t bytes, int root) {
  if (options_.size <= 1 || bytes == 0) return;
  gloo::BroadcastOptions opts(Channel(channel));
  opts.setOutput(static_cast<uint8_t*>(data), bytes);
  opts.setRoot(root);
  opts.setTag(2);
  gloo::broadcast(opts);
}

void GlooTransport::Allgatherv(int channel, const void* in, void* out,
                             const std::vector<size_t>& bytes_per_rank) {
  if (options_.size <= 1) {
    if (bytes_per_rank[0]) std::memmove(out, in, bytes_per_rank[0]);
    return;
  }
  size_t total = 0;
  for (size_t b : bytes_per_rank) total += b;
  if (total == 0) return;
  gloo::AllgathervOptions opts(Channel(channel));
  uint8_t dummy = 0;  // Gloo rejects a null input even of no bytes
  opts.setInput(in ? const_cast<uint8_t*>(static_cast<const uint8_t*>(in)) : &dummy,
                bytes_per_rank[options_.rank]);
  opts.setOutput(static_cast<uint8_t*>(out), bytes_per_rank);
  opts.setTag(3);
  gloo::allgatherv(opts);
}

void GlooTransport::AllgatherBlocks(int channel, const void* in, void* out, size_t block) {
  const int size = options_.size, rank = options_.rank;
  if (block == 0) return;
  if (size <= 1) {
    std::memmove(out, in, block);
    return;
  }
  const auto& ctx = Channel(channel);
  const auto timeout = ctx->getTimeout();
  // held[i] is rank (rank + i) % size's block.
  std::vector<char> held(block * size);
  std::memcpy(held.data(), in, block);
  auto buffer = ctx->createUnboundBuffer(held.data(), held.size());
  uint32_t round = 0;
  for (int have = 1; have < size; have *= 2, ++round) {
    const int count = std::min(have, size - have);
    const int to = (rank - have + size) % size, from = (rank + have) % size;
    const uint64_t slot = gloo::Slot::build(0x22, round);
    buffer->recv(from, slot, have * block, count * block);
    buffer->send(to, slot, 0, count * block);
    if (!buffer->waitRecv(timeout)) {
      throw std::runtime_error("allgather (Bruck): no data from rank " + std::to_string(from) +
                               " within GLOO_TIMEOUT_SECONDS");
    }
    if (!buffer->waitSend(timeout)) {
      throw std::runtime_error("allgather (Bruck): rank " + std::to_string(to) +
                               " took no data within GLOO_TIMEOUT_SECONDS");
    }
  }
  char* dst = static_cast<char*>(out);
  for (int i = 0; i < size; ++i) {
    std::memcpy(dst + static_cast<size_t>((rank + i) % size) * block,
                held.data() + static_cast<size_t>(i) * block, block);
  }
}

void GlooTransport::Alltoallv(int channel, const void* in,
                            const std::vector<int64_t>& send_bytes, void* out,
                            const std::vector<int64_t>& recv_bytes, bool any_rank_moves_data) {
  if (options_.size <= 1) {
    if (send_bytes[0]) std::memmove(out, in, static_cast<size_t>(send_bytes[0]));
    return;
  }
  int64_t total_in = 0, total_out = 0;
  for (int64_t b : send_bytes) total_in += b;
  for (int64_t b : recv_bytes) total_out += b;
  // Only the caller knows whether any rank moves data (the negotiated
  // splits); a rank with nothing of its own to move must still take part,
  // or the others' messages to it are left for its next collective.
  if (!any_rank_moves_data) return;
  // Gloo rejects null buffers even when a side has nothing to move.
  uint8_t dummy = 0;
  gloo::AlltoallvOptions opts(Channel(channel));
  opts.setInput(total_in ? const_cast<uint8_t*>(static_cast<const uint8_t*>(in)) : &dummy,
                send_bytes);
  opts.setOutput(total_out ? static_cast<uint8_t*>(out) : &dummy, recv_bytes);
  opts.setTag(4);
  gloo::alltoallv(opts);
}

void GlooTransport::ReduceScatter(int channel, void* data, const std::vector<size_t>& counts,
                                  DataType dtype, ReduceOp op) {
  const int size = options_.size, rank = options_.rank;
  if (size <= 1) return;
  const ReduceFn fn = HostReduceFn(dtype, op);
  if (counts.size() != static_cast<size_t>(size)) {
    throw std::invalid_argument("reduce-scatter needs one count per rank");
  }
  const size_t esize = DataTypeSize(dtype);
  std::vector<size_t> first(size + 1, 0);
  for (int b = 0; b < size; ++b) first[b + 1] = first[b] + counts[b];
  if (first[size] == 0) return;  // the same on every rank: none takes part
  const auto& ctx = Channel(channel);
  const auto timeout = ctx->getTimeout();
  char* base = static_cast<char*>(data);
  std::vector<char> incoming(*std::max_element(counts.begin(), counts.end()) * esize + 1);
  auto out = ctx->createUnboundBuffer(base, first[size] * esize);
  auto in = ctx->createUnboundBuffer(incoming.data(), incoming.size());
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  // Step s sends block rank-s-1 and receives block rank-s-2 (mod size), so
  // after size - 1 steps block `rank` has been summed over every rank here.
  for (int s = 0; s + 1 < size; ++s) {
    const int send = ((rank - s - 1) % size + size) % size;
    const int recv = ((rank - s - 2) % size + size) % size;
    const uint64_t slot = gloo::Slot::build(0x20, static_cast<uint32_t>(s));
    if (counts[recv]) in->recv(prev, slot, 0, counts[recv] * esize);
    if (counts[send]) out->send(next, slot, first[send] * esize, counts[send] * esize);
    if (counts[recv]) {
      if (!in->waitRecv(timeout)) {
        throw std::runtime_error("reduce-scatter: no data from rank " + std::to_string(prev) +
                                 " within GLOO_TIMEOUT_SECONDS");
      }
      char* block = base + first[recv] * esize;
      fn(block, block, incoming.data(), counts[recv]);
    }
    if (counts[send] && !out->waitSend(timeout)) {
      throw std::runtime_error("reduce-scatter: rank " + std::to_string(next) +
                               " took no data within GLOO_TIMEOUT_SECONDS");
    }
  }
}

void GlooTransport::AllreduceDoubling(int channel, void* data, size_t count, DataType dtype,
                                      ReduceOp op) {
  DoublingOn(Channel(channel), data, count, dtype, op);
}

void GlooTransport::DoublingOn(const std::shared_ptr<gloo::Context>& ctx, void* data,
                               size_t count, DataType dtype, ReduceOp op) {
  const int size = ctx->size, rank = ctx->rank;
  if (size <= 1 || count == 0) return;
  const ReduceFn fn = HostReduceFn(dtype, op);
  const size_t bytes = count * DataTypeSize(dtype);
  const auto timeout = ctx->getTimeout();
  std::vector<char> incoming(bytes);
  auto mine = ctx->createUnboundBuffer(data, bytes);
  auto theirs = ctx->createUnboundBuffer(incoming.data(), bytes);
  int p = 1;
  while (p * 2 <= size) p *= 2;
  const int paired = 2 * (size - p);  // ranks below this fold into pairs
  // A doubling rank's place among the p (-1: it handed its data on), and back.
  const int place = rank < paired ? (rank % 2 ? rank / 2 : -1) : rank - (size - p);
  auto rank_of = [&](int at) { return at < size - p ? 2 * at + 1 : at + (size - p); };
  auto wait_recv = [&](int from) {
    if (!theirs->waitRecv(timeout)) {
      throw std::runtime_error("allreduce (recursive doubling): no data from rank " +
                               std::to_string(from) + " within GLOO_TIMEOUT_SECONDS");
    }
  };
  auto wait_send = [&](int to) {
    if (!mine->waitSend(timeout)) {
      throw std::runtime_error("allreduce (recursive doubling): rank " + std::to_string(to) +
                               " took no data within GLOO_TIMEOUT_SECONDS");
    }
  };
  // data = first op second, whichever buffer holds which.
  auto combine = [&](bool incoming_first) {
    if (incoming_first) {
      fn(incoming.data(), incoming.data(), data, count);
      std::memcpy(data, incoming.data(), bytes);
    } else {
      fn(data, data, incoming.data(), count);
    }
  };
  uint32_t step = 0;
  const auto slot = [&] { return gloo::Slot::build(0x21, step); };
  if (rank < paired) {  // fold: the even rank's buffer comes first
    if (rank % 2 == 0) {
      mine->send(rank + 1, slot());
      wait_send(rank + 1);
    } else {
      theirs->recv(rank - 1, slot());
      wait_recv(rank - 1);
      combine(true);
    }
  }
  ++step;
  if (place >= 0) {
    for (int mask = 1; mask < p; mask <<= 1, ++step) {
      const int peer = rank_of(place ^ mask);
      theirs->recv(peer, slot());
      mine->send(peer, slot());
      wait_recv(peer);
      wait_send(peer);
      combine((place ^ mask) < place);
    }
  } else {
    for (int mask = 1; mask < p; mask <<= 1) ++step;
  }
  if (rank < paired) {  // unfold: the odd rank hands the result back
    if (rank % 2) {
      mine->send(rank - 1, slot());
      wait_send(rank - 1);
    } else {
      mine->recv(rank + 1, slot());
      if (!mine->waitRecv(timeout)) {
        throw std::runtime_error("allreduce (recursive doubling): no result from rank " +
                                 std::to_string(rank + 1) + " within GLOO_TIMEOUT_SECONDS");
      }
    }
  }
}

}  // namespace perseus
