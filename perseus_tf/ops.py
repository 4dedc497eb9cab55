"""TensorFlow collectives across Perseus ranks: wrappers and gradients.

Each function adds (or, eagerly, runs) one op from the native library; the op
enqueues a named request in the process's runtime, which negotiates it with
the other ranks. Names pair requests across ranks: inside a graph or a
`tf.function` the node name serves, so it is enough that every rank builds
the same graph; pass `name` when ranks build graphs differently.

Example:
    import perseus_tf as ptf
    ptf.init()
    total = ptf.allreduce(tf.constant([1.0, 2.0]), op=ptf.Sum)
"""

import os

import tensorflow as tf

from perseus_tf import _adasum as _adasum_impl
from perseus_tf import _native



def _load_library():
    """Loads the op library built for this TensorFlow (`make native` or
    `pip install` builds `_perseus_ops_tf<major>_<minor>.so`; a Bazel build
    gives `_perseus_ops.so`)."""
    here = os.path.dirname(os.path.abspath(__file__))
    major, minor = tf.__version__.split(".")[:2]
    candidates = [f"_perseus_ops_tf{major}_{minor}.so", "_perseus_ops.so"]
    for name in candidates:
        path = os.path.join(here, name)
        if os.path.exists(path):
            return tf.load_op_library(path)
    raise ImportError(
        f"perseus_tf has no op library for TensorFlow {tf.__version__} in {here} "
        f"(looked for {', '.join(candidates)}): rebuild with "
        "`pip install --no-build-isolation -e .` in this environment")


_LIB = _load_library()

# Op types TF may run in any order relative to each other inside a
# tf.function. Perseus ops are stateful (they must run, and must not be
# merged or folded), and TF's automatic control dependencies chain every
# stateful op in program order: each gradient group's allreduce would wait
# for the previous group's to finish, and for any stateful op traced before
# it, so no reduction could overlap back-propagation. Grouped allreduces
# need no order: each is matched across ranks by name in the runtime, as
# Horovod's (not stateful) ops are, and TF still runs every one of them.
UNORDERED_OP_TYPES = ("PerseusGroupedAllreduce",)


def _let_tf_run_unordered(op_types):
    """Adds op_types to the stateful ops TF's automatic control dependencies
    leave unordered but still run (a module-level set of
    tensorflow/python/framework/auto_control_deps.py, read at every trace,
    the same in TF 2.15 to 2.21). Returns False when this TF has no such set
    (then the ops stay in program order: correct, without the overlap)."""
    try:
        from tensorflow.python.framework import auto_control_deps as acd
    except ImportError:
        return False
    current = getattr(acd, "MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS", None)
    if not isinstance(current, frozenset):
        return False
    acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = current | frozenset(op_types)
    return True


UNORDERED = _let_tf_run_unordered(UNORDERED_OP_TYPES)

# Reduction ops, numbered as in Horovod so that code passing them through works.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5

_NATIVE_REDUCE = {op: _native.REDUCE_CODES[name] for op, name in (
    (Sum, "sum"), (Average, "average"), (Min, "min"), (Max, "max"), (Product, "product"))}
_COMPRESSION = {None: _native.COMPRESS_NONE, "none": _native.COMPRESS_NONE,
                "fp16": _native.COMPRESS_FP16, "float16": _native.COMPRESS_FP16,
                "mixed": _native.COMPRESS_MIXED}


def _compression(compression):
    """A compression name ("none", "fp16", "mixed") or a runtime code (int,
    as _native.gradient_compression() returns) -> the code."""
    if isinstance(compression, int) and not isinstance(compression, bool) and \
            0 <= compression <= _native.COMPRESS_DOWNSAMPLE:
        return compression
    key = compression.lower() if isinstance(compression, str) else compression
    if key not in _COMPRESSION:
        raise ValueError(f"compression={compression!r} is not supported; use 'none', 'fp16' "
                         "(float32 sums and averages travel as float16 times "
                         "PERSEUS_ALLREDUCE_GRADIENT_SCALE; other tensors as they are) or "
                         "'mixed' (float32 inside a host, float16 between hosts)")
    return _COMPRESSION[key]


