// A simulated device, for testing without a GPU the ordering a GPU relies on.
//
// It behaves like a device as the runtime sees one: its memory is written
// and read only by work queued on its streams, each stream runs its queue in
// order on a thread of its own after a random delay, events mark points in a
// stream, a stream can wait for another's event, and the host learns that
// work finished only by waiting for an event or from a host function queued
// on a stream. Unlike a GPU, it checks every access: each piece of work
// declares the allocations it reads and writes, and every agent (each
// stream, and the host) carries a vector clock of the work it knows to have
// finished. Reading or writing an allocation whose last writer (or, for a
// write, last reader) is not known to the agent is a hazard: a missing wait
// on an event, or a result used before its work finished. Hazards are
// recorded, whether or not the timing happened to make the bytes right, and
// TakeHazards returns them.
//
// One device per process (Get). Memory that is not the device's (host
// memory) is not checked.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace perseus {

class SimDevice {
 public:
  struct Range {
    const void* p;
    size_t bytes;
  };
  struct Event;
  using EventPtr = std::shared_ptr<Event>;

  static SimDevice& Get();

  // Device memory (filled with 0xA5, so a read of bytes nobody wrote shows).
  void* Alloc(size_t bytes);
  void Free(void* p);
  bool Owns(const void* p);

  // A new stream and its thread; Destroy drains it first.
  int CreateStream();
  void DestroyStream(int stream);

  // Queues fn on `stream`; it runs after what is queued before it, after a
  // random delay of up to max_delay_us. Accesses are checked when it runs.
  void Launch(int stream, const char* what, std::vector<Range> reads, std::vector<Range> writes,
              std::function<void()> fn);
  // An event at the current end of `stream`.
  EventPtr Record(int stream);
  // Later work on `stream` runs after the event fires and knows what it knew.
  void StreamWait(int stream, const EventPtr& event);
  // The host waits for the event and learns what it knew.
  void Synchronize(const EventPtr& event);
  // Queues fn on `stream`; when it runs, the host knows what the stream knew.
  void LaunchHostFunc(int stream, std::function<void()> fn);
  // The host's own accesses to device memory (checked at once).
  void HostRead(const void* p, size_t bytes, const char* what) {
    HostAccess(p, bytes, false, what);
  }
  void HostWrite(const void* p, size_t bytes, const char* what) {
    HostAccess(p, bytes, true, what);
  }

  std::vector<std::string> TakeHazards();
  void set_max_delay_us(int us) { max_delay_us_ = us; }
  int64_t launches() const { return launches_; }

 private:
  struct Op {
    std::string what;
    std::vector<Range> reads, writes;
    std::function<void()> fn;
    EventPtr wait;      // a StreamWait
    EventPtr record;    // a Record
    bool host_func = false;
    uint64_t seq = 0;
    std::vector<uint64_t> host_knows;  // the host's clock when it queued the work
  };
  struct Stream {
    int id = 0;
    std::thread thread;
    std::deque<Op> queue;
    uint64_t issued = 0;
    std::vector<uint64_t> clock;  // by agent: 0 the host, 1 + stream id
    bool stop = false;
    bool running = false;
    Op current;  // what runs now (while running)
  };
  struct Allocation {
    size_t bytes = 0;
    std::map<int, uint64_t> last_write;  // agent -> its op's seq
    std::map<int, uint64_t> last_read;
    std::string last_write_what;
  };

  SimDevice() = default;
  // Queues op at the end of the stream (numbered, with what the host knows).
  void Enqueue(int stream, Op op);
  void HostAccess(const void* p, size_t bytes, bool write, const char* what);
  void Loop(Stream* s);
  // Checks and records the accesses of agent `agent` at seq, knowing clock.
  void Access(int agent, uint64_t seq, const std::vector<uint64_t>& clock,
              const std::vector<Range>& ranges, bool write, const std::string& what);
  Allocation* Find(const void* p, size_t bytes, uintptr_t* base);
  // Work queued or running that touches the host's access (a hazard: the
  // host cannot know it finished).
  void CheckUnfinished(const void* p, size_t bytes, bool write, const char* what);
  static void Merge(std::vector<uint64_t>& into, const std::vector<uint64_t>& from);

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uintptr_t, Allocation> allocs_;
  std::map<int, std::unique_ptr<Stream>> streams_;
  int next_stream_ = 0;
  std::vector<uint64_t> host_clock_;
  uint64_t host_seq_ = 0;
  std::vector<std::string> hazards_;
  int max_delay_us_ = 200;
  int64_t launches_ = 0;
};

}  // namespace perseus
