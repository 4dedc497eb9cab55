"""Every patch Perseus-TF makes to Keras and TensorFlow internals, in one table.

Each patch declares what it replaces (its targets), the Keras releases it
applies to, and the patches it must come after (it wraps what they put
there). `install` applies patches in the table's order, once per Keras in use
(`_keras.in_use`); `uninstall` takes them off again, leaving every target as
it was, and the tests use it to isolate checks. A target missing from a Keras
the table says the patch applies to fails the install naming the patch, the
target and the release, and a check (tests/workers/checks_strategy.py) fails
on every Keras release CI runs.

The code of each patch stays beside the feature it serves (the `apply`
column names it); what it replaces goes through the `Patching` it is handed,
never by assignment (tests/test_layout.py checks that no module of the
package patches anything on its own).

Targets are dotted paths: "{keras}" stands for the Keras package the patch is
applied to (`keras` or `tf_keras`); the longest importable prefix is the
module, the rest attributes, e.g. "{keras}.callbacks.BackupAndRestore.on_train_begin".
"""

import importlib
import inspect
import threading
from typing import Callable, NamedTuple, Optional, Tuple

from perseus_tf import _keras

ALL_KERAS = ((2, 15), None)


class Patch(NamedTuple):
    """One patch: the row of the table."""
    name: str
    apply: str                          # "module:function", called (patching, flavour, **context)
    targets: Tuple[str, ...]            # what it replaces (wraps)
    keras: Optional[Tuple] = ALL_KERAS  # (oldest, first release it no longer applies to); None: TF
    after: Tuple[str, ...] = ()         # patches it wraps the work of
    doc: str = ""


_K3 = ((3, 0), None)
_K2 = ((2, 15), (3, 0))
_BACKUP = "{keras}.callbacks.BackupAndRestore"

