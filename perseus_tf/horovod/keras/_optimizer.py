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

Mixed precision: a LossScaleOptimizer around a DistributedOptimizer (what
Keras builds in `compile` under the mixed_float16 policy) decides from the
gradients it is given whether to apply a step or skip it, before it calls
the inner optimizer. Were the gradients reduced inside the inner optimizer,
a rank whose local gradients overflowed would skip the step, and with it
the collective, while the others went on: from then on each rank's step k
would be averaged with another rank's step k+1. So the LossScaleOptimizer's
entry point (Keras 3 `apply`, Keras 2 `apply_gradients`) is wrapped once to
reduce first (as Keras 2's own loss scaling does through the inner
optimizer's gradient aggregation): every rank then decides from the same
reduced gradients, and the inner optimizer applies them without reducing
again. With local accumulation, the step's summed gradients are what is
checked.
"""


import tensorflow as tf

from perseus_tf import _keras
from perseus_tf.horovod._gradient_reducer import GradientReducer, LocalAccumulator


def keras_optimizer_classes():
    """The Keras optimizer base classes importable here (tf.keras, keras, legacy)."""
    return _keras.optimizer_classes()


def _is_keras3(cls):
    # Keras 3's optimizers (any backend) have `stateless_apply`; Keras 2's do not.
    return hasattr(cls, "stateless_apply") and hasattr(cls, "apply")


class _Settings:
    """The DistributedOptimizer arguments a wrapped class is built with."""

    def __init__(self, reducer_args, backward_passes_per_step, average_aggregated_gradients,
                 shard=False):
        self.reducer_args = reducer_args
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.shard = shard  # shard_optimizer_state (perseus_tf/strategy/keras_shard.py)


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
        # > 0 while a LossScaleOptimizer around this optimizer applies
        # gradients it has already reduced through it.
        self.reduced_outside = 0
        # Sharded: the step's variables, while a LossScaleOptimizer applies
        # this rank's share of them.
        self.step_variables = None


class _DistributedMixin:
    """What every wrapped Keras optimizer class shares."""

    _perseus_settings = None  # set on each generated class

    def _perseus(self):
        state = self.__dict__.get("_perseus_state_")
        if state is None:
            state = _State(self._perseus_settings)
            self.__dict__["_perseus_state_"] = state
        return state

    def _perseus_sharded(self):
        """shard_optimizer_state=True in a job of more than one rank (one
        rank has nothing to share out: it applies as unsharded, as does an
        elastic job once it shrinks to one)."""
        from perseus_tf.strategy import keras_shard
        return keras_shard._shim_sharded(self)

    def register_local_var(self, var):
        """Keeps `var`'s gradient local (not reduced across ranks)."""
        self._perseus().reducer.register_local_var(var)

    def _perseus_apply(self, grads, variables, apply_fn, reduce=True):
        """Reduces `grads` and calls `apply_fn(reduced)`; with local
        accumulation, only every k-th call (the others count an iteration).
        reduce=False: apply_fn reduces (sharded: a reduce-scatter) and gets
        this rank's gradients, or their accumulated sums (averaged over the
        passes when average_aggregated_gradients)."""
        state = self._perseus()
        if state.reduced_outside:
            return apply_fn(grads)
        if state.accumulator is None:
            return apply_fn(state.reducer(grads, variables) if reduce else grads)
        if reduce:
            is_step, summed = state.accumulator.accumulate(grads, variables)
        else:
            acc = state.accumulator
            is_step, totals = acc.sums.add(
                [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for g in grads], variables)
            summed = [None if t is None else
                      t / tf.cast(acc.k, t.dtype) if acc.average else t for t in totals]

        def step():
            applied = apply_fn(summed)
            deps = [] if applied is None or not tf.is_tensor(applied) else [applied]
            with tf.control_dependencies(deps):
                return tf.constant(True)

        def skip():
            # (Keras 3.0 to 3.2's assign_add returns None; the update runs.)
            counted = self.iterations.assign_add(1)
            with tf.control_dependencies([] if counted is None else [counted]):
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
            if (state.accumulator is not None or self._perseus_settings.shard) and \
                    not self.built:
                self.build(variables)  # outside the tf.cond that applies
        else:
            variables = state.variables
        base_apply = super().apply
        if self._perseus_sharded():
            from perseus_tf.strategy import keras_shard
            if state.reduced_outside:
                return keras_shard.shim_apply(self, grads, variables, base_apply, state.reducer,
                                              reduced=True, all_variables=state.step_variables)
            return self._perseus_apply(
                grads, variables, lambda summed: keras_shard.shim_apply(
                    self, summed, variables, base_apply, state.reducer), reduce=False)
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
        if self._perseus_sharded():
            return self._perseus_sharded_apply(grads, variables, base_apply, args, kwargs)
        return self._perseus_apply(
            grads, variables,
            lambda reduced: base_apply(list(zip(reduced, variables)), *args, **kwargs))

    def _perseus_sharded_apply(self, grads, variables, base_apply, args, kwargs):
        """shard_optimizer_state=True (Keras 2): the shares reduce-scattered,
        or, inside a LossScaleOptimizer (which reduced them whole to check
        them), this rank's share of them; applied, then gathered."""
        from perseus_tf.strategy import keras_shard
        state = self._perseus()
        with tf.init_scope():
            self.build(variables)
        shards = keras_shard._shards(self)
        keras_shard._checkpoint_state_whole(self, shards)
        apply = lambda gs, vs: base_apply(list(zip(gs, vs)), *args, **kwargs)  # noqa: E731
        if not state.reduced_outside:
            return self._perseus_apply(
                grads, variables, lambda summed: keras_shard.shim_apply(
                    self, summed, variables, apply, state.reducer), reduce=False)
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        owned = keras_shard.owned_share(self, shards, pairs)
        return keras_shard.shim_apply(self, [g for g, _ in owned], [v for _, v in owned],
                                      apply, state.reducer, reduced=True,
                                      all_variables=[v for _, v in pairs])


def _reduced_through(inner, apply_fn):
    """apply_fn(reduced), run with `inner` told that its gradients arrive
    reduced."""
    def apply(reduced):
        state = inner._perseus()
        state.reduced_outside += 1
        try:
            return apply_fn(reduced)
        finally:
            state.reduced_outside -= 1
    return apply


def _keras3_loss_scale_apply(original):
    def apply(self, grads, trainable_variables=None):
        inner = getattr(self, "inner_optimizer", None)
        if not is_distributed(inner):
            return original(self, grads, trainable_variables)
        grads = list(grads)
        if trainable_variables is not None:
            variables = list(trainable_variables)
        else:
            variables = inner._perseus().variables
        if not self.built:  # its variables, outside the tf.cond of accumulation
            self.build(variables)
            self.built = True
        if inner._perseus_sharded():
            return _sharded_loss_scale_apply(self, original, inner, grads, variables)
        return inner._perseus_apply(grads, variables, _reduced_through(
            inner, lambda reduced: original(self, reduced, trainable_variables)))
    apply.__doc__ = original.__doc__
    return apply


def _sharded_loss_scale_apply(lso, original, inner, grads, variables):
    """A LossScaleOptimizer around a sharded DistributedOptimizer: each rank
    checks its share of the reduced gradients, the ranks agree (one
    allreduce: any share not finite skips the step everywhere), and the
    inner optimizer applies the shares and gathers the weights."""
    from perseus_tf.strategy import keras_shard
    state = inner._perseus()
    if state.accumulator is not None:
        raise ValueError(
            "a LossScaleOptimizer around hvd.DistributedOptimizer(shard_optimizer_state=True, "
            "backward_passes_per_step=k > 1) is not supported: set backward_passes_per_step=1, "
            "or shard_optimizer_state=False")
    shards = keras_shard._shards(inner)
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    owned = keras_shard.shim_reduce(inner, shards, pairs, state.reducer)
    finite = keras_shard.all_finite([g for g, _ in owned])
    lso.__dict__["check_finite"] = lambda _grads: finite
    state.step_variables = [v for _, v in pairs]
    state.reduced_outside += 1
    try:
        return original(lso, [g for g, _ in owned], [v for _, v in owned])
    finally:
        state.reduced_outside -= 1
        state.step_variables = None
        del lso.__dict__["check_finite"]


def _keras2_loss_scale_apply_gradients(original):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        inner = getattr(self, "inner_optimizer", None)
        grads_and_vars = list(grads_and_vars)
        if not is_distributed(inner) or not grads_and_vars:
            return original(self, grads_and_vars, *args, **kwargs)
        grads, variables = (list(x) for x in zip(*grads_and_vars))
        return inner._perseus_apply(grads, variables, _reduced_through(
            inner, lambda reduced: original(self, list(zip(reduced, variables)), *args,
                                            **kwargs)))
    apply_gradients.__doc__ = original.__doc__
    return apply_gradients


def reduce_first(patching, flavour):
    """Wraps this Keras' LossScaleOptimizer classes (Keras 3's; Keras 2's
    current and legacy ones), so that around a DistributedOptimizer they
    reduce the gradients before deciding whether they are finite (see the
    module's docstring). Around any other optimizer they behave as before."""
    if flavour.major == 3:
        patching.wrap("{keras}.optimizers.LossScaleOptimizer.apply", _keras3_loss_scale_apply)
        return
    for target in patching.patch.targets:
        cls, name, _ = patching.target(target)
        if name in vars(cls):
            patching.replace(cls, name, _keras2_loss_scale_apply_gradients(vars(cls)[name]))


def _holds_shim_collectives(model):
    """Whether a compiled model's train step reduces its gradients here."""
    optimizer = getattr(model, "optimizer", None)
    return is_distributed(optimizer) or is_distributed(getattr(optimizer, "inner_optimizer", None))


def distributed_class(optimizer_class, settings):
    """A subclass of `optimizer_class` that reduces gradients with `settings`."""
    from perseus_tf import patches
    from perseus_tf.strategy import keras_xla
    keras_xla.holding_collectives(_holds_shim_collectives)
    patches.install(patches.SHIM)
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
