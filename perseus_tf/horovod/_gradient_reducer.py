"""The gradient path shared by DistributedOptimizer (TF1 and Keras) and
DistributedGradientTape: validation of the Horovod arguments, grouping, and
the reduction itself through perseus_tf.ops.grouped_allreduce, one fused
native request per (group, dtype); plus local gradient accumulation for
`backward_passes_per_step`.
"""

import warnings

import tensorflow as tf

from perseus_tf import _backprop_order, ops
from perseus_tf._accumulator import GradientAccumulator
from perseus_tf.horovod import _basics
from perseus_tf.horovod._collectives import (Adasum, Average, Sum, _device, runtime_fp16,
                                             _sparse_allreduce, check_op)
from perseus_tf.horovod._process_sets import global_process_set, op_kwargs
from perseus_tf.horovod.compression import Compression


def resolve_groups(num_groups, groups):
    """Horovod's `num_groups` (deprecated) / `groups` arguments, validated."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is not None:
        if isinstance(groups, bool) or not (isinstance(groups, list) or
                                            (isinstance(groups, int) and groups > 0)):
            raise ValueError("groups should be a non-negative integer or a list of list of "
                             "tf.Variable.")
    return groups


def check_predivide(op, gradient_predivide_factor):
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")


def check_adasum(op, average_aggregated_gradients):
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True; "
                         "leave it False with op=hvd.Adasum")


def _split_evenly(items, n):
    """n consecutive chunks whose sizes differ by at most one (empty chunks dropped)."""
    q, r = divmod(len(items), n)
    chunks, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        chunks.append(items[start:end])
        start = end
    return [c for c in chunks if c]


class GradientReducer:
    """Reduces gradient lists as Horovod's DistributedOptimizer does.

    Args:
      compression, sparse_as_dense, op, gradient_predivide_factor, groups,
      process_set: as in `hvd.DistributedOptimizer`.
      scale_local_gradients: divide gradients of registered local variables
        by the process set's size.
      name: a name scope for the ops.
    """

    def __init__(self, name='DistributedGradients', device_dense='', device_sparse='',
                 compression=Compression.none, sparse_as_dense=False, op=Average,
                 gradient_predivide_factor=1.0, groups=None, process_set=global_process_set,
                 scale_local_gradients=True):
        check_op(op)
        check_predivide(op, gradient_predivide_factor)
        self.name = name
        self.device_dense = device_dense
        self.device_sparse = device_sparse
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local_vars = []
        # Average with a predivide factor f: scale by 1/f before the sum and
        # f/size after it (the runtime divides by size for Average).
        if op == Average:
            self.prescale, self.postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        else:
            self.prescale = self.postscale = 1.0

    def register_local_var(self, var):
        """Gradients of `var` stay local: never reduced (scaled by 1/size if asked)."""
        self.local_vars.append(var)

    def is_local(self, var):
        return self._is_local(var)

    def _is_local(self, var):
        return var is not None and any(var is v for v in self.local_vars)

    def __call__(self, grads, variables=None):
        """Returns the reduced gradients, in order; None stays None."""
        grads = list(grads)
        variables = list(variables) if variables is not None else [None] * len(grads)
        if self.sparse_as_dense:
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
        out = list(grads)
        ps = self.process_set
        set_size = _basics.size() if ps.process_set_id == 0 else ps.size()
        local = [i for i, v in enumerate(variables) if self._is_local(v) and grads[i] is not None]
        if self.scale_local_gradients and local and set_size > 1:
            for i in local:
                g = grads[i]
                if isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(g.values / set_size, g.indices, g.dense_shape)
                else:
                    out[i] = g / tf.cast(set_size, g.dtype)
        shared = [i for i, g in enumerate(grads) if g is not None and i not in local]
        if not shared or not ps.included() or set_size <= 1:
            return out
        with tf.name_scope(self.name + "_Allreduce"):
            groups = self._group_indices(shared, variables, grads)
            if self.groups is None:
                # Each group's gradients are computed before backprop goes on
                # past it (a graph only; eagerly they all exist already).
                _backprop_order.order([[grads[i] for i in group] for group in groups])
            for group in groups:
                for i, g in zip(group, self._reduce_group([grads[i] for i in group])):
                    out[i] = g
        return out

    def _group_indices(self, shared, variables, grads):
        if self.groups is None:
            if tf.executing_eagerly():
                return [shared]  # eagerly every gradient exists already
            # In a graph, runs in the order backprop produces them (last
            # layers first), each its own op: TF starts each as soon as its
            # gradients exist, while backprop goes on (ops.UNORDERED_OP_TYPES).
            from perseus_tf._backprop_order import backprop_groups
            return backprop_groups(shared, grads)
        if isinstance(self.groups, int):
            return _split_evenly(shared, self.groups)
        remaining = list(shared)
        result = []
        for var_group in self.groups:
            members = [i for i in remaining if any(variables[i] is v for v in var_group)]
            if members:
                result.append(members)
                remaining = [i for i in remaining if i not in members]
        return result + [[i] for i in remaining]

    def _reduce_group(self, grads):
        """One grouped_allreduce per dtype (after compression); sparse ones gathered."""
        results = [None] * len(grads)
        by_dtype = {}
        contexts = {}
        by_runtime = self.compression is Compression.fp16 and self.op in (Average, Sum)
        with _device(self.device_dense):
            for i, g in enumerate(grads):
                if isinstance(g, tf.IndexedSlices):
                    continue
                g = tf.convert_to_tensor(g)
                if by_runtime and g.dtype == tf.float32:
                    contexts[i] = None
                    by_dtype.setdefault("float32 as float16", []).append((i, g))
                    continue
                compressed, ctx = self.compression.compress(g)
                contexts[i] = ctx
                by_dtype.setdefault(compressed.dtype, []).append((i, compressed))
            native = _native_compression(self.compression)
            for key, members in by_dtype.items():
                compression, prescale, postscale = native, self.prescale, self.postscale
                if key == "float32 as float16":
                    compression, prescale, postscale = runtime_fp16(prescale, postscale)
                reduced = ops.grouped_allreduce([t for _, t in members], op=self.op,
                                                prescale_factor=prescale,
                                                postscale_factor=postscale,
                                                compression=compression, gradients=True,
                                                **op_kwargs(self.process_set))
                for (i, _), r in zip(members, reduced):
                    results[i] = self.compression.decompress(r, contexts[i])
        with _device(self.device_sparse):
            for i, g in enumerate(grads):
                if isinstance(g, tf.IndexedSlices):
                    results[i] = _sparse_allreduce(g, self.op, self.prescale, self.postscale,
                                                   self.process_set)
        return results


def _native_compression(compression):
    """Perseus's own gradient compression, on top of Horovod's compressors.

    Horovod's semantics come first: with `Compression.none` gradients are
    exact, as a Horovod script expects. Only when the user sets
    PERSEUS_ALLREDUCE_DTYPE (0: float16 with the gradient scale; 2: float16
    between hosts), PERSEUS_TOPK_ALLREDUCE or PERSEUS_DOWNSAMPLE_N_ELEMENTS
    explicitly do float32 gradients travel compressed by the runtime.
    """
    import os

    from perseus_tf import _native

    chosen = ("PERSEUS_ALLREDUCE_DTYPE", "PERSEUS_TOPK_ALLREDUCE", "PERSEUS_DOWNSAMPLE_N_ELEMENTS")
    if compression is not Compression.none or not any(v in os.environ for v in chosen):
        return "none"
    return _native.gradient_compression()


class LocalAccumulator:
    """Sums gradients locally over `k` backward passes; reduces on the k-th.

    The sums are kept by the accumulator PerseusStrategy uses too
    (perseus_tf/_accumulator.py): local variables that start at zero on every
    rank, so the ranks' counters agree and they reduce on the same pass.
    Works eagerly, in tf.function and in TF1 graphs.

    Args:
      k: backward passes per applied step.
      average: divide the accumulated sum by k before applying.
      reducer: the GradientReducer applied on the k-th pass.
    """

    def __init__(self, k, average, reducer):
        self.sums = GradientAccumulator(k, "backward_passes_per_step")
        self.k = self.sums.k
        self.average = average
        self.reducer = reducer

    def accumulate(self, grads, variables):
        """Adds `grads`; returns (is_apply_step, gradients to apply).

        On the k-th pass the gradients are the reduced sums (divided by k when
        averaging); on the others, the unreduced sums (not to be applied).
        """
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        is_step, totals = self.sums.add(grads, None if variables is None else list(variables))

        def reduced():
            out = self.reducer(totals, variables)
            if self.average:
                out = [None if g is None else g / tf.cast(self.k, g.dtype) for g in out]
            return [tf.zeros([]) if g is None else g for g in out]

        def pending():
            return [tf.zeros([]) if t is None else tf.identity(t) for t in totals]

        chosen = tf.cond(is_step, reduced, pending)
        chosen = [None if g is None else c for g, c in zip(grads, chosen)]
        return is_step, chosen
