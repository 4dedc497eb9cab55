// The executor: the stream threads and what runs on them. It takes a response
// with the local requests it covers, in the order every rank dispatches them,
// runs the collective on that stream (fused, compressed, or one of the other
// collectives), and completes the requests. It knows nothing of negotiation
// or plans: a plan bucket reduces through its envelope, which hands the
// outcome to the plan (Response::envelope, plan/envelope.h), and the plan
// check is work the plan attached (Response::control).
//
// Streams 0..streams-1 take online work in turn, and a plan's buckets; the
// extra stream `streams` takes online work while any rank runs a plan.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cc/core/common.h"
#include "cc/core/timeline.h"
#include "cc/device/data_plane.h"
#include "cc/runtime/activity.h"
#include "cc/runtime/compression/compression.h"
#include "cc/runtime/response.h"
#include "cc/runtime/options.h"
#include "cc/runtime/request.h"
#include "cc/runtime/stats.h"
#include "cc/transport/allreduce_algorithms.h"
#include "cc/transport/nccl.h"
#include "cc/transport/transport.h"

namespace perseus {

struct ExecutorContext {
  Topology ranks;                   // this runtime's members and this rank among them
  TransportSettings transport;      // streams, timeout_seconds
  CompressionSettings compression;  // what the compressors and fp16 scaling read
  // Tensors on CUDA devices through NCCL, and where its wheels keep it (options.h).
  bool nccl = false;
  std::vector<std::string> nccl_dirs;
  Transport* world = nullptr;  // broadcast, allgather, alltoall, reduce-scatter, top-k
  AllreduceTopology topology;  // how allreduces travel
  AllreduceGroups groups;
  Timeline* timeline = nullptr;
  // Each stream says here what it runs (failure reports).
  std::shared_ptr<Activity> activity;
  // The runtime's failure once it failed (OK while it runs): queued work
  // then completes with it instead of running.
  std::function<Status()> failure;
  // Fails the runtime with this description; returns the failure every
  // request now completes with.
  std::function<Status(const std::string&)> fail;
  // How rank 0 hands NCCL's unique id of communicator `name` to the others
  // (through the rendezvous store, under this round's keys).
  std::function<NcclBootstrap(const std::string& name)> nccl_bootstrap;
};

class Executor {
 public:
  // Starts transport.streams + 1 stream threads.
  explicit Executor(const ExecutorContext& context);
  ~Executor();
  // Runs what is queued, then joins the threads.
  void Stop();
  // After Stop: closes NCCL's communicators and the device planes (their
  // streams and threads), while the process's CUDA is still alive.
  void ReleaseDevices();
  // Any thread (the runtime's failure path): a wait on NCCL in progress ends
  // within a poll, its communicator aborted by its own thread so that NCCL's
  // kernels stop too, and later NCCL calls fail at once, saying `why`.
  // (A communicator still being made waits its own deadline.)
  void StopDeviceWork(const std::string& why);

  // Queues the response on `stream`, after what is queued there.
  void Submit(int stream, Response response, Requests requests);
  // Runs it on the calling thread when `stream` is idle (saving a thread
  // hand-off); false, with nothing done, when the stream is busy.
  bool RunHereIfIdle(int stream, Response& response, Requests& requests);

  std::vector<StreamStats> stats();
  // What the device planes hold for their buffers, summed (Stats).
  DataPlane::Memory DeviceBufferMemory();

  // The data plane of memory placed as `where` (data_plane.h), made on
  // first use with one stream of its own per executor stream. Throws when
  // this build has no such device.
  DataPlane& PlaneFor(const Placement& where);

 private:
  struct Stream {
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Response> queue;
    std::deque<Requests> work;
    bool stop = false;
    bool busy = false;  // a response of this stream is running (here or inline)
    // The running response's tensors are on a CUDA device on every rank
    // (kMetaOnDevice), so NCCL may carry them.
    bool on_device_everywhere = false;
    StreamScratch scratch;
  };

  void StreamLoop(int stream);
  // Records in the activity board what `stream` runs (null: nothing);
  // here: on the negotiation thread (RunHereIfIdle).
  void Note(int stream, const Response* running, bool here);
  void Run(int stream, Response& response, Requests& requests);
  // The plane a response's requests run on: with NCCL, a CUDA plane when the
  // response's tensors are on a device on every rank (this rank's too, were
  // its requests stand-ins or host memory); else the first device placement
  // among them (host requests beside it are copied in and out), else host.
  DataPlane& PlaneOf(const Response& response, const Requests& requests);
  bool ExecuteOnDevice(int stream, DataPlane& plane, const Response& r, Requests& requests);
  bool ExecuteOnHost(int stream, const Response& r, Requests& requests);
  // False when the requests must not be completed (a voted-down plan bucket).
  // On `plane`, the plane of the requests (PlaneOf).
  bool Execute(int stream, DataPlane& plane, const Response& r, Requests& requests);
  bool Allreduce(int stream, DataPlane& plane, const Response& r, Requests& requests);
  // One tensor reduced on its output (a copy there first when apart).
  void InPlaceAllreduce(int stream, DataPlane& plane, const TensorMeta& m0, Request& q);
  // Allreduces a buffer of `plane` (staged through host memory when it is
  // a device's: the transports move host memory).
  void AllreduceBuffer(int stream, DataPlane& plane, void* buf, size_t count, DataType dtype,
                       ReduceOp op, size_t half_across = 0);
  // Whether a buffer of `plane` in `dtype` goes through NCCL (nccl.h), not
  // host staging.
  bool NcclTakes(int stream, const DataPlane& plane, DataType dtype) const;
  // NCCL's communicator of `stream` among all ranks, or (host_group) among
  // this host's ranks, when NcclTakes, else null. Made on first use: every
  // rank reaches the same stream's buckets in the same order.
  NcclComm* NcclFor(int stream, DataPlane& plane, DataType dtype, bool host_group = false);
  // kNcclTwoLevel (allreduce_algorithms.h) of a device buffer.
  void NcclTwoLevel(int stream, DataPlane& plane, void* buf, size_t count, DataType dtype,
                    ReduceOp op, size_t half_across);
  // Waits, with the communicator's deadline, for `plane`'s queued work.
  void AwaitNccl(NcclComm& comm, int stream, DataPlane& plane, const std::string& what);
  void Allgather(int stream, const Response& r, Request& q);
  void Alltoall(int stream, const Response& r, Request& q);
  void Reducescatter(int stream, const Response& r, Request& q);

  ExecutorContext c_;
  Timeline& timeline_;
  Residuals residuals_;
  std::unique_ptr<Compressors> compressors_;
  std::vector<std::unique_ptr<Stream>> streams_;
  std::mutex planes_mu_;
  std::unique_ptr<DataPlane> host_plane_;
  std::map<std::pair<int, int>, std::unique_ptr<DataPlane>> device_planes_;  // (kind, device)
  int cuda_device_ = 0;  // the last CUDA device a plane was made for (planes_mu_)
  std::vector<std::unique_ptr<NcclComm>> nccl_, nccl_host_;  // by stream (nccl_mu_ to
                                                             // replace or reach from
                                                             // another thread)
  std::mutex nccl_mu_;
  std::string nccl_stop_why_;  // StopDeviceWork's reason, once called (nccl_mu_)
  std::mutex stats_mu_;
  std::vector<StreamStats> stats_;
};

}  // namespace perseus
