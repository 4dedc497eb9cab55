#include "cc/transport/gloo_abortable.h"

#include <algorithm>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include <gloo/common/error.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/unbound_buffer.h>

namespace perseus {
namespace {

using gloo::transport::UnboundBuffer;

// What one context's buffers share: whether the context was aborted, and
// the buffers alive now (a wait can only be on one of them).
class AbortState {
 public:
  void Add(UnboundBuffer* inner) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.insert(inner);
    if (aborted_) WakeLocked(inner);
  }
  void Remove(UnboundBuffer* inner) {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(inner);
  }
  void Abort(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) return;
    aborted_ = true;
    why_ = why;
    for (UnboundBuffer* b : live_) WakeLocked(b);
  }
  void ThrowIfAborted() {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) throw gloo::IoException(why_);
  }

 private:
  // Gloo keeps the flag when no thread waits: the next wait returns at once.
  static void WakeLocked(UnboundBuffer* b) {
    b->abortWaitSend();
    b->abortWaitRecv();
  }
  std::mutex mu_;
  bool aborted_ = false;
  std::string why_;
  std::set<UnboundBuffer*> live_;
};

std::mutex registry_mu;
std::vector<std::weak_ptr<AbortState>>& Registry() {
  static auto* states = new std::vector<std::weak_ptr<AbortState>>();
  return *states;
}

std::shared_ptr<AbortState> NewState() {
  auto state = std::make_shared<AbortState>();
  std::lock_guard<std::mutex> lock(registry_mu);
  auto& states = Registry();
  states.erase(std::remove_if(states.begin(), states.end(),
                              [](const std::weak_ptr<AbortState>& w) { return w.expired(); }),
               states.end());
  states.push_back(state);
  return state;
}

// Every call goes to Gloo's own buffer; a wait that returns without
// completing (woken by Abort) throws instead of returning false, which Gloo's
// collectives would not check.
class AbortableBuffer : public UnboundBuffer {
 public:
  AbortableBuffer(std::shared_ptr<AbortState> state, std::unique_ptr<UnboundBuffer> inner)
      : UnboundBuffer(inner->ptr, inner->size), state_(std::move(state)), inner_(std::move(inner)) {
    state_->Add(inner_.get());
  }
  ~AbortableBuffer() override { state_->Remove(inner_.get()); }

  bool waitRecv(int* rank, std::chrono::milliseconds timeout) override {
    state_->ThrowIfAborted();
    const bool done = inner_->waitRecv(rank, timeout);
    if (!done) state_->ThrowIfAborted();
    return done;
  }
  bool waitSend(int* rank, std::chrono::milliseconds timeout) override {
    state_->ThrowIfAborted();
    const bool done = inner_->waitSend(rank, timeout);
    if (!done) state_->ThrowIfAborted();
    return done;
  }
  void abortWaitRecv() override { inner_->abortWaitRecv(); }
  void abortWaitSend() override { inner_->abortWaitSend(); }
  void send(int dst, uint64_t slot, size_t offset, size_t nbytes) override {
    state_->ThrowIfAborted();
    inner_->send(dst, slot, offset, nbytes);
  }
  void recv(int src, uint64_t slot, size_t offset, size_t nbytes) override {
    state_->ThrowIfAborted();
    inner_->recv(src, slot, offset, nbytes);
  }
  void recv(std::vector<int> srcs, uint64_t slot, size_t offset, size_t nbytes) override {
    state_->ThrowIfAborted();
    inner_->recv(std::move(srcs), slot, offset, nbytes);
  }

 private:
  std::shared_ptr<AbortState> state_;
  std::unique_ptr<UnboundBuffer> inner_;
};

// Pairs are Gloo's own (the inner context's), so the transport and
// FailGlooPair see the real TCP pairs.
class AbortableContext : public gloo::transport::Context {
 public:
  AbortableContext(std::shared_ptr<gloo::transport::Context> inner,
                   std::shared_ptr<AbortState> state)
      : gloo::transport::Context(inner->rank, inner->size),
        inner_(std::move(inner)),
        state_(std::move(state)) {
    setTimeout(inner_->getTimeout());
  }
  std::unique_ptr<gloo::transport::Pair>& getPair(int rank) override {
    return inner_->getPair(rank);
  }
  std::unique_ptr<gloo::transport::Pair>& createPair(int rank) override {
    return inner_->createPair(rank);
  }
  std::unique_ptr<UnboundBuffer> createUnboundBuffer(void* ptr, size_t size) override {
    return std::unique_ptr<UnboundBuffer>(
        new AbortableBuffer(state_, inner_->createUnboundBuffer(ptr, size)));
  }

 private:
  std::shared_ptr<gloo::transport::Context> inner_;
  std::shared_ptr<AbortState> state_;
};

class AbortableDevice : public gloo::transport::Device {
 public:
  AbortableDevice(std::shared_ptr<gloo::transport::Device> inner, std::chrono::milliseconds timeout)
      : inner_(std::move(inner)), timeout_(timeout) {}
  std::string str() const override { return inner_->str(); }
  const std::string& getPCIBusID() const override { return inner_->getPCIBusID(); }
  int getInterfaceSpeed() const override { return inner_->getInterfaceSpeed(); }
  bool hasGPUDirect() const override { return inner_->hasGPUDirect(); }
  std::shared_ptr<gloo::transport::Context> createContext(int rank, int size) override {
    auto inner = inner_->createContext(rank, size);
    // Gloo sets the timeout on the context it is handed (this wrapper);
    // the pairs take theirs from the inner one when they are created.
    inner->setTimeout(timeout_);
    auto state = NewState();
    {
      std::lock_guard<std::mutex> lock(mu_);
      states_.push_back(state);
    }
    return std::make_shared<AbortableContext>(std::move(inner), std::move(state));
  }
  void Abort(const std::string& why) {
    std::vector<std::weak_ptr<AbortState>> states;
    {
      std::lock_guard<std::mutex> lock(mu_);
      states = states_;
    }
    for (const auto& w : states) {
      if (auto s = w.lock()) s->Abort(why);
    }
  }

 private:
  std::shared_ptr<gloo::transport::Device> inner_;
  std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::vector<std::weak_ptr<AbortState>> states_;
};

}  // namespace

std::shared_ptr<gloo::transport::Device> WrapGlooDevice(
    std::shared_ptr<gloo::transport::Device> device, std::chrono::milliseconds timeout) {
  return std::make_shared<AbortableDevice>(std::move(device), timeout);
}

void AbortGlooDevice(const std::shared_ptr<gloo::transport::Device>& device,
                     const std::string& why) {
  if (auto* d = dynamic_cast<AbortableDevice*>(device.get())) d->Abort(why);
}

int AbortGlooWaits(const std::string& why) {
  std::vector<std::shared_ptr<AbortState>> alive;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    for (const auto& w : Registry()) {
      if (auto s = w.lock()) alive.push_back(std::move(s));
    }
  }
  for (const auto& s : alive) s->Abort(why);
  return static_cast<int>(alive.size());
}

}  // namespace perseus
