"""What Keras 3.8 does under a tf.distribute strategy, on Keras 3.0 to 3.7.

Gradients: averaged over the replicas on every Keras 3 release.

Keras 3.8 and later do what tf.distribute's custom-loop recipe does: `fit`
scales each replica's loss by 1/replicas, and the TF optimizer sums the
gradients over the replicas (`_all_reduce_sum_gradients`), so a step
applies the gradient of the global batch's mean loss, as one process
training on the global batch would. Older releases do not, under any
tf.distribute strategy:

- Keras 3.0 to 3.4 never reduce the gradients: each replica applies its own
  (3.2 to 3.4 call `_all_reduce_sum_gradients` in cross-replica context,
  where it returns them unreduced). Every rank would train its own model,
  silently.
- Keras 3.0 to 3.7 do not scale `fit`'s loss: with the sum, every step of
  3.5 to 3.7 would be `replicas` times too large.

Under a PerseusStrategy both are made to behave as 3.8: on 3.0 to 3.4 the
TF optimizer sums the gradients over the replicas before its update (custom
loops that scale their loss by the global batch, as
tf.nn.compute_average_loss does, then train as on 3.8); on 3.0 to 3.7 the
loss of Keras' own train step is divided by the replica count where the
train step hands it to the optimizer (`optimizer.scale_loss`, after the
loss metric has recorded it). Keras 3.8 and later, and Keras 2 (which
scales and sums in its own optimizer), are left alone.

Metrics: Keras 3.0 to 3.6 create a metric's variables as plain variables
(the TF backend drops their aggregation), so each rank would report its own
rows' loss and metrics. Under a PerseusStrategy they are created as Keras
3.8 creates them, on-read variables that sum (or average, as the metric
asks) over the ranks when read: `metric_variable()` marks their creation
for PerseusExtended._create_variable.
"""

import threading

import tensorflow as tf

from perseus_tf import _keras

_installed = False
_predicates = []   # strategy -> whether to behave as Keras 3.8 under it


def _applies(strategy):
    return any(is_ours(strategy) for is_ours in _predicates)
# Set by Keras' train step for the optimizer's next scale_loss (the same
# replica thread): the replica count to divide the loss by.
_train_step = threading.local()
# Set while Keras 3.0 to 3.6 create a metric's variable: its aggregation.
_metric = threading.local()


def metric_variable():
    """The aggregation ("sum", "mean", ...) of the metric variable being
    created in this thread, or None."""
    return getattr(_metric, "aggregation", None)


def install(is_perseus):
    """Patches Keras 3.0 to 3.7's TF trainer and optimizers once;
    is_perseus(strategy) tells the strategies to do it under (each call adds
    one: tests/workers/model_matrix_worker.py adds its one-process
    MirroredStrategy reference)."""
    global _installed
    flavour = _keras.keras3()
    if flavour is None or flavour.at_least(3, 8):
        return
    if is_perseus not in _predicates:
        _predicates.append(is_perseus)
    if _installed:
        return
    _installed = True
    _scale_fit_loss(_applies)
    if not flavour.at_least(3, 5):
        _sum_gradients(_applies)
    if not flavour.at_least(3, 7):
        _mark_metric_variables()


def _mark_metric_variables():
    """Marks a metric variable's creation; a variable made while a step is
    traced is created later, outside add_variable (its TF variable is made
    at _deferred_initialize), so the variable carries its aggregation too."""
    import inspect

    from keras.src.backend.tensorflow import core
    from keras.src.metrics import metric

    add_variable = metric.Metric.add_variable
    signature = inspect.signature(add_variable)

    def marked(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        aggregation = bound.arguments.get("aggregation", "sum")   # 3.0-3.2: always sums
        _metric.aggregation = aggregation
        try:
            variable = add_variable(self, *args, **kwargs)
        finally:
            _metric.aggregation = None
        variable._perseus_aggregation = aggregation
        return variable

    metric.Metric.add_variable = marked
    for method in ("_initialize", "_initialize_with_initializer"):
        if method in vars(core.Variable):
            setattr(core.Variable, method, _initialized_marked(vars(core.Variable)[method]))


def _initialized_marked(initialize):
    def initialized(self, *args, **kwargs):
        aggregation = getattr(self, "_perseus_aggregation", None)
        if aggregation is None:
            return initialize(self, *args, **kwargs)
        _metric.aggregation = aggregation
        try:
            return initialize(self, *args, **kwargs)
        finally:
            _metric.aggregation = None
    return initialized


def _scale_fit_loss(is_perseus):
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.optimizers import base_optimizer, loss_scale_optimizer

    trainer = tf_trainer.TensorFlowTrainer
    train_step = trainer.train_step

    def scaled_train_step(self, *args, **kwargs):
        strategy = tf.distribute.get_strategy()
        _train_step.divisor = strategy.num_replicas_in_sync if is_perseus(strategy) else None
        try:
            return train_step(self, *args, **kwargs)
        finally:
            _train_step.divisor = None

    trainer.train_step = scaled_train_step
    for cls in (base_optimizer.BaseOptimizer, loss_scale_optimizer.LossScaleOptimizer):
        cls.scale_loss = _divided_once(cls.scale_loss)


def _divided_once(scale_loss):
    def divided(self, loss):
        n = getattr(_train_step, "divisor", None)
        if n:
            _train_step.divisor = None      # once per train step
            loss = loss / tf.cast(n, loss.dtype)
        return scale_loss(self, loss)
    return divided


def _sum_gradients(is_perseus):
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    cls = tf_optimizer.TFOptimizer
    update_step = cls._backend_update_step

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        context = tf.distribute.get_replica_context()
        present = [i for i, g in enumerate(grads) if g is not None]
        if context is not None and present and is_perseus(tf.distribute.get_strategy()):
            reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
            grads = list(grads)
            for i, g in zip(present, reduced):
                grads[i] = g
        return update_step(self, grads, trainable_variables, learning_rate)

    cls._backend_update_step = _backend_update_step
