"""Saving a model on one rank (`if rank == 0: model.save(path)`, the Horovod
habit) under PerseusStrategy, with no collective and no broken file.

Sync-on-read variables (batch-norm moving statistics, averaged over the
ranks; metric totals) are read through a collective, so a save that only
rank 0 makes once waited for the others and timed out with half a file
written. Two patches make it safe:

  * In `fit`, at every epoch's end (before the user's callbacks, so that a
    ModelCheckpoint sees the result) and at the end of training, every rank
    replaces its own copy of each averaged sync-on-read variable with the
    average over the ranks: one grouped allreduce, while every rank is still
    in `fit`. After `fit`, every rank holds the same statistics.
  * While Keras saves (`Model.save`, `Model.save_weights`,
    `keras.saving.save_model`), sync-on-read variables read this rank's own
    copy: no collective. Saved after `fit`, that copy is the average, so
    every rank saves the same model; a save in the middle of an epoch (a
    ModelCheckpoint with save_freq in batches) holds the saving rank's own
    statistics since the last epoch end.

The strategy module consults local_reads_active() in its reduction.
"""

import contextlib
import functools
import threading

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

_state = threading.local()
_installed = False


def local_reads_active():
    """True while Keras saves a model on this thread."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def local_reads():
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _averaged_on_read(model):
    """The model's sync-on-read variables whose reads average over ranks."""
    found = []
    for variable in getattr(model, "variables", []):
        # Keras 3 wraps a tf.Variable. (No getattr probe on Keras 2's own
        # variables: a sync-on-read one would answer it with a collective.)
        tf_variable = variable if isinstance(variable, tf.Variable) else variable._value
        if (isinstance(tf_variable, values_lib.SyncOnReadVariable)
                and tf_variable.aggregation == tf.VariableAggregation.MEAN):
            found.append(tf_variable)
    return found


def _average_into_local_copies(model, is_ours, allreduce_average):
    strategy = getattr(model, "distribute_strategy", None)
    if not is_ours(strategy):
        return
    variables = _averaged_on_read(model)
    if not variables:
        return
    locals_ = [v.values[0] for v in variables]
    averaged = allreduce_average([v.read_value() for v in locals_])
    for local, value in zip(locals_, averaged):
        local.assign(value)


def _check_steps_agree(model, params, is_ours):
    """fit(): every rank must run the same number of steps per epoch, or the
    one that runs out first leaves the epoch while the others still reduce
    gradients. Where Keras knows the count on every rank (a dataset of known
    length, or steps_per_epoch), the ranks compare it before the first step."""
    if not is_ours(getattr(model, "distribute_strategy", None)):
        return
    from perseus_tf import ops
    if ops.size() < 2:
        return
    steps = (params or {}).get("steps")
    mine = -1 if steps is None else int(steps)
    every = ops.allgather(tf.constant([mine], tf.int64),
                          name="perseus.fit.steps_per_epoch").numpy().tolist()
    if min(every) < 0 or len(set(every)) == 1:
        return  # unknown somewhere (a generator, a filter): nothing to compare
    listing = ", ".join(f"rank {r}: {s}" for r, s in enumerate(every))
    raise ValueError(
        f"PerseusStrategy fit(): the ranks would run different numbers of steps per epoch "
        f"({listing}) because their datasets have different lengths. Give every rank the same "
        f"number of batches: shard the data evenly, or repeat() it and pass "
        f"steps_per_epoch={min(every)}")


def install(is_ours, allreduce_average):
    """Installs both patches once.

    Args:
      is_ours: strategy -> bool, whether it is a PerseusStrategy.
      allreduce_average: list of tensors -> their averages over the ranks (a
        grouped allreduce every rank makes).
    """
    global _installed
    if _installed:
        return
    _installed = True
    try:
        import keras
    except ImportError:  # pragma: no cover - Keras 2 ships inside TF 2.15
        keras = tf.keras
    _patch_saving(keras)
    _patch_epoch_ends(keras, is_ours, allreduce_average)


def _reading_locally(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with local_reads():
            return fn(*args, **kwargs)
    wrapper._perseus_local_reads = True
    return wrapper


def _patch_saving(keras):
    for model_class in {keras.Model, tf.keras.Model}:
        for method in ("save", "save_weights"):
            fn = getattr(model_class, method, None)
            if fn is not None and not getattr(fn, "_perseus_local_reads", False):
                setattr(model_class, method, _reading_locally(fn))
    saving = getattr(keras, "saving", None)
    fn = getattr(saving, "save_model", None)
    if fn is not None and not getattr(fn, "_perseus_local_reads", False):
        saving.save_model = _reading_locally(fn)


def _callback_list_class(keras):
    try:
        from keras.src.callbacks import callback_list  # Keras 3
        return callback_list.CallbackList
    except ImportError:
        return keras.callbacks.CallbackList  # Keras 2


def _patch_epoch_ends(keras, is_ours, allreduce_average):
    callback_list = _callback_list_class(keras)

    class AverageOnReadVariables(keras.callbacks.Callback):
        """Every rank averages the model's sync-on-read statistics."""

        def on_train_begin(self, logs=None):
            _check_steps_agree(self.model, self.params, is_ours)

        def on_epoch_end(self, epoch, logs=None):
            _average_into_local_copies(self.model, is_ours, allreduce_average)

        def on_train_end(self, logs=None):
            _average_into_local_copies(self.model, is_ours, allreduce_average)

    init = callback_list.__init__

    @functools.wraps(init)
    def __init__(self, callbacks=None, *args, **kwargs):
        # First in the list: user callbacks at the epoch's end see the result.
        callbacks = [AverageOnReadVariables()] + list(callbacks or [])
        init(self, callbacks, *args, **kwargs)

    callback_list.__init__ = __init__
