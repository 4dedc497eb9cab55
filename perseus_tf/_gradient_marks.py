"""Which reductions carry gradients, so that only those are compressed.

DESIGN: compression (PERSEUS_ALLREDUCE_DTYPE) applies to gradient
reductions of float32 tensors; metrics, losses, batch-norm statistics and
other reductions stay exact. Under a tf.distribute strategy all of them reach
PerseusCrossDeviceOps the same way, so PerseusStrategy marks the gradient
ones: Keras optimizers all-reduce gradients inside `apply_gradients` (Keras 3
in `apply`'s update step, Keras 2 when it aggregates), and the reductions
traced while an optimizer's `apply_gradients` runs are gradient reductions.
The mark belongs to the thread that runs `apply_gradients` (a replica's
thread under MirroredStrategy). The reductions themselves run in a merge
call, which MirroredStrategy runs in another thread (its main one), so the
mark travels with each merge call made while it is set
(`carry_into_merge_calls`): another thread tracing at the same time (a
metric's reduction, another model) is never taken for a gradient reduction.

Local gradient accumulation (PERSEUS_ACCUMULATE_N_STEPS=N, PerseusStrategy's
accumulate_n_steps) lives here too. MirroredStrategy cannot put an
optimizer's apply (a merge call) inside a tf.cond, so `apply_gradients`
always runs, with the accumulated gradients divided by N; what is
conditional is inside the merge call, in cross-replica context: the
gradient all-reduce (PerseusCrossDeviceOps asks `pending_step()`) and the
optimizer's variable updates run only on every N-th call, so ranks
communicate once per N steps. The sums are kept by the accumulator the
Horovod shim uses too (_accumulator.py), local to each process.
"""

import contextlib
import functools
import threading


class _Mark(threading.local):
    depth = 0        # gradient_reduction() scopes this thread is in
    pending = None   # the apply step's predicate of an accumulating apply_gradients
    plain = False    # inside not_gradients()


_mark = _Mark()


@contextlib.contextmanager
def gradient_reduction(pending=None):
    """Reductions made in this scope (in this thread, and in the merge calls
    it makes) carry gradients; `pending`: an accumulating optimizer's apply
    step predicate."""
    saved = _mark.depth, _mark.pending
    _mark.depth += 1
    if pending is not None:
        _mark.pending = pending
    try:
        yield
    finally:
        _mark.depth, _mark.pending = saved


@contextlib.contextmanager
def not_gradients():
    """Reductions made in this scope carry no gradients, even inside an
    optimizer's apply (a loss scale's agreement on a step's finiteness)."""
    saved = _mark.depth, _mark.plain
    _mark.depth, _mark.plain = 0, True
    try:
        yield
    finally:
        _mark.depth, _mark.plain = saved


def active():
    return _mark.depth > 0


def pending_step():
    """A boolean tensor (True on every N-th call) while an accumulating
    optimizer applies gradients, else None."""
    return _mark.pending


def carry_into_merge_calls(patching, flavour):
    """A merge call made by a thread inside gradient_reduction() (or
    not_gradients()) runs its function inside the same scope, in whichever
    thread the strategy runs it."""
    from tensorflow.python.autograph.core import ag_ctx
    from tensorflow.python.autograph.impl import api as autograph

    def wrap(merge_call):
        @functools.wraps(merge_call)
        def marked_merge_call(self, merge_fn, args=(), kwargs=None):
            if not active() and not _mark.plain:
                return merge_call(self, merge_fn, args, kwargs)
            depth, pending, plain = _mark.depth, _mark.pending, _mark.plain
            # Converted as merge_call would, then left alone by it.
            converted = autograph.tf_convert(merge_fn, ag_ctx.control_status_ctx(),
                                             convert_by_default=False)

            @autograph.do_not_convert
            def carried(*a, **kw):
                saved = _mark.depth, _mark.pending, _mark.plain
                if plain:   # (the merging thread may be inside a gradient scope)
                    _mark.depth, _mark.plain = 0, True
                else:
                    _mark.depth, _mark.pending = saved[0] + depth, pending
                try:
                    return converted(*a, **kw)
                finally:
                    _mark.depth, _mark.pending, _mark.plain = saved

            return merge_call(self, carried, args, kwargs)
        return marked_merge_call

    patching.wrap("tensorflow.python.distribute.distribute_lib.ReplicaContext.merge_call", wrap)


def _accumulation_steps():
    import tensorflow as tf

    if tf.distribute.in_cross_replica_context() or not tf.distribute.has_strategy():
        return 1
    return getattr(tf.distribute.get_strategy(), "_accumulate_n_steps", 1)


def _accumulating_apply(self, original, n, grads_and_vars, args, kwargs):
    import tensorflow as tf

    from perseus_tf._accumulator import GradientAccumulator

    grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
    variables = [v for _, v in grads_and_vars]
    acc = getattr(self, "_perseus_accumulator", None)
    if acc is None or not acc.serves(variables):
        acc = GradientAccumulator(n, "PERSEUS_ACCUMULATE_N_STEPS", variables=variables)
        self._perseus_accumulator = acc
    is_step, totals = acc.add([g for g, _ in grads_and_vars], variables)
    grads = [t / tf.cast(n, t.dtype) for t in totals]
    with gradient_reduction(pending=is_step):
        return original(self, list(zip(grads, variables)), *args, **kwargs)


