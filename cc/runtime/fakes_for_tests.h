// Fakes for the unit tests of the runtime's parts (executor_test.cc,
// controller_test.cc): a world transport whose other rank mirrors this one,
// the surroundings an executor needs, and completions waited for with a
// deadline. Test code only: nothing in the product includes it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cc/core/reduce.h"
#include "cc/core/timeline.h"
#include "cc/runtime/executor.h"
#include "cc/transport/transport.h"

namespace perseus {
namespace testing {

// Rank 0 of a world of two. The other rank holds the same values as this
// one in an allreduce (so a sum doubles), sends bytes of 0x5A in a
// broadcast from it, and rows of 100 + this rank's in an allgather; on the
// control channel it sends what this rank sends (a peer that makes the same
// calls). It records every call but the control ones, and throws when told
// to.
class FakeWorld : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void Allreduce(int channel, void* data, size_t count, DataType dtype, ReduceOp op) override {
    Note("allreduce " + std::string(DataTypeName(dtype)) + " " + std::to_string(count));
    GetReduceFn(dtype, op)(data, data, data, count);
  }
  void Broadcast(int channel, void* data, size_t bytes, int root) override {
    Note("broadcast from " + std::to_string(root));
    if (root == 1) std::memset(data, 0x5A, bytes);
  }
  void Allgatherv(int channel, const void* in, void* out,
                  const std::vector<size_t>& bytes_per_rank) override {
    if (channel == kControl) {
      if (fail) throw std::runtime_error("the peer hung up");
      for (size_t r = 0, at = 0; r < bytes_per_rank.size(); at += bytes_per_rank[r++]) {
        std::memcpy(static_cast<char*>(out) + at, in, bytes_per_rank[0]);
      }
      return;
    }
    Note("allgather");
    std::memcpy(out, in, bytes_per_rank[0]);
    const float* mine = static_cast<const float*>(in);
    float* theirs = reinterpret_cast<float*>(static_cast<char*>(out) + bytes_per_rank[0]);
    for (size_t i = 0; i < bytes_per_rank[1] / sizeof(float); ++i) {
      theirs[i] = 100.0f + mine[i % (bytes_per_rank[0] / sizeof(float))];
    }
  }
  void Alltoallv(int, const void*, const std::vector<int64_t>&, void*,
                 const std::vector<int64_t>&, bool) override {
    Note("alltoall");
  }
  void ReduceScatter(int, void*, const std::vector<size_t>&, DataType, ReduceOp) override {
    Note("reducescatter");
  }

  std::vector<std::string> calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  std::atomic<bool> fail{false};

 private:
  void Note(const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      calls_.push_back(what);
    }
    if (fail) throw std::runtime_error("the peer hung up");
  }
  std::mutex mu_;
  std::vector<std::string> calls_;
};

// The executor's surroundings: the fake world, one stream, and the
// runtime's failure as the executor reports it.
struct Bench {
  FakeWorld world;
  Timeline timeline;
  std::mutex mu;
  Status failure;
  std::string failed_with;

  ExecutorContext Context(int32_t streams = 1) {
    ExecutorContext c;
    c.ranks.rank = 0;
    c.ranks.size = 2;
    c.transport.streams = streams;
    c.world = &world;
    c.groups.world = &world;
    c.timeline = &timeline;
    c.failure = [this] {
      std::lock_guard<std::mutex> lock(mu);
      return failure;
    };
    c.fail = [this](const std::string& what) {
      std::lock_guard<std::mutex> lock(mu);
      failed_with = what;
      failure = Status::Error(StatusCode::kUnavailable, what);
      return failure;
    };
    return c;
  }
};

// Completion of a request, waited for with a deadline.
struct Done {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  std::vector<Status> statuses;

  std::function<void(const Status&)> Recorder() {
    return [this](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      statuses.push_back(s);
      ++count;
      cv.notify_all();
    };
  }
  bool WaitFor(int n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return count >= n; });
  }
};

// A float32 request of `op` over `data` (input and output), completing into `done`.
inline std::shared_ptr<Request> Tensor(const std::string& name, std::vector<float>* data,
                                       Done& done, OpType op = OpType::kAllreduce) {
  auto q = std::make_shared<Request>();
  q->meta.name = name;
  q->meta.op = op;
  q->meta.dtype = DataType::kFloat32;
  q->meta.shape = {static_cast<int64_t>(data->size())};
  q->input = data->data();
  q->output = data->data();
  q->done = done.Recorder();
  return q;
}

}  // namespace testing
}  // namespace perseus
