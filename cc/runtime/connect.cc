// Start-up: the roll call in the store (duplicate ranks, settings that must
// agree) and connecting the transport, with retries after stray connections.
#include "cc/runtime/runtime.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>

#include "cc/core/reduce.h"
#include "cc/rendezvous/store_client.h"
#include "cc/rendezvous/store_protocol.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/gloo_transport.h"

namespace perseus {
namespace {

std::map<std::string, std::string> ParseSettings(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

std::string Join(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// What rank `me` and rank `r` published in the roll call: an error naming
// each setting (or installed version) that differs, with both values.
Status CompareSettings(const std::map<std::string, std::string>& mine,
                       const std::map<std::string, std::string>& theirs, const std::string& me,
                       int r) {
  std::string diff, versions;
  for (const auto& kv : mine) {
    auto it = theirs.find(kv.first);
    const std::string other = it == theirs.end() ? "(unset)" : it->second;
    if (other == kv.second) continue;
    // "<package> version" lines: what each rank has installed.
    const bool version =
        kv.first.size() > 8 && kv.first.compare(kv.first.size() - 8, 8, " version") == 0;
    std::string& out = version ? versions : diff;
    out += std::string(out.empty() ? "" : "; ") + kv.first + ": rank " + me + " has " +
           kv.second + ", rank " + std::to_string(r) + " has " + other;
  }
  if (!versions.empty()) {
    return Status::Error(StatusCode::kFailedPrecondition,
                         "Perseus: ranks run different software: " + versions +
                             ". Install the same versions for every rank (one Python "
                             "environment, or the same packages on every host).");
  }
  if (!diff.empty()) {
    return Status::Error(StatusCode::kInvalidArgument,
                         "Perseus: ranks disagree on settings that must be the same on "
                         "every rank: " + diff + ". Set them alike for every rank "
                         "(perseusrun passes its environment to all ranks).");
  }
  return Status::OK();
}

// The last process the store refused (a different secret), which a rank
// waiting for the others names once per address: often the missing rank
// itself, which failed at once on its side.
class RefusedByStore {
 public:
  // Whether the store refused a process at a new address since last asked.
  bool Changed(StoreClient* store) {
    std::vector<char> from;
    if (!store->TryGet(store_protocol::kRejectedFromKey, std::chrono::milliseconds(0), &from) ||
        std::string(from.begin(), from.end()) == from_) {
      return false;
    }
    from_.assign(from.begin(), from.end());
    return true;
  }
  // "; the store refused a process at ADDR ..." or "" when none was.
  std::string Note() const {
    if (from_.empty()) return "";
    return "; the store refused a process at " + from_ +
           " whose secret differs from this job's (give every rank the same "
           "PERSEUS_RENDEZVOUS_SECRET or PERSEUS_RENDEZVOUS_SECRET_FILE)";
  }

 private:
  std::string from_;
};

// The roll call's error when ranks did not come within its wait.
Status NotStarted(const InitOptions& o, const std::vector<int>& missing, int64_t waited,
                  const std::string& refused_note) {
  return Status::Error(
      StatusCode::kUnavailable,
      "Perseus rank " + std::to_string(o.rank) + ": rank(s) " + Join(missing) + " of " +
          std::to_string(o.size) + " did not start within " + std::to_string(waited) +
          " s (PERSEUS_SIZE=" + std::to_string(o.size) + "; is every rank launched, " +
          "with the same PERSEUS_JOB_ID and rendezvous address?" + refused_note + ")");
}

}  // namespace

// Before any connection: every process claims its rank (a second claim of
// the same rank fails both at once), publishes the settings that must agree,
// and reads every other rank's, failing at the first difference with the
// variable and both values. Waits for ranks that have not started yet up to
// `wait`, saying so on stderr every GLOO_TIMEOUT_SECONDS.
Status Runtime::RollCall(const InitOptions& o, const std::string& prefix,
                         std::chrono::milliseconds wait) {
  const std::string me = std::to_string(o.rank);
  const std::string claim = prefix + "/claim/" + me;
  auto duplicate = [&]() {
    return Status::Error(
        StatusCode::kInvalidArgument,
        "Perseus: two processes claim rank " + me + " of job " + o.job_id +
            " (PERSEUS_RANK=" + me + " twice?). Every process of a job needs its own rank, " +
            "0 to " + std::to_string(o.size - 1) + " (PERSEUS_SIZE=" + std::to_string(o.size) +
            "); perseusrun assigns them.");
  };
  if (store_->Add(claim, 1) > 1) return duplicate();
  store_->set(prefix + "/settings/" + me, std::vector<char>(o.settings.begin(), o.settings.end()));
  const auto mine = ParseSettings(o.settings);
  std::vector<bool> seen(o.size, false);
  seen[o.rank] = true;
  const auto start = std::chrono::steady_clock::now();
  const auto note_every = std::chrono::milliseconds(
      std::max<int64_t>(1000, static_cast<int64_t>(o.timeout_seconds * 1000)));
  auto next_note = start + note_every;
  RefusedByStore refused;
  for (;;) {
    std::vector<int> missing;
    for (int r = 0; r < o.size; ++r) {
      if (seen[r]) continue;
      std::vector<char> value;
      if (!store_->TryGet(prefix + "/settings/" + std::to_string(r),
                          std::chrono::milliseconds(missing.empty() ? 100 : 0), &value)) {
        missing.push_back(r);
        continue;
      }
      seen[r] = true;
      Status same = CompareSettings(mine, ParseSettings(std::string(value.begin(), value.end())),
                                    me, r);
      if (!same.ok()) return same;
    }
    if (missing.empty()) return Status::OK();
    if (store_->Add(claim, 0) > 1) return duplicate();
    if (refused.Changed(store_.get())) {
      std::fprintf(stderr, "Perseus rank %d: waiting for rank(s) %s to start%s\n", o.rank,
                   Join(missing).c_str(), refused.Note().c_str());
    }
    const auto now = std::chrono::steady_clock::now();
    const auto waited = std::chrono::duration_cast<std::chrono::seconds>(now - start).count();
    if (now - start >= wait) return NotStarted(o, missing, waited, refused.Note());
    if (now >= next_note) {
      std::fprintf(stderr,
                   "Perseus rank %d: waiting for rank(s) %s to start (%lld s so far; gives up "
                   "after %lld s%s)\n",
                   o.rank, Join(missing).c_str(), static_cast<long long>(waited),
                   static_cast<long long>(wait.count() / 1000), refused.Note().c_str());
      next_note = now + note_every;
    }
  }
}

// Builds the Gloo backend on a helper thread and waits at most
// GLOO_TIMEOUT_SECONDS + 10 s: Gloo's pair set-up can block without a
// deadline of its own after a foreign connection. Returns "" or the error.
// When it gives up, the helper thread is left blocked: the store client it
// uses is deliberately kept alive (leaked) so that it never touches freed
// memory, and this rank votes for another attempt with a new client.
std::string Runtime::ConnectWithDeadline(const TransportOptions& bo) {
  struct Attempt {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::unique_ptr<GlooTransport> backend;
    std::string error;
  };
  auto attempt = std::make_shared<Attempt>();
  StoreClient* store = store_.get();
  std::thread([attempt, bo, store] {
    // Gloo's network loop threads start here and keep this name.
    NameThisThread("perseus-gloo");
    std::unique_ptr<GlooTransport> backend;
    std::string error;
    try {
      backend.reset(new GlooTransport(bo, store));
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(attempt->mu);
    attempt->backend = std::move(backend);
    attempt->error = error;
    attempt->done = true;
    attempt->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(attempt->mu);
  if (!attempt->cv.wait_for(lock, bo.timeout + std::chrono::seconds(10),
                            [&] { return attempt->done; })) {
    // The blocked thread still uses the store client: keep it alive (its
    // connection also still stands for this rank) and go on with a new one.
    store_.release();
    store_.reset(new StoreClient(options_.store_addr, options_.store_port, options_.secret,
                                 StartupStoreWait(bo.timeout)));
    store_->SetAnswerTimeout(StoreAnswerTimeout(bo.timeout));
    return "connecting to the other ranks did not finish within GLOO_TIMEOUT_SECONDS + 10 s "
           "(Gloo is stuck on a connection)";
  }
  transport_ = std::move(attempt->backend);
  return attempt->error;
}

// Gloo's TCP pairs take the first connection that reaches their listening
// port: a foreign connect-and-close there (a port scan, a health check)
// fails that pair on both of its ranks. Every rank votes in the store after
// connecting; if any failed, all drop what they made and connect again
// under fresh keys (three attempts), so a stray connection costs a retry,
// not the job. Throws when the last attempt fails.
void Runtime::ConnectTransport(TransportOptions* bo) {
  if (!store_) {
    transport_.reset(new GlooTransport(*bo, nullptr));
    return;
  }
  const std::string base = bo->key_prefix;
  const int kAttempts = 3;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    bo->key_prefix = attempt ? base + "/retry" + std::to_string(attempt) : base;
    std::string error = ConnectWithDeadline(*bo);
    const std::string votes = base + "/connected" + std::to_string(attempt) + "/";
    store_->set(votes + std::to_string(options_.rank), {error.empty() ? '1' : '0'});
    std::vector<int> failed;
    const auto deadline = Clock::now() + bo->timeout + std::chrono::seconds(30);
    for (int r = 0; r < options_.size; ++r) {
      std::vector<char> vote;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (!store_->TryGet(votes + std::to_string(r), std::max(left, std::chrono::milliseconds(0)),
                          &vote)) {
        throw std::runtime_error("rank " + std::to_string(r) +
                                 " did not finish connecting within GLOO_TIMEOUT_SECONDS + 30 s" +
                                 (error.empty() ? std::string() : " (here: " + error + ")"));
      }
      if (vote.empty() || vote[0] != '1') failed.push_back(r);
    }
    if (failed.empty()) return;
    transport_.reset();
    if (attempt + 1 == kAttempts) {
      throw std::runtime_error(
          (error.empty() ? RankList(failed) + " could not connect" : error) +
          " (after " + std::to_string(kAttempts) + " attempts)");
    }
    if (options_.rank == failed.front()) {
      std::fprintf(stderr,
                   "Perseus: connecting the ranks failed on %s (%s; a foreign "
                   "connection to a listening port?); connecting again (attempt %d of %d)\n",
                   RankList(failed).c_str(), error.empty() ? "see that rank" : error.c_str(),
                   attempt + 2, kAttempts);
    }
  }
}

}  // namespace perseus
