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


def _wrap(cls):
    original = cls.__dict__.get("apply_gradients")
    if original is None or getattr(original, "_perseus_wrapped", False):
        return

    @functools.wraps(original)
    def apply_gradients(self, *args, **kwargs):
        with gradient_reduction():
            return original(self, *args, **kwargs)

    apply_gradients._perseus_wrapped = True
    cls.apply_gradients = apply_gradients


def install():
    """Marks reductions inside Keras optimizers' apply_gradients (idempotent)."""
    global _installed
    if _installed:
        return
    import tensorflow as tf

    classes = []
    try:
        import keras

        classes.append(keras.optimizers.Optimizer)
        if keras.__version__.startswith("3."):
            # Keras 3's base class defines apply_gradients on its backend base.
            classes.extend(c for c in keras.optimizers.Optimizer.__mro__
                           if "apply_gradients" in c.__dict__)
    except ImportError:  # pragma: no cover
        pass
    for name in ("Optimizer",):
        for module in (getattr(tf.keras, "optimizers", None),
                       getattr(getattr(tf.keras, "optimizers", None), "legacy", None)):
            cls = getattr(module, name, None) if module is not None else None
            if isinstance(cls, type):
                classes.append(cls)
                classes.extend(c for c in cls.__mro__ if "apply_gradients" in c.__dict__)
    classes.append(tf.compat.v1.train.Optimizer)
    for cls in classes:
        _wrap(cls)
    _installed = True
