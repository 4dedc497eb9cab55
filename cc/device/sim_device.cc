#include "cc/device/sim_device.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <sstream>

#include "cc/core/common.h"

namespace perseus {

struct SimDevice::Event {
  bool fired = false;
  std::vector<uint64_t> clock;  // what the stream knew when it passed the event
};

namespace {
// How long anyone waits for an event: work queued before it runs on other
// threads and always ends, so an event that has not fired by then means
// work that never will (a deadlock in the code under test). It is reported
// as a hazard and the waiter goes on.
constexpr std::chrono::seconds kEventWait(120);

std::string AgentName(int agent) {
  return agent == 0 ? "the host" : "stream " + std::to_string(agent - 1);
}
}  // namespace

SimDevice& SimDevice::Get() {
  // Never destroyed: stream threads may outlive static destruction.
  static SimDevice* device = new SimDevice();
  return *device;
}

void SimDevice::Merge(std::vector<uint64_t>& into, const std::vector<uint64_t>& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

void* SimDevice::Alloc(size_t bytes) {
  char* p = new char[std::max<size_t>(bytes, 1)];
  std::memset(p, 0xA5, std::max<size_t>(bytes, 1));
  std::lock_guard<std::mutex> lock(mu_);
  allocs_[reinterpret_cast<uintptr_t>(p)].bytes = std::max<size_t>(bytes, 1);
  return p;
}

void SimDevice::Free(void* p) {
  if (p == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(p));
    if (it == allocs_.end()) {
      hazards_.push_back("simulated device: Free of memory it did not allocate");
      return;
    }
    ++host_seq_;
    if (host_clock_.empty()) host_clock_.resize(1, 0);
    host_clock_[0] = host_seq_;
    Access(0, host_seq_, host_clock_, {{p, 1}}, true, "free");
    allocs_.erase(it);
  }
  delete[] static_cast<char*>(p);
}

bool SimDevice::Owns(const void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  uintptr_t base;
  return Find(p, 0, &base) != nullptr;
}

SimDevice::Allocation* SimDevice::Find(const void* p, size_t bytes, uintptr_t* base) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  auto it = allocs_.upper_bound(at);
  if (it == allocs_.begin()) return nullptr;
  --it;
  if (at >= it->first + it->second.bytes) return nullptr;
  if (at + bytes > it->first + it->second.bytes) {
    hazards_.push_back("simulated device: an access of " + std::to_string(bytes) +
                       " bytes runs past the end of its " + std::to_string(it->second.bytes) +
                       "-byte allocation");
  }
  *base = it->first;
  return &it->second;
}

void SimDevice::Access(int agent, uint64_t seq, const std::vector<uint64_t>& clock,
                       const std::vector<Range>& ranges, bool write, const std::string& what) {
  for (const Range& r : ranges) {
    uintptr_t base;
    Allocation* a = Find(r.p, r.bytes, &base);
    if (a == nullptr) continue;  // host memory
    auto unknown = [&](const std::map<int, uint64_t>& accesses) {
      for (const auto& kv : accesses) {
        if (kv.first == agent) continue;
        const uint64_t known = static_cast<size_t>(kv.first) < clock.size() ? clock[kv.first] : 0;
        if (known < kv.second) return kv.first;
      }
      return -1;
    };
    int other = unknown(a->last_write);
    const char* kind = "the write";
    if (other < 0 && write) {
      other = unknown(a->last_read);
      kind = "a read";
    }
    if (other >= 0) {
      std::ostringstream msg;
      msg << "simulated device: " << AgentName(agent) << (write ? " wrote " : " read ")
          << "a " << a->bytes << "-byte allocation in '" << what << "' before it knew that "
          << kind << " by " << AgentName(other)
          << (kind[0] == 't' ? " ('" + a->last_write_what + "')" : std::string())
          << " had finished: a missing wait on an event";
      hazards_.push_back(msg.str());
    }
    if (write) {
      a->last_write.clear();
      a->last_read.clear();
      a->last_write[agent] = seq;
      a->last_write_what = what;
    } else {
      uint64_t& last = a->last_read[agent];
      last = std::max(last, seq);
    }
  }
}

int SimDevice::CreateStream() {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<Stream> s(new Stream());
  s->id = next_stream_++;
  Stream* raw = s.get();
  streams_[raw->id] = std::move(s);
  raw->thread = std::thread(&SimDevice::Loop, this, raw);
  return raw->id;
}

void SimDevice::DestroyStream(int stream) {
  std::unique_ptr<Stream> s;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = streams_.find(stream);
    if (it == streams_.end()) return;
    it->second->stop = true;
    cv_.notify_all();
  }
  Stream* raw;
  {
    std::lock_guard<std::mutex> lock(mu_);
    raw = streams_[stream].get();
  }
  raw->thread.join();
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(stream);
}

