// perseus_tf._core: the runtime's Python face, without TensorFlow.
//
// It starts and stops the process's runtime (shared with the TF op library),
// reports rank and statistics, and runs collectives on numpy arrays, which is
// how the runtime is tested where TensorFlow is not installed. Collectives
// are submitted asynchronously and return a Handle, so tests can enqueue many
// tensors in a chosen order before waiting on any. What only tests, the
// benchmarks and the GPU tools use is in perseus_tf._testing
// (cc/python/testing/), which the product never imports.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>

#include "cc/core/common.h"
#include "cc/core/reduce.h"
#include "cc/python/stats_dict.h"
#include "cc/runtime/runtime.h"
#include "cc/transport/nccl.h"

namespace py = pybind11;

namespace perseus {
namespace {

struct MismatchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct CommunicationError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct InvalidError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void Raise(const Status& s) {
  switch (s.code) {
    case StatusCode::kFailedPrecondition: throw MismatchError(s.message);
    case StatusCode::kInvalidArgument: throw InvalidError(s.message);
    default: throw CommunicationError(s.message);
  }
}

// State of one submitted collective, shared with the runtime's callback.
struct HandleState {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  Status status;
  std::vector<char> storage;  // outputs whose shape comes from negotiation
  std::vector<int64_t> shape;
};

// The `done` of a request whose handle waits on `state`.
std::function<void(const Status&)> FinishInto(std::shared_ptr<HandleState> state) {
  return [state](const Status& s) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->status = s;
    state->finished = true;
    state->cv.notify_all();
  };
}

class Handle {
 public:
  Handle(std::shared_ptr<HandleState> state, std::shared_ptr<Request> request,
         py::object input, py::object output, py::object dtype)
      : state_(std::move(state)), request_(std::move(request)), input_(std::move(input)),
        output_(std::move(output)), dtype_(std::move(dtype)) {}
  Handle(Handle&&) = default;
  Handle(const Handle&) = delete;

  // The runtime writes into arrays this handle keeps alive: a handle dropped
  // early must not free them under a running collective.
  ~Handle() {
    if (!state_) return;
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->finished; });
  }

  // Returns (output array, received_splits or None).
  py::tuple Wait() {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(state_->mu);
      state_->cv.wait(lock, [&] { return state_->finished; });
    }
    if (!state_->status.ok()) Raise(state_->status);
    py::object result = output_;
    if (result.is_none()) {
      py::array arr(py::dtype::from_args(dtype_), state_->shape);
      if (!state_->storage.empty()) {
        std::memcpy(arr.mutable_data(), state_->storage.data(), state_->storage.size());
      }
      result = arr;
    }
    py::object splits = py::none();
    if (request_->meta.op == OpType::kAlltoall) splits = py::cast(request_->received_splits);
    if (request_->meta.op == OpType::kJoin) splits = py::cast(request_->result);
    return py::make_tuple(result, splits);
  }

  bool Done() {
    std::lock_guard<std::mutex> lock(state_->mu);
    return state_->finished;
  }

 private:
  std::shared_ptr<HandleState> state_;
  std::shared_ptr<Request> request_;
  py::object input_;
  py::object output_;
  py::object dtype_;
};

// Where a submitted array is placed before it runs: in host memory as given,
// unless a placement was installed (_set_placement: perseus_tf._testing puts
// arrays on the simulated device or a GPU first).
using ArrayPlacement = void (*)(Request& request, void* host_out);
ArrayPlacement placement = nullptr;

Runtime& RuntimeOf(int process_set) {
  Runtime* rt = Runtime::Find(process_set);
  if (rt == nullptr) {
    throw InvalidError("this rank is not a member of process set " + std::to_string(process_set) +
                       " (or the set was removed)");
  }
  return *rt;
}