_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
          Product: "Product"}


def init(**overrides):
    """Starts this process's runtime (idempotent). Keyword arguments override
    PERSEUS_* variables by field name, e.g. ``init(streams=2)``."""
    _native.init(**overrides)


def shutdown():
    """Stops the runtime; a collective call on every rank."""
    _native.shutdown()


def abort(reason=""):
    """Stops this rank's runtime at once, without the other ranks (not a
    collective; any thread): its pending collectives fail, the others' fail
    naming this rank, and init() may then start the job's next round."""
    _native.abort(reason)


def is_initialized():
    return _native.is_initialized()


def _topo(key):
    _native.ensure_initialized()
    return _native.topology()[key]


def rank():
    return _topo("rank")


def size():
    return _topo("size")


def local_rank():
    return _topo("local_rank")


def local_size():
    return _topo("local_size")


def cross_rank():
    return _topo("cross_rank")


def cross_size():
    return _topo("cross_size")


def stats():
    """Runtime counters (see perseus_tf._native.stats)."""
    return _native.stats()


def _native_op(op):
    if op == Adasum:
        raise NotImplementedError(
            "op=Adasum is for allreduce and grouped_allreduce only; use op=Average or op=Sum")
    if op not in _NATIVE_REDUCE:
        raise ValueError(f"op={op!r} is not a reduction; use one of Average, Sum, Min, "
                         "Max, Product")
    return _NATIVE_REDUCE[op]


def _name(name):
    return "" if name is None else str(name)


# The dtypes the op library's kernels take (cc/tf/ops.cc kTypes).
_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8,
           tf.int8, tf.uint16, tf.int16, tf.bool)


def _check_dtypes(what, tensors, name):
    """A tensor of a dtype the kernels do not take (complex64, string) is
    named here, not by TF's dump of the op's NodeDef."""
    for tensor in tensors:
        dtype = getattr(tensor, "dtype", None)
        try:
            dtype = None if dtype is None else tf.as_dtype(dtype)
        except TypeError:
            dtype = None  # numpy object arrays and the like: TF's conversion says why
        if dtype is not None and dtype not in _DTYPES:
            label = f"tensor {name!r}" if name else "a tensor"
            raise TypeError(
                f"Perseus {what} of {label}: dtype {dtype.name} is not supported; it takes "
                + ", ".join(d.name for d in _DTYPES)
                + (" (send a complex tensor as its real and imaginary parts)"
                   if dtype.is_complex else ""))


def _plannable(gradients):
    """PERSEUS_OFFLINE_NEG: 1 every allreduce may run from an offline plan, 0
    none, unset (auto) only gradient reductions (`gradients=True`)."""
    cfg = _native.config()
    mode = None if cfg is None else cfg.offline_neg
    return bool(gradients) if mode is None else mode == 1


def allreduce(tensor, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
              process_set_id=0, compression="none", gradients=False):
    """Reduces `tensor` across ranks; every rank gets the result.

    Args:
      tensor: a dense tensor (float16/bfloat16/float32/float64/int32/int64/
        uint8/int8/uint16/int16; bool with Min or Max).
      op: Sum (default), Average, Min, Max or Product.
      prescale_factor: multiply by this before the reduction.
      postscale_factor: multiply by this after the reduction.
      name: pairs this call across ranks (defaults to the op's node name).
      process_set_id: reduce among a process set's members only (see
        add_process_set); 0, the default, is every rank.
      compression: "none", "fp16" or "mixed": with "fp16" a float32
        Sum/Average travels as float16 of (x * PERSEUS_ALLREDUCE_GRADIENT_SCALE),
        summed in float16 and divided by the scale after; "mixed" does that
        only between hosts (float32 inside one). Other dtypes and ops ignore it.
      gradients: marks a training step's gradient reduction: with
        PERSEUS_OFFLINE_NEG unset it may then run from an offline plan.
    """
    _check_dtypes("allreduce", [tensor], name)
    _native.ensure_initialized()
    if op == Adasum:
        return _adasum([tensor], prescale_factor, postscale_factor, name, process_set_id)[0]
    return _LIB.perseus_allreduce(tensor, tensor_name=_name(name), reduce_op=_native_op(op),
                                  prescale=float(prescale_factor),
                                  postscale=float(postscale_factor),
                                  process_set_id=int(process_set_id),
                                  compression=_compression(compression),
                                  plannable=_plannable(gradients))


