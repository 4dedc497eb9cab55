// The executor (executor.h): streams, the execute switch, the plain
// allreduce. The fused allreduce is in fused_allreduce.cc, moving requests
// between host and device in staging.cc, compressed allreduces in
// compression/, the other collectives in collectives.cc, NCCL's in
// executor_nccl.cc.
#include "cc/runtime/executor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <sstream>

#include "cc/core/reduce.h"
#include "cc/device/cuda_library.h"
#include "cc/runtime/compression/compression.h"
#include "cc/runtime/fused_allreduce.h"
#include "cc/runtime/staging.h"
#include "cc/runtime/runtime_internal.h"
#include "cc/transport/allreduce_algorithms.h"

namespace perseus {

Executor::Executor(const ExecutorContext& context)
    : c_(context), timeline_(*c_.timeline) {
  CompressionContext compression;
  compression.settings = &c_.compression;
  compression.rank = c_.ranks.rank;
  compression.size = c_.ranks.size;
  compression.timeline = &timeline_;
  compression.world = c_.world;
  compression.residuals = &residuals_;
  compression.allreduce = [this](int stream, DataPlane& plane, void* data, size_t count,
                                 DataType dtype, ReduceOp op, size_t half_across) {
    AllreduceBuffer(stream, plane, data, count, dtype, op, half_across);
  };
  host_plane_ = MakeHostPlane(c_.transport.streams + 1);
  compressors_.reset(new Compressors(compression));
  stats_.resize(c_.transport.streams + 1);
  nccl_.resize(c_.transport.streams + 1);
  nccl_host_.resize(c_.transport.streams + 1);
  for (int s = 0; s <= c_.transport.streams; ++s) streams_.emplace_back(new Stream());
  for (int s = 0; s <= c_.transport.streams; ++s) {
    streams_[s]->thread = std::thread(&Executor::StreamLoop, this, s);
  }
}

Executor::~Executor() {
  Stop();
  ReleaseDevices();
}

void Executor::Stop() {
  for (auto& s : streams_) {
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->stop = true;
    }
    s->cv.notify_all();
  }
  for (auto& s : streams_) {
    if (s->thread.joinable()) s->thread.join();
  }
}

void Executor::ReleaseDevices() {
  {
    std::lock_guard<std::mutex> lock(nccl_mu_);
    for (auto& comm : nccl_) comm.reset();
    for (auto& comm : nccl_host_) comm.reset();
  }
  std::lock_guard<std::mutex> lock(planes_mu_);
  device_planes_.clear();
}

void Executor::StopDeviceWork(const std::string& why) {
  std::lock_guard<std::mutex> lock(nccl_mu_);
  if (nccl_stop_why_.empty()) nccl_stop_why_ = why.empty() ? "the runtime stopped" : why;
  for (auto* comms : {&nccl_, &nccl_host_}) {
    for (auto& comm : *comms) {
      if (comm) comm->RequestAbort(nccl_stop_why_);
    }
  }
}

std::vector<StreamStats> Executor::stats() {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

DataPlane::Memory Executor::DeviceBufferMemory() {
  std::lock_guard<std::mutex> lock(planes_mu_);
  DataPlane::Memory sum;
  for (auto& entry : device_planes_) {
    const DataPlane::Memory m = entry.second->BufferMemory();
    sum.device += m.device;
    sum.host += m.host;
  }
  return sum;
}

namespace {

// An Activity entry (activity.h): "running allgather of 'x' and 3 more".
std::string Running(const Response& r) {
  std::string out = std::string("running ") + OpTypeName(r.op) + " of '" +
                    (r.names.empty() ? std::string() : r.names[0]) + "'";
  if (r.names.size() > 1) out += " and " + std::to_string(r.names.size() - 1) + " more";
  if (!r.envelope.empty()) out += " (an offline plan bucket)";
  return out;
}

}  // namespace

void Executor::Note(int stream, const Response* running, bool here) {
  if (!c_.activity) return;
  const int slot = Activity::StreamSlot(stream);
  if (!running) {
    c_.activity->Clear(slot);
  } else {
    c_.activity->Set(slot, Running(*running) + (here ? " on the negotiation thread" : ""));
  }
}

bool Executor::RunHereIfIdle(int stream, Response& response, Requests& requests) {
  // Saves a thread hand-off. The stream's order is unchanged: nothing else
  // can be dispatched to it while this thread is busy.
  Stream& s = *streams_[stream];
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.queue.empty() || s.busy) return false;
    s.busy = true;
  }
  Note(stream, &response, /*here=*/true);
  Run(stream, response, requests);
  Note(stream, nullptr, false);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.busy = false;
  }
  s.cv.notify_one();
  return true;
}

