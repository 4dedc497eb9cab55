// TF's GPU kernels of the Perseus ops, run without TensorFlow's Python or a
// TF GPU device: this library loads libtensorflow_framework.so.2 and the op
// library, gives the kernels a stand-in GPU device (its device context hands
// them a CUDA stream of our own, its allocator hands out CUDA device memory
// and gives freed blocks out again at once, as TF's does), creates the
// kernels through TF's kernel registry for DEVICE_GPU and runs them. CUDA
// comes through cc/cuda/driver.h: the real driver on a GPU machine, the
// stand-in of cc/testing/fake_cuda.cc in CI. The input of each run is
// written on "TF's" stream by a slow producer (libperseus_cuda.so's test
// producer: a busy kernel, then the copy), so a kernel that does not order
// its reads after TF's stream reads garbage. tools/tf_gpu_harness.py drives
// it (through ctypes, in a process whose runtime _core started).
#include <dlfcn.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "cc/cuda/driver.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/device_attributes.pb.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/memory_types.h"
#include "tensorflow/core/framework/node_def_builder.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/public/version.h"
#include "xla/stream_executor/stream.h"

namespace {

using namespace tensorflow;  // NOLINT: a test tool
namespace se = stream_executor;
namespace cu = perseus::cu;

// What libperseus_cuda.so offers the test harness (cuda_plane.h).
struct CudaTestCalls {
  int (*produce)(int, void*, const void*, size_t, int, void**, void**) = nullptr;
  int (*fetch)(int, void*, const void*, size_t) = nullptr;
  int (*event_destroy)(void*) = nullptr;
  const char* (*error_string)(int) = nullptr;
};
CudaTestCalls g_cuda;

// A CUDA stream as TF's compute stream: only its handle is ever asked for.
class StandInStream : public se::Stream {
 public:
  explicit StandInStream(void* handle) : handle_(handle) {}
  PlatformSpecificHandle platform_specific_handle() const override {
    PlatformSpecificHandle h;
    h.stream = handle_;
    return h;
  }
  bool ok() const override { return true; }
  absl::StatusOr<se::Stream*> GetOrCreateSubStream() override { return Unused(); }
  void ReturnSubStream(se::Stream*) override {}
  absl::Status WaitFor(se::Stream*) override { return Unused(); }
  absl::Status WaitFor(se::Event*) override { return Unused(); }
  absl::Status RecordEvent(se::Event*) override { return Unused(); }
  absl::Status Memcpy(void*, const se::DeviceAddressBase&, uint64_t) override { return Unused(); }
  absl::Status Memcpy(se::DeviceAddressBase*, const void*, uint64_t) override { return Unused(); }
  absl::Status BlockHostUntilDone() override { return Unused(); }
  absl::Status DoHostCallbackWithStatus(absl::AnyInvocable<absl::Status() &&>) override {
    return Unused();
  }
  se::StreamExecutor* parent() const override { return nullptr; }
  se::CudaComputeCapability GetCudaComputeCapability() const override { return {}; }
  se::RocmComputeCapability GetRocmComputeCapability() const override { return {}; }
  se::OneAPIComputeCapability GetOneAPIComputeCapability() const override { return {}; }
  std::variant<se::StreamPriority, int> priority() const override { return 0; }
  const std::string& GetName() const override { return name_; }
  void SetName(std::string name) override { name_ = std::move(name); }

 private:
  static absl::Status Unused() {
    return absl::UnimplementedError("the harness's stream only gives its handle");
  }
  void* handle_;
  std::string name_ = "harness stream";
};

class StandInContext : public DeviceContext {
 public:
  explicit StandInContext(se::Stream* stream) : stream_(stream) {}
  se::Stream* stream() const override { return stream_; }

 private:
  se::Stream* stream_;
};

// CUDA device memory; a freed block is handed out again at once to the next
// request it fits (TF's allocator does the same: work queued on its stream
// before the free still runs first, in stream order).
class DeviceAllocator : public Allocator {
 public:
  std::string Name() override { return "perseus_harness_gpu"; }
  void* AllocateRaw(size_t, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= bytes) {
        void* p = it->first;
        live_[p] = it->second;
        free_.erase(it);
        ++reused_;
        return p;
      }
    }
    cu::DevicePtr p = 0;
    if (cu::Driver::Get(nullptr)->MemAlloc(&p, bytes ? bytes : 1) != cu::kSuccess) return nullptr;
    live_[reinterpret_cast<void*>(p)] = bytes ? bytes : 1;
    return reinterpret_cast<void*>(p);
  }
  void DeallocateRaw(void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = live_.find(p);
    if (it == live_.end()) return;
    free_.emplace_back(p, it->second);
    live_.erase(it);
  }
  int reused() {
    std::lock_guard<std::mutex> lock(mu_);
    return reused_;
  }

 private:
  std::mutex mu_;
  std::map<void*, size_t> live_;
  std::vector<std::pair<void*, size_t>> free_;
  int reused_ = 0;
};

