// Helpers shared by the files that implement Runtime (not for other callers).
#pragma once

#include <algorithm>
#include <chrono>
#include <sstream>
#include <string>
#include <vector>

namespace perseus {

using Clock = std::chrono::steady_clock;

// "rank 3" or "ranks 1, 2".
inline std::string RankList(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  return out.str();
}

// How long a store read waits at start-up for ranks that have not started:
// importing TensorFlow on a loaded machine can take minutes.
inline std::chrono::milliseconds StartupStoreWait(std::chrono::milliseconds gloo_timeout) {
  return std::max(gloo_timeout, std::chrono::milliseconds(300000));
}

// How long the store may take to answer a request of the round's connection
// beyond the wait it asks for (store_client.h): GLOO_TIMEOUT_SECONDS, at
// least 5 s. The heartbeat names a silent store sooner (health.h).
inline std::chrono::milliseconds StoreAnswerTimeout(std::chrono::milliseconds gloo_timeout) {
  return std::max(gloo_timeout, std::chrono::milliseconds(5000));
}

}  // namespace perseus
