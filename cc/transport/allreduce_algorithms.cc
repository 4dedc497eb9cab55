#include "cc/transport/allreduce_algorithms.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace perseus {

AllreduceAlgorithm ChooseAllreduce(size_t bytes, bool mixed, const AllreduceTopology& t,
                                   AllreduceMemory memory) {
  if (memory == AllreduceMemory::kNcclDevice) {
    // NCCL's own rings and trees already follow the hosts; two levels only
    // where something must cross hosts differently: float16 for mixed
    // compression, or the user's PERSEUS_ALLREDUCE_MODE=1.
    return t.two_level && (mixed || t.mode == 1) ? AllreduceAlgorithm::kNcclTwoLevel
                                                 : AllreduceAlgorithm::kNccl;
  }
  if (t.one_host_shm) return AllreduceAlgorithm::kShm;
  // Two levels where the cost model says they are faster (unmeasured: for
  // buckets of 256 KiB and more); always for mixed compression and mode 1.
  const bool faster =
      t.two_level_cost.cross.beta > 0
          ? TwoLevelFaster(t.ranks, t.hosts, static_cast<double>(bytes), t.flat_cost,
                           static_cast<int64_t>(t.doubling_bytes), t.two_level_cost)
          : bytes >= (256u << 10);
  const bool two_level = t.two_level && (mixed || t.mode == 1 || (t.mode < 0 && faster));
  if (two_level) return AllreduceAlgorithm::kTwoLevel;
  // Small flat buckets wait on the network's latency more than on its
  // bandwidth: recursive doubling's log2(N) exchanges beat the ring's
  // 2(N - 1) steps there (benchmarks/hosts_latency.py: 3 to 9 times faster
  // from 64 B to 64 KiB at 4 and 8 hosts). Below about one float per rank
  // the ring's blocks are mostly empty and Gloo skips them: the ring wins.
  const bool doubles = t.doubling_bytes > 0 && bytes <= t.doubling_bytes &&
                       bytes >= 4 * static_cast<size_t>(std::max(t.ranks, 1));
  return doubles ? AllreduceAlgorithm::kFlatDoubling : AllreduceAlgorithm::kFlatRing;
}