PATCHES = (
    # -- gradient reductions: which ones are compressed (perseus_tf/_gradient_marks.py) ----
    Patch("gradients.merge_call_carries_mark", "perseus_tf._gradient_marks:carry_into_merge_calls",
          ("tensorflow.python.distribute.distribute_lib.ReplicaContext.merge_call",), None,
          doc="a replica thread's gradient mark reaches its merge call's thread"),
    Patch("gradients.optimizer_apply", "perseus_tf._gradient_marks:mark_optimizer_apply",
          ("{keras}.optimizers.Optimizer.apply_gradients",
           "{keras}.src.backend.tensorflow.optimizer.TFOptimizer._distributed_tf_update_step",
           "{keras}.src.backend.tensorflow.optimizer.TFOptimizer._apply_weight_decay"),
          _K3, after=("gradients.merge_call_carries_mark",),
          doc="reductions inside apply_gradients are gradient reductions; accumulation"),
    # (Keras 2: before the marks, which wrap it: accumulation happens outside it.)
    Patch("shard.optimizer_state_keras2", "perseus_tf.strategy.keras_shard:shard_optimizer_state_keras2",
          ("{keras}.src.optimizers.optimizer._BaseOptimizer._build_index_dict",
           "{keras}.src.optimizers.optimizer.Optimizer.add_variable_from_reference",
           "{keras}.src.optimizers.optimizer.Optimizer.apply_gradients",
           "{keras}.src.optimizers.optimizer._BaseOptimizer.save_own_variables",
           "{keras}.src.optimizers.optimizer._BaseOptimizer.load_own_variables",
           "{keras}.src.optimizers.optimizer._BaseOptimizer._use_weight_decay"), _K2,
          after=("gradients.merge_call_carries_mark",),
          doc="shard_optimizer_state on Keras 2: the same, and checkpoints written whole"),
    Patch("gradients.optimizer_apply_keras2", "perseus_tf._gradient_marks:mark_optimizer_apply",
          ("{keras}.optimizers.Optimizer.apply_gradients",
           "{keras}.optimizers.legacy.Optimizer.apply_gradients",
           "{keras}.optimizers.Optimizer._distributed_apply_gradients_fn",
           "{keras}.optimizers.Optimizer._apply_weight_decay",
           "{keras}.src.mixed_precision.loss_scale_optimizer.LossScaleOptimizer.apply_gradients",
           "{keras}.src.mixed_precision.loss_scale_optimizer.LossScaleOptimizerV3"
           ".apply_gradients"),
          _K2, after=("gradients.merge_call_carries_mark", "shard.optimizer_state_keras2"),
          doc="reductions inside apply_gradients are gradient reductions; accumulation"),
    Patch("gradients.tf1_optimizer_apply", "perseus_tf._gradient_marks:mark_tf1_optimizer_apply",
          ("tensorflow.python.training.optimizer.Optimizer.apply_gradients",), None,
          after=("gradients.merge_call_carries_mark",),
          doc="the same for tf.compat.v1.train.Optimizer"),
    # -- what Keras 3.8 does under a strategy, on older Keras 3 (keras_backports) ------
    Patch("backports.scale_fit_loss", "perseus_tf.strategy.keras_backports:scale_fit_loss",
          ("{keras}.src.backend.tensorflow.trainer.TensorFlowTrainer.train_step",
           "{keras}.src.optimizers.base_optimizer.BaseOptimizer.scale_loss",
           "{keras}.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.scale_loss"),
          ((3, 0), (3, 8)), doc="fit divides its loss by the replicas"),
    Patch("backports.sum_gradients", "perseus_tf.strategy.keras_backports:sum_gradients",
          ("{keras}.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step",),
          ((3, 0), (3, 5)), doc="the TF optimizer sums gradients over the replicas"),
    Patch("backports.metric_variables", "perseus_tf.strategy.keras_backports:mark_metric_variables",
          ("{keras}.src.metrics.metric.Metric.add_variable",
           "{keras}.src.backend.tensorflow.core.Variable._initialize"),
          ((3, 0), (3, 10)), doc="metric variables sum or average over the ranks when read"),
    Patch("backports.metric_variables_initializer",
          "perseus_tf.strategy.keras_backports:mark_metric_variables_initializer",
          ("{keras}.src.backend.tensorflow.core.Variable._initialize_with_initializer",),
          ((3, 5), (3, 10)), after=("backports.metric_variables",),
          doc="the same where Keras initializes a variable from its initializer"),
    # -- sharded optimizer state (keras_shard) ----------------------------------------
    Patch("shard.optimizer_state", "perseus_tf.strategy.keras_shard:shard_optimizer_state",
          ("{keras}.src.optimizers.base_optimizer.BaseOptimizer.add_variable_from_reference",
           "{keras}.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step",
           "{keras}.src.optimizers.base_optimizer.BaseOptimizer.save_own_variables",
           "{keras}.src.optimizers.base_optimizer.BaseOptimizer.load_own_variables",
           "{keras}.src.optimizers.base_optimizer.BaseOptimizer._use_weight_decay"), _K3,
          after=("gradients.optimizer_apply", "backports.sum_gradients"),
          doc="shard_optimizer_state: slots on their owner, reduce-scatter, allgather"),
    # -- mixed precision, XLA, batch-norm statistics -----------------------------------
    Patch("mixed.agree_on_skipped_steps", "perseus_tf.strategy.keras_mixed:agree_on_skipped_steps",
          ("{keras}.optimizers.LossScaleOptimizer.check_finite",), _K3,
          doc="every rank skips a step with a non-finite gradient together"),
    Patch("xla.off_around_collectives", "perseus_tf.strategy.keras_xla:off_around_collectives",
          ("{keras}.Model.make_train_function", "{keras}.Model.make_test_function",
           "{keras}.Model.make_predict_function"),
          doc="no XLA for steps that hold Perseus collectives"),
    Patch("strategy.batch_norm_statistics", "perseus_tf.strategy:mark_batch_norm_statistics",
          ("{keras}.layers.BatchNormalization.build",), _K3,
          doc="moving statistics are created on-read, averaged"),
    # -- saving on one rank, predict (keras_save, keras_predict) -----------------------
    Patch("save.local_reads", "perseus_tf.strategy.keras_save:read_locally_while_saving",
          ("{keras}.Model.save", "{keras}.Model.save_weights", "{keras}.Model.get_weights",
           "{keras}.layers.Layer.get_weights", "{keras}.saving.save_model"),
          doc="saving reads this rank's copy of on-read variables: no collective"),
    Patch("save.epoch_end_averages", "perseus_tf.strategy.keras_save:average_at_epoch_ends",
          ("{keras}.callbacks.CallbackList.__init__",),
          doc="on-read statistics averaged over the ranks at each epoch's end"),
    Patch("predict.gather_rows", "perseus_tf.strategy.keras_predict:gather_rows",
          ("{keras}.src.backend.tensorflow.trainer.reduce_per_replica",
           "{keras}.src.backend.tensorflow.trainer.TensorFlowTrainer.predict_on_batch"), _K3,
          doc="predict returns every rank's rows"),
    Patch("predict.gather_rows_keras2", "perseus_tf.strategy.keras_predict:gather_rows",
          ("{keras}.src.engine.training.reduce_per_replica",), _K2,
          doc="predict returns every rank's rows"),
    Patch("predict.concatenate", "perseus_tf.strategy.keras_predict:concatenate_predictions",
          ("{keras}.src.backend.tensorflow.trainer.TensorFlowTrainer.predict",),
          ((3, 0), (3, 3)), after=("predict.gather_rows",),
          doc="predict concatenates the replicas' rows, as 3.3 does"),
    # -- input pipelines (TensorFlow's) ------------------------------------------------
    Patch("input.no_autotune_thread", "perseus_tf.strategy.input_teardown:without_autotune_threads",
          ("tensorflow.python.data.ops.multi_device_iterator_ops._create_device_dataset",), None,
          doc="per-device datasets start no tf.data autotuning thread"),
    # -- BackupAndRestore, checkpoints, preemption (keras_files, keras_preempt) --------
    Patch("files.step_resume", "perseus_tf.strategy.keras_files:resume_at_saved_step",
          (_BACKUP + ".on_train_begin", _BACKUP + ".on_epoch_begin", _BACKUP + ".on_train_end",
           _BACKUP + "._save_model"), _K3,
          doc="BackupAndRestore resumes at the saved step, torn backups named"),
    Patch("files.batch_skip_enumerate_epoch", "perseus_tf.strategy.keras_files:skip_resumed_batches",
          ("{keras}.src.backend.tensorflow.trainer.TFEpochIterator.enumerate_epoch",),
          ((3, 0), (3, 7)), doc="the resumed epoch skips the batches it trained"),
    Patch("files.batch_skip", "perseus_tf.strategy.keras_files:skip_resumed_batches",
          ("{keras}.src.trainers.epoch_iterator.EpochIterator._enumerate_iterator",),
          ((3, 7), None), doc="the resumed epoch skips the batches it trained"),
    Patch("files.step_resume_keras2", "perseus_tf.strategy.keras_files:resume_at_saved_step_keras2",
          ("{keras}.src.engine.data_adapter.DataHandler.enumerate_epochs",), _K2,
          doc="the resumed epoch skips the batches it trained"),
    Patch("files.rank_scratch", "perseus_tf.strategy.keras_files:write_in_rank_scratch",
          ("{keras}.callbacks.ModelCheckpoint._get_file_path",
           "{keras}.callbacks.ModelCheckpoint._save_model", "{keras}.callbacks.TensorBoard.__init__",
           _BACKUP + "._save_model", _BACKUP + ".on_train_end"), _K3,
          after=("files.step_resume",), doc="ranks other than 0 write into their scratch folder"),
    Patch("files.restore_check", "perseus_tf.strategy.keras_files:check_same_restore",
          (_BACKUP + ".on_train_begin",), after=("files.step_resume",),
          doc="ranks that restored different states fail at once"),
    Patch("preempt.backup_on_sigterm", "perseus_tf.strategy.keras_preempt:back_up_on_sigterm",
          (_BACKUP + ".on_train_begin", _BACKUP + ".on_train_end",
           _BACKUP + ".on_train_batch_end", _BACKUP + "._save_model", "{keras}.Model.fit"), _K3,
          after=("files.step_resume", "files.rank_scratch", "files.restore_check"),
          doc="SIGTERM: every rank stops after the same batch with a backup"),
    Patch("preempt.backup_on_sigterm_keras2", "perseus_tf.strategy.keras_preempt:back_up_on_sigterm",
          (_BACKUP + ".on_train_begin", _BACKUP + ".on_train_end",
           _BACKUP + ".on_train_batch_end", _BACKUP + "._implements_train_batch_hooks",
           "{keras}.src.distribute.worker_training_state.WorkerTrainingState.back_up",
           "{keras}.src.distribute.worker_training_state.WorkerTrainingState"
           ".maybe_load_initial_counters_from_ckpt", "{keras}.Model.fit"), _K2,
          after=("files.step_resume_keras2", "files.restore_check"),
          doc="SIGTERM: every rank stops after the same batch with a backup"),
    # -- the Horovod shim --------------------------------------------------------------
    Patch("shim.reduce_before_loss_scaling", "perseus_tf.horovod.keras._optimizer:reduce_first",
          ("{keras}.optimizers.LossScaleOptimizer.apply",), _K3,
          doc="around a DistributedOptimizer, gradients are reduced before the finite check"),
    Patch("shim.reduce_before_loss_scaling_keras2", "perseus_tf.horovod.keras._optimizer:reduce_first",
          ("{keras}.src.mixed_precision.loss_scale_optimizer.LossScaleOptimizer.apply_gradients",
           "{keras}.src.mixed_precision.loss_scale_optimizer.LossScaleOptimizerV3"
           ".apply_gradients"), _K2,
          doc="around a DistributedOptimizer, gradients are reduced before the finite check"),
)

