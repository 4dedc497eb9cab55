// TensorFlow kernels: a thin adapter that turns op inputs into runtime
// Requests (cc/runtime/runtime.h) and completes the op when the runtime
// calls back. All kernels are asynchronous, so a waiting collective holds no
// TF thread.
//
// The same kernels are registered for TF's GPUs. There a request's memory
// is placed on the CUDA device with an event recorded on TF's compute stream
// after the output was allocated (cc/device/data_plane.h): the runtime's own
// streams wait for it, and the op completes once the runtime's device work
// has finished, so TF's later kernels read finished results. The op library
// links no CUDA: events go through libperseus_cuda.so (cuda_library.h).
#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>

#include "cc/device/cuda_library.h"
#include "cc/runtime/runtime.h"
#include "tensorflow/core/framework/device_base.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {
namespace {

using perseus::DataType;
using perseus::OpType;
using perseus::Request;
using perseus::Runtime;

Status ToTf(const perseus::Status& s) {
  switch (s.code) {
    case perseus::StatusCode::kOk: return OkStatus();
    case perseus::StatusCode::kInvalidArgument: return errors::InvalidArgument(s.message);
    case perseus::StatusCode::kFailedPrecondition: return errors::FailedPrecondition(s.message);
    case perseus::StatusCode::kUnavailable: return errors::Unavailable(s.message);
    default: return errors::Internal(s.message);
  }
}

Status ToPerseus(::tensorflow::DataType dt, DataType* out) {
  switch (dt) {
    case DT_HALF: *out = DataType::kFloat16; break;
    case DT_BFLOAT16: *out = DataType::kBFloat16; break;
    case DT_FLOAT: *out = DataType::kFloat32; break;
    case DT_DOUBLE: *out = DataType::kFloat64; break;
    case DT_INT32: *out = DataType::kInt32; break;
    case DT_INT64: *out = DataType::kInt64; break;
    case DT_UINT8: *out = DataType::kUint8; break;
    case DT_INT8: *out = DataType::kInt8; break;
    case DT_BOOL: *out = DataType::kBool; break;
    case DT_UINT16: *out = DataType::kUint16; break;
    case DT_INT16: *out = DataType::kInt16; break;
    default:
      return errors::InvalidArgument("Perseus collectives do not support dtype ",
                                     DataTypeString(dt));
  }
  return OkStatus();
}

std::vector<int64_t> ShapeOf(const Tensor& t) {
  std::vector<int64_t> shape;
  for (int i = 0; i < t.dims(); ++i) shape.push_back(t.dim_size(i));
  return shape;
}

void* DataOf(const Tensor& t) { return const_cast<char*>(t.tensor_data().data()); }

// A GPU kernel's TF device and compute stream, and its CUDA runtime calls.
struct TfGpu {
  const perseus::CudaLibrary* lib = nullptr;
  int device = 0;
  void* stream = nullptr;

  Status Find(OpKernelContext* ctx) {
    std::string why;
    lib = perseus::CudaLibrary::Load(&why);
    if (lib == nullptr) return errors::FailedPrecondition("Perseus collective on a GPU: ", why);
    const DeviceBase::AcceleratorDeviceInfo* info =
        ctx->device()->tensorflow_accelerator_device_info();
    DeviceContext* dc = ctx->op_device_context();
    if (info == nullptr || dc == nullptr || dc->stream() == nullptr) {
      return errors::Internal("Perseus collective on ", ctx->device()->name(),
                              ": TF gave the kernel no GPU stream");
    }
    device = info->gpu_id;
    stream = dc->stream()->platform_specific_handle().stream;
    return OkStatus();
  }

  Status Check(int code, const char* what) const {
    if (code == 0) return OkStatus();
    return errors::Internal("Perseus collective on GPU ", device, ": ", what, ": ",
                            lib->error_string(code));
  }

