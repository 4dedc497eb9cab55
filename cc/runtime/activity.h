// What this rank's runtime threads are doing, and since when. A failure
// report ends with it (Runtime::Fail): when a peer gives up on this rank, or
// this rank on a peer, the report says what held each thread, which is what
// tells a hang's cause (a negotiation thread that never reached the cycle
// the others wait in, a stream stuck behind another collective).
//
// Slot 0 is the negotiation thread; slot 1 + i is stream i. Writers set a
// slot when a wait or a collective starts and clear it when it ends.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

namespace perseus {

class Activity {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int kNegotiation = 0;
  static int StreamSlot(int stream) { return 1 + stream; }

  explicit Activity(int streams) : slots_(static_cast<size_t>(streams) + 2) {}

  void Set(int slot, std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    if (slot < 0 || slot >= static_cast<int>(slots_.size())) return;
    slots_[slot].what = std::move(what);
    slots_[slot].since = Clock::now();
  }
  void Clear(int slot) { Set(slot, std::string()); }

  // How long the slot busy the longest has been (zero: none is).
  Clock::duration Longest() const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    Clock::duration out{0};
    for (const Slot& s : slots_) {
      if (!s.what.empty()) out = std::max(out, now - s.since);
    }
    return out;
  }

  // The slots busy for at least `at_least`, as one clause each:
  // "the negotiation thread had been waiting in ... for 61.0 s; stream 2
  // had been running allgather of 'x' for 60.2 s"; empty when none was.
  std::string Describe(Clock::duration at_least) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    std::string out;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (s.what.empty() || now - s.since < at_least) continue;
      char seconds[32];
      std::snprintf(seconds, sizeof(seconds), "%.1f s",
                    std::chrono::duration<double>(now - s.since).count());
      if (!out.empty()) out += "; ";
      out += (i == kNegotiation ? std::string("the negotiation thread")
                                : "stream " + std::to_string(i - 1)) +
             " had been " + s.what + " for " + seconds;
    }
    return out;
  }

 private:
  struct Slot {
    std::string what;
    Clock::time_point since;
  };
  mutable std::mutex mu_;
  std::vector<Slot> slots_;
};

}  // namespace perseus
