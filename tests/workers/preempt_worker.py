"""Keras fit under PerseusStrategy with BackupAndRestore, stopped and
restarted (tests/test_preemption.py).

    preempt_worker.py OUT BACKUP SAVE_FREQ [EVENT]

Trains a small model for 3 epochs of 4 batches, global batch 24 at any size.
SAVE_FREQ is BackupAndRestore's ("epoch" or a number of batches). EVENT
"term:E:B:R" or "kill:E:B:R": rank R sends itself SIGTERM (a preemption
notice) or SIGKILL at the start of batch B of epoch E, once per job (a file
in OUT remembers it); "grow:E:B:R": there rank R creates OUT/grow (for the
discovery script) and every rank waits until perseusrun says hosts were
added. Rank 0 appends "epoch batch size time" to OUT/steps.txt
after each batch it trained (each batch takes at least PREEMPT_WORKER_SLEEP
seconds more, when set); each rank that finishes writes
OUT/final-RANK.json with its size and weights.
"""

import json
import os
import signal
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import perseus_tf  # noqa: E402
import perseus_tf.config.elastic_rounds  # noqa: E402

keras = tf.keras
out, backup_dir, save_freq = sys.argv[1], sys.argv[2], sys.argv[3]
event = sys.argv[4] if len(sys.argv) > 4 else ""
save_freq = save_freq if save_freq == "epoch" else int(save_freq)

strategy = perseus_tf.PerseusStrategy()
rank, size = perseus_tf.rank(), perseus_tf.size()
rng = np.random.default_rng(3)
x = rng.standard_normal((96, 5)).astype(np.float32)
y = (x @ rng.standard_normal((5, 1)) + 0.1).astype(np.float32)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(24)

with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input(shape=(5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")


class Script(keras.callbacks.Callback):
    """The event, and rank 0's record of the batches trained."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if not event:
            return
        kind, e, b, r = event.split(":")
        done = os.path.join(out, "event-done")
        if (self.epoch, batch) != (int(e), int(b)) or os.path.exists(done):
            return
        if kind == "grow":
            # Every rank: the discovery script lists one more slot once OUT/grow
            # exists; wait until perseusrun's worker there has asked to join.
            if rank == int(r):
                open(os.path.join(out, "grow"), "w").close()
            deadline = time.monotonic() + 240
            while perseus_tf.config.elastic_rounds.hosts_updated() is None:
                assert time.monotonic() < deadline, "no worker joined within 240 s"
                time.sleep(0.05)
            perseus_tf.allreduce(tf.constant([1]), name="preempt_worker.grown")
            if rank == 0:
                open(done, "w").close()
        elif rank == int(r):
            open(done, "w").close()
            os.kill(os.getpid(), signal.SIGTERM if kind == "term" else signal.SIGKILL)

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(float(os.environ.get("PREEMPT_WORKER_SLEEP", "0")))
        if rank == 0:
            with open(os.path.join(out, "steps.txt"), "a") as f:
                f.write(f"{self.epoch} {batch} {size} {time.time():.3f}\n")


# The recorder runs before BackupAndRestore, which leaves fit at a stop.
model.fit(data, epochs=3, verbose=0,
          callbacks=[Script(), keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq)])
weights = np.concatenate([w.numpy().ravel() for w in model.trainable_weights])
with open(os.path.join(out, f"final-{rank}.json"), "w") as f:
    json.dump({"size": size, "weights": weights.tolist()}, f)