BY_NAME = {p.name: p for p in PATCHES}

# What each entry point installs (in the table's order whatever the order here).
STRATEGY = ("gradients.merge_call_carries_mark", "gradients.optimizer_apply",
            "gradients.optimizer_apply_keras2",
            "gradients.tf1_optimizer_apply", "backports.scale_fit_loss",
            "backports.sum_gradients", "backports.metric_variables",
            "backports.metric_variables_initializer", "shard.optimizer_state",
            "shard.optimizer_state_keras2", "mixed.agree_on_skipped_steps", "xla.off_around_collectives",
            "strategy.batch_norm_statistics", "save.local_reads", "save.epoch_end_averages",
            "predict.gather_rows", "predict.gather_rows_keras2", "predict.concatenate",
            "input.no_autotune_thread", "files.step_resume", "files.batch_skip_enumerate_epoch",
            "files.batch_skip", "files.step_resume_keras2", "preempt.backup_on_sigterm",
            "preempt.backup_on_sigterm_keras2")
STRATEGY_MULTI_RANK = ("files.rank_scratch", "files.restore_check")
STEP_RESUME = ("files.step_resume", "files.batch_skip_enumerate_epoch", "files.batch_skip",
               "files.step_resume_keras2")
BACKPORTS = ("backports.scale_fit_loss", "backports.sum_gradients", "backports.metric_variables",
             "backports.metric_variables_initializer")
