// perseus_tf._testing: what the tests, the benchmarks and the GPU tools reach
// in the runtime besides its Python face (perseus_tf._core). The product
// never imports it (tests/test_layout.py).
//
//   use_test_device()       PERSEUS_TEST_DEVICE=sim|cuda: every array
//                           submitted through _core goes on the simulated
//                           device or a GPU first (sim_requests.h)
//   submit_device(...)      an allreduce or broadcast of device memory the
//                           caller owns (CuPy arrays on the GPU machine)
//   raw_allreduce(a, dtype, doubling=False)  one buffer through the
//                           transport, no negotiation: Gloo's ring or recursive
//                           doubling (the benchmarks' baselines)
//   raw_allgather(a, bruck=False)  a's bytes from every rank, in rank
//                           order (a new bytes object): Gloo's ring or Bruck's
//   sim_device_launches()   work queued on the simulated device so far
//   nccl_lone_communicator  a NCCL communicator nobody else joins
//   hmac_sha256(key, data)  the store handshake's MAC, against hashlib's
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cc/core/common.h"
#include "cc/device/sim_device.h"
#include "cc/python/testing/sim_requests.h"
#include "cc/rendezvous/hmac_sha256.h"
#include "cc/runtime/runtime.h"

namespace py = pybind11;

namespace perseus {
namespace {

// A failed status as _core raises it (its exception classes).
[[noreturn]] void Raise(const Status& s) {
  py::module_ core = py::module_::import("perseus_tf._core");
  const char* kind = s.code == StatusCode::kFailedPrecondition ? "MismatchError"
                     : s.code == StatusCode::kInvalidArgument  ? "InvalidArgumentError"
                                                                : "CommunicationError";
  PyErr_SetString(core.attr(kind).ptr(), s.message.c_str());
  throw py::error_already_set();
}

Runtime& RuntimeOf(int process_set) {
  Runtime* rt = Runtime::Find(process_set);
  if (rt == nullptr) {
    throw py::value_error("this rank is not a member of process set " +
                          std::to_string(process_set) + " (or the set was removed)");
  }
  return *rt;
}

struct DeviceDone {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  Status status;
};

// A submitted collective of device memory. The caller owns the memory and
// the ready event; dropping the handle waits for the collective to end.
// The runtime completes every request, with an error at the latest when
// its stall or transport timeout runs out; `limit` (both timeouts and a
// minute more) bounds the wait should it not.
class DeviceHandle {
 public:
  DeviceHandle(std::shared_ptr<DeviceDone> done, uintptr_t output, std::string name,
               std::chrono::milliseconds limit)
      : done_(std::move(done)), output_(output), name_(std::move(name)), limit_(limit) {}
  DeviceHandle(DeviceHandle&&) = default;
  DeviceHandle(const DeviceHandle&) = delete;
  ~DeviceHandle() {
    if (!done_) return;
    py::gil_scoped_release release;
    Block();
  }
  // Returns (output pointer, None), as _core's Handle returns (array, None).
  py::tuple Wait() {
    bool finished;
    {
      py::gil_scoped_release release;
      finished = Block();
    }
    if (!finished) {
      Raise(Status::Error(StatusCode::kUnavailable,
                          "submit_device '" + name_ + "': not completed within " +
                              std::to_string(limit_.count() / 1000) +
                              " s; the runtime neither finished nor failed it"));
    }
    if (!done_->status.ok()) Raise(done_->status);
    return py::make_tuple(py::int_(output_), py::none());
  }
  bool Done() {
    std::lock_guard<std::mutex> lock(done_->mu);
    return done_->finished;
  }