void SimDevice::Enqueue(int stream, Op op) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream& s = *streams_.at(stream);
  op.seq = ++s.issued;
  op.host_knows = host_clock_;
  if (op.fn && !op.host_func) ++launches_;
  s.queue.push_back(std::move(op));
  cv_.notify_all();
}

void SimDevice::Launch(int stream, const char* what, std::vector<Range> reads,
                       std::vector<Range> writes, std::function<void()> fn) {
  Op op;
  op.what = what;
  op.reads = std::move(reads);
  op.writes = std::move(writes);
  op.fn = std::move(fn);
  Enqueue(stream, std::move(op));
}

SimDevice::EventPtr SimDevice::Record(int stream) {
  Op op;
  op.what = "record";
  op.record = std::make_shared<Event>();
  EventPtr event = op.record;
  Enqueue(stream, std::move(op));
  return event;
}

void SimDevice::StreamWait(int stream, const EventPtr& event) {
  if (!event) return;
  Op op;
  op.what = "wait";
  op.wait = event;
  Enqueue(stream, std::move(op));
}

void SimDevice::Synchronize(const EventPtr& event) {
  if (!event) return;
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, kEventWait, [&] { return event->fired; })) {
    hazards_.push_back("simulated device: the host waited " + std::to_string(kEventWait.count()) +
                       " s for an event that never fired");
    return;
  }
  Merge(host_clock_, event->clock);
}

void SimDevice::LaunchHostFunc(int stream, std::function<void()> fn) {
  Op op;
  op.what = "host function";
  op.fn = std::move(fn);
  op.host_func = true;
  Enqueue(stream, std::move(op));
}

void SimDevice::CheckUnfinished(const void* p, size_t bytes, bool write, const char* what) {
  uintptr_t base;
  if (Find(p, bytes, &base) == nullptr) return;
  auto touches = [&](const Op& op) {
    auto overlaps = [&](const std::vector<Range>& ranges) {
      for (const Range& r : ranges) {
        uintptr_t other;
        if (Find(r.p, 0, &other) != nullptr && other == base) return true;
      }
      return false;
    };
    return overlaps(op.writes) || (write && overlaps(op.reads));
  };
  for (const auto& kv : streams_) {
    const Stream& s = *kv.second;
    const Op* pending = s.running && touches(s.current) ? &s.current : nullptr;
    for (size_t i = 0; pending == nullptr && i < s.queue.size(); ++i) {
      if (touches(s.queue[i])) pending = &s.queue[i];
    }
    if (pending != nullptr) {
      hazards_.push_back("simulated device: the host " + std::string(write ? "wrote" : "read") +
                         " memory in '" + what + "' while '" + pending->what + "' on stream " +
                         std::to_string(s.id) + " had not finished: a missing wait on an event");
      return;
    }
  }
}

void SimDevice::HostAccess(const void* p, size_t bytes, bool write, const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  CheckUnfinished(p, bytes, write, what);
  ++host_seq_;
  if (host_clock_.empty()) host_clock_.resize(1, 0);
  host_clock_[0] = host_seq_;
  Access(0, host_seq_, host_clock_, {{p, bytes}}, write, what);
}

std::vector<std::string> SimDevice::TakeHazards() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  out.swap(hazards_);
  return out;
}

void SimDevice::Loop(Stream* s) {
  NameThisThread("perseus-sim" + std::to_string(s->id));
  std::mt19937 rng(static_cast<uint32_t>(1234567 + s->id));
  const int agent = 1 + s->id;
  for (;;) {
    Op op;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle until work or DestroyStream comes (not a wait on another
      // agent: nothing is pending while the queue is empty).
      cv_.wait(lock, [&] { return !s->queue.empty() || s->stop; });
      if (s->queue.empty()) return;
      op = std::move(s->queue.front());
      s->queue.pop_front();
      s->running = true;
      s->current.what = op.what;
      s->current.reads = op.reads;
      s->current.writes = op.writes;
    }
    const int delay = max_delay_us_;
    if (delay > 0 && (op.fn || op.record)) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % (delay + 1)));
    }
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (op.wait) {
        if (cv_.wait_for(lock, kEventWait, [&] { return op.wait->fired; })) {
          Merge(s->clock, op.wait->clock);
        } else {
          hazards_.push_back("simulated device: stream " + std::to_string(s->id) + " waited " +
                             std::to_string(kEventWait.count()) +
                             " s for an event that never fired");
        }
      }
      // What the host knew when it queued the work, the work knows.
      Merge(s->clock, op.host_knows);
      if (s->clock.size() <= static_cast<size_t>(agent)) s->clock.resize(agent + 1, 0);
      s->clock[agent] = op.seq;
      Access(agent, op.seq, s->clock, op.reads, false, op.what);
      Access(agent, op.seq, s->clock, op.writes, true, op.what);
      if (op.host_func) Merge(host_clock_, s->clock);
    }
    if (op.fn) op.fn();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (op.record) {
        op.record->clock = s->clock;
        op.record->fired = true;
      }
      s->running = false;
    }
    cv_.notify_all();
  }
}

}  // namespace perseus