  // Memory on this GPU, ready when what TF queued on its stream so far is.
  Status Place(perseus::Placement* where) const {
    void* event = nullptr;
    TF_RETURN_IF_ERROR(
        Check(lib->record_event(device, stream, &event), "recording an event on TF's stream"));
    const perseus::CudaLibrary* l = lib;
    where->kind = perseus::MemoryKind::kCuda;
    where->device = device;
    where->stream = stream;
    where->ready = std::shared_ptr<void>(event, [l](void* e) { l->event_destroy(e); });
    return OkStatus();
  }

};

// Reads the attributes every reducing op has (reduce_op, prescale, postscale).
struct ReduceAttrs {
  perseus::ReduceOp op = perseus::ReduceOp::kSum;
  float prescale = 1.0f, postscale = 1.0f;
  int64 compression = 0;  // allreduce of float32 only: 1 = float16 on the wire
  bool plannable = false;  // may run from an offline plan

  Status Read(OpKernelConstruction* c) {
    int reduce_op;
    TF_RETURN_IF_ERROR(c->GetAttr("reduce_op", &reduce_op));
    if (reduce_op < 0 || reduce_op > 4) {
      return errors::InvalidArgument("reduce_op must be 0..4, got ", reduce_op);
    }
    op = static_cast<perseus::ReduceOp>(reduce_op);
    TF_RETURN_IF_ERROR(c->GetAttr("prescale", &prescale));
    if (c->HasAttr("compression")) TF_RETURN_IF_ERROR(c->GetAttr("compression", &compression));
    if (c->HasAttr("plannable")) TF_RETURN_IF_ERROR(c->GetAttr("plannable", &plannable));
    return c->GetAttr("postscale", &postscale);
  }
  void Apply(Request* req) const {
    req->meta.compression = static_cast<int32_t>(compression);
    if (plannable) req->meta.flags |= perseus::kMetaPlannable;
    req->meta.reduce_op = op;
    req->meta.prescale = prescale;
    req->meta.postscale = postscale;
  }
};

// Common attributes and request building for every collective kernel.
class CollectiveKernel : public AsyncOpKernel {
 public:
  explicit CollectiveKernel(OpKernelConstruction* c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("tensor_name", &tensor_name_));
    OP_REQUIRES_OK(c, c->GetAttr("process_set_id", &process_set_id_));
    // Inside a graph the node name is the same on every rank; that is what
    // pairs up the requests when no explicit name was given.
    if (tensor_name_.empty()) tensor_name_ = name();
    gpu_ = c->device_type() == DeviceType(DEVICE_GPU);
  }

  // Starting a collective only checks and queues it (the work runs on the
  // runtime's threads), so TF's executor may start it inline, as soon as
  // its inputs exist. Otherwise, on CPU, TF queues it behind the other
  // ready work: with one inter-op thread, behind the rest of
  // back-propagation, and no gradient group could start before it ends.
  bool IsExpensive() override { return false; }

 protected:
  // Fills meta from input `index`; returns false (with ctx status set) on error.
  bool Prepare(OpKernelContext* ctx, int index, OpType op, Request* req) {
    const Tensor& in = ctx->input(index);
    Status s = ToPerseus(in.dtype(), &req->meta.dtype);
    if (!s.ok()) {
      ctx->SetStatus(s);
      return false;
    }
    req->meta.op = op;
    req->meta.name = tensor_name_;
    req->meta.shape = ShapeOf(in);
    req->input = DataOf(in);
    return true;
  }

  perseus::Status NotAMember(const Request& req) const {
    return perseus::Status::Error(
        perseus::StatusCode::kInvalidArgument,
        "Perseus " + std::string(perseus::OpTypeName(req.meta.op)) + " of tensor '" +
            req.meta.name + "': this rank is not a member of process set " +
            std::to_string(process_set_id_) + " (or the set was removed)");
  }

  // The runtime of this op's process set (the world for id 0).
  perseus::Status Enqueue(std::shared_ptr<Request> req) {
    Runtime* rt = Runtime::Find(static_cast<int>(process_set_id_));
    if (rt == nullptr) return NotAMember(*req);
    return rt->Enqueue(std::move(req));
  }

  // Enqueues; on success the runtime completes the op, else we do here.
  void Submit(OpKernelContext* ctx, std::shared_ptr<Request> req, DoneCallback done) {
    perseus::Status s = Enqueue(std::move(req));
    if (!s.ok()) {
      ctx->SetStatus(ToTf(s));
      done();
    }
  }