 private:
  // False when `limit_` ran out first.
  bool Block() {
    std::unique_lock<std::mutex> lock(done_->mu);
    return done_->cv.wait_for(lock, limit_, [&] { return done_->finished; });
  }
  std::shared_ptr<DeviceDone> done_;
  uintptr_t output_;
  std::string name_;
  std::chrono::milliseconds limit_;
};

// `ready` is a cudaEvent_t recorded after the producer's writes on `stream`
// (0: already written).
DeviceHandle SubmitDevice(int op, uintptr_t input, uintptr_t output, std::vector<int64_t> shape,
                          const std::string& name, int dtype, int device, uintptr_t stream,
                          uintptr_t ready, int reduce_op, int root, double prescale,
                          double postscale, int compression, bool plannable, int process_set) {
  Runtime& rt = RuntimeOf(process_set);
  const OpType kind = static_cast<OpType>(op);
  if (kind != OpType::kAllreduce && kind != OpType::kBroadcast) {
    throw py::value_error("'" + name + "': submit_device takes allreduce and broadcast only");
  }
  auto done = std::make_shared<DeviceDone>();
  auto req = std::make_shared<Request>();
  req->meta.name = name;
  req->meta.op = kind;
  req->meta.dtype = static_cast<DataType>(dtype);
  req->meta.reduce_op = static_cast<ReduceOp>(reduce_op);
  req->meta.shape = std::move(shape);
  req->meta.root = root;
  req->meta.prescale = prescale;
  req->meta.postscale = postscale;
  req->meta.compression = compression;
  if (plannable) req->meta.flags |= kMetaPlannable;
  req->input = reinterpret_cast<const void*>(input);
  req->output = reinterpret_cast<void*>(output);
  req->where.kind = MemoryKind::kCuda;
  req->where.device = device;
  req->where.stream = reinterpret_cast<void*>(stream);
  if (ready) req->where.ready = std::shared_ptr<void>(reinterpret_cast<void*>(ready), [](void*) {});
  req->done = [done](const Status& s) {
    std::lock_guard<std::mutex> lock(done->mu);
    done->status = s;
    done->finished = true;
    done->cv.notify_all();
  };
  Status s;
  {
    py::gil_scoped_release release;
    s = rt.EnqueueGroup({req});
  }
  if (!s.ok()) Raise(s);
  const InitOptions& o = rt.options();
  const auto limit = std::chrono::milliseconds(
      static_cast<int64_t>((o.stall_timeout_seconds + 2 * o.timeout_seconds + 60) * 1000));
  return DeviceHandle(done, output, name, limit);
}

}  // namespace
}  // namespace perseus

using namespace perseus;  // NOLINT

PYBIND11_MODULE(_testing, m) {
  m.doc() = "Perseus-TF test hooks (tests, benchmarks and GPU tools only)";
  m.def("use_test_device", [] {
    // Throws for a value other than sim, cuda or unset (ValueError).
    const TestDevice device = RequestedTestDevice();
    py::module_ core = py::module_::import("perseus_tf._core");
    if (device == TestDevice::kNone) {
      core.attr("_set_placement")(py::none());
      return std::string();
    }
    core.attr("_set_placement")(
        py::capsule(reinterpret_cast<void*>(&PlaceOnTestDevice), "perseus.placement"));
    return std::string(device == TestDevice::kSim ? "sim" : "cuda");
  });
  m.def("sim_device_launches", [] { return SimDevice::Get().launches(); });
  m.def("hmac_sha256", [](py::bytes key, py::bytes data) {
    const Sha256Digest mac = HmacSha256(std::string(key), std::string(data));
    return py::bytes(reinterpret_cast<const char*>(mac.data()), mac.size());
  }, py::arg("key"), py::arg("data"));
  m.def("nccl_lone_communicator", [](std::vector<std::string> wheel_dirs, int size,
                                     int timeout_ms) {
    py::gil_scoped_release release;
    return NcclLoneCommunicator(wheel_dirs, size, timeout_ms);
  });
  m.def("raw_allreduce", [](py::array data, int dtype, bool doubling) {
    Status s;
    void* p = data.mutable_data();
    size_t n = static_cast<size_t>(data.size());
    {
      py::gil_scoped_release release;
      s = Runtime::Get().RawAllreduce(p, n, static_cast<DataType>(dtype), doubling);
    }
    if (!s.ok()) Raise(s);
  }, py::arg("data"), py::arg("dtype"), py::arg("doubling") = false);
  m.def("raw_allgather", [](py::bytes data, bool bruck) {
    const std::string in = data;
    std::string out;
    Status s;
    {
      py::gil_scoped_release release;
      s = Runtime::Get().RawAllgather(in, &out, bruck);
    }
    if (!s.ok()) Raise(s);
    return py::bytes(out);
  }, py::arg("data"), py::arg("bruck") = false);
  py::class_<DeviceHandle>(m, "DeviceHandle")
      .def("wait", &DeviceHandle::Wait)
      .def("done", &DeviceHandle::Done);
  m.def("submit_device", &SubmitDevice, py::arg("op"), py::arg("input"), py::arg("output"),
        py::arg("shape"), py::arg("name"), py::arg("dtype"), py::arg("device") = 0,
        py::arg("stream") = 0, py::arg("ready") = 0, py::arg("reduce_op") = 0,
        py::arg("root") = 0, py::arg("prescale") = 1.0, py::arg("postscale") = 1.0,
        py::arg("compression") = 0, py::arg("plannable") = false, py::arg("process_set") = 0);
}