// The numpy dtype a dtype code travels as; bfloat16 as its 16-bit pattern
// (uint16) or ml_dtypes' bfloat16.
bool MatchesCode(const py::dtype& dt, int code) {
  const char kind = dt.kind();
  const py::ssize_t size = dt.itemsize();
  switch (static_cast<DataType>(code)) {
    case DataType::kFloat16: return kind == 'f' && size == 2;
    case DataType::kBFloat16: return (kind == 'u' || kind == 'V') && size == 2;
    case DataType::kFloat32: return kind == 'f' && size == 4;
    case DataType::kFloat64: return kind == 'f' && size == 8;
    case DataType::kInt32: return kind == 'i' && size == 4;
    case DataType::kInt64: return kind == 'i' && size == 8;
    case DataType::kUint8: return kind == 'u' && size == 1;
    case DataType::kInt8: return kind == 'i' && size == 1;
    case DataType::kBool: return kind == 'b' && size == 1;
    case DataType::kUint16: return kind == 'u' && size == 2;
    case DataType::kInt16: return kind == 'i' && size == 2;
  }
  return false;
}

// The runtime reads and writes raw memory: every buffer it is given is
// checked first (dtype code against the array, contiguity, sizes), so a bad
// call raises instead of corrupting memory.
void CheckBuffer(const py::array& a, int dtype, const std::string& what) {
  if (!(a.flags() & py::array::c_style)) throw InvalidError(what + " must be C-contiguous");
  if (!MatchesCode(a.dtype(), dtype)) {
    throw InvalidError(what + " has numpy dtype " + std::string(py::str(a.dtype())) +
                       ", which does not match dtype code " + std::to_string(dtype) + " (" +
                       DataTypeName(static_cast<DataType>(dtype)) +
                       "); pass the array's own dtype code");
  }
}

void CheckCodes(const std::string& name, int op, int dtype, int reduce_op) {
  if (op < 0 || op > static_cast<int>(OpType::kJoin)) {
    throw InvalidError("'" + name + "': op code " + std::to_string(op) + " is not 0 to " +
                       std::to_string(static_cast<int>(OpType::kJoin)));
  }
  if (dtype < 0 || dtype > static_cast<int>(DataType::kInt16)) {
    throw InvalidError("'" + name + "': dtype code " + std::to_string(dtype) + " is not 0 to " +
                       std::to_string(static_cast<int>(DataType::kInt16)));
  }
  if (reduce_op < 0 || reduce_op > static_cast<int>(ReduceOp::kProduct)) {
    throw InvalidError("'" + name + "': reduce_op " + std::to_string(reduce_op) + " is not 0 to " +
                       std::to_string(static_cast<int>(ReduceOp::kProduct)));
  }
}

// Enqueue may wait for the runtime's lock (and a test-only pause holds it
// there): other Python threads run meanwhile.
Status EnqueueReleasingGil(Runtime& rt, const std::vector<std::shared_ptr<Request>>& requests) {
  py::gil_scoped_release release;
  return rt.EnqueueGroup(requests);
}

// A request for `input` with the fields every submit sets.
std::shared_ptr<Request> NewRequest(const py::array& input, const std::string& name, int op,
                                    int dtype, int reduce_op, int compression, bool plannable) {
  CheckCodes(name, op, dtype, reduce_op);
  CheckBuffer(input, dtype, "input array of '" + name + "'");
  auto req = std::make_shared<Request>();
  req->meta.name = name;
  req->meta.op = static_cast<OpType>(op);
  req->meta.dtype = static_cast<DataType>(dtype);
  req->meta.reduce_op = static_cast<ReduceOp>(reduce_op);
  for (py::ssize_t i = 0; i < input.ndim(); ++i) req->meta.shape.push_back(input.shape(i));
  req->meta.compression = compression;
  if (plannable) req->meta.flags |= kMetaPlannable;
  req->input = input.data();
  return req;
}