def _wrap_update(patching, cls, attr):
    """Makes an optimizer's cross-replica update run only on apply steps."""
    original = cls.__dict__.get(attr)
    if original is None:
        return

    @functools.wraps(original)
    def update(self, distribution, *args, **kwargs):
        import tensorflow as tf

        pred = _mark.pending
        if pred is None:
            return original(self, distribution, *args, **kwargs)

        def apply():
            out = original(self, distribution, *args, **kwargs)
            with tf.control_dependencies([] if out is None else [out]):
                return tf.constant(True)

        return tf.cond(pred, apply, lambda: tf.constant(False))

    patching.replace(cls, attr, update)


def decay_weight(optimizer, variable, decide=None):
    """Keras' decoupled weight decay of one variable (Keras 3 and 2 alike).
    decide: the variable whose exclusion from weight decay counts (the model
    variable a sharded optimizer's piece of it stands for)."""
    import tensorflow as tf

    if optimizer._use_weight_decay(variable if decide is None else decide):
        lr = tf.cast(optimizer.learning_rate, variable.dtype)
        wd = tf.cast(optimizer.weight_decay, variable.dtype)
        variable.assign_sub(variable * wd * lr)


def _wrap_weight_decay(patching, cls):
    """Makes an optimizer's weight decay (Keras 3's TF optimizer, Keras 2),
    which runs in a merge call of its own before the update's, decay the
    weights on apply steps only (accumulating: once per applied step, as
    one larger batch would). The condition goes inside the merge call: a
    merge call under a replica's condition is refused."""
    original = cls.__dict__.get("_apply_weight_decay")
    if original is None:
        return

    @functools.wraps(original)
    def _apply_weight_decay(self, variables):
        import tensorflow as tf

        pred = _mark.pending
        if pred is None or self.weight_decay is None:
            return original(self, variables)

        def merged(distribution, variables):
            def apply():
                for variable in variables:
                    if not isinstance(variable, tf.Variable) and hasattr(variable, "value"):
                        variable = variable.value   # a Keras 3 variable's tf.Variable
                    distribution.extended.update(
                        variable, functools.partial(decay_weight, self), group=False)
                return tf.constant(True)
            return tf.cond(pred, apply, lambda: tf.constant(False))

        tf.__internal__.distribute.interim.maybe_merge_call(
            merged, self._distribution_strategy, variables)

    patching.replace(cls, "_apply_weight_decay", _apply_weight_decay)


def _refuse_unsharded(optimizer):
    """Under PerseusStrategy(shard_optimizer_state=True) the optimizers of
    Keras 3 and Keras 2's `keras.optimizers.Optimizer` are sharded
    (perseus_tf/strategy/keras_shard.py): any other (Keras 2's legacy
    optimizers) would keep its whole state on every rank, so it is refused."""
    import tensorflow as tf

    if tf.distribute.in_cross_replica_context() or not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    if not getattr(strategy, "_shard_optimizer_state", False):
        return
    if not any(c.__module__.endswith(("backend.tensorflow.optimizer", "src.optimizers.optimizer"))
               for c in type(optimizer).__mro__):
        raise ValueError(
            f"{type(optimizer).__module__}.{type(optimizer).__name__} cannot shard its state: "
            "PerseusStrategy(shard_optimizer_state=True) (PERSEUS_SHARD_OPTIMIZER_STATE=1) "
            "shards Keras 3's optimizers and Keras 2's keras.optimizers (not "
            "keras.optimizers.legacy); use one, or set shard_optimizer_state=False")


def _wrap(patching, cls):
    original = cls.__dict__.get("apply_gradients")
    if original is None:
        return

    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        _refuse_unsharded(self)
        n = _accumulation_steps() if _mark.pending is None else 1
        if n > 1:
            return _accumulating_apply(self, original, n, grads_and_vars, args, kwargs)
        with gradient_reduction():
            return original(self, grads_and_vars, *args, **kwargs)

    patching.replace(cls, "apply_gradients", apply_gradients)


def mark_optimizer_apply(patching, flavour):
    """Marks reductions inside this Keras' optimizers' apply_gradients (and
    its legacy ones'): every class of their MRO that defines it."""
    from perseus_tf import _keras

    roots = _keras.optimizer_classes(flavour)
    bases = list(dict.fromkeys(base for cls in roots for base in cls.__mro__))
    for cls in bases:
        # Keras 3's base class defines apply_gradients on its backend base.
        if "apply_gradients" in cls.__dict__:
            _wrap(patching, cls)
    # Where Keras 3 (TF backend) and Keras 2 update variables in
    # cross-replica context.
    for attr in ("_distributed_tf_update_step", "_distributed_apply_gradients_fn"):
        for cls in bases:
            if attr in cls.__dict__:
                _wrap_update(patching, cls, attr)
    # Both decay the weights before that, in a merge call of their own.
    for cls in bases:
        if cls.__module__.endswith(("src.optimizers.optimizer", "backend.tensorflow.optimizer")):
            _wrap_weight_decay(patching, cls)
    if flavour.major == 2:
        # Keras 2's LossScaleOptimizers sum the gradients themselves, before
        # their inner optimizer's apply_gradients: those sums are gradients.
        for target in patching.patch.targets:
            if ".mixed_precision." in target:
                cls, name, _ = patching.target(target)
                if name in vars(cls):
                    _wrap_marking(patching, cls)


def _wrap_marking(patching, cls):
    original = cls.__dict__["apply_gradients"]

    @functools.wraps(original)
    def apply_gradients(self, *args, **kwargs):
        with gradient_reduction():
            return original(self, *args, **kwargs)

    patching.replace(cls, "apply_gradients", apply_gradients)


def mark_tf1_optimizer_apply(patching, flavour):
    """The same for tf.compat.v1.train.Optimizer."""
    import tensorflow as tf
    _wrap(patching, tf.compat.v1.train.Optimizer)
