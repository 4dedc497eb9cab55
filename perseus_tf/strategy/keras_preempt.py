"""Preemption and restart for Keras `fit` under PerseusStrategy.

A job whose `fit` has a BackupAndRestore callback stops cleanly when any
rank gets SIGTERM (a spot instance's notice, a scheduler's preemption, or
perseusrun passing on its own SIGTERM):

1. the signal only sets a flag on the rank that got it;
2. after a batch the ranks add their flags up (one allreduce of three
   int32), so all of them see the notice after the same batch. They do so
   about every PERSEUS_PREEMPTION_CHECK_SECONDS (1 s; 0: every batch):
   rank 0 proposes in each allreduce how many batches that is at the pace
   of the last ones, and every rank counts them;
3. every rank then backs up as BackupAndRestore does (rank 0 writes the
   real files; Keras 3's other ranks write into scratch, Keras 2's into
   temporary directories) and rank 0 adds a marker naming the epoch and
   the batches of it already trained; then each rank leaves `fit` with
   SystemExit: EXIT_PREEMPTED on a rank that got the signal, EXIT_RESTART
   on the others. (A notice that training's end overtakes goes to the
   SIGTERM handler there was before fit.)

Under an elastic perseusrun (--min-np/--max-np) the ranks that exit with
EXIT_RESTART are started again on their slots, the preempted slots are left
out, and the new, smaller job resumes: BackupAndRestore restores the
weights and the optimizer, the marker makes `fit` start at the saved epoch
and batch, and every rank skips the batches of its shard that the epoch
already trained (keras_files). The dataset's global batch stays the same
(tf.distribute splits it over the new number of replicas), so training
goes on as the uninterrupted job would have.

Under an elastic perseusrun, workers that perseusrun starts on new or
returning slots make the job restart the same way (rank 0 reads perseusrun's
hosts-updated count at most once a second and adds it to the allreduce), so
it grows. A rank that dies (rather than being told to
stop) makes the others' collectives fail: in `fit` with a BackupAndRestore
callback they then exit with EXIT_RESTART too and the job restarts from the
last backup (steps since it are trained again, at the new size).
"""

import functools
import json
import os
import signal
import sys
import threading
import time

from perseus_tf.config.elastic_rounds import EXIT_PREEMPTED, EXIT_RESTART, hosts_updated, \
    is_elastic, record_preemption

MARKER = "perseus_preemption.json"

_notice = threading.Event()   # this rank got SIGTERM during fit


def _handle_sigterm(_signum, _frame):
    _notice.set()


_hosts_checked = [0.0]


def _growth_offered():
    """On rank 0 of an elastic job, at most once a second: whether perseusrun
    has started workers that wait to join (they join at a restart)."""
    from perseus_tf import ops
    if ops.rank() != 0 or not is_elastic():
        return 0
    now = time.monotonic()
    if now - _hosts_checked[0] < 1.0:
        return 0
    _hosts_checked[0] = now
    update = hosts_updated()
    return 1 if update is not None and not update[1] else 0


def _agree(proposal):
    """(ranks that got SIGTERM, whether workers wait to join, rank 0's
    proposal of batches until the next check), the same on every rank: one
    allreduce."""
    import tensorflow as tf
    from perseus_tf import ops
    mine = tf.constant([1 if _notice.is_set() else 0, _growth_offered(), proposal], tf.int32)
    if ops.size() > 1:
        mine = ops.allreduce(mine, op=ops.Sum, name="perseus.preemption.notice")
    notices, growth, interval = (int(v) for v in mine.numpy())
    return notices, growth, max(1, interval)


def _proposal(check_s, seconds, batches):
    """Rank 0's batches until the next check: about check_s seconds of them
    at the pace of the last ones (1 while check_s is 0)."""
    if check_s <= 0 or batches <= 0 or seconds <= 0:
        return 1
    return max(1, min(100000, int(check_s * batches / seconds)))


def _write_marker(directory, epoch, done, size):
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, MARKER)
    with open(path + ".tmp", "w") as f:
        json.dump({"epoch": int(epoch), "done": int(done), "size": int(size)}, f)
    os.replace(path + ".tmp", path)