Handle Submit(int op, py::array input, const std::string& name, int dtype, int reduce_op,
              int root, double prescale, double postscale, std::vector<int64_t> splits,
              py::object output, int process_set, int compression, bool plannable) {
  Runtime& rt = RuntimeOf(process_set);
  auto state = std::make_shared<HandleState>();
  auto req = NewRequest(input, name, op, dtype, reduce_op, compression, plannable);
  req->meta.root = root;
  req->meta.prescale = prescale;
  req->meta.postscale = postscale;
  req->meta.splits = std::move(splits);
  const OpType kind = static_cast<OpType>(op);
  const bool same_shape = kind == OpType::kAllreduce || kind == OpType::kBroadcast;
  if (!output.is_none() && !same_shape) {
    throw InvalidError("'" + name + "': output= is only for allreduce and broadcast (" +
                       OpTypeName(kind) + " allocates its own result)");
  }
  if (same_shape && output.is_none()) {
    // A fresh result array of the input's shape and dtype.
    std::vector<py::ssize_t> shape(input.shape(), input.shape() + input.ndim());
    output = py::array(input.dtype(), shape);
  }
  if (!output.is_none()) {
    if (!py::isinstance<py::array>(output)) throw InvalidError("'" + name + "': output must be a numpy array");
    py::array out = output.cast<py::array>();
    CheckBuffer(out, dtype, "output array of '" + name + "'");
    if (!out.writeable()) throw InvalidError("output array of '" + name + "' is read-only");
    if (out.size() != input.size()) {
      throw InvalidError("output array of '" + name + "' has " + std::to_string(out.size()) +
                         " elements; it needs the input's " + std::to_string(input.size()));
    }
    req->output = out.mutable_data();
  } else {
    DataType dt = req->meta.dtype;
    req->allocate = [state, dt](const std::vector<int64_t>& shape) -> void* {
      state->shape = shape;
      state->storage.resize(static_cast<size_t>(NumElements(shape)) * DataTypeSize(dt));
      return state->storage.data();
    };
  }
  req->done = FinishInto(state);
  if (placement) placement(*req, req->output);
  Status s = EnqueueReleasingGil(rt, {req});
  if (!s.ok()) Raise(s);
  return Handle(state, req, input, output, input.attr("dtype"));
}

// What the TF grouped-allreduce kernel does, from numpy: every array reduced
// in place, all enqueued from C++ in one call (one grouped call of n), and
// one handle that completes when all have.
struct GroupState {
  std::mutex mu;
  std::condition_variable cv;
  size_t remaining = 0;
  Status status;
};

class GroupHandle {
 public:
  GroupHandle(std::shared_ptr<GroupState> state, py::list arrays)
      : state_(std::move(state)), arrays_(std::move(arrays)) {}
  GroupHandle(GroupHandle&&) = default;
  GroupHandle(const GroupHandle&) = delete;
  ~GroupHandle() {
    if (!state_) return;
    py::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait(lock, [&] { return state_->remaining == 0; });
  }
  void Wait() {
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(state_->mu);
      state_->cv.wait(lock, [&] { return state_->remaining == 0; });
    }
    if (!state_->status.ok()) Raise(state_->status);
  }

 private:
  std::shared_ptr<GroupState> state_;
  py::list arrays_;  // kept alive while the runtime writes into them
};

GroupHandle SubmitGroup(py::list arrays, std::vector<std::string> names, int dtype,
                        int reduce_op, int compression, bool plannable, int process_set) {
  if (arrays.size() != names.size()) {
    throw InvalidError("submit_group needs one name per array (" + std::to_string(arrays.size()) +
                       " arrays, " + std::to_string(names.size()) + " names)");
  }
  Runtime& rt = RuntimeOf(process_set);
  std::vector<std::shared_ptr<Request>> requests;
  auto state = std::make_shared<GroupState>();
  for (size_t i = 0; i < names.size(); ++i) {
    if (!py::isinstance<py::array>(arrays[i])) {
      throw InvalidError("submit_group: item " + std::to_string(i) + " ('" + names[i] +
                         "') is not a numpy array");
    }
    py::array a = arrays[i].cast<py::array>();
    if (!a.writeable()) throw InvalidError("submit_group arrays must be writeable");
    auto req = NewRequest(a, names[i], static_cast<int>(OpType::kAllreduce), dtype, reduce_op,
                          compression, plannable);
    req->meta.group = static_cast<int32_t>(names.size());
    req->output = a.mutable_data();
    req->done = [state](const Status& st) {
      std::lock_guard<std::mutex> lock(state->mu);
      if (!st.ok() && state->status.ok()) state->status = st;
      if (--state->remaining == 0) state->cv.notify_all();
    };
    if (placement) placement(*req, req->output);
    requests.push_back(std::move(req));
  }
  // One call, queued all together or not at all.
  state->remaining = requests.size();
  Status st = EnqueueReleasingGil(rt, requests);
  if (!st.ok()) Raise(st);
  return GroupHandle(state, arrays);
}

py::dict StatsDict(int process_set) { return StatsToDict(RuntimeOf(process_set).GetStats()); }

}  // namespace
}  // namespace perseus

