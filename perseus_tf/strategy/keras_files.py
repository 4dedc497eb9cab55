"""Keras 3 callbacks that write files write them on rank 0 only.

Every rank still runs the callbacks (a callback may make collectives of its
own; saving itself makes none, see keras_save), but ranks other than 0
write into a private scratch directory.
Keras 2 does this itself for strategies in multi-worker mode; Keras 3 does
not, so PerseusStrategy installs these small redirections when size > 1.
"""

import atexit
import errno
import os
import shutil

from perseus_tf import _keras
from perseus_tf.common.scratch import rank_scratch
from perseus_tf.strategy.keras_preempt import read_marker

_BACKUP = "{keras}.callbacks.BackupAndRestore"


def _out_of_room(error):
    return isinstance(error, OSError) and (
        error.errno == errno.ENOSPC or "No space left" in str(error))


def _model_mib(model):
    import numpy as np
    total = 0
    for w in getattr(model, "weights", []):
        total += int(np.prod(w.shape)) * np.dtype(getattr(w.dtype, "name", w.dtype)).itemsize
    return total / 2**20


def _writing_scratch(what, directory, rank, write, model):
    """write(), with a full scratch disk named: what was being written,
    where, how much room it needs and what to do (a bare "No space left on
    device" on a rank that writes nothing the user asked for says none)."""
    try:
        return write()
    except Exception as e:  # noqa: BLE001 - only a full disk is translated
        if not _out_of_room(e):
            raise
        try:
            free = shutil.disk_usage(directory).free / 2**20
        except OSError:
            free = 0.0
        raise OSError(
            errno.ENOSPC,
            f"Perseus-TF rank {rank}: no space left in its scratch directory {directory} for "
            f"its copy of {what} (the model's weights alone are about "
            f"{_model_mib(model):.1f} MiB, with optimizer state more; {free:.1f} MiB are "
            f"free there). Under PerseusStrategy the ranks other than 0 write their copies "
            f"there while rank 0 writes yours: free space in {os.path.dirname(directory)}, "
            f"or set TMPDIR to a directory with room on every host") from e


def write_in_rank_scratch(patching, flavour, rank):
    """Keras 3's file-writing callbacks on a rank other than 0 (Keras 2 uses
    the strategy's should_checkpoint and task id itself)."""
    if rank == 0:
        return
    scratch = rank_scratch(rank)
    # Full checkpoint copies: removed when the process exits (and by
    # perseusrun or remote.py when a signal kills it: common/scratch.py).
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    checkpoint = "{keras}.callbacks.ModelCheckpoint."
    _, _, get_path = patching.target(checkpoint + "_get_file_path")

    def _get_file_path(self, *args, **kwargs):
        path = get_path(self, *args, **kwargs)
        return os.path.join(scratch, "checkpoints", os.path.basename(path))

    patching.wrap(checkpoint + "_get_file_path", lambda _: _get_file_path)
    _, _, checkpoint_save = patching.target(checkpoint + "_save_model")

    def _checkpoint_save_model(self, *args, **kwargs):
        return _writing_scratch(
            f"the checkpoint {os.path.basename(str(self.filepath))}",
            os.path.join(scratch, "checkpoints"), rank,
            lambda: checkpoint_save(self, *args, **kwargs), self.model)

    patching.wrap(checkpoint + "_save_model", lambda _: _checkpoint_save_model)
    _, _, tb_init = patching.target("{keras}.callbacks.TensorBoard.__init__")

    def tensorboard_init(self, log_dir="logs", *args, **kwargs):
        tb_init(self, os.path.join(scratch, "tensorboard"), *args, **kwargs)

    patching.wrap("{keras}.callbacks.TensorBoard.__init__", lambda _: tensorboard_init)

    # BackupAndRestore: every rank restores from rank 0's backup (the real
    # backup_dir, which must be readable by every rank: one host, or a shared
    # file system), so all resume at the same epoch with the same weights;
    # ranks other than 0 still save, into their scratch directory, and
    # never delete rank 0's backup.
    _, _, save_model = patching.target(_BACKUP + "._save_model")
    _, _, train_end = patching.target(_BACKUP + ".on_train_end")
    write_dir = os.path.join(scratch, "backup")

    def _save_model(self):
        paths = {"backup_dir": write_dir,
                 "_weights_path": os.path.join(write_dir, "latest.weights.h5"),
                 "_training_metadata_path": os.path.join(write_dir, "training_metadata.json")}
        paths["_prev_weights_path"] = paths["_weights_path"] + ".bkp"
        paths["_prev_training_metadata_path"] = paths["_training_metadata_path"] + ".bkp"
        # Keras 3.0 has no metadata file; 3.0 to 3.6 keep no previous copies.
        paths = {k: v for k, v in paths.items() if k == "backup_dir" or hasattr(self, k)}
        real = {k: getattr(self, k) for k in paths}
        for k, v in paths.items():
            setattr(self, k, v)
        try:
            _writing_scratch("the BackupAndRestore backup", write_dir, rank,
                             lambda: save_model(self), self.model)
        finally:
            for k, v in real.items():
                setattr(self, k, v)

    def on_train_end(self, logs=None):
        real = self.backup_dir
        self.backup_dir = write_dir
        try:
            train_end(self, logs)
        finally:
            self.backup_dir = real

    patching.wrap(_BACKUP + "._save_model", lambda _: _save_model)
    patching.wrap(_BACKUP + ".on_train_end", lambda _: on_train_end)