void Executor::Submit(int stream, Response response, Requests requests) {
  Stream& s = *streams_[stream];
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.queue.push_back(std::move(response));
    s.work.push_back(std::move(requests));
  }
  s.cv.notify_one();
}

void Executor::StreamLoop(int index) {
  NameThisThread("perseus-exec" + std::to_string(index));
  Stream& s = *streams_[index];
  while (true) {
    Response response;
    std::vector<std::shared_ptr<Request>> requests;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      s.cv.wait(lock, [&] { return (!s.queue.empty() && !s.busy) || s.stop; });
      if (s.queue.empty()) return;
      response = std::move(s.queue.front());
      s.queue.pop_front();
      requests = std::move(s.work.front());
      s.work.pop_front();
      s.busy = true;
    }
    Note(index, &response, /*here=*/false);
    Run(index, response, requests);
    Note(index, nullptr, false);
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.busy = false;
    }
    s.cv.notify_all();  // the background thread may wait for this stream to be idle
  }
}

void Executor::Run(int index, Response& response, Requests& requests) {
  const Status failed = c_.failure();
  if (!failed.ok()) {
    for (auto& q : requests) q->done(failed);
    return;
  }
  auto start = Clock::now();
  Clock::time_point oldest = start;
  for (auto& q : requests) {
    if (q->enqueued != Clock::time_point{} && q->enqueued < oldest) oldest = q->enqueued;
  }
  std::string span_args;
  if (timeline_.enabled()) {
    int64_t bytes = 0;
    for (const TensorMeta& m : response.metas) {
      bytes += NumElements(m.shape) * static_cast<int64_t>(DataTypeSize(m.dtype));
    }
    span_args = TimelineArgs()
                    .Int("tensors", static_cast<int64_t>(response.names.size()))
                    .Int("bytes", bytes)
                    .Text("first", response.names[0])
                    .Bool("plan", !response.envelope.empty())
                    .str();
  }
  Status status;
  bool complete = true;
  DataPlane* plane = host_plane_.get();
  try {
    if (!response.control) plane = &PlaneOf(response, requests);
    complete = Execute(index, *plane, response, requests);
  } catch (const std::exception& e) {
    status = c_.fail(response.control ? std::string(e.what())
                                      : std::string("stream ") + std::to_string(index) + " " +
                                            OpTypeName(response.op) + " of '" +
                                            response.names[0] + "' failed: " + e.what());
  }
  const auto end = Clock::now();
  // Recorded before the requests complete, so a caller that stops the
  // timeline right after its collective returns finds it there.
  timeline_.Record(1 + index, OpTypeName(response.op), "bucket", start, end, span_args);
  double secs = std::chrono::duration<double>(end - start).count();
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    StreamStats& st = stats_[index];
    ++st.responses;
    st.tensors += static_cast<int64_t>(response.names.size());
    for (const TensorMeta& m : response.metas) {
      st.bytes += WireBytes(m, c_.compression, c_.topology.two_level);
    }
    st.busy_seconds += secs;
    st.wait_seconds += std::chrono::duration<double>(start - oldest).count();
  }
  if (!complete) return;
  if (plane->host()) {
    for (auto& q : requests) q->done(status);
    return;
  }
  // Done once the device work queued for them has finished.
  plane->Finish(index, [requests, status, fail = c_.fail](const std::string& error) {
    const Status st = error.empty() || !status.ok() ? status : fail(error);
    for (auto& q : requests) q->done(st);
  });
}