def grouped_allreduce(tensors, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
                      process_set_id=0, compression="none", gradients=False):
    """Reduces a list of tensors as one request, fused into as few buckets as fit."""
    _native.ensure_initialized()
    tensors = list(tensors)
    _check_dtypes("grouped_allreduce", tensors, name)
    if not tensors:
        return []
    if op == Adasum:
        return _adasum(tensors, prescale_factor, postscale_factor, name, process_set_id)
    return _LIB.perseus_grouped_allreduce(tensors, tensor_name=_name(name),
                                          reduce_op=_native_op(op),
                                          prescale=float(prescale_factor),
                                          postscale=float(postscale_factor),
                                          process_set_id=int(process_set_id),
                                          compression=_compression(compression),
                                          plannable=_plannable(gradients))


def _adasum(tensors, prescale_factor, postscale_factor, name, process_set_id):
    """op=Adasum (perseus_tf/_adasum.py): over one allgather per dtype."""
    if process_set_id:
        topology = _native.process_set_topology(int(process_set_id))
        if topology is None:
            raise ValueError(f"rank {rank()} is not a member of process set {process_set_id}; "
                             "only its members may reduce in it")
        set_size = topology["size"]
    else:
        set_size = size()

    def gather(tensor, label):
        return allgather(tensor, name=label, process_set_id=process_set_id)

    return _adasum_impl.grouped_adasum(tensors, gather, set_size, float(prescale_factor),
                                       float(postscale_factor), _name(name) or None,
                                       int(process_set_id))


def broadcast(tensor, root_rank=0, name=None, process_set_id=0):
    """Returns root_rank's `tensor` on every rank (in a process set, root_rank
    is a position in the set, not a world rank)."""
    _check_dtypes("broadcast", [tensor], name)
    _native.ensure_initialized()
    return _LIB.perseus_broadcast(tensor, tensor_name=_name(name), root_rank=int(root_rank),
                                  process_set_id=int(process_set_id))


def allgather(tensor, name=None, process_set_id=0):
    """Concatenates every rank's tensor along dimension 0 (sizes may differ)."""
    _check_dtypes("allgather", [tensor], name)
    _native.ensure_initialized()
    return _LIB.perseus_allgather(tensor, tensor_name=_name(name),
                                  process_set_id=int(process_set_id))


def alltoall(tensor, splits=None, name=None, process_set_id=0):
    """Sends `splits[r]` rows of `tensor` to rank r; returns (received, received_splits).

    Without splits, dimension 0 is divided evenly among the ranks.
    """
    _check_dtypes("alltoall", [tensor], name)
    _native.ensure_initialized()
    has_splits = splits is not None
    splits = tf.cast(splits, tf.int32) if has_splits else tf.zeros([0], tf.int32)
    return _LIB.perseus_alltoall(tensor, splits, tensor_name=_name(name), has_splits=has_splits,
                                 process_set_id=int(process_set_id))