def check_same_restore(patching, flavour):
    """After BackupAndRestore restores (any Keras, any rank), the ranks compare
    what they restored: the epoch and a checksum of the weights. Ranks that
    resumed from different states would train on different weights with no
    error, so they fail at once, naming each rank's state."""
    def wrap(original):
        def on_train_begin(self, logs=None):
            original(self, logs)
            _check_same_restore(self.model)
        return on_train_begin

    patching.wrap(_BACKUP + ".on_train_begin", wrap)


def _check_same_restore(model):
    import numpy as np
    import tensorflow as tf

    from perseus_tf import ops

    if ops.size() <= 1:
        return
    epoch = int(getattr(model, "_initial_epoch", 0) or 0)
    step = _pending_skip[0]
    total = 0.0
    for w in model.trainable_weights:
        total += float(np.sum(np.abs(np.asarray(w.numpy(), np.float64))))
    mine = tf.constant([[float(epoch), float(step), total]], tf.float64)
    everyone = ops.allgather(mine, name="perseus.backup_and_restore.state").numpy()
    if np.all(everyone[:, :2] == everyone[0, :2]) and np.allclose(everyone[:, 2], everyone[0, 2],
                                                                    rtol=1e-12, atol=0):
        return
    states = "; ".join(f"rank {r}: epoch {int(e)} step {int(b)}, weight checksum {c:.9g}"
                       for r, (e, b, c) in enumerate(everyone))
    raise RuntimeError(
        "BackupAndRestore: the ranks restored different training states (" + states + "). "
        "Every rank must read the same backup: put backup_dir on a file system every rank "
        "can read, or delete the stale backup to start over.")


# BackupAndRestore with save_freq in batches: resume at the saved step.
#
# Keras 2 resumes at the step after the saved one but reads the resumed
# epoch's data from its first batch again; Keras 3 saves the step but resumes
# at the start of the saved epoch. Both are made to resume at the saved step
# AND to skip the batches that epoch had already trained on, so that a
# dataset giving the same batches every epoch trains exactly as a run that
# was never interrupted. The skip is one host-side `next` per batch, on every
# rank alike (each rank reads its own shard).

_pending_skip = [0]   # batches the next training epoch drops (Keras 3's iterator, Keras 2's handler)


def skip_batches_of_next_epoch(count):
    """The next `fit` starts its first epoch at batch `count`: the batches
    before it are read and dropped, not trained (elastic's resumed epoch).
    Needs the step-resume patches (perseus_tf.patches.STEP_RESUME)."""
    _pending_skip[0] = int(count)


def _drop_batches(iterator, count):
    """Reads and drops `count` batches; False when the data ran out first."""
    import tensorflow as tf
    for _ in range(count):
        try:
            next(iterator)
        except (StopIteration, tf.errors.OutOfRangeError):
            return False
    return True


