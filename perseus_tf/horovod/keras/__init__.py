"""Horovod's Keras API (`horovod.tensorflow.keras`) over the Perseus runtime.

    import perseus_tf.horovod.keras as hvd   # instead of: import horovod.tensorflow.keras as hvd

Works with Keras 3 (TF >= 2.16) and Keras 2 (TF 2.15). See
docs/horovod.md for what is supported.
"""

import tensorflow as tf

from perseus_tf.horovod import _collectives
from perseus_tf.horovod._basics import (
    init, shutdown, is_initialized, size, rank, local_size, local_rank, cross_size, cross_rank,
    is_homogeneous, mpi_threads_supported, mpi_enabled, mpi_built, gloo_enabled, gloo_built,
    nccl_built, ddl_built, ccl_built, cuda_built, rocm_built, start_timeline, stop_timeline)
from perseus_tf.horovod._collectives import (Average, Sum, Adasum, Min, Max, Product, join,
                                             barrier)
from perseus_tf.horovod._gradient_reducer import check_adasum, check_predivide, resolve_groups
from perseus_tf.horovod._process_sets import (ProcessSet, global_process_set, add_process_set,
                                              remove_process_set)
from perseus_tf.horovod.compression import Compression
from perseus_tf.horovod import functions as _functions
from perseus_tf.horovod.keras import callbacks, elastic
from perseus_tf.horovod.keras._optimizer import (_Settings, distributed_class,
                                                 keras_optimizer_classes)
from perseus_tf.horovod.keras.callbacks import (
    BroadcastGlobalVariablesCallback, MetricAverageCallback, LearningRateScheduleCallback,
    LearningRateWarmupCallback)


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True,
                         shard_optimizer_state=False):
    """A copy of a Keras optimizer that averages gradients across ranks before applying them.

    Args: as `perseus_tf.horovod.DistributedOptimizer` (compression,
    sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
    average_aggregated_gradients, num_groups/groups, process_set,
    scale_local_gradients). The result is an instance of a subclass of the
    optimizer's class, built from its config (its state is not copied: wrap
    before training).
    shard_optimizer_state: Perseus-TF's own (Keras 3 and 2): each rank keeps the
    optimizer's slots of the variables it owns only; gradients are
    reduce-scattered and the owners' weights allgathered
    (docs/sharding.md). Op Average or Sum, Compression.none or fp16, the
    global process set, backward_passes_per_step=1.

    Example:
      opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
      model.compile(optimizer=opt, loss="mse")
    """
    if not isinstance(optimizer, keras_optimizer_classes()):
        raise ValueError(f"hvd.DistributedOptimizer (Keras) needs a Keras optimizer, got "
                         f"{optimizer!r}; use perseus_tf.horovod.DistributedOptimizer for "
                         "tf.compat.v1.train optimizers")
    check_adasum(op, average_aggregated_gradients)
    check_predivide(op, gradient_predivide_factor)
    groups = resolve_groups(num_groups, groups)
    settings = _settings(name or "Distributed" + type(optimizer).__name__, device_dense,
                         device_sparse, compression, sparse_as_dense, gradient_predivide_factor,
                         op, backward_passes_per_step, average_aggregated_gradients, groups,
                         process_set, scale_local_gradients)
    if shard_optimizer_state:
        _check_shardable(optimizer, compression, op, backward_passes_per_step, process_set)
        settings.shard = True
    cls = distributed_class(type(optimizer), settings)
    distributed = cls.from_config(optimizer.get_config())
    # exclude_from_weight_decay is not in an optimizer's config: the copy
    # excludes what the optimizer given excludes (Horovod's copy does not).
    for name, value in vars(optimizer).items():
        if name.startswith("_exclude_from_weight_decay"):
            setattr(distributed, name, value.copy() if hasattr(value, "copy") else value)
    return distributed


def _check_shardable(optimizer, compression, op, backward_passes_per_step, process_set):
    """What hvd.DistributedOptimizer(shard_optimizer_state=True) cannot honour,
    refused by name."""
    from perseus_tf.horovod.keras._optimizer import _is_keras3
    why = None
    if not _is_keras3(type(optimizer)) and not any(
            c.__module__.endswith("src.optimizers.optimizer") for c in type(optimizer).__mro__):
        why = (f"{type(optimizer).__module__}.{type(optimizer).__name__} is a legacy "
               "optimizer (keras.optimizers.legacy: not sharded); use keras.optimizers'")
    elif op not in (Average, Sum):
        why = "op must be hvd.Average or hvd.Sum"
    elif compression not in (Compression.none, Compression.fp16):
        why = "compression must be hvd.Compression.none or hvd.Compression.fp16"
    elif process_set is not global_process_set and getattr(process_set, "process_set_id", 0):
        why = "the process set must be the global one"
    if why:
        raise ValueError(f"hvd.DistributedOptimizer(shard_optimizer_state=True): {why}; or "
                         "leave shard_optimizer_state=False")


