"""A Keras worker of an elastic job, written as Horovod's Keras elastic
example is: a compiled model whose optimizer (SGD with momentum) builds its
slots at the first step, hvd.elastic.KerasState, the commit / batch / epoch
callbacks, and `fit` inside hvd.elastic.run.

Usage: keras_elastic_worker.py OUT_DIR EPOCHS STEPS [KILL]. Every rank reads
the same STEPS batches each epoch (so the gradients' average, at any size,
is one process's gradient). KILL is "WORKER@EPOCH.BATCH": that worker
(PERSEUS_ELASTIC_WORKER) SIGKILLs itself as that batch begins, in its first
life only. TOUCH_DIR=dir gets a file epoch<E> at each commit made in epoch
E or later (for a discovery script); SLOW=seconds sleeps in each batch;
UNTIL_SIZE=n trains (at most EPOCHS epochs) until an epoch has run at size n,
and stops at that epoch's end (the state's `sizes` has each epoch's size).
SHARD=1 shards the optimizer's state (shard_optimizer_state=True), and
OPTIMIZER=adam trains with Adam instead.
Every worker that finishes writes OUT_DIR/<worker>.json: the batches it
trained as (epoch, batch), its final weights, those of one process training
the same batches uninterrupted, and its resets.
"""

import json
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import perseus_tf.horovod.keras as hvd

keras = tf.keras
BATCH = 4


def make_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def data(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 1))).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


class Record(keras.callbacks.Callback):
    def __init__(self, state, kill, trained):
        super().__init__()
        self.state, self.kill, self.trained = state, kill, trained

    def on_train_batch_begin(self, batch, logs=None):
        if self.kill == (self.state.epoch, batch):
            os.kill(os.getpid(), signal.SIGKILL)
        slow = float(os.environ.get("SLOW", "0"))
        if slow:
            time.sleep(slow)

    def on_train_batch_end(self, batch, logs=None):
        self.trained.append((self.state.epoch, batch))

    def on_epoch_end(self, epoch, logs=None):
        # Before the epoch callback counts it: sizes[e] is epoch e's size.
        self.state.sizes = self.state.sizes + [hvd.size()]
        until = int(os.environ.get("UNTIL_SIZE", "0"))
        if until and self.state.sizes[-1] == until:
            self.model.stop_training = True  # every rank: the same sizes, synced


def optimizer():
    if os.environ.get("OPTIMIZER") == "adam":
        return keras.optimizers.Adam(0.05)
    return keras.optimizers.SGD(0.05, momentum=0.9)


def optimizer_variables(model):
    variables = model.optimizer.variables
    return list(variables() if callable(variables) else variables)


def main():
    out_dir, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    me = os.environ["PERSEUS_ELASTIC_WORKER"]
    kill = None
    for entry in (sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] else []):
        worker, at = entry.rsplit("@", 1)
        if worker == me:
            kill = tuple(int(p) for p in at.split("."))
    touch_dir = os.environ.get("TOUCH_DIR")
    hvd.init()
    model = make_model()
    shard = os.environ.get("SHARD") == "1"
    model.compile(optimizer=hvd.DistributedOptimizer(optimizer(), shard_optimizer_state=shard),
                  loss="mse")
    state = hvd.elastic.KerasState(model, batch=0, epoch=0, sizes=[])
    resets, trained = [], []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    if touch_dir:
        commit = state.commit

        def touching_commit():
            commit()
            for e in range(state.epoch + 1):
                open(os.path.join(touch_dir, f"epoch{e}"), "a").close()
        state.commit = touching_commit
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 Record(state, kill, trained),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        model.fit(data(steps), epochs=epochs - state.epoch, callbacks=callbacks, verbose=0)

    start = time.monotonic()
    train(state)
    took = time.monotonic() - start
    state.save()   # (every rank: the optimizer's state, whole)
    whole_state = state._saved_optimizer
    ref = make_model()
    ref.compile(optimizer=optimizer(), loss="mse")
    ref.fit(data(steps), epochs=state.epoch, verbose=0)
    with open(os.path.join(out_dir, me.replace(":", "_") + ".json"), "w") as f:
        json.dump({"trained": trained, "resets": resets, "size": hvd.size(),
                   "rank": hvd.rank(), "seconds": took, "state": [state.epoch, state.batch],
                   "sizes": state.sizes,
                   "state_shapes": [list(v.shape) for v in optimizer_variables(model)],
                   "reference_state": [np.asarray(v).tolist()
                                       for v in optimizer_variables(ref)],
                   "whole_state": [np.asarray(v).tolist() for v in whole_state],
                   "weights": [w.tolist() for w in model.get_weights()],
                   "reference": [w.tolist() for w in ref.get_weights()]}, f)


if __name__ == "__main__":
    main()