def resume_at_saved_step_keras2(patching, flavour):
    """Keras 2.15 and tf_keras 2.15 to 2.21: DataHandler.enumerate_epochs."""
    target = "{keras}.src.engine.data_adapter.DataHandler.enumerate_epochs"
    _, _, original = patching.target(target)

    def enumerate_epochs(self):
        first = True
        for epoch, iterator in original(self):
            if first:
                skip, _pending_skip[0] = _pending_skip[0], 0
                self._initial_step = max(int(self._initial_step), skip)
            if first and self._initial_step > 0:
                # steps() starts at _initial_step; feed it the batches after it
                _drop_batches(iterator, int(self._initial_step))
            first = False
            yield epoch, iterator

    patching.wrap(target, lambda _: enumerate_epochs)


# Keras 3 writes a backup in two steps, the weights, then the metadata that
# says which epoch and batch they are of; a job stopped between them leaves
# new weights beside old metadata. Rank 0 adds the weights file's digest to
# the metadata once both are written, and a restore checks it.
_DIGEST_KEY = "perseus_weights_sha256"


def _file_digest(path):
    import hashlib
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _record_weights_digest(callback):
    """Adds the weights' digest to the metadata Keras just wrote (replacing
    the file whole, so it is never half written)."""
    import json
    weights, metadata = callback._weights_path, callback._training_metadata_path
    if not (os.path.isfile(weights) and os.path.isfile(metadata)):
        return  # a remote backup_dir (gs://...): Keras' own files only
    with open(metadata) as f:
        saved = json.load(f)
    saved[_DIGEST_KEY] = _file_digest(weights)
    partial = metadata + ".perseus-partial"
    with open(partial, "w") as f:
        json.dump(saved, f)
    os.replace(partial, metadata)


def _torn(weights, metadata):
    """The metadata (a dict) when it holds a digest that `weights` does not
    match; else None (a whole backup, or one written without a digest)."""
    import json
    try:
        with open(metadata) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not saved.get(_DIGEST_KEY) or not os.path.isfile(weights):
        return None
    return None if _file_digest(weights) == saved[_DIGEST_KEY] else saved


def _whole_backup(callback):
    """(weights path, metadata path) to restore from: the backup itself, or,
    when it is torn and Keras kept the previous one (double_checkpoint), that
    one. A torn backup with nothing to fall back to is refused, named."""
    from perseus_tf import ops
    weights, metadata = callback._weights_path, callback._training_metadata_path
    saved = _torn(weights, metadata)
    if saved is None:
        return weights, metadata
    what = (f"the backup in {callback.backup_dir} is torn: {os.path.basename(weights)} is not "
            f"the file that {os.path.basename(metadata)} (epoch {saved.get('epoch')}, batch "
            f"{saved.get('batch')}) describes; the job was stopped while Keras wrote a backup "
            "(during or after its weights, before its metadata), so the weights are not those "
            "of the step the metadata names")
    prev_w = getattr(callback, "_prev_weights_path", None)
    prev_m = getattr(callback, "_prev_training_metadata_path", None)
    if (getattr(callback, "double_checkpoint", False) and prev_w and os.path.isfile(prev_w)
            and os.path.isfile(prev_m) and _torn(prev_w, prev_m) is None):
        if ops.rank() == 0:
            print(f"Perseus-TF: BackupAndRestore: {what}. Resuming from the previous backup "
                  f"({os.path.basename(prev_w)}) instead.", flush=True)
        return prev_w, prev_m
    raise RuntimeError(
        f"BackupAndRestore: refusing to resume: {what}. Delete {callback.backup_dir} to start "
        "over (BackupAndRestore(double_checkpoint=True), Keras 3.7 or newer, keeps the "
        "previous backup to fall back to)")


