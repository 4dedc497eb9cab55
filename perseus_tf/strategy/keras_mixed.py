"""Mixed precision under PerseusStrategy: ranks agree on skipping a step.

Keras 3's LossScaleOptimizer decides whether a step's gradients are finite
from each replica's local gradients, before they are all-reduced (the inner
optimizer reduces them later). Across processes that decision can differ:
one rank skips the step, the others go on to an all-reduce it never joins.
Under a PerseusStrategy the check is made global here: the count of replicas
that saw a non-finite gradient is summed over all replicas, and every
replica skips the step if any saw one. Keras 2 all-reduces the gradients
before its check, so it needs nothing.
"""

import tensorflow as tf

from perseus_tf import _gradient_marks


def agree_on_skipped_steps(patching, flavour, is_perseus):
    """Keras 3's LossScaleOptimizer.check_finite, made global under the
    strategies is_perseus(strategy) tells (given by the strategy module,
    which this one does not import)."""
    def wrap(local_check):
        def check_finite(self, grads):
            finite = local_check(self, grads)
            strategy = tf.distribute.get_strategy()
            context = tf.distribute.get_replica_context()
            if not is_perseus(strategy) or context is None:
                return finite
            bad = tf.cast(tf.logical_not(tf.convert_to_tensor(finite)), tf.float32)
            # Not a gradient (though made inside the optimizer's apply): it
            # runs every step, the gradients' reductions after it only on
            # the steps not skipped, and an offline plan holds only theirs.
            with _gradient_marks.not_gradients():
                bad_replicas = context.all_reduce(tf.distribute.ReduceOp.SUM, bad)
            return tf.equal(bad_replicas, 0.0)
        return check_finite

    patching.wrap("{keras}.optimizers.LossScaleOptimizer.check_finite", wrap)