PYBIND11_MODULE(_core, m) {
  using namespace perseus;
  m.doc() = "Perseus-TF native runtime (shared with the TensorFlow op library).";
  py::register_exception<MismatchError>(m, "MismatchError", PyExc_RuntimeError);
  py::register_exception<CommunicationError>(m, "CommunicationError", PyExc_RuntimeError);
  py::register_exception<InvalidError>(m, "InvalidArgumentError", PyExc_ValueError);

  // The codes Python passes to the ops and to submit: one definition each,
  // here, from the C++ enums (Python turns them into ints where it must).
  py::enum_<DataType>(m, "DataType")
      .value("float16", DataType::kFloat16)
      .value("bfloat16", DataType::kBFloat16)
      .value("float32", DataType::kFloat32)
      .value("float64", DataType::kFloat64)
      .value("int32", DataType::kInt32)
      .value("int64", DataType::kInt64)
      .value("uint8", DataType::kUint8)
      .value("int8", DataType::kInt8)
      .value("bool", DataType::kBool)
      .value("uint16", DataType::kUint16)
      .value("int16", DataType::kInt16);
  py::enum_<ReduceOp>(m, "ReduceOp")
      .value("sum", ReduceOp::kSum)
      .value("average", ReduceOp::kAverage)
      .value("min", ReduceOp::kMin)
      .value("max", ReduceOp::kMax)
      .value("product", ReduceOp::kProduct);
  py::enum_<OpType>(m, "OpType")
      .value("allreduce", OpType::kAllreduce)
      .value("allgather", OpType::kAllgather)
      .value("broadcast", OpType::kBroadcast)
      .value("alltoall", OpType::kAlltoall)
      .value("reducescatter", OpType::kReducescatter)
      .value("barrier", OpType::kBarrier)
      .value("join", OpType::kJoin);
  py::dict compression;
  compression["none"] = kCompressNone;
  compression["fp16"] = kCompressFp16;
  compression["mixed"] = kCompressMixed;
  compression["topk"] = kCompressTopk;
  compression["downsample"] = kCompressDownsample;
  m.attr("COMPRESSION") = compression;

  // Runtime::Init's options, field by field (cc/runtime/options.h).
  py::class_<InitOptions> init_options(m, "InitOptions");
  init_options.def(py::init<>())
      .def_readwrite("rank", &InitOptions::rank)
      .def_readwrite("size", &InitOptions::size)
      .def_readwrite("local_rank", &InitOptions::local_rank)
      .def_readwrite("local_size", &InitOptions::local_size)
      .def_readwrite("cross_rank", &InitOptions::cross_rank)
      .def_readwrite("cross_size", &InitOptions::cross_size)
      .def_readwrite("store_addr", &InitOptions::store_addr)
      .def_readwrite("store_port", &InitOptions::store_port)
      .def_readwrite("secret", &InitOptions::secret)
      .def_readwrite("job_id", &InitOptions::job_id)
      .def_readwrite("host_addr", &InitOptions::host_addr)
      .def_readwrite("settings", &InitOptions::settings)
      .def_readwrite("timeline_path", &InitOptions::timeline_path)
      .def_readwrite("nccl", &InitOptions::nccl)
      .def_readwrite("nccl_dirs", &InitOptions::nccl_dirs)
      .def_readwrite("topk_fallback", &InitOptions::topk_fallback);
  // Every setting, under its name in perseus_tf/config/spec.py.
#define PERSEUS_BIND_SETTING(Part, name) \
  init_options.def_readwrite(#name, &Part::name);
  PERSEUS_NATIVE_SETTINGS(PERSEUS_BIND_SETTING)
#undef PERSEUS_BIND_SETTING

  m.def("init", [](const InitOptions& opts) {
    Status s;
    {
      py::gil_scoped_release release;
      s = Runtime::Get().Init(opts);
    }
    if (!s.ok()) Raise(s);
  });
  m.def("shutdown", [] {
    py::gil_scoped_release release;
    Runtime::Get().Shutdown();
  });
  m.def("abort", [](const std::string& why) {
    py::gil_scoped_release release;
    Runtime::AbortAll(why);
  });
  m.def("is_initialized", [] { return Runtime::Get().initialized(); });
  m.def("state", [] { return std::string(Runtime::Get().state_name()); });
  m.def("forked_after_init", [] { return Runtime::ForkedAfterInit(); });
  m.def("first_failure", []() -> py::object {
    FirstFailure f = GetFirstFailure();
    if (!f.seen) return py::none();
    py::dict d;
    d["time"] = f.wall_time;
    d["culprits"] = f.culprits;
    d["message"] = f.message;
    return d;
  });
  m.def("topology", [] {
    const InitOptions& o = Runtime::Get().options();
    py::dict d;
    d["rank"] = o.rank;
    d["size"] = o.size;
    d["local_rank"] = o.local_rank;
    d["local_size"] = o.local_size;
    d["cross_rank"] = o.cross_rank;
    d["cross_size"] = o.cross_size;
    return d;
  });
  m.def("stats", &StatsDict, py::arg("process_set") = 0);
  py::class_<GroupHandle>(m, "GroupHandle").def("wait", &GroupHandle::Wait);
  m.def("submit_group", &SubmitGroup, py::arg("arrays"), py::arg("names"), py::arg("dtype"),
        py::arg("reduce_op") = 0, py::arg("compression") = 0, py::arg("plannable") = false,
        py::arg("process_set") = 0);
  m.def("add_process_set", [](int id, std::vector<int> ranks) {
    Status s;
    {
      py::gil_scoped_release release;
      s = Runtime::AddProcessSet(id, ranks);
    }
    if (!s.ok()) Raise(s);
  });
  m.def("remove_process_set", [](int id) {
    Status s;
    {
      py::gil_scoped_release release;
      s = Runtime::RemoveProcessSet(id);
    }
    if (!s.ok()) Raise(s);
  });
  m.def("process_set_ids", &Runtime::ProcessSetIds);
  m.def("start_timeline", [](const std::string& path, bool mark_cycles) {
    Runtime::Get().StartTimeline(path, mark_cycles);
  }, py::arg("path"), py::arg("mark_cycles") = true);
  m.def("stop_timeline", [] {
    std::string error;
    if (!Runtime::Get().StopTimeline(&error)) throw CommunicationError(error);
  });
  m.def("process_set_topology", [](int id) -> py::object {
    Runtime* rt = Runtime::Find(id);
    if (rt == nullptr || !rt->initialized()) return py::none();
    const InitOptions& o = rt->options();
    py::dict d;
    d["rank"] = o.rank;
    d["size"] = o.size;
    std::vector<int> ranks = o.global_ranks;
    if (ranks.empty()) for (int r = 0; r < o.size; ++r) ranks.push_back(r);
    d["ranks"] = ranks;
    return d;
  });
  // NCCL, loaded at run time (cc/transport/nccl.h): from PERSEUS_NCCL_LIBRARY,
  // else the wheels' lib folders given, else the loader's path.
  m.def("nccl_library", [](std::vector<std::string> wheel_dirs) {
    std::string why_not;
    const NcclLibrary* lib = NcclLibrary::Load(wheel_dirs, &why_not);
    py::dict d;
    d["available"] = lib != nullptr;
    d["path"] = lib ? lib->path : std::string();
    d["version"] = lib ? lib->version : 0;
    d["why_not"] = why_not;
    return d;
  });
  py::class_<Handle>(m, "Handle")
      .def("wait", &Handle::Wait)
      .def("done", &Handle::Done);
  m.def("submit", &Submit, py::arg("op"), py::arg("input"), py::arg("name"), py::arg("dtype"),
        py::arg("reduce_op") = 0, py::arg("root") = 0, py::arg("prescale") = 1.0,
        py::arg("postscale") = 1.0, py::arg("splits") = std::vector<int64_t>(),
        py::arg("output") = py::none(), py::arg("process_set") = 0,
        py::arg("compression") = 0, py::arg("plannable") = false);
  // Installs the placement of submitted arrays (a capsule named
  // "perseus.placement" holding an ArrayPlacement), or removes it (None).
  m.def("_set_placement", [](py::object capsule) {
    if (capsule.is_none()) {
      placement = nullptr;
      return;
    }
    py::capsule c = capsule.cast<py::capsule>();
    if (std::string(c.name() ? c.name() : "") != "perseus.placement") {
      throw InvalidError("_set_placement takes a capsule named perseus.placement");
    }
    placement = reinterpret_cast<ArrayPlacement>(c.get_pointer());
  });
}
