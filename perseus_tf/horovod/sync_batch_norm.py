"""`hvd.SyncBatchNormalization`: a Keras BatchNormalization whose batch
statistics, in training, are those of the global batch (every rank's rows),
as Horovod's is.

Each rank sums its rows, their squares and their count per channel; one
grouped allreduce adds them up over the ranks; mean = sum / count and
variance = sum of squares / count - mean^2. The allreduce has a gradient
(the upstream gradients summed over the ranks), so back-propagation goes
through the global statistics too. Inference uses the moving statistics,
which every rank updates from the same global statistics, so they stay equal.

Works on Keras 3 (it overrides `_moments`) and Keras 2 (TF 2.15:
`_calculate_mean_and_var`). One rank: plain BatchNormalization.

Example:
    model = keras.Sequential([keras.layers.Conv2D(8, 3),
                              hvd.SyncBatchNormalization(),
                              keras.layers.ReLU()])
"""

import tensorflow as tf

from perseus_tf import ops
from perseus_tf.horovod import _world

# As Horovod's: a layer of `tf.keras` (Keras 3 on TF >= 2.16, Keras 2 on
# TF 2.15, tf_keras under TF_USE_LEGACY_KERAS=1).
keras = tf.keras
_KERAS3 = not hasattr(keras.layers.BatchNormalization, "_calculate_mean_and_var")


def _global_moments(inputs, axes, keep_dims, mask, name):
    """Mean and variance over `axes` of every rank's rows (mask: 1 where a
    row counts, broadcast over the last axis)."""
    x = tf.cast(tf.convert_to_tensor(inputs), tf.float32)
    if mask is None:
        weight = tf.ones_like(x)
    else:
        weight = tf.cast(tf.convert_to_tensor(mask), tf.float32)
        while len(weight.shape) < len(x.shape):
            weight = tf.expand_dims(weight, -1)
        weight = tf.broadcast_to(weight, tf.shape(x))
    local = [tf.reduce_sum(x * weight, axes, keepdims=keep_dims),
             tf.reduce_sum(tf.square(x) * weight, axes, keepdims=keep_dims),
             tf.reduce_sum(weight, axes, keepdims=keep_dims)]
    total, squares, count = ops.grouped_allreduce(local, op=ops.Sum, name=name)
    count = tf.maximum(count, 1.0)
    mean = total / count
    variance = tf.maximum(squares / count - tf.square(mean), 0.0)
    return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization with the batch statistics of every rank's rows.

    Takes BatchNormalization's arguments (on Keras 3, leave `synchronized`
    False: this layer synchronizes across processes itself).
    """

    def _collective_name(self):
        return f"perseus.sync_batch_norm.{self.name}"

    if _KERAS3:
        def _moments(self, inputs, mask):
            if _world.size() == 1:
                return super()._moments(inputs, mask)
            return _global_moments(inputs, self._reduction_axes, False, mask,
                                   self._collective_name())
    else:
        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            if _world.size() == 1:
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims,
                                                       mask=mask)
            return _global_moments(inputs, reduction_axes, keep_dims, mask,
                                   self._collective_name())