def resume_at_saved_step(patching, flavour):
    """Keras 3's BackupAndRestore (the batches are skipped by
    skip_resumed_batches)."""
    import json

    begin, epoch_begin, train_end, save = (
        patching.target(_BACKUP + "." + name)[2]
        for name in ("on_train_begin", "on_epoch_begin", "on_train_end", "_save_model"))

    def _save_model(self):
        save(self)
        from perseus_tf import ops
        # Only rank 0's backup is read back (the others write a scratch copy).
        if hasattr(self, "_training_metadata_path") and ops.rank() == 0:
            _record_weights_digest(self)

    def _begin(self, logs, weights, metadata):
        """Keras' restore from these files, a damaged one named; returns the
        metadata it restored (None: none). The previous
        backup's files (named *.bkp, which Keras will not load) are read
        through copies under their usual names, in a folder of this rank's:
        the backup itself is left as it is."""
        import tempfile
        real = self._weights_path, self._training_metadata_path
        copies = None
        if weights != real[0]:
            copies = tempfile.mkdtemp(prefix="perseus-restore-")
            for source, usual in ((weights, real[0]), (metadata, real[1])):
                shutil.copyfile(source, os.path.join(copies, os.path.basename(usual)))
            weights, metadata = (os.path.join(copies, os.path.basename(p)) for p in real)
        self._weights_path, self._training_metadata_path = weights, metadata
        try:
            begin(self, logs)
            # Read after Keras' restore: on a damaged file, Keras itself
            # falls back to the previous pair, copied over these.
            if not os.path.exists(metadata):
                return None
            with open(metadata) as f:
                return json.load(f)
        except OSError as e:
            raise RuntimeError(
                f"BackupAndRestore could not read its backup {weights} ({e}): the file is "
                f"damaged, for instance by a process stopped while writing it. Delete "
                f"{self.backup_dir} to start over") from e
        finally:
            self._weights_path, self._training_metadata_path = real
            if copies:
                shutil.rmtree(copies, ignore_errors=True)

    def on_train_begin(self, logs=None):
        _pending_skip[0] = 0
        if not hasattr(self, "_training_metadata_path"):
            # Keras 3.0 backs up the weights only and restarts at epoch 0.
            _keras.require(flavour, (3, 1),
                           "BackupAndRestore (resuming at the saved epoch)")
            begin(self, logs)
            return
        saved = _begin(self, logs, *_whole_backup(self))
        marked = read_marker(self.backup_dir)   # a preemption's backup, any save_freq
        if marked is not None:
            epoch, done = marked
        elif self.save_freq == "epoch" or saved is None:
            return
        else:
            epoch, done = int(saved.get("epoch", 0)), int(saved.get("batch", -1)) + 1
        steps = (self.params or {}).get("steps")
        if done <= 0:
            return
        if steps and done >= steps:      # saved at the epoch's last batch
            epoch, done = epoch + 1, 0
        self.model._initial_epoch = epoch
        self._current_epoch = epoch
        self._last_batch_seen = done - 1
        self._batches_seen_since_last_saving = 0
        _pending_skip[0] = done

    def on_epoch_begin(self, epoch, logs=None):
        # Keras 3 counts epochs from 0 after a restore; saves must record the
        # epoch really being trained.
        self._current_epoch = epoch
        epoch_begin(self, epoch, logs)

    def on_train_end(self, logs=None):
        _pending_skip[0] = 0
        train_end(self, logs)

    for name, fn in (("on_train_begin", on_train_begin), ("on_epoch_begin", on_epoch_begin),
                     ("on_train_end", on_train_end), ("_save_model", _save_model)):
        patching.wrap(_BACKUP + "." + name, lambda _, fn=fn: fn)


def skip_resumed_batches(patching, flavour):
    """Drops the batches of _pending_skip at the start of the next epoch.

    Where Keras 3 hands `fit` its batches, by release (all checked in CI at
    the ends of the range, tests/test_keras_versions.py):
      - 3.0 to 3.6: the TF backend's TFEpochIterator.enumerate_epoch yields
        (step, iterator);
      - 3.7 to 3.10: EpochIterator._enumerate_iterator yields (step, iterator);
      - 3.11 and later: EpochIterator._enumerate_iterator yields
        (first step, last step, iterator).
    One call of the step function takes steps_per_execution batches.
    """
    (target,) = patching.patch.targets   # by release: perseus_tf.patches
    _, _, enumerate_original = patching.target(target)

    def enumerate_batches(self):
        skip, _pending_skip[0] = _pending_skip[0], 0
        for item in enumerate_original(self):
            begin_step, iterator = item[0], item[-1]
            end_step = item[1] if len(item) == 3 else \
                begin_step + max(1, int(getattr(self, "steps_per_execution", 1) or 1)) - 1
            if skip > 0 and begin_step < skip:
                if not _drop_batches(iterator, end_step - begin_step + 1):
                    return
                continue
            yield item

    patching.wrap(target, lambda _: enumerate_batches)
