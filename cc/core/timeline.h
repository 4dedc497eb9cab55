// PERSEUS_TIMELINE: a Chrome-trace (Perfetto-viewable) record of what one
// rank's runtime did: negotiation cycles on the background thread, buckets
// on each stream, and the compression and communication inside a bucket.
// Events are kept in memory and written as one JSON file at shutdown.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace perseus {

class Timeline {
 public:
  using Clock = std::chrono::steady_clock;

  // Empty path: disabled (Record is then a no-op).
  void Start(const std::string& path, int pid, const std::string& process_name);
  bool enabled() const { return enabled_; }
  // One complete event ("ph":"X") on thread `tid` (0 = negotiation, 1 + s =
  // stream s). `args` is a JSON object body without braces, may be empty.
  void Record(int tid, const char* name, const char* category, Clock::time_point start,
              Clock::time_point end, const std::string& args = "");
  // Writes the file (once); returns false with `error` set when it cannot.
  bool Write(std::string* error);

 private:
  struct Event {
    int tid;
    const char* name;
    const char* category;
    int64_t start_us;
    int64_t duration_us;
    std::string args;
  };
  bool enabled_ = false;
  std::string path_;
  std::string process_name_;
  int pid_ = 0;
  Clock::time_point origin_;
  std::mutex mu_;
  std::vector<Event> events_;
};

// A span's "args" object, built field by field (strings escaped for JSON).
class TimelineArgs {
 public:
  TimelineArgs& Int(const char* key, int64_t value);
  TimelineArgs& Bool(const char* key, bool value);
  TimelineArgs& Text(const char* key, const std::string& value);
  const std::string& str() const { return text_; }

 private:
  void Key(const char* key);
  std::string text_;
};

// Records [construction, destruction) of a scope when the timeline is on.
class TimelineSpan {
 public:
  TimelineSpan(Timeline& t, int tid, const char* name, const char* category,
               std::string args = "")
      : t_(t), tid_(tid), name_(name), category_(category), args_(std::move(args)) {
    if (t_.enabled()) start_ = Timeline::Clock::now();
  }
  ~TimelineSpan() {
    if (t_.enabled()) t_.Record(tid_, name_, category_, start_, Timeline::Clock::now(), args_);
  }

 private:
  Timeline& t_;
  int tid_;
  const char* name_;
  const char* category_;
  std::string args_;
  Timeline::Clock::time_point start_;
};

}  // namespace perseus
