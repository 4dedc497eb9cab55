"""BackupAndRestore across a restart of every rank (tests/test_backup_restore.py).

    backup_worker.py PHASE DIR

PHASE "crash": fit with BackupAndRestore(DIR, save_freq=2 batches) and stop
at the start of epoch 2 (as a killed job would). PHASE "resume": a new model
(other initial weights), the same callback: prints the epochs it ran and a
checksum of its weights. PHASE "skew": like resume, but ranks other than 0
look in an empty directory: the ranks must refuse to go on.
PHASE "whole": seed 1, no interruption, save_freq=3 batches (the reference).
PHASE "crash-step": seed 1, save_freq=3, killed at the start of epoch 1's
third batch (the last backup is after its second). PHASE "resume-step": a new
model (seed 99) resumes from that backup: it must train epoch 1's last two
batches, then epochs 2 and 3, and end where "whole" ended.
PHASE "crash-torn" ("crash-torn-double": with double_checkpoint=True): as
"crash-step", but rank 0 then puts the first backup's metadata back beside
the second backup's weights, as a job stopped between Keras' two writes of
the second backup leaves them. "resume-torn" / "resume-double": "resume-step"
with the same callback settings.
"""

import shutil

import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import perseus_tf  # noqa: E402

keras = tf.keras
phase, directory = sys.argv[1], sys.argv[2]
strategy = perseus_tf.PerseusStrategy()
rank = perseus_tf.rank()
x = np.random.default_rng(0).random((64, 6)).astype(np.float32)
y = x.sum(axis=1, keepdims=True)
data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8 * perseus_tf.size())


class Stop(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise KeyboardInterrupt("job killed")


class StopMidEpoch(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.epoch == 1 and batch == 2:
            raise KeyboardInterrupt("job killed")


class CountBatches(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.seen.setdefault(self.epoch, []).append(int(batch))


class Tear(keras.callbacks.Callback):
    """After the first backup, keeps its metadata; when the job is stopped,
    puts it back over the second backup's (rank 0 writes the backup)."""

    def __init__(self, backup_dir):
        super().__init__()
        self.metadata = os.path.join(backup_dir, "training_metadata.json")
        self.kept = self.metadata + ".first"

    def on_train_batch_end(self, batch, logs=None):
        if rank == 0 and os.path.exists(self.metadata) and not os.path.exists(self.kept):
            shutil.copyfile(self.metadata, self.kept)

    def tear(self):
        if rank == 0:
            shutil.copyfile(self.kept, self.metadata)


with strategy.scope():
    keras.utils.set_random_seed(1 if phase == "whole" or phase.startswith("crash") else 99)
    model = keras.Sequential([keras.Input(shape=(6,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
where = directory if phase != "skew" or rank == 0 else directory + "-empty"
callbacks = [keras.callbacks.BackupAndRestore(backup_dir=where, save_freq=2)]
if phase in ("whole", "crash-step", "resume-step", "crash-torn", "resume-torn",
             "crash-torn-double", "resume-double"):
    counter = CountBatches()
    double = {"double_checkpoint": True} if phase.endswith("double") else {}
    callbacks = [keras.callbacks.BackupAndRestore(backup_dir=directory, save_freq=3, **double),
                 counter]
    tear = Tear(directory) if phase.startswith("crash-torn") else None
    try:
        model.fit(data, epochs=4, verbose=0,
                  callbacks=callbacks + ([tear] if tear else []) +
                  ([StopMidEpoch()] if phase.startswith("crash-") else []))
    except KeyboardInterrupt:
        if tear:
            tear.tear()
        print(f"CRASHED rank {rank}", flush=True)
        sys.exit(0)
    except RuntimeError as e:
        print(f"REFUSED rank {rank}: {e}", flush=True)
        sys.exit(3)
    weights = np.concatenate([w.numpy().ravel() for w in model.trainable_weights])
    print(f"STEPS rank {rank} {sorted(counter.seen.items())} weights "
          f"{' '.join(f'{v:.8e}' for v in weights)}", flush=True)
    sys.exit(0)
if phase == "crash":
    try:
        model.fit(data, epochs=4, verbose=0, callbacks=callbacks + [Stop()])
    except KeyboardInterrupt:
        pass
    print(f"CRASHED rank {rank}", flush=True)
    sys.exit(0)
try:
    history = model.fit(data, epochs=4, verbose=0, callbacks=callbacks)
except RuntimeError as e:
    print(f"REFUSED rank {rank}: {e}", flush=True)
    sys.exit(3)
checksum = sum(float(np.abs(w.numpy()).sum()) for w in model.trainable_weights)
print(f"RESUMED rank {rank} epochs {history.epoch} checksum {checksum:.9g}", flush=True)
