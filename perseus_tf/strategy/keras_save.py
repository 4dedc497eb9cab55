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
    `keras.saving.save_model`) or a model or layer's `get_weights` reads,
    sync-on-read variables read this rank's own copy: no collective. Saved after `fit`, that copy is the average, so
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


def _steps_everywhere(steps, name):
    """Every rank's step count (-1: unknown on that rank), or None when some
    rank does not know its count or all agree."""
    from perseus_tf import ops
    mine = -1 if steps is None else int(steps)
    every = ops.allgather(tf.constant([mine], tf.int64), name=name).numpy().tolist()
    if min(every) < 0 or len(set(every)) == 1:
        return None  # unknown somewhere (a generator, a filter): nothing to compare
    return every


def _disagreement(model, steps, name, is_ours):
    """Under PerseusStrategy with several ranks: (each rank's count as text,
    the smallest count) when the ranks' step counts differ where all know
    theirs; else None. Every rank of such a strategy calls it alike."""
    if not is_ours(getattr(model, "distribute_strategy", None)):
        return None
    from perseus_tf import ops
    if ops.size() < 2:
        return None
    every = _steps_everywhere(steps, name)
    if every is None:
        return None
    return ", ".join(f"rank {r}: {s}" for r, s in enumerate(every)), min(every)


def _check_steps_agree(model, params, is_ours):
    """fit(): every rank must run the same number of steps per epoch, or the
    one that runs out first leaves the epoch while the others still reduce
    gradients. Where Keras knows the count on every rank (a dataset of known
    length, or steps_per_epoch), the ranks compare it before the first step."""
    found = _disagreement(model, (params or {}).get("steps"), "perseus.fit.steps_per_epoch",
                          is_ours)
    if found is None:
        return
    listing, fewest = found
    raise ValueError(
        f"PerseusStrategy fit(): the ranks would run different numbers of steps per epoch "
        f"({listing}) because their datasets have different lengths. Give every rank the same "
        f"number of batches: shard the data evenly, or repeat() it and pass "
        f"steps_per_epoch={fewest}")


def _validation_steps(model, params, in_fit):
    """The steps of the evaluation about to start, where Keras knows them:
    in fit, from the validation data's iterator (Keras 3) or data handler
    (Keras 2), which fit's callbacks' params do not describe; in evaluate(),
    from its params."""
    if not in_fit:
        return (params or {}).get("steps")
    iterator = getattr(model, "_eval_epoch_iterator", None)  # Keras 3
    if iterator is not None:
        return getattr(iterator, "num_batches", None)
    handler = getattr(model, "_eval_data_handler", None)  # Keras 2
    return None if handler is None else getattr(handler, "inferred_steps", None)


def _check_validation_steps_agree(model, params, is_ours, in_fit):
    """fit()'s validation and evaluate(): checked like fit's training steps;
    ranks with validation sets of different lengths would otherwise pair one
    rank's metric reductions with another's end-of-data exchange."""
    if not is_ours(getattr(model, "distribute_strategy", None)):
        return
    found = _disagreement(model, _validation_steps(model, params, in_fit),
                          "perseus.evaluate.steps", is_ours)
    if found is None:
        return
    if in_fit:  # fit keeps its validation data for the next fit when it fails
        for cached in ("_eval_epoch_iterator", "_eval_data_handler"):
            if getattr(model, cached, None) is not None:
                setattr(model, cached, None)
    listing, fewest = found
    where, knob = (("fit() validation", "validation_steps") if in_fit
                   else ("evaluate()", "steps"))
    raise ValueError(
        f"PerseusStrategy {where}: the ranks would run different numbers of evaluation steps "
        f"({listing}) because their validation datasets have different lengths (the training "
        f"data's lengths are checked the same way). Give every rank the same number of "
        f"batches: shard the validation data evenly, or pass {knob}={fewest}")


def _check_predict_steps_agree(model, params, is_ours):
    """predict(): every rank gathers every step's rows (keras_predict), so
    all must run the same number of steps; a rank that ran out first would
    leave the others waiting in a gather. Checked like fit's steps."""
    found = _disagreement(model, (params or {}).get("steps"), "perseus.predict.steps", is_ours)
    if found is None:
        return
    listing, fewest = found
    raise ValueError(
        f"PerseusStrategy predict(): the ranks would run different numbers of steps "
        f"({listing}) because their inputs have different lengths. Every rank passes the "
        f"same input (each predicts its slice of every batch, and every rank gets all the "
        f"rows back), or pass steps={fewest}")


def read_locally_while_saving(patching, flavour):
    """Saving and get_weights read this rank's own copy of on-read variables.
    get_weights too: `if rank == 0: model.get_weights()` is a Horovod habit,
    and a collective read there would wait for ranks that never come."""
    for target in ("{keras}.Model.save", "{keras}.Model.save_weights",
                   "{keras}.Model.get_weights", "{keras}.layers.Layer.get_weights"):
        owner, name, _ = patching.target(target)
        if name in vars(owner):   # inherited: patched where it is defined
            patching.replace(owner, name, _reading_locally(vars(owner)[name]))
    patching.wrap("{keras}.saving.save_model", _reading_locally)


def average_at_epoch_ends(patching, flavour, is_perseus, allreduce_average):
    """Every fit's callback list starts with one that averages the model's
    on-read statistics over the ranks (and checks that the ranks' step counts
    agree).

    Args:
      is_perseus: strategy -> bool, whether it is a PerseusStrategy.
      allreduce_average: list of tensors -> their averages over the ranks (a
        grouped allreduce every rank makes).
    """
    _patch_epoch_ends(patching, flavour, is_perseus, allreduce_average)


def _reading_locally(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with local_reads():
            return fn(*args, **kwargs)
    return wrapper


def _patch_epoch_ends(patching, flavour, is_ours, allreduce_average):
    keras = flavour.package

    class AverageOnReadVariables(keras.callbacks.Callback):
        """Every rank averages the model's sync-on-read statistics."""

        in_fit = False

        def on_train_begin(self, logs=None):
            self.in_fit = True
            _check_steps_agree(self.model, self.params, is_ours)

        def on_test_begin(self, logs=None):
            _check_validation_steps_agree(self.model, self.params, is_ours, self.in_fit)

        def on_predict_begin(self, logs=None):
            _check_predict_steps_agree(self.model, self.params, is_ours)

        def on_epoch_end(self, epoch, logs=None):
            _average_into_local_copies(self.model, is_ours, allreduce_average)

        def on_train_end(self, logs=None):
            self.in_fit = False
            _average_into_local_copies(self.model, is_ours, allreduce_average)

    def wrap(init):
        @functools.wraps(init)
        def __init__(self, callbacks=None, *args, **kwargs):
            # First in the list: user callbacks at the epoch's end see the result.
            callbacks = [AverageOnReadVariables()] + list(callbacks or [])
            init(self, callbacks, *args, **kwargs)
        return __init__

    patching.wrap("{keras}.callbacks.CallbackList.__init__", wrap)