  std::string tensor_name_;
  int64 process_set_id_ = 0;
  bool gpu_ = false;  // registered for DEVICE_GPU: tensors in TF's GPU memory
};

// Allreduce, broadcast: the output has the input's shape and may reuse its buffer.
class SameShapeKernel : public CollectiveKernel {
 public:
  SameShapeKernel(OpKernelConstruction* c, OpType op) : CollectiveKernel(c), op_(op) {
    if (op == OpType::kAllreduce) {
      OP_REQUIRES_OK(c, reduce_.Read(c));
    } else {
      OP_REQUIRES_OK(c, c->GetAttr("root_rank", &root_));
    }
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    auto req = std::make_shared<Request>();
    if (!Prepare(ctx, 0, op_, req.get())) return done();
    reduce_.Apply(req.get());
    req->meta.root = root_;
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, ctx->forward_input_or_allocate_output({0}, 0, ctx->input(0).shape(), &out), done);
    req->output = DataOf(*out);
    if (gpu_) {
      TfGpu gpu;
      OP_REQUIRES_OK_ASYNC(ctx, gpu.Find(ctx), done);
      OP_REQUIRES_OK_ASYNC(ctx, gpu.Place(&req->where), done);
    }
    req->done = [ctx, done](const perseus::Status& s) {
      ctx->SetStatus(ToTf(s));
      done();
    };
    Submit(ctx, std::move(req), std::move(done));
  }

 private:
  OpType op_;
  ReduceAttrs reduce_;
  int root_ = 0;
};

class AllreduceKernel : public SameShapeKernel {
 public:
  explicit AllreduceKernel(OpKernelConstruction* c) : SameShapeKernel(c, OpType::kAllreduce) {}
};
class BroadcastKernel : public SameShapeKernel {
 public:
  explicit BroadcastKernel(OpKernelConstruction* c) : SameShapeKernel(c, OpType::kBroadcast) {}
};

// N tensors, one request each, all enqueued together so that they are
// negotiated in one cycle and fused. The per-tensor work is kept small (a
// call may carry hundreds of gradients every step): the names are built once
// per kernel, each request's callback holds one pointer, and outputs that
// cannot reuse their input share one allocation.
class GroupedAllreduceKernel : public CollectiveKernel {
 public:
  explicit GroupedAllreduceKernel(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, reduce_.Read(c));
    for (int i = 0; i < c->num_inputs(); ++i) names_.push_back(tensor_name_ + "." + std::to_string(i));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const int n = ctx->num_inputs();
    // What the N callbacks share: the first error, and who completes the op.
    struct Group {
      Group(OpKernelContext* c, DoneCallback d, int n) : ctx(c), done(std::move(d)), left(n) {}
      OpKernelContext* ctx;
      DoneCallback done;
      std::atomic<int> left;
      std::mutex mu;
      Status status;
      void Finish(const perseus::Status& s) {
        if (!s.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (status.ok()) status = ToTf(s);
        }
        if (--left == 0) {
          ctx->SetStatus(status);
          done();
        }
      }
    };
    std::vector<std::shared_ptr<Request>> reqs;
    reqs.reserve(n);
    std::vector<int> unforwarded;
    for (int i = 0; i < n; ++i) {
      auto req = std::make_shared<Request>();
      if (!Prepare(ctx, i, OpType::kAllreduce, req.get())) return done();
      req->meta.name = names_[i];
      reduce_.Apply(req.get());
      req->meta.group = n;  // the call's size: plans match whole calls
      std::unique_ptr<Tensor> forwarded =
          ctx->forward_input(i, OpKernelContext::Params::kNoReservation, ctx->input_dtype(i),
                             ctx->input(i).shape(), DEVICE_MEMORY, AllocatorAttributes());
      if (forwarded != nullptr) {
        req->output = DataOf(*forwarded);
        ctx->set_output(i, *forwarded);
      } else {
        unforwarded.push_back(i);
      }
      reqs.push_back(std::move(req));
    }
    if (!unforwarded.empty()) {
      OP_REQUIRES_OK_ASYNC(ctx, AllocateShared(ctx, unforwarded, &reqs), done);
    }
    if (gpu_ && n > 0) {  // one event, after every output is allocated
      TfGpu gpu;
      OP_REQUIRES_OK_ASYNC(ctx, gpu.Find(ctx), done);
      OP_REQUIRES_OK_ASYNC(ctx, gpu.Place(&reqs[0]->where), done);
      for (auto& req : reqs) req->where = reqs[0]->where;
    }
    auto group = std::make_shared<Group>(ctx, std::move(done), n);
    for (auto& req : reqs) {
      req->done = [group](const perseus::Status& s) { group->Finish(s); };
    }
    // One call: queued all together (or not at all), so an offline plan
    // never sees half of it.
    Runtime* rt = Runtime::Find(static_cast<int>(process_set_id_));
    perseus::Status s = rt == nullptr ? NotAMember(*reqs[0]) : rt->EnqueueGroup(reqs);
    if (!s.ok()) {
      ctx->SetStatus(ToTf(s));
      group->done();
    }
  }

 private:
  // Outputs `which` (inputs that could not be reused) as views of one
  // buffer, each at a 64-byte aligned offset (what Eigen kernels expect).
  static Status AllocateShared(OpKernelContext* ctx, const std::vector<int>& which,
                               std::vector<std::shared_ptr<Request>>* reqs) {
    constexpr int64_t kAlign = 64;
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (int i : which) {
      offsets.push_back(total);
      total += (ctx->input(i).TotalBytes() + kAlign - 1) / kAlign * kAlign;
    }
    Tensor buffer;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(DT_INT8, TensorShape({std::max<int64_t>(total, 1)}),
                                          &buffer));
    for (size_t k = 0; k < which.size(); ++k) {
      const Tensor& in = ctx->input(which[k]);
      Tensor out;
      TF_RETURN_IF_ERROR(out.BitcastFrom(
          buffer.Slice(offsets[k], offsets[k] + static_cast<int64_t>(in.TotalBytes())),
          in.dtype(), in.shape()));
      (*reqs)[which[k]]->output = DataOf(out);
      ctx->set_output(which[k], out);
    }
    return OkStatus();
  }

  ReduceAttrs reduce_;
  std::vector<std::string> names_;
};

