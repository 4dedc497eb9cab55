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
    epoch's end.

    A commit due at the end of a batch or an epoch is made when the next
    batch or epoch begins (or training ends): by then every callback has
    seen that end, so the committed `state.batch` and `state.epoch` describe
    the committed weights whatever the order of the callbacks in the list.
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._left = batches_per_commit
        self._due = False

    def _commit_if_due(self):
        if self._due:
            self._due = False
            self.state.commit()

    def on_train_begin(self, logs=None):
        self._left = self.batches_per_commit  # the same count on every rank after a reset
        self._due = False

    def on_train_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_batch_end(self, batch, logs=None):
        self._left -= 1
        if self._left == 0:
            self._due = True
            self._left = self.batches_per_commit

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self._due = True

    def on_train_end(self, logs=None):
        self._commit_if_due()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps `state.batch` at the number of batches of the current epoch
    done (0 at each epoch's end), and makes `fit` start its first epoch
    after that many batches: after a reset, the interrupted epoch trains
    each of its remaining batches once. The batches skipped are read and
    dropped on every rank alike (the data starts again at each `fit`), so a
    dataset that gives the same batches every epoch trains as a job that was
    never interrupted. (Horovod edits `params["steps"]`, which Keras reads
    for its progress bar only, so there the whole epoch ran again.)"""

    def __init__(self, state):
        super().__init__()
        self.state = state
        from perseus_tf import patches
        from perseus_tf.strategy import keras_files
        patches.install(patches.STEP_RESUME)
        self._skip_batches = keras_files.skip_batches_of_next_epoch

    def on_train_begin(self, logs=None):
        done = int(getattr(self.state, "batch", 0) or 0)
        if done > 0:
            self._skip_batches(done)

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = batch + 1  # Keras numbers the batches after a skip from it

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
