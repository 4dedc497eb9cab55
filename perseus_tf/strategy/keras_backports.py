"""What Keras 3.8 and 3.10 do under a tf.distribute strategy, on older Keras 3.

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

Metrics: Keras 3.0 to 3.9 create a metric's variables as variables every
replica writes (3.0 to 3.6 drop their aggregation; 3.7 to 3.9 keep it but
not the on-read synchronization), so each rank would report its own rows'
loss and metrics in evaluate. Under a PerseusStrategy they are created as
Keras 3.10 creates them (`synchronization="on_read"`), on-read variables
that sum (or average, as the metric asks) over the ranks when read:
`metric_variable()` marks their creation for PerseusExtended._create_variable.
"""

import threading

import tensorflow as tf

from perseus_tf import _keras

_predicates = []   # strategy -> whether to behave as Keras 3.8 under it


def _applies(strategy):
    return any(is_ours(strategy) for is_ours in _predicates)
# Set by Keras' train step for the optimizer's next scale_loss (the same
# replica thread): the replica count to divide the loss by.
_train_step = threading.local()
# Set while Keras 3.0 to 3.9 create a metric's variable: its aggregation.
_metric = threading.local()


def metric_variable():
    """The aggregation ("sum", "mean", ...) of the metric variable being
    created in this thread, or None."""
    return getattr(_metric, "aggregation", None)


def also_under(is_perseus):
    """Behave as Keras 3.8 under the strategies is_perseus(strategy) tells
    too (tests/workers/model_matrix_worker.py adds its one-process
    MirroredStrategy reference); the patches are perseus_tf.patches.BACKPORTS."""
    if is_perseus not in _predicates:
        _predicates.append(is_perseus)


# The patches act under the strategies registered with also_under (the
# strategy registers PerseusStrategy before it installs them).
def scale_fit_loss(patching, flavour):
    _scale_fit_loss(patching, _applies)


def sum_gradients(patching, flavour):
    _sum_gradients(patching, _applies)


def mark_metric_variables(patching, flavour):
    _mark_metric_variables(patching)


def mark_metric_variables_initializer(patching, flavour):
    patching.wrap("{keras}.src.backend.tensorflow.core.Variable._initialize_with_initializer",
                  _initialized_marked)


def _mark_metric_variables(patching):
    """Marks a metric variable's creation; a variable made while a step is
    traced is created later, outside add_variable (its TF variable is made
    at _deferred_initialize), so the variable carries its aggregation too."""
    import inspect

    _, _, add_variable = patching.target("{keras}.src.metrics.metric.Metric.add_variable")
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

    patching.wrap("{keras}.src.metrics.metric.Metric.add_variable", lambda _: marked)
    patching.wrap("{keras}.src.backend.tensorflow.core.Variable._initialize", _initialized_marked)


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


def _scale_fit_loss(patching, is_perseus):
    def scaled(train_step):
        def scaled_train_step(self, *args, **kwargs):
            strategy = tf.distribute.get_strategy()
            _train_step.divisor = strategy.num_replicas_in_sync if is_perseus(strategy) else None
            try:
                return train_step(self, *args, **kwargs)
            finally:
                _train_step.divisor = None
        return scaled_train_step

    patching.wrap("{keras}.src.backend.tensorflow.trainer.TensorFlowTrainer.train_step", scaled)
    patching.wrap("{keras}.src.optimizers.base_optimizer.BaseOptimizer.scale_loss", _divided_once)
    patching.wrap("{keras}.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.scale_loss",
                  _divided_once)


def _divided_once(scale_loss):
    def divided(self, loss):
        n = getattr(_train_step, "divisor", None)
        if n:
            _train_step.divisor = None      # once per train step
            loss = loss / tf.cast(n, loss.dtype)
        return scale_loss(self, loss)
    return divided


def _sum_gradients(patching, is_perseus):
    _, _, update_step = patching.target(
        "{keras}.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step")

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        context = tf.distribute.get_replica_context()
        present = [i for i, g in enumerate(grads) if g is not None]
        if context is not None and present and is_perseus(tf.distribute.get_strategy()):
            reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
            grads = list(grads)
            for i, g in zip(present, reduced):
                grads[i] = g
        return update_step(self, grads, trainable_variables, learning_rate)

    patching.wrap("{keras}.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step",
                  lambda _: _backend_update_step)
