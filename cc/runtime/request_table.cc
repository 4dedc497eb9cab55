// The request table (request_table.h): submitting, taking what a cycle or a
// plan step runs, closing.
#include "cc/runtime/request_table.h"

#include <algorithm>
#include <sstream>
#include <thread>

#include "cc/runtime/plan/plan.h"

namespace perseus {

std::shared_ptr<Request> StandIn(const Response& response, size_t index) {
  auto q = std::make_shared<Request>();
  q->meta = response.metas[index];
  q->done = [](const Status&) {};
  const size_t esize = DataTypeSize(q->meta.dtype);
  if (response.op == OpType::kAllgather) {
    // No rows from this rank; the gathered result is discarded.
    if (!q->meta.shape.empty()) q->meta.shape[0] = 0;
    q->allocate = [q](const std::vector<int64_t>& shape) -> void* {
      q->scratch.resize(std::max<size_t>(1, NumElements(shape) * DataTypeSize(q->meta.dtype)));
      return q->scratch.data();
    };
    return q;
  }
  // Zeros in (neutral for a sum, the only reduction a joined rank should
  // meet), result discarded.
  q->scratch.assign(std::max<size_t>(1, NumElements(q->meta.shape) * esize), 0);
  q->input = q->output = q->scratch.data();
  q->allocate = [q](const std::vector<int64_t>& shape) -> void* {
    size_t need = NumElements(shape) * DataTypeSize(q->meta.dtype);
    if (need > q->scratch.size()) q->scratch.resize(need);
    return q->scratch.data();
  };
  return q;
}

// A call's progress from Submit to its `done`: whether it has completed,
// and the error it completes with because a second call of its name came
// on this rank while it was in flight.
struct RequestTable::Flight {
  std::mutex mu;
  bool finished = false;
  Status twice;
  // Marks the call failed unless it already finished; false if it had.
  bool Fail(const Status& why) {
    std::lock_guard<std::mutex> lock(mu);
    if (finished) return false;
    if (twice.ok()) twice = why;
    return true;
  }
  bool Finished() {
    std::lock_guard<std::mutex> lock(mu);
    return finished;
  }
};

void RequestTable::Open(int world_rank) {
  std::lock_guard<std::mutex> lock(mu_);
  world_rank_ = world_rank;
  closed_ = false;
  closed_status_ = Status::OK();
  queue_.clear();
  pending_.clear();
  flight_.clear();
  abandoned_.clear();
  joined_ = false;
  shutdown_requested_ = false;
  shutdown_by_.clear();
  shutdown_by_rank_ = -1;
  plan_ = OfflinePlan();
  plan_waiting_ = false;
  last_step_done_ = Clock::time_point{};
}

void RequestTable::Close(const Status& status) {
  std::unordered_map<std::string, std::shared_ptr<Request>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_) {
      closed_ = true;
      closed_status_ = status;
    }
    pending.swap(pending_);
    queue_.clear();
  }
  cv_.notify_all();
  for (auto& kv : pending) kv.second->done(status);
}

