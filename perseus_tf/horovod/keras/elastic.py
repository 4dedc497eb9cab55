"""`hvd.elastic` of the Keras API (horovod.tensorflow.keras.elastic): the
state of a Keras model and the callbacks that keep it current in `fit`, over
perseus_tf.horovod.elastic (see there for what a reset does, and for what is
not there yet)."""

import tensorflow as tf

from perseus_tf.horovod.elastic import (  # noqa: F401 - Horovod's names
    HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State, TensorFlowKerasState, run)

keras = tf.keras


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer and keyword attributes (Horovod's
    KerasState, for the Keras API)."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits `state` every `batches_per_commit` batches and at each
    epoch's end."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._left = batches_per_commit

    def on_train_begin(self, logs=None):
        self._left = self.batches_per_commit  # the same count on every rank after a reset

    def on_batch_end(self, batch, logs=None):
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the last batch done, and after a reset runs
    only the rest of the interrupted epoch's steps."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._steps = None

    def on_train_begin(self, logs=None):
        self._steps = None

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps") if self.params else None
        if steps:
            if self._steps is None:
                self._steps = steps
            self.params["steps"] = self._steps - self.state.batch

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps `state.epoch` at the number of epochs done across resets (Keras
    counts from 0 at each fit)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._first = state.epoch

    def on_train_begin(self, logs=None):
        self._first = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._first + epoch + 1
