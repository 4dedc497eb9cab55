"""Perseus-TF: fast data-parallel TensorFlow training across processes.

Public names (TensorFlow is imported on first use, so that the launcher,
`perseus_tf.runner`, starts without it):

  init, shutdown, abort, is_initialized, rank, size, local_rank, local_size,
  cross_rank, cross_size, stats
  allreduce, grouped_allreduce, broadcast, allgather, alltoall,
  reducescatter, barrier, join, add_process_set, remove_process_set,
  process_set_ranks
  Average, Sum, Min, Max, Product, Adasum
  PerseusStrategy, PerseusCrossDeviceOps
"""

import importlib
import os

from perseus_tf import _failure_record, notices

_failure_record.install()
notices.install_setting_error_hook()

# TensorFlow's CPU allocator, unless the user chose: the pooling (BFC) one.
# The default allocator hands each large tensor fresh pages from the system;
# under any tf.distribute strategy a Keras step then spends as much time in
# page faults as in its kernels (MobileNetV2 on a CPU: 1240 ms a step against
# 690 ms with the pool, benchmarks/step_overlap.py). TensorFlow reads this
# when it makes its CPU device: importing perseus_tf before the first
# TensorFlow op is enough.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

_FROM_OPS = (
    "init", "shutdown", "abort", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "stats", "allreduce", "grouped_allreduce", "broadcast",
    "allgather", "alltoall", "reducescatter", "barrier", "join", "add_process_set",
    "remove_process_set", "process_set_ranks", "Average", "Sum", "Min", "Max", "Product",
    "Adasum",
)

_ELSEWHERE = {"PerseusStrategy": "perseus_tf.strategy",
              "PerseusCrossDeviceOps": "perseus_tf.cross_device_ops"}

__all__ = list(_FROM_OPS) + list(_ELSEWHERE)


def __getattr__(name):
    if name in _FROM_OPS:
        return getattr(importlib.import_module("perseus_tf.ops"), name)
    if name in _ELSEWHERE:
        return getattr(importlib.import_module(_ELSEWHERE[name]), name)
    raise AttributeError(f"module 'perseus_tf' has no attribute {name!r}")