SHIM = ("shim.reduce_before_loss_scaling", "shim.reduce_before_loss_scaling_keras2",
        "xla.off_around_collectives", "shard.optimizer_state", "shard.optimizer_state_keras2")


def applies(patch, flavour):
    """Whether `patch` is made to `flavour` (None: TensorFlow's own, made once)."""
    if patch.keras is None or flavour is None:
        return patch.keras is None and flavour is None
    oldest, until = patch.keras
    return flavour.version >= oldest and (until is None or flavour.version < until)


def _resolve(target, flavour):
    """(owner, attribute name, current value) of a dotted target; raises
    LookupError naming what is missing."""
    path = target.replace("{keras}", flavour.name if flavour is not None else "keras")
    parts = path.split(".")
    module, i = None, len(parts) - 1
    while i > 0:
        try:
            module = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if module is None:
        raise LookupError(f"no module {parts[0]}")
    owner = module
    for j, part in enumerate(parts[i:-1], start=i):
        if not hasattr(owner, part):
            raise LookupError(f"{'.'.join(parts[:j])} has no {part}")
        owner = getattr(owner, part)
    if not hasattr(owner, parts[-1]):
        raise LookupError(f"{'.'.join(parts[:-1])} has no {parts[-1]}")
    return owner, parts[-1], getattr(owner, parts[-1])


def missing_targets(flavours=None):
    """(patch name, flavour, target, what is missing) for every target of a
    patch that applies to a Keras in use (or `flavours`) and cannot be found."""
    flavours = _keras.in_use() if flavours is None else flavours
    found = []
    for patch in PATCHES:
        for flavour in [None] + list(flavours):
            if not applies(patch, flavour):
                continue
            for target in patch.targets:
                try:
                    _resolve(target, flavour)
                except LookupError as e:
                    found.append((patch.name, flavour, target, str(e)))
    return found