Status RequestTable::Submit(const Requests& requests, Clock::time_point now, bool* closed) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    *closed = closed_;
    if (closed_) return Status::OK();
    // All or nothing: the whole call is in pending_ before the controller
    // can look at any of it (it waits for mu_), so a plan bucket never sees
    // half a call. A name already pending (from an earlier call, or twice
    // in this one) takes back what this call inserted.
    for (size_t i = 0; i < requests.size(); ++i) {
      const TensorMeta& m = requests[i]->meta;
      const bool joining_twice = m.op == OpType::kJoin && joined_;
      auto flying = flight_.find(m.name);
      Flight* in_flight = flying != flight_.end() && !flying->second->Finished()
                              ? flying->second.get() : nullptr;
      if (joining_twice || in_flight || !pending_.emplace(m.name, requests[i]).second) {
        for (size_t j = 0; j < i; ++j) pending_.erase(requests[j]->meta.name);
        if (joining_twice) {
          return Status::Error(StatusCode::kInvalidArgument,
                               "Perseus join: join() is already in progress on this rank");
        }
        if (in_flight) return InFlightTwiceLocked(m, in_flight);
        return Status::Error(StatusCode::kInvalidArgument,
                             std::string("Perseus ") + OpTypeName(m.op) + " of tensor '" + m.name +
                                 "': the call names this tensor twice; a collective with this "
                                 "name is already in flight on rank " +
                                 std::to_string(world_rank_) +
                                 "; the tensors of one call need distinct names");
      }
    }
    if (flight_.size() >= sweep_at_) {
      for (auto it = flight_.begin(); it != flight_.end();) {
        it = it->second->Finished() ? flight_.erase(it) : std::next(it);
      }
      sweep_at_ = std::max<size_t>(64, 2 * flight_.size());
    }
    for (const auto& q : requests) {
      // The call is in flight until its `done` runs, on whatever thread.
      auto flight = std::make_shared<Flight>();
      flight_[q->meta.name] = flight;
      auto done = std::move(q->done);
      q->done = [flight, done](const Status& status) {
        Status twice;
        {
          std::lock_guard<std::mutex> lock(flight->mu);
          flight->finished = true;
          twice = flight->twice;
        }
        done(status.ok() ? twice : status);
      };
    }
    for (const auto& q : requests) {
      TensorMeta& m = q->meta;
      q->enqueued = now;
      if (m.op == OpType::kJoin) joined_ = true;
      if (plan_.active() && (m.flags & kMetaPlannable)) {
        // Runs from the plan; one that does not fit it votes to leave the
        // plan. The controller is woken when this completes a bucket (or
        // votes).
        bool completes;
        wake |= !plan_.Arrive(m, &completes) || completes;
        wake |= !plan_waiting_;  // its deadline starts now
      } else {
        queue_.push_back(m);
        wake = true;
      }
    }
  }
  if (wake) cv_.notify_one();
  return Status::OK();
}

Status RequestTable::InFlightTwiceLocked(const TensorMeta& m, Flight* flying) {
  const std::string rank = std::to_string(world_rank_);
  const std::string why =
      "two calls of this name were in flight at once on rank " + rank +
      " (from two threads, or a call made again before the first completed), and the ranks "
      "could pair them differently; both fail on every rank. Give collectives that may run "
      "at the same time distinct names (name=...); unnamed eager calls share one name";
  const std::string op = std::string("Perseus ") + OpTypeName(m.op) + " of tensor '" + m.name + "'";
  flying->Fail(Status::Error(StatusCode::kInvalidArgument, op + " is not applied: " + why));
  // The others' calls of the name fail too, even the one this rank's call
  // in flight is negotiating with (Negotiator::Add takes a refusal from a
  // rank that already asked).
  TensorMeta refusal = m;
  refusal.flags = kMetaRejected | kMetaInFlightTwice;
  refusal.rejected = why;
  queue_.push_back(std::move(refusal));
  cv_.notify_one();
  return Status::Error(StatusCode::kInvalidArgument, op + ": " + why);
}

void RequestTable::Reject(const Requests& requests, const std::string& why) {
  // The other ranks made this call with good arguments, or will: tell them
  // in the next cycle, so that theirs fail at once instead of stalling.
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    for (const auto& q : requests) {
      if (q->meta.name.empty() || pending_.count(q->meta.name)) continue;
      TensorMeta m = q->meta;
      m.flags = kMetaRejected;
      m.rejected = why;
      queue_.push_back(std::move(m));
    }
  }
  cv_.notify_one();
}

void RequestTable::RequestShutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_requested_ = true;
  }
  cv_.notify_all();
}

bool RequestTable::ShuttingDown() {
  std::lock_guard<std::mutex> lock(mu_);
  return shutdown_requested_ || !shutdown_by_.empty();
}

std::string RequestTable::shutdown_by() {
  std::lock_guard<std::mutex> lock(mu_);
  return shutdown_by_;
}

int RequestTable::shutdown_by_rank() {
  std::lock_guard<std::mutex> lock(mu_);
  return shutdown_by_rank_;
}

bool RequestTable::HasPending() {
  std::lock_guard<std::mutex> lock(mu_);
  return !pending_.empty();
}

RequestTable::Queued RequestTable::TakeQueued(Clock::time_point wake_by,
                                              Clock::time_point send_at) {
  Queued out;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_until(lock, wake_by, [&] { return !queue_.empty() || shutdown_requested_; });
  if (!queue_.empty() && Clock::now() < send_at) {
    lock.unlock();
    std::this_thread::sleep_until(send_at);
    lock.lock();
  }
  out.requests.assign(queue_.begin(), queue_.end());
  queue_.clear();
  out.shutdown = shutdown_requested_;
  out.in_plan = plan_.active();
  return out;
}

