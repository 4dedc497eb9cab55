"""Local gradient accumulation: the one accumulator PerseusStrategy
(PERSEUS_ACCUMULATE_N_STEPS) and the Horovod shim (backward_passes_per_step)
share.

Each pass adds its gradients to sums kept in variables of this process and
counts the pass; every k-th pass is the step on which the caller reduces and
applies the totals. The sums are cleared on that same pass, so the caller
needs no separate reset and a step that is skipped leaves nothing behind.

The variables are local to the process: created outside any function being
traced (`tf.init_scope`), synchronized ON_READ so that under a
tf.distribute strategy each replica updates its own copy in replica context,
and, in a TF1 graph, kept in the LOCAL_VARIABLES collection (initialized by
`local_variables_initializer`, never broadcast or checkpointed as model
state). They start at zero on every rank, so the ranks' counters agree and
every rank reduces on the same pass.
"""

import tensorflow as tf


def _local_variable(shape, dtype, name):
    with tf.init_scope():  # out of any tf.function or tf.cond being built
        initial = tf.zeros(shape, dtype)
        sync = dict(trainable=False, name=name,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.NONE)
        if tf.executing_eagerly():
            return tf.Variable(initial, **sync)
        return tf.compat.v1.Variable(initial, use_resource=True,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
                                     **sync)


class GradientAccumulator:
    """Sums gradients over `k` passes; says which pass is the k-th.

    Works eagerly, in tf.function, in TF1 graphs and in a strategy's replica
    context. A gradient may be None (a variable without one); it must then be
    None on every pass.

    Args:
      k: passes per applied step (an integer >= 1).
      what: the setting `k` came from, named in errors.
      variables: the variables whose gradients it sums, when the caller
        keeps one accumulator per variable list (see `serves`).

    Example:
      acc = GradientAccumulator(4, "backward_passes_per_step")
      is_step, totals = acc.add(grads)   # totals: the sums including this pass
      tf.cond(is_step, lambda: apply(reduce(totals)), lambda: skip())
    """

    def __init__(self, k, what="accumulation steps", variables=None):
        if int(k) != k or k < 1:
            raise ValueError(f"{what} must be a positive integer, got {k}")
        self.k = int(k)
        self.what = what
        self._variable_ids = None if variables is None else [id(v) for v in variables]
        self.sums = None
        self.counter = None
        self._graph = None

    def serves(self, variables):
        """True if this accumulator was made for exactly `variables` (the
        same objects in the same order): other variables need new sums."""
        return self._variable_ids == [id(v) for v in variables]

    def _build(self, grads, variables):
        with tf.init_scope():
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        if self.sums is not None and graph is self._graph:
            if len(grads) != len(self.sums) or any(
                    (g is None) != (s is None) for g, s in zip(grads, self.sums)):
                raise ValueError(f"{self.what} > 1 needs the same variables to have gradients "
                                 "on every pass")
            return
        self._graph = graph
        self.counter = _local_variable([], tf.int64, "perseus_accumulated_passes")
        # A variable's shape is fully known where its gradient's may not be
        # (inside a function traced with unknown batch dimensions).
        shapes = [v.shape if v is not None else g.shape if g is not None else None
                  for g, v in zip(grads, variables or [None] * len(grads))]
        self.sums = [None if g is None else _local_variable(shape, g.dtype,
                                                            f"perseus_grad_sum_{i}")
                     for i, (g, shape) in enumerate(zip(grads, shapes))]

    def add(self, grads, variables=None):
        """Adds one pass of `grads` (of `variables`, when given: their shapes
        size the sums); returns (is_step, totals).

        `is_step` is a boolean tensor, True on every k-th pass. `totals` are
        the sums including this pass (None where the gradient is None); on
        the k-th pass the stored sums are cleared.
        """
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        self._build(grads, variables)
        totals = [None if g is None else s.read_value() + g for s, g in zip(self.sums, grads)]
        count = self.counter.assign_add(1, read_value=True)
        is_step = tf.equal(count % self.k, 0)
        writes = [s.assign(tf.where(is_step, tf.zeros_like(t), t))
                  for s, t in zip(self.sums, totals) if t is not None]
        with tf.control_dependencies(writes):
            totals = [None if t is None else tf.identity(t) for t in totals]
        return is_step, totals
