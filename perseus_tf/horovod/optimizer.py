"""`hvd.DistributedOptimizer`: TF1 (`tf.compat.v1.train.Optimizer`) optimizers
here; Keras optimizers are handed to `perseus_tf.horovod.keras`."""

import tensorflow as tf

from perseus_tf.horovod._collectives import Adasum, Average
from perseus_tf.horovod._gradient_reducer import (GradientReducer, LocalAccumulator, check_adasum,
                                           check_predivide,
                                           resolve_groups)
from perseus_tf.horovod._process_sets import global_process_set
from perseus_tf.horovod.compression import Compression


class _WrappingOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer around another (self._optimizer): its slots and
    variables are the wrapped optimizer's."""

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


class _DistributedOptimizer(_WrappingOptimizer):
    """Wraps a TF1 optimizer: `compute_gradients` returns gradients reduced
    across ranks; `apply_gradients` applies them (every k-th call when
    accumulating locally)."""

    def __init__(self, optimizer, name, use_locking, reducer, backward_passes_per_step,
                 average_aggregated_gradients):
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._reducer = reducer
        self._accumulator = None
        self._is_step = None
        if backward_passes_per_step > 1:
            if tf.executing_eagerly():
                raise ValueError("backward_passes_per_step > 1 is not supported for a "
                                 "tf.compat.v1.train.Optimizer in eager mode; use a Keras "
                                 "optimizer or build a graph")
            self._accumulator = LocalAccumulator(backward_passes_per_step,
                                                 average_aggregated_gradients, reducer)

    def register_local_var(self, var):
        """Keeps `var`'s gradient local (not reduced across ranks)."""
        self._reducer.register_local_var(var)

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, reduced across ranks."""
        grads_and_vars = self._optimizer.compute_gradients(*args, **kwargs)
        if not grads_and_vars:
            return grads_and_vars
        grads, variables = zip(*grads_and_vars)
        if self._accumulator is None:
            reduced = self._reducer(grads, variables)
        else:
            self._is_step, reduced = self._accumulator.accumulate(grads, variables)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Applies through the wrapped optimizer; when accumulating, only on
        every k-th call (the others just advance `global_step`)."""
        if self._accumulator is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        if self._is_step is None:
            raise ValueError("with backward_passes_per_step > 1, call compute_gradients "
                             "(or minimize) before apply_gradients")
        grads_and_vars = list(grads_and_vars)

        def apply():
            applied = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                      name=name)
            with tf.control_dependencies([applied]):
                return tf.constant(True)

        def skip():
            advance = [] if global_step is None else [global_step.assign_add(1)]
            with tf.control_dependencies(advance):
                return tf.constant(False)

        return tf.cond(self._is_step, apply, skip)


class _DistributedAdasumOptimizer(_WrappingOptimizer):
    """op=Adasum for a TF1 optimizer, as Horovod does it: Adasum combines the
    ranks' weight updates, not their gradients. Each rank applies its own
    gradients with the wrapped optimizer (so momentum or Adam shape the
    update first); every backward_passes_per_step-th call, each variable's
    change since the last exchange is combined across ranks with Adasum and
    becomes every rank's new value."""

    def __init__(self, optimizer, name, use_locking, backward_passes_per_step, process_set):
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._passes = backward_passes_per_step
        self._process_set = process_set
        self._starts = {}
        self._counter = None

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, this rank's own."""
        return self._optimizer.compute_gradients(*args, **kwargs)

    def _start(self, var):
        # The variable's value at the last exchange; taken from the variable
        # at the first apply (after any restore), see apply_gradients.
        key = var.ref()
        if key not in self._starts:
            with tf.init_scope():
                label = var.name.split(":")[0].replace("/", "_") + "_adasum_start"
                self._starts[key] = tf.Variable(tf.zeros(var.shape, var.dtype),
                                                trainable=False, name=label)
        return self._starts[key]

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        from perseus_tf.horovod import _collectives
        grads_and_vars = [(g, v) for g, v in grads_and_vars]
        variables = [v for g, v in grads_and_vars if g is not None]
        starts = [self._start(v) for v in variables]
        if self._counter is None:
            with tf.init_scope():
                self._counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                            name="adasum_passes")

        def snapshot():
            with tf.control_dependencies([s.assign(v) for v, s in zip(variables, starts)]):
                return tf.constant(True)

        # The first call records where the weights start.
        first = tf.cond(tf.equal(self._counter, 0), snapshot, lambda: tf.constant(False))
        with tf.control_dependencies([first]):
            applied = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                      name=name)
        with tf.control_dependencies([applied]):
            count = self._counter.assign_add(1)

        def exchange():
            deltas = [v - s for v, s in zip(variables, starts)]
            combined = _collectives.grouped_allreduce(deltas, op=_collectives.Adasum,
                                                      process_set=self._process_set)
            updates = []
            for v, s, d in zip(variables, starts, combined):
                new = s.assign_add(d)
                updates.append(v.assign(new))
            with tf.control_dependencies(updates):
                return tf.constant(True)

        if self._passes == 1:
            with tf.control_dependencies([count]):
                return exchange()
        return tf.cond(tf.equal(count % self._passes, 0), exchange, lambda: tf.constant(False))


