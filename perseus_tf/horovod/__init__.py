"""Horovod's TensorFlow API (`horovod.tensorflow`) over the Perseus runtime.

Change one line of a Horovod script:

    import perseus_tf.horovod as hvd      # instead of: import horovod.tensorflow as hvd

and start it with `perseusrun -np N -- python train.py`. Every collective and
the gradient path of DistributedOptimizer / DistributedGradientTape run on
the same native runtime as PerseusStrategy. See docs/horovod.md for what is
supported and what is not.
"""

from perseus_tf.horovod._basics import (
    init, shutdown, is_initialized, size, rank, local_size, local_rank, cross_size, cross_rank,
    is_homogeneous, size_op, local_size_op, rank_op, local_rank_op, process_set_included_op,
    mpi_threads_supported, mpi_enabled, mpi_built, gloo_enabled, gloo_built, nccl_built,
    ddl_built, ccl_built, cuda_built, rocm_built, start_timeline, stop_timeline,
    _executing_eagerly)
from perseus_tf.horovod._collectives import (
    Average, Sum, Adasum, Min, Max, Product, handle_average_backwards_compatibility,
    allreduce, grouped_allreduce, allgather, grouped_allgather, broadcast, alltoall,
    reducescatter, grouped_reducescatter, barrier, join)
from perseus_tf.horovod._process_sets import (
    ProcessSet, global_process_set, add_process_set, remove_process_set)
from perseus_tf.horovod.compression import Compression
from perseus_tf.horovod import elastic
from perseus_tf.horovod.functions import (
    broadcast_, broadcast_variables, broadcast_global_variables, broadcast_object, broadcast_object_fn,
    allgather_object)
from perseus_tf.horovod.hooks import BroadcastGlobalVariablesHook
from perseus_tf.horovod.optimizer import DistributedOptimizer
from perseus_tf.horovod.sync_batch_norm import SyncBatchNormalization
from perseus_tf.horovod.tape import DistributedGradientTape, PartialDistributedGradientTape

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "size_op", "local_size_op", "rank_op",
    "local_rank_op", "process_set_included_op", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "handle_average_backwards_compatibility",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
    "reducescatter", "grouped_reducescatter", "barrier", "join",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "Compression",
    "broadcast_", "broadcast_variables", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "allgather_object", "BroadcastGlobalVariablesHook",
    "DistributedOptimizer", "DistributedGradientTape", "PartialDistributedGradientTape",
    "SyncBatchNormalization",
    "elastic",
]