class StandInGpu : public DeviceBase {
 public:
  StandInGpu(int gpu, void* stream)
      : DeviceBase(Env::Default()), stream_(stream), context_(new StandInContext(&stream_)) {
    info_.stream = &stream_;
    info_.default_context = context_;
    info_.gpu_id = gpu;
    set_tensorflow_accelerator_device_info(&info_);
    name_ = "/job:localhost/replica:0/task:0/device:GPU:" + std::to_string(gpu);
    attributes_.set_name(name_);
    attributes_.set_device_type(DEVICE_GPU);
  }
  Allocator* GetAllocator(AllocatorAttributes attr) override {
    return attr.on_host() ? cpu_allocator() : &memory_;
  }
  const std::string& name() const override { return name_; }
  const DeviceAttributes& attributes() const override { return attributes_; }
  ~StandInGpu() override { context_->Unref(); }  // a DeviceContext is reference counted
  DeviceContext* context() { return context_; }
  DeviceAllocator& memory() { return memory_; }

 private:
  StandInStream stream_;
  StandInContext* context_;
  AcceleratorDeviceInfo info_;
  DeviceAllocator memory_;
  std::string name_;
  DeviceAttributes attributes_;
};

std::unique_ptr<StandInGpu> g_gpu;
void* g_stream = nullptr;
int g_device = 0;

void SetError(char* err, size_t len, const std::string& what) {
  if (err && len) std::snprintf(err, len, "%s", what.c_str());
}

// "name=kind:value;..." (kind i: int, f: float, s: string, b: bool) into
// the builder.
void AddAttrs(NodeDefBuilder* b, const std::string& attrs) {
  std::stringstream in(attrs);
  std::string item;
  while (std::getline(in, item, ';')) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string name = item.substr(0, eq);
    const char kind = item[eq + 1];
    const std::string value = item.substr(eq + 3);
    if (kind == 'i') b->Attr(name, static_cast<int64_t>(std::stoll(value)));
    if (kind == 'f') b->Attr(name, std::stof(value));
    if (kind == 's') b->Attr(name, value);
    if (kind == 'b') b->Attr(name, value == "true");
  }
}

// The NodeDef of `op` on inputs of `dtypes` (a list input for the grouped
// allreduce) with `attrs`, and TF's memory types for it on a GPU.
absl::Status BuildNode(const char* op, const char* attrs, int n_in, const int32_t* dtypes,
                       NodeDef* def, MemoryTypeVector* in_types, MemoryTypeVector* out_types) {
  NodeDefBuilder b("perseus_harness_op", op);
  std::vector<NodeDefBuilder::NodeOut> inputs;
  for (int i = 0; i < n_in; ++i) {
    inputs.emplace_back("in" + std::to_string(i), 0, static_cast<DataType>(dtypes[i]));
  }
  if (std::string(op) == "PerseusGroupedAllreduce") {
    b.Input(inputs);
  } else {
    for (const auto& o : inputs) b.Input(o);
  }
  AddAttrs(&b, attrs);
  absl::Status s = b.Finalize(def);
  if (s.ok()) {
    s = MemoryTypesForNode(OpRegistry::Global(), DeviceType(DEVICE_GPU), *def, in_types,
                           out_types);
  }
  return s;
}

}  // namespace