def _is_keras_optimizer(optimizer):
    from perseus_tf.horovod.keras._optimizer import keras_optimizer_classes
    return isinstance(optimizer, keras_optimizer_classes())


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='',
                         device_sparse='', compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wraps an optimizer so that gradients are combined across ranks before
    they are applied.

    Args:
      optimizer: a `tf.compat.v1.train.Optimizer` or a Keras optimizer.
      name: name prefix of the reduction ops (default "Distributed" + class name).
      use_locking: passed to tf.compat.v1.train.Optimizer.
      device_dense: device of the dense reductions.
      device_sparse: device of the sparse reductions.
      compression: `Compression.none` or `Compression.fp16`.
      sparse_as_dense: reduce tf.IndexedSlices gradients as dense tensors.
      backward_passes_per_step: sum gradients locally over this many calls
        and reduce and apply on the last one.
      op: Average (default), Sum, Adasum, Min, Max or Product. With Adasum a
        TF1 optimizer applies each rank's gradients locally and Adasum
        combines the weight changes every backward_passes_per_step calls
        (Horovod's way); a Keras optimizer gets the Adasum of the gradients.
      gradient_predivide_factor: with Average, scale by 1/f before the sum
        and f/size after it.
      average_aggregated_gradients: divide the locally summed gradients by
        backward_passes_per_step.
      num_groups: deprecated spelling of an integer `groups`.
      groups: an int n (split the gradients into n fused requests) or a list
        of lists of variables (each list one request; others alone).
      process_set: reduce among this process set only.
      scale_local_gradients: divide gradients of `register_local_var`
        variables by the process set size.

    Example:
      opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1 * hvd.size()))
      train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    """
    check_adasum(op, average_aggregated_gradients)
    check_predivide(op, gradient_predivide_factor)
    groups = resolve_groups(num_groups, groups)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if name is None:
            name = "Distributed" + type(optimizer).__name__
        if op == Adasum:
            return _DistributedAdasumOptimizer(optimizer, name, use_locking,
                                               int(backward_passes_per_step), process_set)
        reducer = GradientReducer(name, device_dense, device_sparse, compression,
                                  sparse_as_dense, op, gradient_predivide_factor, groups,
                                  process_set, scale_local_gradients)
        return _DistributedOptimizer(optimizer, name, use_locking, reducer,
                                     backward_passes_per_step, average_aggregated_gradients)
    if _is_keras_optimizer(optimizer):
        from perseus_tf.horovod import keras as hvd_keras
        return hvd_keras.DistributedOptimizer(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    raise ValueError("Provided optimizer doesn't inherit from either legacy TensorFlow "
                     f"(tf.compat.v1.train.Optimizer) or Keras optimizer: {optimizer}")
