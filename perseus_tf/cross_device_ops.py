"""PerseusCrossDeviceOps: tf.distribute reductions through the Perseus runtime.

A value with one component per local device is first summed on this process
(when it drives several devices), then reduced across processes with one
fused request for a whole batch (Keras hands all gradients at once), and the
result is placed on every destination device.

Works inside PerseusStrategy (one process per replica) and with stock
`tf.distribute.MirroredStrategy(devices, cross_device_ops=PerseusCrossDeviceOps())`
in one process (then the cross-process step is a no-op of world size 1).
"""

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_utils
from tensorflow.python.distribute import reduce_util
from tensorflow.python.distribute import values as values_lib

from perseus_tf import _backprop_order
from perseus_tf import _gradient_marks
from perseus_tf import _native
from perseus_tf import ops as perseus_ops


def _components(value):
    if isinstance(value, values_lib.DistributedValues):
        return list(value.values)
    return [value]


def _dense(t):
    if isinstance(t, tf.IndexedSlices):
        return tf.convert_to_tensor(t)
    return t


def _same_device(a, b):
    a, b = tf.DeviceSpec.from_string(a or ""), tf.DeviceSpec.from_string(b or "")
    return (a.device_type or "CPU") == (b.device_type or "CPU") and \
        (a.device_index or 0) == (b.device_index or 0)


def collective_device(t):
    """Where a collective of `t` runs: on its GPU when it lives on one (the
    op library has GPU kernels: the runtime reads and writes TF's GPU memory,
    with NCCL or staged through the host), else on the CPU."""
    spec = tf.DeviceSpec.from_string(t.device or "")
    return t.device if spec.device_type == "GPU" else "/cpu:0"


def _mirrored(value, destinations):
    """`value` as a Mirrored value on `destinations`. One replica per process
    (PerseusStrategy) has one destination, where the reduced tensor already
    is: it is wrapped as it is, without the copy (an Identity op per tensor,
    most of a many-tensor step's cost) that simple_broadcast would add."""
    devices = cross_device_ops_lib.get_devices_from(destinations)
    if len(devices) == 1 and isinstance(value, tf.Tensor) and \
            _same_device(value.device, devices[0]):
        return distribute_utils.regroup([value], wrap_class=values_lib.Mirrored)
    return cross_device_ops_lib.simple_broadcast(value, destinations, always_mirrored=True)


class PerseusCrossDeviceOps(tf.distribute.CrossDeviceOps):
    """Cross-device and cross-process reductions over the native fused allreduce.

    Example:
        strategy = tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"], cross_device_ops=perseus_tf.PerseusCrossDeviceOps())
    """

    def __init__(self):
        super().__init__()
        _native.ensure_initialized()

    @property
    def _num_between_graph_workers(self):
        # The base class skips reductions of a single local value unless it
        # knows other processes take part.
        return perseus_ops.size()

    # -- helpers ----------------------------------------------------------------

    @staticmethod
    def _local_sum(value):
        parts = [_dense(p) for p in _components(value)]
        if len(parts) == 1:
            return parts[0], 1
        with tf.device(parts[0].device):
            return tf.add_n(parts), len(parts)

    def _reduce_many(self, reduce_op, values):
        """Reduces each value across local devices and processes; returns tensors."""
        locals_, counts = zip(*[self._local_sum(v) for v in values])
        size = perseus_ops.size()
        if size > 1:
            # Tensors of one dtype travel as grouped (fused) requests.
            # Gradients are split into a few groups in backprop order (the
            # last layers' first), so that inside a tf.function a group can
            # be reduced while earlier layers' gradients are still computed.
            by_dtype = {}
            for i, t in enumerate(locals_):
                by_dtype.setdefault(t.dtype, []).append(i)
            if _gradient_marks.active():
                groups = _backprop_order.backprop_groups
                by_dtype = {(dtype, n): chunk for dtype, idx in by_dtype.items()
                            for n, chunk in enumerate(groups(idx, locals_))}
            else:
                by_dtype = {(dtype, 0): idx for dtype, idx in by_dtype.items()}
            reduced = list(locals_)
            gradients = _gradient_marks.active()
            if gradients:
                # Each group's gradients are computed before backprop goes on
                # past it (_backprop_order), whatever TF's executor prefers.
                stages = {}
                for (_, n), idx in by_dtype.items():
                    stages.setdefault(n, []).extend(locals_[i] for i in idx)
                _backprop_order.order([stages[n] for n in sorted(stages)])
            compression = _native.gradient_compression() if gradients else 0
            # Accumulating gradients (PERSEUS_ACCUMULATE_N_STEPS): reduce only
            # on apply steps; other steps' values are not used.
            pending = _gradient_marks.pending_step() if gradients else None
            for (dtype, _), idx in by_dtype.items():
                inputs = [locals_[i] for i in idx]

                def reduce(inputs=inputs, dtype=dtype):
                    return perseus_ops.grouped_allreduce(
                        inputs, op=perseus_ops.Sum,
                        compression=compression if dtype == tf.float32 else 0,
                        gradients=gradients)

                with tf.device(collective_device(inputs[0])):
                    if pending is None:
                        outs = reduce()
                    else:
                        outs = tf.cond(pending, reduce,
                                       lambda inputs=inputs: [tf.identity(t) for t in inputs])
                for i, o in zip(idx, outs):
                    reduced[i] = o
        else:
            reduced = list(locals_)
        if reduce_op == reduce_util.ReduceOp.MEAN:
            out = []
            for t, n in zip(reduced, counts):
                replicas = n * size
                if t.dtype.is_floating or t.dtype.is_complex:
                    out.append(t / tf.cast(replicas, t.dtype))
                else:
                    out.append(t // tf.cast(replicas, t.dtype))
            reduced = out
        return reduced

    # -- CrossDeviceOps interface ---------------------------------------------------

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        return self.batch_reduce_implementation(
            reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        if not value_destination_pairs:
            return []
        values = [v for v, _ in value_destination_pairs]
        reduced = self._reduce_many(reduce_op, values)
        return [_mirrored(r, d) for r, (_, d) in zip(reduced, value_destination_pairs)]

    def broadcast_implementation(self, tensor, destinations):
        return cross_device_ops_lib.simple_broadcast(tensor, destinations, always_mirrored=True)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        parts = [_dense(p) for p in _components(per_replica_value)]
        local = parts[0] if len(parts) == 1 else tf.concat(parts, axis=axis)
        if perseus_ops.size() > 1:
            rank = local.shape.rank
            if axis != 0:
                perm = [axis] + [i for i in range(rank) if i != axis]
                inverse = [perm.index(i) for i in range(rank)]
                local = tf.transpose(local, perm)
            with tf.device(collective_device(local)):
                local = perseus_ops.allgather(local)
            if axis != 0:
                local = tf.transpose(local, inverse)
        return cross_device_ops_lib.simple_broadcast(local, destinations, always_mirrored=True)
