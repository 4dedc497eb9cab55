// The executor's NCCL paths (executor.h): which buckets NCCL carries, the
// communicators of the world and of each host, and the two-level allreduce
// of device buffers (kNcclTwoLevel in allreduce_algorithms.h).
#include <algorithm>
#include <string>

#include "cc/runtime/executor.h"
#include "cc/runtime/runtime_internal.h"

namespace perseus {

void Executor::NcclTwoLevel(int stream, DataPlane& plane, void* buf, size_t count,
                            DataType dtype, ReduceOp op, size_t half_across) {
  NcclComm& host = *NcclFor(stream, plane, dtype, true);
  void* native = plane.NativeStream(stream);
  {
    TimelineSpan span(timeline_, 1 + stream, "nccl host reduce", "transport");
    host.Reduce(buf, buf, count, dtype, op, 0, native);
    AwaitNccl(host, stream, plane, "reduce inside the host");
  }
  if (GroupCollectives* leaders = c_.groups.leaders) {  // this host's leader
    if (half_across > 0) {
      // Mixed compression (float32): the first half_across elements cross
      // hosts as float16 times the gradient scale, the rest (a plan bucket's
      // votes) as plain float16, both cast here on the device; the host
      // path (allreduce_algorithms.cc) does the same on the host.
      const float scale = static_cast<float>(c_.compression.gradient_scale);
      float* f = static_cast<float*>(buf);
      auto* h = static_cast<uint16_t*>(plane.Buffer(stream, PlaneBuffer::kHalf, count * 2));
      const size_t scaled = std::min(half_across, count);
      plane.ToHalf(stream, f, h, scaled, scale);
      plane.ToHalf(stream, f + scaled, h + scaled, count - scaled, 1.0f);
      void* staged = plane.Buffer(stream, PlaneBuffer::kStaging, count * 2);
      plane.ToHost(stream, staged, h, count * 2);
      {
        TimelineSpan ring(timeline_, 1 + stream, "cross-host allreduce (fp16)", "communication");
        leaders->Allreduce(stream, staged, count, DataType::kFloat16, ReduceOp::kSum);
      }
      plane.FromHost(stream, h, staged, count * 2);
      plane.FromHalf(stream, h, f, scaled, 1.0f / scale);
      plane.FromHalf(stream, h + scaled, f + scaled, count - scaled, 1.0f);
    } else {
      const size_t bytes = count * DataTypeSize(dtype);
      void* staged = plane.Buffer(stream, PlaneBuffer::kStaging, bytes);
      plane.ToHost(stream, staged, buf, bytes);
      {
        TimelineSpan ring(timeline_, 1 + stream, "cross-host allreduce", "communication");
        leaders->Allreduce(stream, staged, count, dtype, op);
      }
      plane.FromHost(stream, buf, staged, bytes);
    }
  }
  TimelineSpan span(timeline_, 1 + stream, "nccl host broadcast", "transport");
  host.Broadcast(buf, buf, count * DataTypeSize(dtype), 0, native);
  AwaitNccl(host, stream, plane, "broadcast inside the host");
}

bool Executor::NcclTakes(int stream, const DataPlane& plane, DataType dtype) const {
  if (plane.kind() != MemoryKind::kCuda || !c_.nccl) return false;
  if (!streams_[stream]->on_device_everywhere) return false;  // some rank has host memory
  return dtype != DataType::kUint16 && dtype != DataType::kInt16;  // no NCCL type
}

NcclComm* Executor::NcclFor(int stream, DataPlane& plane, DataType dtype, bool host_group) {
  if (!NcclTakes(stream, plane, dtype)) return nullptr;
  // NCCL binds a communicator to the device current when it is made, and
  // queues each call on the current device: the plane's, whatever ran on
  // this thread before (a broadcast with no producer's event of its own
  // reaches here without any plane call).
  plane.MakeCurrent();
  std::unique_ptr<NcclComm>& comm =
      (host_group ? nccl_host_ : nccl_).at(static_cast<size_t>(stream));
  if (!comm) {
    std::string why;
    const NcclLibrary* lib = NcclLibrary::Load(c_.nccl_dirs, &why);
    if (lib == nullptr) {
      throw std::runtime_error("PERSEUS_GPU_TRANSPORT=nccl, but NCCL cannot be loaded: " + why +
                               "; or set PERSEUS_GPU_TRANSPORT=host on every rank");
    }
    const std::string name =
        (host_group ? "host" + std::to_string(c_.ranks.cross_rank) + "." : std::string()) +
        "stream" + std::to_string(stream);
    const std::string group =
        c_.ranks.process_set_id ? "process set " + std::to_string(c_.ranks.process_set_id)
                                : std::string("the world");
    std::unique_ptr<NcclComm> made(new NcclComm(
        *lib, host_group ? c_.ranks.local_rank : c_.ranks.rank,
        host_group ? c_.ranks.local_size : c_.ranks.size, c_.nccl_bootstrap(name),
        std::chrono::milliseconds(static_cast<int64_t>(c_.transport.timeout_seconds * 1000)),
        "stream " + std::to_string(stream) + " of " +
            (host_group ? "host " + std::to_string(c_.ranks.cross_rank) + " of " + group
                        : group),
        plane.DeviceIdentity()));
    std::lock_guard<std::mutex> lock(nccl_mu_);
    if (!nccl_stop_why_.empty()) made->RequestAbort(nccl_stop_why_);
    comm = std::move(made);
  }
  return comm.get();
}

void Executor::AwaitNccl(NcclComm& comm, int stream, DataPlane& plane, const std::string& what) {
  comm.WaitUntil(plane.Marker(stream), what);
}

}  // namespace perseus