namespace {

// Pipelined in chunks: while a leader's helper thread sends chunk c across
// hosts (the slow link), the calling thread already reduces chunk c+1 inside
// the host; the broadcasts inside the host follow, chunk by chunk. The host
// and leader groups use separate contexts, so the two threads never share one.
void TwoLevel(const AllreduceGroups& g, const AllreduceCall& call, Timeline& timeline) {
  const int stream = call.channel;
  const DataType dtype = call.dtype;
  const ReduceOp op = call.op;
  const size_t count = call.count, half_across = call.half_across;
  const size_t esize = DataTypeSize(dtype);
  const size_t chunk = std::max<size_t>(1, (size_t{4} << 20) / esize);
  const size_t chunks = (count + chunk - 1) / chunk;
  char* base = static_cast<char*>(call.data);
  auto first = [chunk](size_t c) { return c * chunk; };
  auto length = [chunk, count](size_t c) { return std::min(chunk, count - c * chunk); };
  const bool leader = g.leaders != nullptr;
  std::vector<uint16_t>& half = *call.half;
  if (half_across > 0 && leader && half.size() < count) half.resize(count);

  // Among the leaders, a small chunk doubles: log2(H) exchanges, not the
  // ring's 2(H - 1) steps (from 4 bytes a leader, as the flat rule).
  auto doubles = [&](size_t bytes) {
    return bytes <= call.cross_doubling_bytes &&
           bytes >= 4 * static_cast<size_t>(std::max(call.hosts, 1));
  };
  // One chunk across hosts (leaders only).
  auto cross = [&](size_t c) {
    const size_t at = first(c), n = length(c);
    if (half_across == 0) {
      if (doubles(n * esize)) {
        TimelineSpan span(timeline, 1 + stream, "cross-host allreduce, doubling",
                          "communication");
        g.leaders->AllreduceDoubling(stream, base + at * esize, n, dtype, op);
        return;
      }
      TimelineSpan ring(timeline, 1 + stream, "cross-host allreduce", "communication");
      g.leaders->Allreduce(stream, base + at * esize, n, dtype, op);
      return;
    }
    float* f = reinterpret_cast<float*>(base) + at;
    uint16_t* h = half.data() + at;
    // Elements before half_across are gradients (scaled); after, plan extras.
    const size_t scaled = half_across > at ? std::min(n, half_across - at) : 0;
    FloatToHalfScaled(f, h, scaled, call.scale);
    FloatToHalfScaled(f + scaled, h + scaled, n - scaled, 1.0f);
    if (doubles(n * 2)) {
      TimelineSpan span(timeline, 1 + stream, "cross-host allreduce, doubling (fp16)",
                        "communication");
      g.leaders->AllreduceDoubling(stream, h, n, DataType::kFloat16, ReduceOp::kSum);
    } else {
      TimelineSpan ring(timeline, 1 + stream, "cross-host allreduce (fp16)", "communication");
      g.leaders->Allreduce(stream, h, n, DataType::kFloat16, ReduceOp::kSum);
    }
    HalfToFloatScaled(h, f, scaled, 1.0f / call.scale);
    HalfToFloatScaled(h + scaled, f + scaled, n - scaled, 1.0f);
  };

  if (chunks == 1) {
    // Nothing to overlap: the three phases in turn on this thread, without
    // a helper thread to start and wake (most of a small bucket's time on
    // a busy host).
    {
      TimelineSpan span(timeline, 1 + stream, "host reduce", "communication");
      g.host->Reduce(stream, base, count, dtype, op);
    }
    if (leader) cross(0);
    TimelineSpan span(timeline, 1 + stream, "host broadcast", "communication");
    g.host->Broadcast(stream, base, count * esize);
    return;
  }
  std::mutex mu;
  std::condition_variable cv;
  size_t reduced = 0, crossed = 0;
  bool cross_failed = false;
  std::exception_ptr error;
  std::thread helper;
  if (leader) {
    helper = std::thread([&] {
      NameThisThread("perseus-cross");
      try {
        for (size_t c = 0; c < chunks; ++c) {
          {
            std::unique_lock<std::mutex> lock(mu);
            cv.wait(lock, [&] { return reduced > c || cross_failed; });
            if (cross_failed) return;
          }
          cross(c);
          std::lock_guard<std::mutex> lock(mu);
          crossed = c + 1;
          cv.notify_all();
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        error = std::current_exception();
        cross_failed = true;
        cv.notify_all();
      }
    });
  }
  auto stop_helper = [&] {
    if (!helper.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (crossed < chunks) cross_failed = true;  // wakes it if still waiting
      cv.notify_all();
    }
    helper.join();
  };
  try {
    for (size_t c = 0; c < chunks; ++c) {
      {
        TimelineSpan span(timeline, 1 + stream, "host reduce", "communication");
        g.host->Reduce(stream, base + first(c) * esize, length(c), dtype, op);
      }
      std::lock_guard<std::mutex> lock(mu);
      reduced = c + 1;
      cv.notify_all();
    }
    for (size_t c = 0; c < chunks; ++c) {
      if (leader) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return crossed > c || cross_failed; });
        if (error) std::rethrow_exception(error);
        if (cross_failed) throw std::runtime_error("cross-host allreduce stopped");
      }
      TimelineSpan span(timeline, 1 + stream, "host broadcast", "communication");
      g.host->Broadcast(stream, base + first(c) * esize, length(c) * esize);
    }
  } catch (...) {
    stop_helper();
    throw;
  }
  stop_helper();
}

}  // namespace

void RunAllreduce(AllreduceAlgorithm algorithm, const AllreduceGroups& g,
                  const AllreduceCall& call, Timeline& timeline) {
  const bool half = call.dtype == DataType::kFloat16;
  switch (algorithm) {
    case AllreduceAlgorithm::kShm: {
      TimelineSpan span(timeline, 1 + call.channel,
                        half ? "shm allreduce (fp16)" : "shm allreduce", "communication");
      g.host->Allreduce(call.channel, call.data, call.count, call.dtype, call.op);
      return;
    }
    case AllreduceAlgorithm::kFlatRing: {
      TimelineSpan ring(timeline, 1 + call.channel,
                        half ? "gloo allreduce (fp16)" : "gloo allreduce", "communication");
      g.world->Allreduce(call.channel, call.data, call.count, call.dtype, call.op);
      return;
    }
    case AllreduceAlgorithm::kFlatDoubling: {
      TimelineSpan doubling(timeline, 1 + call.channel,
                            half ? "gloo allreduce, doubling (fp16)" : "gloo allreduce, doubling",
                            "communication");
      g.world->AllreduceDoubling(call.channel, call.data, call.count, call.dtype, call.op);
      return;
    }
    case AllreduceAlgorithm::kTwoLevel:
      TwoLevel(g, call, timeline);
      return;
    case AllreduceAlgorithm::kNccl:
    case AllreduceAlgorithm::kNcclTwoLevel:
      break;
  }
  throw std::logic_error("internal error: NCCL's allreduce algorithms run in the executor");
}

}  // namespace perseus
