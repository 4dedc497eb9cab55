#include "cc/core/timeline.h"

#include <cstdio>
#include <fstream>
#include <sstream>

namespace perseus {

void Timeline::Start(const std::string& path, int pid, const std::string& process_name) {
  std::lock_guard<std::mutex> lock(mu_);
  enabled_ = !path.empty();
  path_ = path;
  pid_ = pid;
  process_name_ = process_name;
  origin_ = Clock::now();
  events_.clear();
}

void Timeline::Record(int tid, const char* name, const char* category, Clock::time_point start,
                      Clock::time_point end, const std::string& args) {
  if (!enabled_) return;
  auto us = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - origin_).count();
  };
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back({tid, name, category, us(start), us(end) - us(start), args});
}

bool Timeline::Write(std::string* error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!enabled_) return true;
  enabled_ = false;
  std::ofstream out(path_);
  if (!out) {
    *error = "cannot write the timeline to " + path_;
    return false;
  }
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  out << "{\"ph\": \"M\", \"name\": \"process_name\", \"pid\": " << pid_
      << ", \"args\": {\"name\": \"" << process_name_ << "\"}}";
  int max_tid = 0;
  for (const Event& e : events_) max_tid = std::max(max_tid, e.tid);
  for (int tid = 0; tid <= max_tid; ++tid) {
    out << ",\n{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": " << pid_
        << ", \"tid\": " << tid << ", \"args\": {\"name\": \""
        << (tid == 0 ? std::string("negotiation") : "stream " + std::to_string(tid - 1))
        << "\"}}";
  }
  for (const Event& e : events_) {
    out << ",\n{\"ph\": \"X\", \"pid\": " << pid_ << ", \"tid\": " << e.tid << ", \"name\": \""
        << e.name << "\", \"cat\": \"" << e.category << "\", \"ts\": " << e.start_us
        << ", \"dur\": " << e.duration_us << ", \"args\": {" << e.args << "}}";
  }
  out << "\n]}\n";
  out.close();
  if (!out) {
    *error = "writing the timeline to " + path_ + " failed";
    return false;
  }
  return true;
}

void TimelineArgs::Key(const char* key) {
  if (!text_.empty()) text_ += ", ";
  text_ += '"';
  text_ += key;
  text_ += "\": ";
}

TimelineArgs& TimelineArgs::Int(const char* key, int64_t value) {
  Key(key);
  text_ += std::to_string(value);
  return *this;
}

TimelineArgs& TimelineArgs::Bool(const char* key, bool value) {
  Key(key);
  text_ += value ? "true" : "false";
  return *this;
}

TimelineArgs& TimelineArgs::Text(const char* key, const std::string& value) {
  Key(key);
  text_ += '"';
  for (char c : value) {
    if (c == '"' || c == '\\') text_ += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    text_ += c;
  }
  text_ += '"';
  return *this;
}

}  // namespace perseus