// Allgather, alltoall, reducescatter: the output shape is known only after
// negotiation, so the runtime asks for the buffer through `allocate`.
class ShapeFromPeersKernel : public CollectiveKernel {
 public:
  ShapeFromPeersKernel(OpKernelConstruction* c, OpType op) : CollectiveKernel(c), op_(op) {
    if (op == OpType::kReducescatter) {
      OP_REQUIRES_OK(c, reduce_.Read(c));
    }
    if (op == OpType::kAlltoall) OP_REQUIRES_OK(c, c->GetAttr("has_splits", &has_splits_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    auto req = std::make_shared<Request>();
    if (!Prepare(ctx, 0, op_, req.get())) return done();
    reduce_.Apply(req.get());
    if (op_ == OpType::kAlltoall && has_splits_) {
      const Tensor& splits = ctx->input(1);
      OP_REQUIRES_ASYNC(ctx, splits.dims() == 1,
                        errors::InvalidArgument("alltoall splits must be a vector, got shape ",
                                                splits.shape().DebugString()),
                        done);
      auto flat = splits.flat<int32>();
      for (int i = 0; i < flat.size(); ++i) req->meta.splits.push_back(flat(i));
    }
    std::shared_ptr<TfGpu> gpu;
    if (gpu_) {
      gpu = std::make_shared<TfGpu>();
      OP_REQUIRES_OK_ASYNC(ctx, gpu->Find(ctx), done);
      OP_REQUIRES_OK_ASYNC(ctx, gpu->Place(&req->where), done);
    }
    Request* placed = req.get();  // outlives its own allocate
    req->allocate = [ctx, gpu, placed](const std::vector<int64_t>& shape) -> void* {
      TensorShape ts;
      for (int64_t d : shape) ts.AddDim(d);
      Tensor* out = nullptr;
      Status s = ctx->allocate_output(0, ts, &out);
      // Memory TF just handed out in its stream's order may still be read
      // by a kernel queued before (from a tensor freed since): the event
      // recorded now on TF's stream becomes the request's `ready`, which the
      // runtime's stream waits for before it writes the output. No host wait.
      if (s.ok() && gpu != nullptr) s = gpu->Place(&placed->where);
      if (!s.ok()) return nullptr;
      return DataOf(*out);
    };
    Request* raw = req.get();
    OpType op = op_;
    req->done = [ctx, done, raw, op](const perseus::Status& s) {
      if (s.ok() && op == OpType::kAlltoall) {
        Tensor* splits = nullptr;
        Status as = ctx->allocate_output(
            1, TensorShape({static_cast<int64_t>(raw->received_splits.size())}), &splits);
        if (as.ok()) {
          auto flat = splits->flat<int32>();
          for (size_t i = 0; i < raw->received_splits.size(); ++i) {
            flat(i) = static_cast<int32>(raw->received_splits[i]);
          }
        }
        ctx->SetStatus(as);
      } else {
        ctx->SetStatus(ToTf(s));
      }
      done();
    };
    Submit(ctx, std::move(req), std::move(done));
  }

 private:
  OpType op_;
  ReduceAttrs reduce_;
  bool has_splits_ = false;
};

class AllgatherKernel : public ShapeFromPeersKernel {
 public:
  explicit AllgatherKernel(OpKernelConstruction* c) : ShapeFromPeersKernel(c, OpType::kAllgather) {}
};
class AlltoallKernel : public ShapeFromPeersKernel {
 public:
  explicit AlltoallKernel(OpKernelConstruction* c) : ShapeFromPeersKernel(c, OpType::kAlltoall) {}
};
class ReducescatterKernel : public ShapeFromPeersKernel {
 public:
  explicit ReducescatterKernel(OpKernelConstruction* c)
      : ShapeFromPeersKernel(c, OpType::kReducescatter) {}
};

// Barrier and join: no input, a scalar int32 out (0 for a barrier, the rank
// that joined last for a join).
class ScalarResultKernel : public CollectiveKernel {
 public:
  ScalarResultKernel(OpKernelConstruction* c, OpType op) : CollectiveKernel(c), op_(op) {}
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Tensor* out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, TensorShape({}), &out), done);
    auto req = std::make_shared<Request>();
    req->meta.op = op_;
    req->meta.name = tensor_name_;
    req->meta.dtype = DataType::kInt32;
    Request* raw = req.get();
    req->done = [ctx, done, out, raw](const perseus::Status& s) {
      if (s.ok()) out->scalar<int32>()() = static_cast<int32>(raw->result);
      ctx->SetStatus(ToTf(s));
      done();
    };
    Submit(ctx, std::move(req), std::move(done));
  }

 private:
  OpType op_;
};