DataPlane& Executor::PlaneFor(const Placement& where) {
  if (where.kind == MemoryKind::kHost) return *host_plane_;
  std::lock_guard<std::mutex> lock(planes_mu_);
  auto key = std::make_pair(static_cast<int>(where.kind), where.device);
  auto it = device_planes_.find(key);
  if (it != device_planes_.end()) return *it->second;
  std::unique_ptr<DataPlane> plane;
  switch (where.kind) {
    case MemoryKind::kSimulated:
      plane = MakeSimPlane(c_.transport.streams + 1);
      break;
    case MemoryKind::kCuda:
      plane = MakeCudaPlane(where.device, c_.transport.streams + 1);
      cuda_device_ = where.device;
      break;
    default:
      throw std::runtime_error(std::string("this build of Perseus has no data plane for ") +
                               MemoryKindName(where.kind) + " memory");
  }
  DataPlane& out = *plane;
  device_planes_[key] = std::move(plane);
  return out;
}

namespace {

bool OnDeviceEverywhere(const Response& r) {
  if (r.control || r.metas.empty()) return false;
  for (const TensorMeta& m : r.metas) {
    if (!(m.flags & kMetaOnDevice)) return false;
  }
  return true;
}

}  // namespace

DataPlane& Executor::PlaneOf(const Response& response, const Requests& requests) {
  const bool cuda = c_.nccl && OnDeviceEverywhere(response);
  for (const auto& q : requests) {
    if (q->where.kind == MemoryKind::kCuda || (!cuda && q->where.kind != MemoryKind::kHost)) {
      return PlaneFor(q->where);
    }
  }
  if (cuda) {
    Placement where;
    where.kind = MemoryKind::kCuda;
    {
      std::lock_guard<std::mutex> lock(planes_mu_);
      where.device = cuda_device_;
    }
    return PlaneFor(where);
  }
  return *host_plane_;
}

bool Executor::Execute(int stream, DataPlane& plane, const Response& r, Requests& requests) {
  streams_[stream]->on_device_everywhere = OnDeviceEverywhere(r);
  if (r.control) {
    r.control([this, stream](void* data, size_t count, DataType dtype, ReduceOp op) {
      AllreduceBuffer(stream, *host_plane_, data, count, dtype, op);
    });
    return true;
  }
  if (requests.size() != r.names.size()) {
    throw std::runtime_error("internal error: response and local requests disagree");
  }
  if (plane.host()) return ExecuteOnHost(stream, r, requests);
  for (auto& q : requests) plane.WaitReady(stream, q->where);
  const int compression = r.op == OpType::kAllreduce ? r.metas[0].compression : 0;
  const bool on_device = (r.op == OpType::kAllreduce && compression != kCompressTopk &&
                          compression != kCompressDownsample) ||
                         (r.op == OpType::kBroadcast && requests.size() == 1);
  if (!on_device) {
    return RunStaged(plane, stream, requests,
                  [&](Requests& host) { return ExecuteOnHost(stream, r, host); });
  }
  for (const auto& q : requests) {
    if (q->where.kind == MemoryKind::kHost) {
      return RunLifted(plane, stream, requests,
                    [&](Requests& lifted) { return ExecuteOnDevice(stream, plane, r, lifted); });
    }
  }
  return ExecuteOnDevice(stream, plane, r, requests);
}

bool Executor::ExecuteOnDevice(int stream, DataPlane& plane, const Response& r,
                               Requests& requests) {
  if (r.op == OpType::kBroadcast) {
    Request& q = *requests[0];
    if (NcclComm* comm = NcclFor(stream, plane, DataType::kUint8)) {
      const size_t bytes = NumElements(q.meta.shape) * DataTypeSize(q.meta.dtype);
      if (bytes) {
        comm->Broadcast(q.input, q.output, bytes, q.meta.root, plane.NativeStream(stream));
        AwaitNccl(*comm, stream, plane, "broadcast of '" + q.meta.name + "'");
      }
      return true;
    }
    return RunStaged(plane, stream, requests,
                  [&](Requests& host) { return ExecuteOnHost(stream, r, host); });
  }
  return Allreduce(stream, plane, r, requests);
}

bool Executor::ExecuteOnHost(int stream, const Response& r, Requests& requests) {
  switch (r.op) {
    case OpType::kAllreduce:
      return Allreduce(stream, *host_plane_, r, requests);
    case OpType::kBroadcast: {
      Request& q = *requests[0];
      size_t bytes = NumElements(q.meta.shape) * DataTypeSize(q.meta.dtype);
      if (c_.ranks.rank == q.meta.root && q.output != q.input && bytes) {
        std::memcpy(q.output, q.input, bytes);
      }
      c_.world->Broadcast(stream, q.output, bytes, q.meta.root);
      break;
    }
    case OpType::kAllgather:
      Allgather(stream, r, *requests[0]);
      break;
    case OpType::kAlltoall:
      Alltoall(stream, r, *requests[0]);
      break;
    case OpType::kReducescatter:
      Reducescatter(stream, r, *requests[0]);
      break;
    case OpType::kBarrier:
    case OpType::kJoin:
      break;
  }
  return true;
}