void RequestTable::ShutdownAgreed(int rank, const std::string& who) {
  std::lock_guard<std::mutex> lock(mu_);
  shutdown_by_ = who;
  shutdown_by_rank_ = rank;
}

bool RequestTable::joined() {
  std::lock_guard<std::mutex> lock(mu_);
  return joined_;
}

RequestTable::Taken RequestTable::TakeResponse(const Response& response, bool joined) {
  const int world_rank = world_rank_;
  Taken out;
  std::lock_guard<std::mutex> lock(mu_);
  std::string not_submitted;
  for (size_t i = 0; i < response.names.size(); ++i) {
    auto it = pending_.find(response.names[i]);
    if (it == pending_.end()) {
      const bool abandoned = abandoned_.erase(response.names[i]) > 0;
      if (!response.error.ok()) continue;
      // Only a rank in join() may lack a name: it takes part with zeros.
      // Any other rank would add zeros nobody asked for to the result.
      if (!joined) {
        not_submitted = response.names[i];
        out.fatal = abandoned
                        ? "the others ran " + std::string(OpTypeName(response.op)) + " of '" +
                              not_submitted + "', which rank " + std::to_string(world_rank) +
                              " gave up when another tensor of its grouped call failed"
                        : "internal error: negotiation started " +
                              std::string(OpTypeName(response.op)) + " of '" + not_submitted +
                              "', which rank " + std::to_string(world_rank) +
                              " has not submitted and it is not in join()";
        break;
      }
      out.requests.push_back(StandIn(response, i));
      continue;
    }
    out.requests.push_back(it->second);
    pending_.erase(it);
  }
  if (!response.error.ok()) {
    // Names this rank has not sent yet (still queued for the next cycle).
    std::unordered_set<std::string> unsent;
    for (const TensorMeta& m : queue_) unsent.insert(m.name);
    // What fails here leaves the queue: a request failed here may have
    // arrived after this cycle's message was sent, and its queued copy
    // would pair with another rank's retry of that name in the next cycle
    // while no request of this rank is left to take part.
    std::unordered_set<std::string> drop;
    for (const auto& q : out.requests) drop.insert(q->meta.name);
    // The rest of a failed grouped call fails with it: its caller waits
    // for all of its tensors, and the others would wait for these forever
    // (a rank whose call held fewer tensors has none of them).
    for (const auto& q : out.requests) {
      if (!q->call) continue;
      for (const std::string& name : *q->call) {
        auto it = pending_.find(name);
        if (it == pending_.end() || it->second->call != q->call) continue;
        if (response.siblings_run) {
          // Every rank has this tensor of the call: it runs as negotiated
          // (queued or sent, it stays so) and then fails with the call.
          Request& sibling = *it->second;
          if (sibling.failed_with_call.ok()) {
            sibling.failed_with_call = Status::Error(
                response.error.code, std::string("Perseus ") + OpTypeName(sibling.meta.op) +
                                         " of tensor '" + name + "' is not applied: '" +
                                         response.names[0] +
                                         "' of the same grouped call failed: " +
                                         response.error.message);
            auto done = std::move(sibling.done);
            const Status failed = sibling.failed_with_call;
            sibling.done = [done, failed](const Status& status) {
              done(status.ok() ? failed : status);
            };
          }
          continue;
        }
        if (plan_.active() && (it->second->meta.flags & kMetaPlannable)) continue;
        if (!unsent.count(name)) abandoned_.insert(name);  // the others know of it
        drop.insert(name);
        out.siblings.push_back(it->second);
        pending_.erase(it);
      }
    }
    if (!unsent.empty()) {
      // A refusal stays: it is this rank's answer to a later call of the
      // name (RequestTable::Reject, InFlightTwiceLocked), which the others
      // pair with theirs.
      queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                  [&](const TensorMeta& m) {
                                    return drop.count(m.name) && !(m.flags & kMetaRejected);
                                  }),
                   queue_.end());
    }
  }
  if (!not_submitted.empty()) {
    // Back where Close finds them: they fail with the job.
    for (auto& q : out.requests) pending_.emplace(q->meta.name, q);
    out.requests.clear();
  } else if (response.op == OpType::kJoin) {
    joined_ = false;
  }
  return out;
}

}  // namespace perseus