def _settings(name, device_dense='', device_sparse='', compression=Compression.none,
              sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
              backward_passes_per_step=1, average_aggregated_gradients=False, groups=None,
              process_set=global_process_set, scale_local_gradients=True):
    reducer_args = dict(name=name, device_dense=device_dense, device_sparse=device_sparse,
                        compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                        gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                        process_set=process_set, scale_local_gradients=scale_local_gradients)
    if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be a positive integer, got "
                         f"{backward_passes_per_step}")
    return _Settings(reducer_args, int(backward_passes_per_step), average_aggregated_gradients)


def PartialDistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=Average,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A DistributedOptimizer that keeps the gradients of `local_layers` local."""
    opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                               sparse_as_dense, gradient_predivide_factor, op,
                               backward_passes_per_step, average_aggregated_gradients, 0, groups,
                               process_set, scale_local_gradients)
    layers = local_layers or []
    for layer in layers if isinstance(layers, (list, tuple)) else [layers]:
        for var in layer.trainable_weights:
            opt.register_local_var(var)
    return opt


def broadcast_global_variables(root_rank):
    """Broadcasts the default graph's global variables (TF1 graph-mode Keras only)."""
    return _functions.broadcast_global_variables(root_rank)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0,
              op=None, compression=Compression.none, process_set=global_process_set):
    """Reduces a tensor-compatible value across ranks (Average by default)."""
    return _collectives.allreduce(tf.constant(value, name=name), average=average,
                                  prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, op=op,
                                  compression=compression, process_set=process_set)


def allgather(value, name=None, process_set=global_process_set):
    """Concatenates every rank's value along dimension 0."""
    return _collectives.allgather(tf.constant(value, name=name), process_set=process_set)


def broadcast(value, root_rank, name=None, process_set=global_process_set):
    """Returns `root_rank`'s value on every rank."""
    return _collectives.broadcast(tf.constant(value, name=name), root_rank,
                                  process_set=process_set)


def reducescatter(value, name=None, op=Average, process_set=global_process_set):
    """Reduces across ranks and keeps this rank's share of dimension 0."""
    return _collectives.reducescatter(tf.constant(value, name=name), op=op,
                                      process_set=process_set)


broadcast_object = _functions.broadcast_object
allgather_object = _functions.allgather_object
broadcast_variables = _functions.broadcast_variables


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Loads a saved Keras model whose optimizer becomes a DistributedOptimizer.

    The optimizer is deserialized directly as the distributed subclass, so its
    saved state (iterations, slots) is restored into it.

    Args:
      filepath: the saved model (.keras, .h5, or a SavedModel directory on Keras 2).
      custom_optimizers: optimizer classes of your own to wrap too.
      custom_objects: passed to keras.models.load_model.
      compression: the DistributedOptimizer's compression.
      legacy_opts: also wrap Keras 2's `keras.optimizers.legacy` classes (Keras 2 only).
    """
    settings = _settings("DistributedOptimizer", compression=compression)
    classes = []
    for holder in (tf.keras.optimizers,
                   getattr(tf.keras.optimizers, "legacy", None) if legacy_opts else None):
        for attr in dir(holder) if holder is not None else []:
            cls = getattr(holder, attr)
            if isinstance(cls, type) and issubclass(cls, keras_optimizer_classes()) and \
                    attr not in ("Optimizer", "LossScaleOptimizer") and \
                    not attr.startswith("_"):
                classes.append(cls)
    classes += list(custom_optimizers or [])
    objects = {}
    for cls in classes:
        try:
            objects[cls.__name__] = distributed_class(cls, settings)
        except ValueError:
            continue
    objects.update(custom_objects or {})
    return tf.keras.models.load_model(filepath, custom_objects=objects)


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "join", "barrier",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Compression",
    "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables",
    "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_object",
    "allgather_object", "broadcast_variables", "load_model", "callbacks",
    "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
    "LearningRateScheduleCallback", "LearningRateWarmupCallback",
]
