"""Collectives with Horovod's signatures and defaults, over perseus_tf.ops.

Differences from perseus_tf.ops that Horovod code relies on: `allreduce`
averages by default (ops: sums), takes the deprecated `average=` flag and a
`compression`, and reduces `tf.IndexedSlices` by gathering values and indices.
"""

import contextlib
import warnings

import tensorflow as tf

from perseus_tf import ops
from perseus_tf.horovod import _basics
from perseus_tf.horovod._process_sets import global_process_set, op_kwargs
from perseus_tf.horovod.compression import Compression

Average, Sum, Adasum, Min, Max, Product = (ops.Average, ops.Sum, ops.Adasum, ops.Min, ops.Max,
                                           ops.Product)


def handle_average_backwards_compatibility(op, average):
    """Resolves the deprecated `average` flag against `op` (default: Average)."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one "
                             "of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning)
        return Average if average else Sum
    return Average


def check_op(op):
    if op not in (Average, Sum, Adasum, Min, Max, Product):
        raise ValueError(f"op={op!r} is not one of hvd.Average, Sum, Adasum, Min, Max, Product")
    return op


def _device(device):
    return tf.device(device) if device else contextlib.nullcontext()


def _set_size(process_set):
    return _basics.size() if process_set.process_set_id == 0 else process_set.size()


def _sparse_allreduce(slices, op, prescale_factor, postscale_factor, process_set):
    """A reduction of IndexedSlices: every rank's rows, concatenated (Horovod's way)."""
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with "
                                  "tf.IndexedSlices (or convert them with tf.convert_to_tensor)")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices; "
                                  "pass sparse_as_dense=True or convert the gradient to a dense "
                                  "tensor")
    kwargs = op_kwargs(process_set)
    values = ops.allgather(slices.values, **kwargs)
    indices = ops.allgather(slices.indices, **kwargs)
    if op == Average:
        values = values / tf.cast(_set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def runtime_fp16(prescale, postscale):
    """Compression.fp16 of float32 gradients, done by the runtime: each value
    is converted to float16 as it is packed and back as it is unpacked (F16C),
    instead of by two TF Cast ops per gradient, which on a CPU cost about four
    times a memory pass. The runtime multiplies by PERSEUS_ALLREDUCE_GRADIENT_SCALE
    before converting and divides after; Horovod's fp16 does not scale, so the
    scale is cancelled through prescale and postscale, and the values that
    travel are Horovod's: float16(x), summed in float16.
    Returns (compression, prescale, postscale) for ops.allreduce and
    ops.grouped_allreduce."""
    from perseus_tf import _native

    _native.ensure_initialized()
    scale = float(_native._config_in_use.gradient_scale)
    return "fp16", prescale / scale, postscale * scale


def _runtime_converts(compression, op, dtype):
    """Whether Compression.fp16 of a tensor of `dtype` under `op` is done by
    the runtime (runtime_fp16): float32 with Average or Sum."""
    return compression is Compression.fp16 and op in (Average, Sum) and dtype == tf.float32


def allreduce(tensor, average=None, device_dense='', device_sparse='',
              compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduces a tensor (or tf.IndexedSlices) across ranks; averages by default.

    Args:
      tensor: tf.Tensor, tf.Variable or tf.IndexedSlices, same shape on every rank.
      average: deprecated; use `op`.
      device_dense: device for the dense path ('' = default).
      device_sparse: device for the sparse path ('' = default).
      compression: `Compression.none` or `Compression.fp16`.
      op: Average (default), Sum, Adasum (float tensors, a power-of-two
        number of ranks; see perseus_tf/_adasum.py), Min, Max or Product.
      prescale_factor: multiply by this before the reduction.
      postscale_factor: multiply by this after the reduction.
      name: pairs the call across ranks (defaults to the op's node name).
      process_set: reduce among this process set's ranks only.
      ignore_name_scope: accepted for compatibility (names are not scoped here).

    Example:
      mean = hvd.allreduce(tf.constant([1.0, 2.0]))
    """
    op = check_op(handle_average_backwards_compatibility(op, average))
    if isinstance(tensor, tf.IndexedSlices):
        with _device(device_sparse):
            return _sparse_allreduce(tensor, op, prescale_factor, postscale_factor, process_set)
    with _device(device_dense):
        tensor = tf.convert_to_tensor(tensor)
        if _runtime_converts(compression, op, tensor.dtype):
            native, prescale, postscale = runtime_fp16(prescale_factor, postscale_factor)
            return ops.allreduce(tensor, op=op, prescale_factor=prescale,
                                 postscale_factor=postscale, name=name, compression=native,
                                 **op_kwargs(process_set))
        compressed, ctx = compression.compress(tensor)
        reduced = ops.allreduce(compressed, op=op, prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, name=name,
                                **op_kwargs(process_set))
        return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='',
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduces a list of tensors as one fused request (IndexedSlices are gathered).

    Same arguments as `allreduce`; returns a list in the order of `tensors`.
    """
    if not tensors:
        return tensors
    op = check_op(handle_average_backwards_compatibility(op, average))
    tensors = list(tensors)
    results = [None] * len(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    with _device(device_sparse):
        for i in sparse:
            results[i] = _sparse_allreduce(tensors[i], op, prescale_factor, postscale_factor,
                                           process_set)
    if dense:
        with _device(device_dense):
            values = {i: tf.convert_to_tensor(tensors[i]) for i in dense}
            # float32 under Compression.fp16 goes to the runtime as itself,
            # in a call of its own (the runtime converts it); the rest is
            # compressed by TF, as Horovod does.
            native = [i for i in dense if _runtime_converts(compression, op, values[i].dtype)]
            if native:
                kind, prescale, postscale = runtime_fp16(prescale_factor, postscale_factor)
                reduced = ops.grouped_allreduce(
                    [values[i] for i in native], op=op, prescale_factor=prescale,
                    postscale_factor=postscale, compression=kind,
                    name=f"{name}.fp16" if name else None, **op_kwargs(process_set))
                for i, r in zip(native, reduced):
                    results[i] = r
            rest = [i for i in dense if i not in native]
            if rest:
                compressed = [compression.compress(values[i]) for i in rest]
                reduced = ops.grouped_allreduce([c for c, _ in compressed], op=op,
                                                prescale_factor=prescale_factor,
                                                postscale_factor=postscale_factor, name=name,
                                                **op_kwargs(process_set))
                for i, r, (_, ctx) in zip(rest, reduced, compressed):
                    results[i] = compression.decompress(r, ctx)
    return results


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenates every rank's tensor along dimension 0 (sizes may differ)."""
    return ops.allgather(tensor, name=name, **op_kwargs(process_set))


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    """`allgather` of each tensor of a list; returns a list."""
    return [ops.allgather(t, name=None if name is None else f"{name}.{i}",
                          **op_kwargs(process_set)) for i, t in enumerate(tensors)]


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """Returns `root_rank`'s tensor on every rank (of the process set).

    `root_rank` is a global rank, also with a process set (as in Horovod).
    """
    kwargs = op_kwargs(process_set)
    if kwargs:  # the runtime numbers a set's members by their position in it
        if root_rank not in process_set.ranks:
            raise ValueError(f"root_rank {root_rank} is not a member of {process_set}")
        root_rank = process_set.ranks.index(root_rank)
    return ops.broadcast(tensor, root_rank=root_rank, name=name, **kwargs)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Sends `splits[r]` rows to rank r. As in Horovod, returns the tensor
    received when splits is None (dimension 0 is then divided evenly among
    the ranks), and (received tensor, received splits) when splits is given.
    """
    received, received_splits = ops.alltoall(tensor, splits=splits, name=name,
                                             **op_kwargs(process_set))
    return received if splits is None else (received, received_splits)


def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduces across ranks (Average by default) and keeps this rank's rows.

    Rows are dealt out evenly; the first (dim0 % size) ranks get one more.
    """
    check_op(op)
    with _device(device_dense):
        compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
        reduced = ops.reducescatter(compressed, op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, name=name,
                                    **op_kwargs(process_set))
        return compression.decompress(reduced, ctx)


def grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """`reducescatter` of each tensor of a list; returns a list."""
    return [reducescatter(t, device_dense=device_dense, compression=compression, op=op,
                          process_set=process_set, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for t in tensors]


def barrier(process_set=global_process_set):
    """Returns once every rank (of the process set) has called barrier."""
    return ops.barrier(**op_kwargs(process_set))


def join(device=''):
    """Marks this rank as out of data; returns the rank that joined last
    (an int32 scalar tensor).

    Until every rank has joined, a joined rank takes part in the others'
    collectives, contributing zeros to allreduces and no rows to allgathers.
    """
    with _device(device):
        return ops.join()
