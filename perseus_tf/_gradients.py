"""Which reductions carry gradients, so that only those are compressed.

DESIGN: compression (PERSEUS_ALLREDUCE_DTYPE) applies to gradient
reductions of float32 tensors; metrics, losses, batch-norm statistics and
other reductions stay exact. Under a tf.distribute strategy all of them reach
PerseusCrossDeviceOps the same way, so PerseusStrategy marks the gradient
ones: Keras optimizers all-reduce gradients inside `apply_gradients` (Keras 3
in `apply`'s update step, Keras 2 when it aggregates), and the reductions
traced while an optimizer's `apply_gradients` runs are gradient reductions.
The mark is a process-wide depth counter, not thread-local, because
MirroredStrategy runs replica functions and merge calls in other threads.

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

_lock = threading.Lock()
_depth = [0]
_installed = False


@contextlib.contextmanager
def gradient_reduction():
    with _lock:
        _depth[0] += 1
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1


def active():
    return _depth[0] > 0


# The apply step's predicate while an accumulating apply_gradients runs (one
# replica per process: one predicate at a time).
_pending = [None]


def pending_step():
    """A boolean tensor (True on every N-th call) while an accumulating
    optimizer applies gradients, else None."""
    return _pending[0]


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
    _pending[0] = is_step
    try:
        with gradient_reduction():
            return original(self, list(zip(grads, variables)), *args, **kwargs)
    finally:
        _pending[0] = None


def _wrap_update(cls, attr):
    """Makes an optimizer's cross-replica update run only on apply steps."""
    original = cls.__dict__.get(attr)
    if original is None or getattr(original, "_perseus_wrapped", False):
        return

    @functools.wraps(original)
    def update(self, distribution, *args, **kwargs):
        import tensorflow as tf

        pred = _pending[0]
        if pred is None:
            return original(self, distribution, *args, **kwargs)

        def apply():
            out = original(self, distribution, *args, **kwargs)
            with tf.control_dependencies([] if out is None else [out]):
                return tf.constant(True)

        return tf.cond(pred, apply, lambda: tf.constant(False))

    update._perseus_wrapped = True
    setattr(cls, attr, update)


def _wrap(cls):
    original = cls.__dict__.get("apply_gradients")
    if original is None or getattr(original, "_perseus_wrapped", False):
        return

    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        n = _accumulation_steps() if _pending[0] is None else 1
        if n > 1:
            return _accumulating_apply(self, original, n, grads_and_vars, args, kwargs)
        with gradient_reduction():
            return original(self, grads_and_vars, *args, **kwargs)

    apply_gradients._perseus_wrapped = True
    cls.apply_gradients = apply_gradients


def install():
    """Marks reductions inside Keras optimizers' apply_gradients (idempotent)."""
    global _installed
    if _installed:
        return
    import tensorflow as tf

    from perseus_tf import _keras

    classes = []
    for cls in _keras.optimizer_classes():
        # Keras 3's base class defines apply_gradients on its backend base.
        classes.append(cls)
        classes.extend(c for c in cls.__mro__ if "apply_gradients" in c.__dict__)
    classes.append(tf.compat.v1.train.Optimizer)
    for cls in classes:
        _wrap(cls)
        # Where Keras 3 (TF backend) and Keras 2 update variables in
        # cross-replica context.
        for attr in ("_distributed_tf_update_step", "_distributed_apply_gradients_fn"):
            for base in cls.__mro__:
                if attr in base.__dict__:
                    _wrap_update(base, attr)
    _installed = True
