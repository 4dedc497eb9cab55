#include "cc/backends/gloo_backend.h"

#include <cstring>
#include <stdexcept>

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

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

}  // namespace

GlooBackend::GlooBackend(const GlooBackendOptions& options,
                         gloo::rendezvous::Store* store)
    : options_(options) {
  if (options_.size <= 1) return;
  control_ = Connect(*store, "control");
  for (int s = 0; s < options_.streams; ++s) {
    streams_.push_back(Connect(*store, "stream" + std::to_string(s)));
  }
}

GlooBackend::~GlooBackend() = default;

std::shared_ptr<gloo::Context> GlooBackend::Connect(gloo::rendezvous::Store& store,
                                                    const std::string& name) {
  gloo::transport::tcp::attr attr;
  if (!options_.iface.empty()) {
    attr.iface = options_.iface;
  } else {
    attr.hostname = options_.host_addr.empty() ? "127.0.0.1" : options_.host_addr;
  }
  auto device = gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(options_.rank, options_.size);
  ctx->setTimeout(options_.timeout);
  gloo::rendezvous::PrefixStore prefixed(options_.key_prefix + "/" + name, store);
  ctx->connectFullMesh(prefixed, device);
  return ctx;
}

void GlooBackend::CreateRawChannel(gloo::rendezvous::Store& store) {
  if (options_.size > 1 && !raw_) raw_ = Connect(store, "raw");
}

const std::shared_ptr<gloo::Context>& GlooBackend::Channel(int channel) {
  if (channel == kControl) return control_;
  if (channel == kRawChannel) {
    if (!raw_) throw std::runtime_error("raw benchmark channel was not created");
    return raw_;
  }
  return streams_.at(static_cast<size_t>(channel));
}

void GlooBackend::Allreduce(int channel, void* data, size_t count, DataType dtype,
                            ReduceFn fn) {
  if (options_.size <= 1 || count == 0) return;
  const auto& ctx = Channel(channel);
  switch (DataTypeSize(dtype)) {
    case 1: RunAllreduce<Bytes<1>>(ctx, data, count, fn); break;
    case 2: RunAllreduce<Bytes<2>>(ctx, data, count, fn); break;
    case 4: RunAllreduce<Bytes<4>>(ctx, data, count, fn); break;
    case 8: RunAllreduce<Bytes<8>>(ctx, data, count, fn); break;
    default: throw std::runtime_error("unsupported element size");
  }
}

void GlooBackend::Broadcast(int channel, void* data, size_t bytes, int root) {
  if (options_.size <= 1 || bytes == 0) return;
  gloo::BroadcastOptions opts(Channel(channel));
  opts.setOutput(static_cast<uint8_t*>(data), bytes);
  opts.setRoot(root);
  opts.setTag(2);
  gloo::broadcast(opts);
}

void GlooBackend::Allgatherv(int channel, const void* in, void* out,
                             const std::vector<size_t>& bytes_per_rank) {
  if (options_.size <= 1) {
    if (bytes_per_rank[0]) std::memmove(out, in, bytes_per_rank[0]);
    return;
  }
  size_t total = 0;
  for (size_t b : bytes_per_rank) total += b;
  if (total == 0) return;
  gloo::AllgathervOptions opts(Channel(channel));
  opts.setInput(const_cast<uint8_t*>(static_cast<const uint8_t*>(in)),
                bytes_per_rank[options_.rank]);
  opts.setOutput(static_cast<uint8_t*>(out), bytes_per_rank);
  opts.setTag(3);
  gloo::allgatherv(opts);
}

void GlooBackend::Alltoallv(int channel, const void* in,
                            const std::vector<int64_t>& send_bytes, void* out,
                            const std::vector<int64_t>& recv_bytes) {
  if (options_.size <= 1) {
    if (send_bytes[0]) std::memmove(out, in, static_cast<size_t>(send_bytes[0]));
    return;
  }
  int64_t total_in = 0, total_out = 0;
  for (int64_t b : send_bytes) total_in += b;
  for (int64_t b : recv_bytes) total_out += b;
  if (total_in == 0 && total_out == 0) return;
  // Gloo rejects null buffers even when a side has nothing to move.
  uint8_t dummy = 0;
  gloo::AlltoallvOptions opts(Channel(channel));
  opts.setInput(total_in ? const_cast<uint8_t*>(static_cast<const uint8_t*>(in)) : &dummy,
                send_bytes);
  opts.setOutput(total_out ? static_cast<uint8_t*>(out) : &dummy, recv_bytes);
  opts.setTag(4);
  gloo::alltoallv(opts);
}

}  // namespace perseus
