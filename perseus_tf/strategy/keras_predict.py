"""`model.predict` under PerseusStrategy returns every row, in the input's
order, on every rank.

The strategy gives each rank its slice of every global batch, as
tf.distribute does. Keras joins a predict step's per-replica outputs with
`reduce_per_replica(..., reduction="concat")`, which gathers across
processes only for MultiWorkerMirroredStrategy; for any other strategy it
joins this process's replicas alone, so each rank got its own rows, silently
(rows 0-7, 16-23, ... of 64 on rank 0). This patch makes the "concat"
reduction of a PerseusStrategy of several ranks join this process's replicas
and then allgather them in rank order: global batch k comes back whole, in
order, on every rank, and predict's step outputs are concatenated as before.
Ranks whose last batch holds fewer rows (or none) send what they have.

Every other reduction (fit's and evaluate's logs) is left as it was: those
values are already the same on every rank.

`predict_on_batch(x)` returns the predictions of all of x on each rank. Keras
2 distributes x like a global batch (every rank passes the same x, as with
predict) and gathers it back through the same reduction. Keras 3 hands x
whole to this process's replicas, so there the patch gathers nothing: the
batch is predicted through a predict function of its own, traced with the
gathering off (under MultiWorkerMirroredStrategy, Keras 3 returns every
worker's copy of x, one after another). Ranks that would run different
numbers of predict steps are refused before the first one
(keras_save._check_predict_steps_agree).

Keras internals reached, by release (perseus_tf/_keras.py lists them all):
  - Keras 3.0 to 3.15: keras.src.backend.tensorflow.trainer.reduce_per_replica,
    looked up as a module global when predict's function is traced, and
    TensorFlowTrainer.predict_on_batch (which builds predict_function through
    make_predict_function when it is None); on 3.0 to 3.2, whose predict
    function reduces with `distribute_reduction_method` (fit's "auto", a
    mean over the replicas), TensorFlowTrainer.predict too, so that its
    reduction is "concat" as from 3.3;
  - Keras 2 (TF 2.15's keras, tf_keras): <package>.src.engine.training
    .reduce_per_replica, the same.
"""

import contextlib
import functools
import threading

import tensorflow as tf
from tensorflow.python.distribute import values as values_lib

# On this thread: `predicting` while a Keras 3.0 to 3.2 predict or any Keras
# 3 predict_on_batch runs (traces) its predict function; `local` while a
# Keras 3 predict_on_batch does.
_state = threading.local()


@contextlib.contextmanager
def _marked(name):
    setattr(_state, name, getattr(_state, name, 0) + 1)
    try:
        yield
    finally:
        setattr(_state, name, getattr(_state, name) - 1)


def _local_rows(value, strategy):
    """This process's replicas' outputs joined along the first axis (a
    scalar output counts as one row per replica, as Keras stacks them)."""
    parts = (strategy.experimental_local_results(value)
             if isinstance(value, values_lib.DistributedValues) else [value])
    if isinstance(parts[0], (tf.SparseTensor, tf.RaggedTensor)):
        raise TypeError(
            f"PerseusStrategy predict(): a model output is a {type(parts[0]).__name__}; "
            "predictions are gathered across ranks as dense tensors only. Return a dense "
            "tensor from the model (or call predict on each rank's own data without the "
            "strategy)")
    parts = [tf.convert_to_tensor(p) for p in parts]
    if parts[0].shape.rank == 0:
        return tf.stack(parts, axis=0)
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def _gathering(original, is_ours):
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if not is_ours(strategy):
            return original(values, strategy, reduction)
        if getattr(_state, "predicting", 0):
            reduction = "concat"  # Keras 3.0 to 3.2 pass fit's "auto" (a mean)
        from perseus_tf import ops
        if reduction != "concat" or getattr(_state, "local", 0) or ops.size() < 2:
            return original(values, strategy, reduction)

        from perseus_tf.cross_device_ops import collective_device

        def gather(value):
            rows = _local_rows(value, strategy)
            with tf.device(collective_device(rows)):
                return ops.allgather(rows)

        return tf.nest.map_structure(gather, values)

    return reduce_per_replica


def _local_predict_on_batch(original, is_ours):
    """Keras 3's predict_on_batch through a predict function of its own,
    traced (and retraced) with the gathering off; kept on the model."""
    @functools.wraps(original)
    def predict_on_batch(self, x):
        from perseus_tf import ops
        if not is_ours(getattr(self, "distribute_strategy", None)) or ops.size() < 2:
            return original(self, x)
        shared = self.predict_function
        self.predict_function = getattr(self, "_perseus_batch_predict_function", None)
        try:
            with _marked("predicting"), _marked("local"):
                return original(self, x)
        finally:
            self._perseus_batch_predict_function = self.predict_function
            self.predict_function = shared

    return predict_on_batch


def _concatenating_predict(original, is_ours):
    """Keras 3.0 to 3.2's predict, whose predict function reduces the
    replicas' outputs with fit's default reduction (a mean): under
    PerseusStrategy it concatenates them, as Keras 3.3 and later do."""
    @functools.wraps(original)
    def predict(self, *args, **kwargs):
        if not is_ours(getattr(self, "distribute_strategy", None)):
            return original(self, *args, **kwargs)
        with _marked("predicting"):
            return original(self, *args, **kwargs)

    return predict


def gather_rows(patching, flavour, is_perseus):
    """The gathering reduction (and Keras 3's predict_on_batch through a
    predict function of its own)."""
    if flavour.major == 3:
        trainer = "{keras}.src.backend.tensorflow.trainer."
        patching.wrap(trainer + "TensorFlowTrainer.predict_on_batch",
                      lambda fn: _local_predict_on_batch(fn, is_perseus))
    else:
        trainer = "{keras}.src.engine.training."
    patching.wrap(trainer + "reduce_per_replica", lambda fn: _gathering(fn, is_perseus))


def concatenate_predictions(patching, flavour, is_perseus):
    """Keras 3.0 to 3.2's predict concatenates the replicas' rows."""
    patching.wrap("{keras}.src.backend.tensorflow.trainer.TensorFlowTrainer.predict",
                  lambda fn: _concatenating_predict(fn, is_perseus))
