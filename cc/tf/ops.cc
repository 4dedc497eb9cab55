// Registration of the Perseus collective ops and their shape functions.
// The kernels are in op_kernels.cc; Python wrappers and gradients in
// perseus_tf/ops.py.
//
// Every op is stateful: Grappler must neither fold a collective on constant
// inputs at optimisation time nor merge two identical ones, since each call
// is a rendezvous with the other ranks.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

constexpr char kTypes[] =
    "T: {half, bfloat16, float, double, int32, int64, uint8, int8, uint16, int16, bool}";

// Output: the input's shape with an unknown first dimension.
Status UnknownFirstDim(InferenceContext* c) {
  ShapeHandle in = c->input(0);
  if (!c->RankKnown(in)) {
    c->set_output(0, c->UnknownShape());
    return OkStatus();
  }
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
  c->set_output(0, out);
  return OkStatus();
}

}  // namespace

REGISTER_OP("PerseusAllreduce")
    .Attr(kTypes)
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Attr("reduce_op: int = 0")
    .Attr("compression: int = 0")
    .Attr("plannable: bool = false")
    .Attr("prescale: float = 1.0")
    .Attr("postscale: float = 1.0")
    .Input("tensor: T")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc("Reduces a tensor across all ranks (0 sum, 1 average, 2 min, 3 max, 4 product).");

REGISTER_OP("PerseusGroupedAllreduce")
    .Attr("T: list({half, bfloat16, float, double, int32, int64, uint8, int8, uint16, int16, bool})")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Attr("reduce_op: int = 0")
    .Attr("compression: int = 0")
    .Attr("plannable: bool = false")
    .Attr("prescale: float = 1.0")
    .Attr("postscale: float = 1.0")
    .Input("tensors: T")
    .Output("outputs: T")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return OkStatus();
    })
    .Doc("Reduces a list of tensors across ranks as one request, fused into buckets.");

REGISTER_OP("PerseusBroadcast")
    .Attr(kTypes)
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Attr("root_rank: int = 0")
    .Input("tensor: T")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc("Every rank receives root_rank's tensor.");

REGISTER_OP("PerseusAllgather")
    .Attr(kTypes)
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Input("tensor: T")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(UnknownFirstDim)
    .Doc("Concatenates every rank's tensor along the first dimension, in rank order.");

REGISTER_OP("PerseusAlltoall")
    .Attr(kTypes)
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Attr("has_splits: bool = false")
    .Input("tensor: T")
    .Input("splits: int32")
    .Output("output: T")
    .Output("received_splits: int32")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(UnknownFirstDim(c));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return OkStatus();
    })
    .Doc("Sends splits[r] rows to rank r and concatenates what arrives, in rank order.");

REGISTER_OP("PerseusReducescatter")
    .Attr(kTypes)
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Attr("reduce_op: int = 0")
    .Attr("compression: int = 0")
    .Attr("prescale: float = 1.0")
    .Attr("postscale: float = 1.0")
    .Input("tensor: T")
    .Output("output: T")
    .SetIsStateful()
    .SetShapeFn(UnknownFirstDim)
    .Doc("Reduces across ranks and keeps this rank's share of the first dimension.");

REGISTER_OP("PerseusShardReducescatter")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("N: int >= 1")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Attr("reduce_op: int = 0")
    .Attr("compression: int = 0")
    .Attr("prescale: float = 1.0")
    .Attr("postscale: float = 1.0")
    .Attr("offsets: list(int)")
    .Attr("total: int >= 1")
    .Attr("owned: list(int) = []")
    .Attr("block_start: int = 0")
    .Attr("M: int >= 0 = 0")
    .Input("tensors: N * T")
    .Output("output: T")
    .Output("owned_sums: M * T")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->UnknownDim()));
      std::vector<int64_t> owned;
      TF_RETURN_IF_ERROR(c->GetAttr("owned", &owned));
      for (size_t k = 0; k < owned.size(); ++k) {
        if (owned[k] < 0 || owned[k] >= c->num_inputs()) {
          return errors::InvalidArgument("owned index ", owned[k], " is not an input");
        }
        c->set_output(static_cast<int>(1 + k), c->input(static_cast<int>(owned[k])));
      }
      return OkStatus();
    })
    .Doc("A reducescatter of one vector of `total` elements made of the tensors, each "
         "flattened at its element offset (zeros elsewhere), without a copy of them. With "
         "`owned` (inputs inside this rank's block, which starts at element `block_start`), "
         "their sums come out as `owned_sums`, in their inputs' buffers where TF allows, and "
         "`output` is empty.");

REGISTER_OP("PerseusBarrier")
    .Attr("tensor_name: string = ''")
    .Attr("process_set_id: int = 0")
    .Output("done: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("Returns once every rank has reached the barrier.");

REGISTER_OP("PerseusJoin")
    .Attr("tensor_name: string = 'perseus.join'")
    .Attr("process_set_id: int = 0")
    .Output("last_joined_rank: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("This rank has no more work: until every rank has joined it takes part in the "
         "others' collectives with empty input. Returns the rank that joined last.");

}  // namespace tensorflow