def read_marker(directory):
    """(epoch, batches of it done) of a preemption backup in directory, or None."""
    try:
        with open(os.path.join(directory, MARKER)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return int(saved["epoch"]), int(saved["done"])


def remove_marker(directory):
    try:
        os.remove(os.path.join(directory, MARKER))
    except OSError:
        pass


def _stop(callback, epoch, batch, save, notices):
    """Backs up after `batch` of `epoch` on every rank and leaves fit."""
    from perseus_tf import ops
    rank = ops.rank()
    save()
    if rank == 0:
        _write_marker(callback.backup_dir, epoch, batch + 1, ops.size())
        record_preemption(epoch, batch + 1)
    code = EXIT_PREEMPTED if _notice.is_set() else EXIT_RESTART
    reason = "got SIGTERM" if _notice.is_set() else \
        f"{notices} rank{'s' if notices > 1 else ''} got SIGTERM" if notices else \
        "perseusrun has new workers for the job"
    print(f"perseus: rank {rank}: {reason}; every rank stopped after epoch {epoch} batch "
          f"{batch} (0-based), backed up to {callback.backup_dir}; a restarted job resumes "
          f"there (exit status {code})", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _restart_after_failure(error):
    """A failed collective in an elastic job's fit: leave for a restart."""
    from perseus_tf.ops import is_collective_failure
    if not (is_elastic() and is_collective_failure(error)):
        return
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = next((line for line in lines if "perseus" in line.lower()), lines[0] if lines else "")
    print(f"perseus: a collective failed in fit ({said[:300]}); "
          "stopping for perseusrun to restart the job from the last backup "
          f"(exit status {EXIT_RESTART})", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_RESTART) from error


_BACKUP = "{keras}.callbacks.BackupAndRestore."


def back_up_on_sigterm(patching, flavour, is_perseus):
    """Patches BackupAndRestore and Model.fit of one Keras (Keras 3, Keras
    2.15, tf_keras). is_perseus(strategy) tells PerseusStrategy apart."""
    from perseus_tf import ops
    keras3 = flavour.major == 3
    backup_owner, _, _ = patching.target(_BACKUP + "on_train_begin")

    def active(callback):
        model = getattr(callback, "model", None)
        return model is not None and is_perseus(model.distribute_strategy)

    begin, end, batch_end = (patching.target(_BACKUP + name)[2]
                             for name in ("on_train_begin", "on_train_end", "on_train_batch_end"))
    previous = {}

    def on_train_begin(self, logs=None):
        begin(self, logs)
        # Batches until the ranks next compare notices, and rank 0's pace
        # since the last comparison: every rank counts the same batches.
        self._perseus_check = {"left": 1, "since": time.monotonic(), "batches": 0}
        if active(self) and threading.current_thread() is threading.main_thread():
            _notice.clear()
            previous[id(self)] = signal.signal(signal.SIGTERM, _handle_sigterm)

    def on_train_end(self, logs=None):
        restored = id(self) in previous
        if restored:
            signal.signal(signal.SIGTERM, previous.pop(id(self)))
        end(self, logs)
        if active(self) and self.delete_checkpoint and ops.rank() == 0:
            remove_marker(self.backup_dir)  # Keras 2 deletes only its checkpoints
        if restored and _notice.is_set():
            # Training ended before the ranks next compared notices: the
            # signal was only deferred; it goes to the handler it was meant for.
            _notice.clear()
            signal.raise_signal(signal.SIGTERM)

    def on_train_batch_end(self, batch, logs=None):
        batch_end(self, batch, logs)
        if not active(self):
            return
        check = self._perseus_check
        check["batches"] += 1
        check["left"] -= 1
        if check["left"] > 0:
            return
        now = time.monotonic()
        proposal = 0 if ops.rank() else _proposal(
            getattr(self.model.distribute_strategy, "_preemption_check_seconds", 1.0),
            now - check["since"], check["batches"])
        notices, growth, check["left"] = _agree(proposal)
        check["since"], check["batches"] = now, 0
        if not (notices or growth):
            return
        if keras3:
            def save():
                self._last_batch_seen = batch
                self._save_model()
        else:
            def save():
                self._backup(epoch=self._current_epoch, batch=batch)
        _stop(self, self._current_epoch, batch, save, notices)

    for name, fn in (("on_train_begin", on_train_begin), ("on_train_end", on_train_end),
                     ("on_train_batch_end", on_train_batch_end)):
        patching.wrap(_BACKUP + name, lambda _, fn=fn: fn)
    if not keras3:
        # Keras 2 skips batch hooks of a callback that saves by epoch.
        patching.wrap(_BACKUP + "_implements_train_batch_hooks",
                      lambda hooks: lambda self: active(self) or hooks(self))
    _install_marker_upkeep(patching, flavour)

    def wrap_fit(fit):
        @functools.wraps(fit)
        def fit_with_restart(self, *args, **kwargs):
            try:
                return fit(self, *args, **kwargs)
            except Exception as error:  # noqa: BLE001 - only collective failures
                callbacks = kwargs.get("callbacks") or (args[5] if len(args) > 5 else None) \
                    or []
                if is_perseus(self.distribute_strategy) and \
                        any(isinstance(c, backup_owner) for c in callbacks):
                    _restart_after_failure(error)
                raise
        return fit_with_restart

    patching.wrap("{keras}.Model.fit", wrap_fit)


def _install_marker_upkeep(patching, flavour):
    """A later regular backup supersedes a preemption marker: rank 0 removes it."""
    from perseus_tf import ops
    if flavour.major == 3:
        def wrap(save_model):
            def _save_model(self):
                save_model(self)
                if ops.rank() == 0:
                    remove_marker(self.backup_dir)
            return _save_model

        patching.wrap(_BACKUP + "_save_model", wrap)
        return
    state_target = "{keras}.src.distribute.worker_training_state.WorkerTrainingState."
    _, _, back_up = patching.target(state_target + "back_up")
    _, _, counters = patching.target(state_target + "maybe_load_initial_counters_from_ckpt")

    def backup_dir(self):
        return os.path.dirname(self.read_checkpoint_manager.directory.rstrip("/"))

    def back_up_marked(self, epoch, batch=0):
        back_up(self, epoch, batch)
        if ops.rank() == 0:
            remove_marker(backup_dir(self))

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch, mode):
        saved = read_marker(backup_dir(self))
        if saved is None or mode != "train":
            return counters(self, steps_per_epoch, initial_epoch, mode)
        epoch, done = saved
        if steps_per_epoch and done >= steps_per_epoch:
            return epoch + 1, 0
        return epoch, done

    patching.wrap(state_target + "back_up", lambda _: back_up_marked)
    patching.wrap(state_target + "maybe_load_initial_counters_from_ckpt",
                  lambda _: maybe_load_initial_counters_from_ckpt)
