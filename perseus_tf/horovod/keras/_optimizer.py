"""`hvd.DistributedOptimizer` for Keras 3 (TF >= 2.16) and Keras 2 (TF 2.15).

The wrapped optimizer is rebuilt as an instance of a subclass of its own
class, through the public `get_config` / `from_config`, overriding only the
public method through which gradients reach the update:
  - Keras 3: `apply(grads, trainable_variables)` (`apply_gradients` and
    `fit` call it);
  - Keras 2: `apply_gradients(grads_and_vars, ...)` (`minimize` and `fit`
    call it), for both the current and the `legacy` optimizers.
The subclass keeps the class's name and module, so saved models load
without Perseus-TF; `load_model` here maps them back onto the subclass.
"""

import tensorflow as tf

from perseus_tf.horovod._gradients import GradientReducer, LocalAccumulator


def keras_optimizer_classes():
    """The Keras optimizer base classes importable here (tf.keras, keras, legacy)."""
    modules = [tf.keras.optimizers]
    try:
        import keras
        modules.append(keras.optimizers)
    except ImportError:  # pragma: no cover
        pass
    classes = []
    for module in modules:
        for holder in (module, getattr(module, "legacy", None)):
            cls = getattr(holder, "Optimizer", None)
            if isinstance(cls, type) and cls not in classes:
                classes.append(cls)
    return tuple(classes)


def _is_keras3(cls):
    # Keras 3's optimizers (any backend) have `stateless_apply`; Keras 2's do not.
    return hasattr(cls, "stateless_apply") and hasattr(cls, "apply")


class _Settings:
    """The DistributedOptimizer arguments a wrapped class is built with."""

    def __init__(self, reducer_args, backward_passes_per_step, average_aggregated_gradients):
        self.reducer_args = reducer_args
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients


class _State:
    """Per-instance state, held in a plain object so Keras does not track it."""

    def __init__(self, settings):
        self.reducer = GradientReducer(**settings.reducer_args)
        self.accumulator = None
        if settings.backward_passes_per_step > 1:
            self.accumulator = LocalAccumulator(settings.backward_passes_per_step,
                                                settings.average_aggregated_gradients,
                                                self.reducer)
        self.variables = None


class _DistributedMixin:
    """What every wrapped Keras optimizer class shares."""

    _perseus_settings = None  # set on each generated class

    def _perseus(self):
        state = self.__dict__.get("_perseus_state_")
        if state is None:
            state = _State(self._perseus_settings)
            self.__dict__["_perseus_state_"] = state
        return state

    def register_local_var(self, var):
        """Keeps `var`'s gradient local (not reduced across ranks)."""
        self._perseus().reducer.register_local_var(var)

    def _perseus_apply(self, grads, variables, apply_fn):
        """Reduces `grads` and calls `apply_fn(reduced)`; with local
        accumulation, only every k-th call (the others count an iteration)."""
        state = self._perseus()
        if state.accumulator is None:
            return apply_fn(state.reducer(grads, variables))
        is_step, summed = state.accumulator.accumulate(grads, variables)

        def step():
            applied = apply_fn(summed)
            deps = [] if applied is None or not tf.is_tensor(applied) else [applied]
            with tf.control_dependencies(deps):
                return tf.constant(True)

        def skip():
            with tf.control_dependencies([self.iterations.assign_add(1)]):
                return tf.constant(False)

        return tf.cond(is_step, step, skip)


class _Keras3Mixin(_DistributedMixin):

    def build(self, variables):
        self._perseus().variables = list(variables)
        return super().build(variables)

    def apply(self, grads, trainable_variables=None):
        """Reduces the gradients across ranks, then applies them (Keras 3)."""
        grads = list(grads)
        state = self._perseus()
        if trainable_variables is not None:
            variables = list(trainable_variables)
            if state.accumulator is not None and not self.built:
                self.build(variables)  # outside the tf.cond that applies
        else:
            variables = state.variables
        base_apply = super().apply
        return self._perseus_apply(
            grads, variables, lambda reduced: base_apply(reduced, trainable_variables))


class _Keras2Mixin(_DistributedMixin):

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Reduces the gradients across ranks, then applies them (Keras 2)."""
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        grads, variables = (list(x) for x in zip(*grads_and_vars))
        base_apply = super().apply_gradients
        return self._perseus_apply(
            grads, variables,
            lambda reduced: base_apply(list(zip(reduced, variables)), *args, **kwargs))


def distributed_class(optimizer_class, settings):
    """A subclass of `optimizer_class` that reduces gradients with `settings`."""
    if issubclass(optimizer_class, _DistributedMixin):
        raise ValueError(f"{optimizer_class.__name__} is already a DistributedOptimizer")
    if getattr(optimizer_class, "inner_optimizer", None) is not None or \
            optimizer_class.__name__ == "LossScaleOptimizer":
        raise ValueError("wrap the inner optimizer: hvd.DistributedOptimizer(opt) first, then "
                         "keras.mixed_precision.LossScaleOptimizer(...) around it")
    mixin = _Keras3Mixin if _is_keras3(optimizer_class) else _Keras2Mixin
    return type(optimizer_class.__name__, (mixin, optimizer_class),
                {"__module__": optimizer_class.__module__,
                 "__qualname__": optimizer_class.__qualname__,
                 "_perseus_settings": settings})


def is_distributed(optimizer):
    return isinstance(optimizer, _DistributedMixin)