class BarrierKernel : public ScalarResultKernel {
 public:
  explicit BarrierKernel(OpKernelConstruction* c) : ScalarResultKernel(c, OpType::kBarrier) {}
};
class JoinKernel : public ScalarResultKernel {
 public:
  explicit JoinKernel(OpKernelConstruction* c) : ScalarResultKernel(c, OpType::kJoin) {}
};

REGISTER_KERNEL_BUILDER(Name("PerseusAllreduce").Device(DEVICE_CPU), AllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusGroupedAllreduce").Device(DEVICE_CPU), GroupedAllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusBroadcast").Device(DEVICE_CPU), BroadcastKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusAllgather").Device(DEVICE_CPU), AllgatherKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusAlltoall").Device(DEVICE_CPU), AlltoallKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusReducescatter").Device(DEVICE_CPU), ReducescatterKernel);

// A sharded optimizer's gradients (perseus_tf/strategy/keras_shard.py): one
// reducescatter of the vector the tensors make at their offsets, read by the
// runtime from the tensors themselves (no concatenated copy). Host memory.
class ShardReducescatterKernel : public CollectiveKernel {
 public:
  explicit ShardReducescatterKernel(OpKernelConstruction* c) : CollectiveKernel(c) {
    OP_REQUIRES_OK(c, reduce_.Read(c));
    OP_REQUIRES_OK(c, c->GetAttr("offsets", &offsets_));
    OP_REQUIRES_OK(c, c->GetAttr("total", &total_));
    OP_REQUIRES_OK(c, c->GetAttr("owned", &owned_));
    OP_REQUIRES_OK(c, c->GetAttr("block_start", &block_start_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    auto req = std::make_shared<Request>();
    OP_REQUIRES_ASYNC(ctx, static_cast<int>(offsets_.size()) == ctx->num_inputs(),
                      errors::InvalidArgument("shard reducescatter '", tensor_name_, "': ",
                                              offsets_.size(), " offsets for ",
                                              ctx->num_inputs(), " tensors"),
                      done);
    OP_REQUIRES_OK_ASYNC(ctx, ToPerseus(ctx->input(0).dtype(), &req->meta.dtype), done);
    req->meta.op = OpType::kReducescatter;
    req->meta.name = tensor_name_;
    req->meta.shape = {total_};
    int64_t end = 0;
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      const Tensor& in = ctx->input(i);
      const int64_t n = in.NumElements();
      OP_REQUIRES_ASYNC(ctx, offsets_[i] >= end && offsets_[i] + n <= total_,
                        errors::InvalidArgument(
                            "shard reducescatter '", tensor_name_, "': tensor ", i, " (",
                            n, " elements at offset ", offsets_[i],
                            ") overlaps the one before or ends past ", total_),
                        done);
      end = offsets_[i] + n;
      if (n) req->pieces.push_back({DataOf(in), offsets_[i], n});
    }
    reduce_.Apply(req.get());
    // This rank's own tensors' sums, each into its input's buffer when TF
    // lets it go (no other reader), else a new one.
    for (size_t k = 0; k < owned_.size(); ++k) {
      const int i = static_cast<int>(owned_[k]);
      OP_REQUIRES_ASYNC(ctx, i >= 0 && i < ctx->num_inputs(),
                        errors::InvalidArgument("owned index ", i, " is not an input"), done);
      Tensor* out = nullptr;
      OP_REQUIRES_OK_ASYNC(ctx, ctx->forward_input_or_allocate_output(
                                    {i}, static_cast<int>(1 + k), ctx->input(i).shape(), &out),
                           done);
      const int64_t n = out->NumElements();
      if (n) req->out_pieces.push_back({DataOf(*out), offsets_[i] - block_start_, n});
    }
    if (!owned_.empty()) {
      Tensor* empty = nullptr;
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, TensorShape({0}), &empty), done);
      if (req->out_pieces.empty()) req->out_pieces.push_back({nullptr, 0, 0});
    }
    req->allocate = [ctx](const std::vector<int64_t>& shape) -> void* {
      TensorShape ts;
      for (int64_t d : shape) ts.AddDim(d);
      Tensor* out = nullptr;
      if (!ctx->allocate_output(0, ts, &out).ok()) return nullptr;
      return DataOf(*out);
    };
    req->done = [ctx, done](const perseus::Status& s) {
      ctx->SetStatus(ToTf(s));
      done();
    };
    Submit(ctx, std::move(req), std::move(done));
  }

 private:
  ReduceAttrs reduce_;
  std::vector<int64> offsets_;
  int64 total_ = 0;
  std::vector<int64> owned_;
  int64 block_start_ = 0;
};
REGISTER_KERNEL_BUILDER(Name("PerseusShardReducescatter").Device(DEVICE_CPU),
                        ShardReducescatterKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusBarrier").Device(DEVICE_CPU), BarrierKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusJoin").Device(DEVICE_CPU), JoinKernel);

// On TF's GPUs (barrier and join have no tensors: TF runs them on the CPU).
REGISTER_KERNEL_BUILDER(Name("PerseusAllreduce").Device(DEVICE_GPU), AllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusGroupedAllreduce").Device(DEVICE_GPU), GroupedAllreduceKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusBroadcast").Device(DEVICE_GPU), BroadcastKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusAllgather").Device(DEVICE_GPU), AllgatherKernel);
REGISTER_KERNEL_BUILDER(
    Name("PerseusAlltoall").Device(DEVICE_GPU).HostMemory("splits").HostMemory("received_splits"),
    AlltoallKernel);
REGISTER_KERNEL_BUILDER(Name("PerseusReducescatter").Device(DEVICE_GPU), ReducescatterKernel);

}  // namespace
}  // namespace tensorflow
