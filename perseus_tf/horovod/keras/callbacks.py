"""Keras callbacks of the Horovod API (horovod.tensorflow.keras.callbacks),
for Keras 3 and Keras 2."""


import numpy as np
import tensorflow as tf

from perseus_tf import ops
from perseus_tf import notices
from perseus_tf.horovod import _basics
from perseus_tf.horovod._collectives import Average
from perseus_tf.horovod.functions import broadcast_variables

keras = tf.keras


def _variables_of(thing):
    variables = getattr(thing, "variables", [])
    return list(variables() if callable(variables) else variables)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Makes every rank start from `root_rank`'s model and optimizer state.

    Model variables are broadcast when training begins and, with the
    optimizer's variables (which Keras creates on the first step), again at
    the end of the first batch, as Horovod does.

    Args:
      root_rank: the rank whose values every rank takes.
      device: device for the broadcasts ('' = default).
      local_variables: variables to leave alone (each rank keeps its own).
    """

    def __init__(self, root_rank, device='', local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = list(local_variables or [])
        self.broadcast_done = False

    def _shared(self, variables):
        return [v for v in variables if not any(v is l for l in self.local_variables)]

    def _broadcast(self, with_optimizer):
        variables = self._shared(_variables_of(self.model))
        if with_optimizer and getattr(self.model, "optimizer", None) is not None:
            # A sharded optimizer's slots differ by rank (each its own share).
            from perseus_tf.strategy import keras_shard
            sharded = keras_shard.sharded_state_ids(self.model.optimizer)
            variables += [v for v in self._shared(_variables_of(self.model.optimizer))
                          if id(v) not in sharded]
        with tf.device(self.device) if self.device else _nothing():
            broadcast_variables(variables, root_rank=self.root_rank)

    def on_train_begin(self, logs=None):
        if not self.broadcast_done:
            self._broadcast(with_optimizer=False)

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        self._broadcast(with_optimizer=True)
        self.broadcast_done = True


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class MetricAverageCallback(keras.callbacks.Callback):
    """Replaces each epoch's logged metrics by their average over the ranks.

    Put it before callbacks that read the metrics (ReduceLROnPlateau,
    ModelCheckpoint, ...), so that they see the averages. All numeric
    entries of the logs are averaged, in one request, in name order.
    """

    def __init__(self, device=''):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and
                       np.issubdtype(np.asarray(v).dtype, np.number))
        if not names:
            return
        values = [tf.constant([float(np.asarray(logs[k]))], tf.float64) for k in names]
        with tf.device(self.device) if self.device else _nothing():
            averaged = ops.grouped_allreduce(values, op=Average)
        for name, value in zip(names, averaged):
            logs[name] = float(value.numpy()[0])


def _get_lr(optimizer):
    lr = optimizer.learning_rate
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) or callable(lr) and \
            not hasattr(lr, "assign"):
        raise ValueError("learning-rate callbacks need an optimizer with a numeric learning "
                         "rate, not a schedule: pass a float learning_rate to the optimizer")
    return float(np.asarray(lr))


def _set_lr(optimizer, value):
    optimizer.learning_rate = value


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate to `initial_lr * multiplier(epoch)` between
    `start_epoch` and `end_epoch`.

    Args:
      initial_lr: the base learning rate (required).
      multiplier: a constant c (the rate is initial_lr * c ** (epoch - start_epoch))
        or a function of the (possibly fractional) epoch.
      start_epoch: the first epoch it acts in.
      end_epoch: the epoch it stops acting at (not included).
      staircase: adjust once per epoch (True) or every batch with a
        fractional epoch (False).
      momentum_correction: scale the momentum by new_lr / old_lr for the
        batch in which the rate changes (Goyal et al. 2017). Applied where the
        optimizer's momentum is a variable or a Keras 2 legacy
        hyperparameter; Keras 3 and Keras 2 (non-legacy) optimizers compile
        momentum in as a constant, so there it is skipped with a warning.
      steps_per_epoch: batches per epoch (needed when staircase=False;
        taken from `fit` otherwise).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        self._warned = False
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify "
                         f"the steps_per_epoch parameter to {type(self).__name__}().")

    def _momentum_is_adjustable(self, optimizer):
        momentum = getattr(optimizer, "momentum", None)
        if momentum is None:
            return False
        if hasattr(momentum, "assign"):
            return True
        legacy = getattr(getattr(keras.optimizers, "legacy", None), "Optimizer", None)
        if isinstance(legacy, type) and isinstance(optimizer, legacy):
            return True
        if float(momentum) != 0.0 and not self._warned:
            notices.warn(f"{type(self).__name__}: momentum correction is skipped: "
                         f"{type(optimizer).__name__}'s momentum is a constant of its compiled "
                         "update step")
            self._warned = True
        return False

    def _adjust_learning_rate(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(optimizer, new_lr)
        if self.momentum_correction and old_lr > 0 and self._momentum_is_adjustable(optimizer):
            self.restore_momentum = float(np.asarray(optimizer.momentum))
            _set_hyper(optimizer, "momentum", self.restore_momentum * new_lr / old_lr)

    def _restore_momentum_if_needed(self):
        if self.restore_momentum is not None:
            _set_hyper(self.model.optimizer, "momentum", self.restore_momentum)
            self.restore_momentum = None

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (
                self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(self.current_epoch)
        elif not self.staircase:
            self._adjust_learning_rate(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        self._restore_momentum_if_needed()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


def _set_hyper(optimizer, name, value):
    current = getattr(optimizer, name)
    if hasattr(current, "assign"):
        current.assign(value)
    else:
        setattr(optimizer, name, value)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramps the learning rate from initial_lr / size() to initial_lr over
    `warmup_epochs` epochs, batch by batch (Goyal et al. 2017).

    Args:
      initial_lr: the learning rate reached at the end of the warmup (required).
      warmup_epochs: length of the warmup.
      momentum_correction: as in LearningRateScheduleCallback.
      steps_per_epoch: as in LearningRateScheduleCallback.
      verbose: print a line on rank 0 when the warmup ends.
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            # Offset by one batch so the last batch of the warmup reaches initial_lr.
            epoch += 1.0 / self.steps_per_epoch
            n = _basics.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _basics.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")