def reducescatter(tensor, op=Sum, prescale_factor=1.0, postscale_factor=1.0, name=None,
                  process_set_id=0, compression="none"):
    """Reduces across ranks and returns this rank's share of dimension 0.

    Rows are dealt out evenly; the first (dim0 % size) ranks get one more.
    compression: "none", "fp16" or "mixed", as allreduce takes it (a float32
    Sum or Average travels as float16 of x * PERSEUS_ALLREDUCE_GRADIENT_SCALE;
    "mixed" so only when the job spans hosts).
    """
    _check_dtypes("reducescatter", [tensor], name)
    _native.ensure_initialized()
    return _LIB.perseus_reducescatter(tensor, tensor_name=_name(name),
                                      reduce_op=_native_op(op),
                                      compression=_compression(compression),
                                      prescale=float(prescale_factor),
                                      postscale=float(postscale_factor),
                                      process_set_id=int(process_set_id))


def shard_reducescatter(tensors, offsets, total, op=Sum, prescale_factor=1.0,
                        postscale_factor=1.0, name=None, compression="none", owned=None):
    """reducescatter of the vector of `total` elements that the tensors make,
    each flattened at its element offset (increasing, not overlapping; zeros
    between them), without concatenating them first: this rank's 1/size of
    it (`total` must divide by the world size). Host tensors of one dtype;
    a sharded optimizer's gradients (perseus_tf/strategy/keras_shard.py).

    owned: indices of the tensors inside this rank's part; then the result
    is the list of their sums, each shaped as its tensor (written into the
    tensor's own buffer when nothing else reads it), instead of the part."""
    tensors = list(tensors)
    _check_dtypes("shard_reducescatter", tensors, name)
    _native.ensure_initialized()
    block_start = rank() * (int(total) // max(1, size()))
    out = _LIB.perseus_shard_reducescatter(
        tensors, offsets=[int(o) for o in offsets], total=int(total),
        tensor_name=_name(name), reduce_op=_native_op(op), prescale=float(prescale_factor),
        postscale=float(postscale_factor), compression=_compression(compression),
        owned=[int(i) for i in owned or []], M=len(owned or []), block_start=block_start)
    return out.output if owned is None else list(out.owned_sums)


def barrier(name=None, process_set_id=0):
    """Blocks until every rank has called barrier with the same name."""
    _native.ensure_initialized()
    return _LIB.perseus_barrier(tensor_name=_name(name) or "perseus.barrier",
                                process_set_id=int(process_set_id))


def join(process_set_id=0):
    """Declares that this rank has no more data (Horovod's join).

    Until every rank has joined, this rank takes part in the collectives the
    others still run, contributing zeros to allreduces (so a Sum or Average
    counts it as zero) and no rows to allgathers; alltoall, and broadcast
    from a joined root, fail. Returns the rank that joined last, as an int32
    scalar tensor. Usable again once it returns (e.g. once per epoch).
    """
    _native.ensure_initialized()
    return _LIB.perseus_join(process_set_id=int(process_set_id))


def add_process_set(ranks):
    """Creates a process set of these world ranks; returns its id (collective)."""
    return _native.add_process_set(ranks)


def remove_process_set(process_set_id):
    """Removes a process set (collective over every rank)."""
    _native.remove_process_set(process_set_id)


def process_set_ranks(process_set_id):
    """World ranks of a process set, in order (0: every rank)."""
    return _native.process_set_ranks(process_set_id)


def _set_rank(op):
    """This process's position in the process set of `op`."""
    set_id = op.get_attr("process_set_id")
    return rank() if set_id == 0 else _native.process_set_topology(set_id)["rank"]


def _set_size(op):
    set_id = op.get_attr("process_set_id")
    return size() if set_id == 0 else _native.process_set_topology(set_id)["size"]


# ---- gradients -------------------------------------------------------------

@tf.RegisterGradient("PerseusAllreduce")
def _allreduce_grad(op, grad):
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in (0, 1):  # sum, average
        raise NotImplementedError("only Sum and Average allreduce have gradients")
    return _LIB.perseus_allreduce(grad, reduce_op=reduce_op, prescale=op.get_attr("prescale"),
                                  postscale=op.get_attr("postscale"),
                                  process_set_id=op.get_attr("process_set_id"),
                                  compression=op.get_attr("compression"))


@tf.RegisterGradient("PerseusGroupedAllreduce")
def _grouped_allreduce_grad(op, *grads):
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in (0, 1):
        raise NotImplementedError("only Sum and Average allreduce have gradients")
    grads = [tf.zeros_like(x) if g is None else g for g, x in zip(grads, op.inputs)]
    return _LIB.perseus_grouped_allreduce(grads, reduce_op=reduce_op,
                                          prescale=op.get_attr("prescale"),
                                          postscale=op.get_attr("postscale"),
                                          process_set_id=op.get_attr("process_set_id"),
                                          compression=op.get_attr("compression"))


# Gradients follow Horovod's conventions, so that code ported from Horovod
# gets Horovod's numbers: allgather and broadcast average the incoming
# gradients over the ranks; reducescatter's is allgather(grad), times the
# set size for Sum. In TF1 graphs only what a fetch needs runs, and Grappler
# may fold a result that does not read a collective's value (a zero-sized
# slice, zeros_like of a known shape): every collective a gradient starts is
# tied to its result by a control dependency, so that no rank skips one the
# others wait for.

@tf.RegisterGradient("PerseusBroadcast")
def _broadcast_grad(op, grad):
    # Only the root's value reaches any output: it gets the average of all
    # ranks' gradients, the others zeros.
    averaged = _LIB.perseus_allreduce(grad, reduce_op=1,
                                      process_set_id=op.get_attr("process_set_id"))
    if _set_rank(op) == op.get_attr("root_rank"):
        return averaged
    with tf.control_dependencies([averaged]):
        return tf.zeros_like(grad)


@tf.RegisterGradient("PerseusAllgather")
def _allgather_grad(op, grad):
    set_id = op.get_attr("process_set_id")
    averaged = _LIB.perseus_allreduce(grad, reduce_op=1, process_set_id=set_id)
    dim0 = tf.shape(op.inputs[0], out_type=tf.int64)[:1]
    dims = _LIB.perseus_allgather(dim0, process_set_id=set_id)
    offset = tf.reduce_sum(dims[:_set_rank(op)])
    begin = tf.concat([[offset], tf.zeros_like(tf.shape(averaged, out_type=tf.int64)[1:])], 0)
    size_ = tf.concat([dim0, tf.shape(averaged, out_type=tf.int64)[1:]], 0)
    with tf.control_dependencies([dims, averaged]):
        return tf.identity(tf.slice(averaged, begin, size_))


@tf.RegisterGradient("PerseusReducescatter")
def _reducescatter_grad(op, grad):
    reduce_op = op.get_attr("reduce_op")
    if reduce_op not in (0, 1):
        raise NotImplementedError("only Sum and Average reducescatter have gradients")
    gathered = _LIB.perseus_allgather(grad, process_set_id=op.get_attr("process_set_id"))
    scale = op.get_attr("prescale") * op.get_attr("postscale")
    if reduce_op == 0:
        scale *= _set_size(op)
    return gathered * tf.cast(scale, gathered.dtype) if scale != 1.0 else gathered


@tf.RegisterGradient("PerseusAlltoall")
def _alltoall_grad(op, grad, _splits_grad):
    received = op.outputs[1]
    back, _ = _LIB.perseus_alltoall(grad, received, has_splits=True,
                                    process_set_id=op.get_attr("process_set_id"))
    return back, None


def is_collective_failure(error) -> bool:
    """Whether an exception is a failed collective of this runtime:
    Perseus's own errors (perseus_tf._core), or TF's for the Perseus ops.
    hvd.elastic resets on one; a PerseusStrategy fit restarts on one
    (strategy/keras_preempt.py)."""
    from perseus_tf import _core
    if isinstance(error, (_core.CommunicationError, _core.MismatchError)):
        return True
    return (isinstance(error, (tf.errors.UnavailableError, tf.errors.FailedPreconditionError,
                               tf.errors.InternalError))
            and "Perseus" in str(error))