bool Executor::Allreduce(int stream, DataPlane& plane, const Response& r, Requests& requests) {
  const TensorMeta& m0 = r.metas[0];
  if (Compressor* compressor = compressors_->For(m0.compression)) {
    return compressor->Allreduce(stream, plane, streams_[stream]->scratch, r, requests);
  }
  const bool carrier = !r.envelope.empty();
  if (requests.size() == 1 && !carrier) {
    InPlaceAllreduce(stream, plane, m0, *requests[0]);
    return true;
  }
  // Fused bucket: pack, reduce once (with a plan bucket's extras), unpack.
  // The large tensors are reduced where they are, after the packed rest, so
  // only once the plan's vote says the results are kept.
  Requests packed, large;
  SplitForFusion(r, requests, &packed, &large);
  if (!packed.empty() || carrier) {
    FusedBucket b;
    b.plane = &plane;
    b.stream = stream;
    b.timeline = &timeline_;
    b.rank = c_.ranks.rank;
    b.size = c_.ranks.size;
    b.reduce = [&](void* buf, size_t count, DataType dtype, ReduceOp op, size_t half_across) {
      AllreduceBuffer(stream, plane, buf, count, dtype, op, half_across);
    };
    if (!RunFusedAllreduce(b, r, packed)) return false;
  }
  for (auto& q : large) InPlaceAllreduce(stream, plane, m0, *q);
  return true;
}

void Executor::InPlaceAllreduce(int stream, DataPlane& plane, const TensorMeta& m0, Request& q) {
  const size_t n = static_cast<size_t>(NumElements(q.meta.shape));
  plane.Copy(stream, {{q.input, q.output, n * DataTypeSize(m0.dtype)}});
  plane.Scale(stream, q.output, m0.dtype, n, m0.prescale);
  AllreduceBuffer(stream, plane, q.output, n, m0.dtype, m0.reduce_op,
                  m0.compression == kCompressMixed ? n : 0);
  plane.Scale(stream, q.output, m0.dtype, n, PostScale(m0, c_.ranks.size));
}

void Executor::AllreduceBuffer(int stream, DataPlane& plane, void* buf, size_t count,
                               DataType dtype, ReduceOp op, size_t half_across) {
  const size_t bytes = count * DataTypeSize(dtype);
  if (count > 0 && NcclTakes(stream, plane, dtype)) {
    const AllreduceAlgorithm algorithm =
        ChooseAllreduce(bytes, half_across > 0, c_.topology, AllreduceMemory::kNcclDevice);
    if (algorithm == AllreduceAlgorithm::kNcclTwoLevel) {
      NcclTwoLevel(stream, plane, buf, count, dtype, op, half_across);
      return;
    }
    NcclComm* comm = NcclFor(stream, plane, dtype);
    TimelineSpan span(timeline_, 1 + stream, "nccl allreduce", "transport");
    comm->Allreduce(buf, buf, count, dtype, op, plane.NativeStream(stream));
    AwaitNccl(*comm, stream, plane, "allreduce");
    return;
  }
  void* data = buf;
  if (!plane.host()) {
    data = plane.Buffer(stream, PlaneBuffer::kStaging, bytes);
    plane.ToHost(stream, data, buf, bytes);
  }
  AllreduceCall call;
  call.channel = stream;
  call.data = data;
  call.count = count;
  call.dtype = dtype;
  call.op = op;
  call.half_across = half_across;
  call.scale = static_cast<float>(c_.compression.gradient_scale);
  call.half = &streams_[stream]->scratch.half;
  call.cross_doubling_bytes = c_.topology.leaders_doubling_bytes;
  call.hosts = c_.topology.hosts;
  RunAllreduce(ChooseAllreduce(bytes, half_across > 0, c_.topology), c_.groups, call, timeline_);
  if (!plane.host()) plane.FromHost(stream, buf, data, bytes);
}

}  // namespace perseus