class Patching:
    """What one patch's apply function replaces, for one Keras: it may
    replace only what its row declares, and every replacement is recorded
    so that it can be undone."""

    def __init__(self, patch, flavour):
        self.patch, self.flavour = patch, flavour
        self.replaced = []   # (owner, name, owned before, previous value)

    def target(self, target):
        """(owner, name, current value) of one of this patch's targets."""
        if target not in self.patch.targets:
            raise ValueError(f"patch {self.patch.name} does not declare {target}")
        try:
            return _resolve(target, self.flavour)
        except LookupError as e:
            raise _keras.KerasVersionError(
                f"Perseus-TF: patch {self.patch.name} needs {target} ({e}) in "
                f"{self.flavour!r}; supported: {_keras.SUPPORTED}") from e

    def wrap(self, target, make):
        """Replaces a target by make(its current value) where the target
        resolves; returns the new value."""
        owner, name, current = self.target(target)
        new = make(current)
        self.replace(owner, name, new)
        return new

    def replace(self, owner, name, value):
        """Sets owner.name (a class, a module): `name` must end one of the
        declared targets (a patch may replace it where a class in the
        target's MRO defines it)."""
        if not any(t.rsplit(".", 1)[-1] == name for t in self.patch.targets):
            raise ValueError(f"patch {self.patch.name} does not declare a target named {name}")
        owned = name in vars(owner)
        self.replaced.append((owner, name, owned, vars(owner).get(name)))
        setattr(owner, name, value)

    def undo(self):
        for owner, name, owned, previous in reversed(self.replaced):
            if owned:
                setattr(owner, name, previous)
            else:
                delattr(owner, name)
        self.replaced = []


class _Entry(NamedTuple):
    index: int
    flavour_name: Optional[str]
    patching: Patching
    context: dict


_lock = threading.RLock()
_stack = []   # _Entry, sorted by the table's order


def _function(patch):
    module, name = patch.apply.split(":")
    return getattr(importlib.import_module(module), name)


def _apply(patch, flavour, context):
    fn = _function(patch)
    accepted = inspect.signature(fn).parameters
    patching = Patching(patch, flavour)
    try:
        fn(patching, flavour, **{k: v for k, v in context.items() if k in accepted})
    except BaseException:
        patching.undo()
        raise
    return patching


def _key(entry):
    return entry.index, entry.flavour_name or ""


def _relayer(add, remove=()):
    """Takes off the entries from the lowest place that changes, drops those
    in `remove`, and puts the rest back with `add`, in the table's order. A
    patch that fails to apply (a target its Keras lacks) is left out and its
    error raised once the others are back."""
    keys = [_key(e) for e in add] + list(remove)
    if not keys:
        return
    low = min(keys)
    start = next((i for i, e in enumerate(_stack) if _key(e) >= low), len(_stack))
    above = _stack[start:]
    for entry in reversed(above):
        entry.patching.undo()
    del _stack[start:]
    pending = [e for e in above if _key(e) not in set(remove)] + list(add)
    flavours = {f.name: f for f in _keras.in_use(imported_only=True)}
    failed = None
    for entry in sorted(pending, key=_key):
        patch = PATCHES[entry.index]
        flavour = flavours.get(entry.flavour_name)
        try:
            _stack.append(entry._replace(patching=_apply(patch, flavour, entry.context)))
        except Exception as e:  # noqa: BLE001 - the others go back on; the first error is raised
            failed = failed or e
    if failed is not None:
        raise failed


def install(names, **context):
    """Applies the named patches (those not applied yet) to every Keras in
    use that each applies to, in the table's order; `context` (keyword
    arguments such as is_perseus or rank) goes to the apply functions that
    take it."""
    with _lock:
        have = {_key(e) for e in _stack}
        add = []
        flavours = [None] + _keras.in_use()
        for index, patch in enumerate(PATCHES):
            if patch.name not in names:
                continue
            for flavour in flavours:
                name = None if flavour is None else flavour.name
                if applies(patch, flavour) and (index, name or "") not in have:
                    add.append(_Entry(index, name, None, dict(context)))
        unknown = set(names) - set(BY_NAME)
        if unknown:
            raise ValueError(f"unknown patches: {sorted(unknown)}")
        _relayer(add)


def uninstall(names=None):
    """Takes the named patches (all: None) off every Keras, leaving the
    others applied in order."""
    with _lock:
        remove = [_key(e) for e in _stack
                  if names is None or PATCHES[e.index].name in names]
        _relayer([], remove)


def installed():
    """(patch name, Keras package name or None) of every applied patch, in
    the order they were applied."""
    with _lock:
        return [(PATCHES[e.index].name, e.flavour_name) for e in _stack]


def _check_table():
    seen = set()
    for patch in PATCHES:
        for name in patch.after:
            if name not in seen:
                raise AssertionError(f"patch {patch.name} must come after {name}, which the "
                                     "table lists later (or not at all)")
        seen.add(patch.name)


_check_table()