extern "C" {

// A tensor crossing the harness: float32 (dtype 1) or int32 (3), up to 4
// dims, and host memory of `capacity` bytes holding (input) or receiving
// (output) its elements.
struct HarnessTensor {
  int32_t dtype;
  int32_t rank;
  int64_t dims[4];
  void* host;
  int64_t capacity;
};

// Loads the op library (registering the ops and their kernels) and the
// CUDA test calls, and makes the stand-in device on `gpu` with a stream of
// our own as TF's stream. 0, or the reason in err.
int harness_init(const char* op_library, const char* cuda_library, int gpu, char* err,
                 size_t len) {
  std::string why;
  const cu::Driver* d = cu::Driver::Get(&why);
  if (d == nullptr) {
    SetError(err, len, why);
    return 1;
  }
  if (dlopen(op_library, RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    SetError(err, len, std::string("cannot load the op library: ") + dlerror());
    return 1;
  }
  void* cuda = dlopen(cuda_library, RTLD_NOW | RTLD_GLOBAL);
  if (cuda == nullptr) {
    SetError(err, len, std::string("cannot load libperseus_cuda.so: ") + dlerror());
    return 1;
  }
  g_cuda.produce = reinterpret_cast<decltype(g_cuda.produce)>(
      dlsym(cuda, "perseus_cuda_test_produce"));
  g_cuda.fetch = reinterpret_cast<decltype(g_cuda.fetch)>(dlsym(cuda, "perseus_cuda_test_fetch"));
  g_cuda.event_destroy =
      reinterpret_cast<decltype(g_cuda.event_destroy)>(dlsym(cuda, "perseus_cuda_event_destroy"));
  g_cuda.error_string =
      reinterpret_cast<decltype(g_cuda.error_string)>(dlsym(cuda, "perseus_cuda_error_string"));
  // The producer's stream (one per device) is "TF's" stream: a probe write
  // of nothing returns it.
  void* event = nullptr;
  int rc = g_cuda.produce(gpu, nullptr, nullptr, 0, 0, &g_stream, &event);
  if (rc != 0) {
    SetError(err, len, std::string("the CUDA test producer failed: ") + g_cuda.error_string(rc));
    return 1;
  }
  g_cuda.event_destroy(event);
  g_device = gpu;
  g_gpu = std::make_unique<StandInGpu>(gpu, g_stream);
  return 0;
}

// Which memory TF gives each input and output of `op` on a GPU ("D" device,
// "H" host), as "inputs/outputs", e.g. "DH/DH"; and whether a DEVICE_GPU
// kernel could be created for it. 0, or the reason in err.
int harness_kernel_info(const char* op, const char* attrs, int n_in, const int32_t* dtypes,
                        char* out, size_t out_len, char* err, size_t len) {
  NodeDef def;
  MemoryTypeVector in_types, out_types;
  absl::Status s = BuildNode(op, attrs, n_in, dtypes, &def, &in_types, &out_types);
  std::unique_ptr<OpKernel> kernel;
  if (s.ok()) {
    kernel = CreateOpKernel(DeviceType(DEVICE_GPU), g_gpu.get(), &g_gpu->memory(), def,
                            TF_GRAPH_DEF_VERSION, &s);
  }
  if (!s.ok()) {
    SetError(err, len, std::string(s.message()));
    return 1;
  }
  std::string text;
  for (MemoryType t : in_types) text += t == HOST_MEMORY ? "H" : "D";
  text += "/";
  for (MemoryType t : out_types) text += t == HOST_MEMORY ? "H" : "D";
  text += kernel->AsAsync() != nullptr ? " async" : " sync";
  SetError(out, out_len, text);
  return 0;
}

// Runs `op` once: each device input is written on TF's stream by the slow
// producer (delay_us of busy device work first); with `stale_output`, a
// block the size of each output is first allocated, queued for a slow write
// of garbage on TF's stream and freed, so the kernel's output is handed
// that block while the write is still queued. Outputs are copied to their
// host buffers (dims filled in). 0, or the reason in err.
int harness_run(const char* op, const char* attrs, int n_in, const HarnessTensor* in, int n_out,
                HarnessTensor* out, int delay_us, int stale_output, double timeout_s, char* err,
                size_t len) {
  std::vector<int32_t> dtypes;
  for (int i = 0; i < n_in; ++i) dtypes.push_back(in[i].dtype);
  NodeDef def;
  MemoryTypeVector in_types, out_types;
  absl::Status s = BuildNode(op, attrs, n_in, dtypes.data(), &def, &in_types, &out_types);
  std::unique_ptr<OpKernel> kernel;
  if (s.ok()) {
    kernel = CreateOpKernel(DeviceType(DEVICE_GPU), g_gpu.get(), &g_gpu->memory(), def,
                            TF_GRAPH_DEF_VERSION, &s);
  }
  if (!s.ok()) {
    SetError(err, len, "creating the kernel: " + std::string(s.message()));
    return 1;
  }
  if (static_cast<int>(out_types.size()) != n_out) {
    SetError(err, len, "the op has " + std::to_string(out_types.size()) + " outputs");
    return 1;
  }
  // Inputs.
  std::vector<Tensor> tensors;
  tensors.reserve(static_cast<size_t>(n_in));
  std::vector<TensorValue> values;
  std::vector<AllocatorAttributes> in_attrs(static_cast<size_t>(n_in));
  for (int i = 0; i < n_in; ++i) {
    TensorShape shape;
    for (int d = 0; d < in[i].rank; ++d) shape.AddDim(in[i].dims[d]);
    const bool host = in_types[i] == HOST_MEMORY;
    in_attrs[i].set_on_host(host);
    tensors.emplace_back(g_gpu->GetAllocator(in_attrs[i]), static_cast<DataType>(in[i].dtype),
                         shape);
    Tensor& t = tensors.back();
    const size_t bytes = t.TotalBytes();
    if (host) {
      std::memcpy(const_cast<char*>(t.tensor_data().data()), in[i].host, bytes);
    } else {
      void* stream = nullptr;
      void* event = nullptr;
      const int rc = g_cuda.produce(g_device, const_cast<char*>(t.tensor_data().data()),
                                    in[i].host, bytes, delay_us, &stream, &event);
      if (rc != 0) {
        SetError(err, len, std::string("producing an input: ") + g_cuda.error_string(rc));
        return 1;
      }
      g_cuda.event_destroy(event);
    }
  }
  for (Tensor& t : tensors) values.emplace_back(&t);
  if (stale_output) {
    for (int i = 0; i < n_out; ++i) {
      if (out_types[i] == HOST_MEMORY) continue;
      const size_t bytes = static_cast<size_t>(out[i].capacity);
      void* block = g_gpu->memory().AllocateRaw(64, bytes);
      std::vector<unsigned char> garbage(bytes, 0x77);
      void* stream = nullptr;
      void* event = nullptr;
      g_cuda.produce(g_device, block, garbage.data(), bytes, delay_us, &stream, &event);
      g_cuda.event_destroy(event);
      g_gpu->memory().DeallocateRaw(block);  // handed out again at once
    }
  }
  std::vector<AllocatorAttributes> out_attrs(static_cast<size_t>(n_out));
  for (int i = 0; i < n_out; ++i) out_attrs[i].set_on_host(out_types[i] == HOST_MEMORY);
  OpKernelContext::Params params;
  params.device = g_gpu.get();
  params.op_kernel = kernel.get();
  params.inputs = values;
  params.input_alloc_attrs = in_attrs;
  params.op_device_context = g_gpu->context();
  params.output_attr_array = out_attrs.data();
  OpKernelContext ctx(&params, n_out);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  AsyncOpKernel* async = kernel->AsAsync();
  if (async == nullptr) {
    kernel->Compute(&ctx);
    done = true;
  } else {
    async->ComputeAsync(&ctx, [&] {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return done; })) {
      SetError(err, len, "the kernel did not finish within the harness's timeout");
      // The context and tensors must outlive the kernel's callback: leak them.
      std::abort();
    }
  }
  if (!ctx.status().ok()) {
    SetError(err, len, "the kernel failed: " + std::string(ctx.status().message()));
    return 1;
  }
  for (int i = 0; i < n_out; ++i) {
    const Tensor* t = ctx.mutable_output(i);
    if (t == nullptr) {
      SetError(err, len, "output " + std::to_string(i) + " was not set");
      return 1;
    }
    out[i].rank = t->dims();
    for (int d = 0; d < t->dims() && d < 4; ++d) out[i].dims[d] = t->dim_size(d);
    const size_t bytes = t->TotalBytes();
    if (static_cast<int64_t>(bytes) > out[i].capacity) {
      SetError(err, len, "output " + std::to_string(i) + " is larger than its buffer");
      return 1;
    }
    if (out_types[i] == HOST_MEMORY) {
      std::memcpy(out[i].host, t->tensor_data().data(), bytes);
    } else {
      const int rc = g_cuda.fetch(g_device, out[i].host, t->tensor_data().data(), bytes);
      if (rc != 0) {
        SetError(err, len, std::string("fetching an output: ") + g_cuda.error_string(rc));
        return 1;
      }
    }
  }
  return 0;
}

int harness_reused_blocks() { return g_gpu ? g_gpu->memory().reused() : 0; }

}  // extern "C"
