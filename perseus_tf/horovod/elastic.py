"""`hvd.elastic`: Horovod 0.28's elastic API (state objects, commit /
restore / sync, the `run` wrapper) over Perseus's rounds.

`run(func)(state, ...)` syncs the state from rank 0 and calls func. When a
collective fails (any rank's runtime failed: a rank aborted, a connection
closed, a peer timed out), the error is a HorovodInternalError: every rank
restores its state to the last commit, resets (shutdown(), then init():
the job's next round, with the rank and size read afresh) and calls func
again after syncing. HostsUpdatedInterrupt does the same without restoring.

Under ``perseusrun --min-np A --max-np B`` (runner/elastic_launcher.py) each init()
takes the worker's place in the job's next round from perseusrun, so a reset
continues at the size of the workers still alive, and workers perseusrun
starts on new or returning hosts join there; check_host_updates (at every
commit) raises HostsUpdatedInterrupt on every rank once perseusrun has seen
hosts come or go. Without it, resets happen at the same size.
"""

import copy
import functools

_RESET_LIMIT = None  # resets allowed per run() call; None: unlimited (horovodrun's default)


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank: run() restores the last commit and
    resets."""


class HostsUpdatedInterrupt(RuntimeError):
    """The job's hosts changed: run() resets without restoring. skip_sync:
    no rank's state needs rank 0's (only ranks were removed)."""

    def __init__(self, skip_sync=False):
        super().__init__("the job's hosts changed")
        self.skip_sync = skip_sync


class State:
    """What run() saves, restores and syncs. Subclasses implement save,
    restore and sync."""

    def __init__(self, bcast_object, get_rank):
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._reset_callbacks = []
        self._host_updates = []  # (timestamp, update) reported by host discovery
        self._last_updated_timestamp = 0

    def register_reset_callbacks(self, callbacks):
        """Functions called (no arguments) after each reset, before func runs
        again: to rescale a learning rate to the new size, say."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_updates = []
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Called when host discovery reports a change (no launcher does yet)."""
        self._host_updates.append((timestamp, update_res))

    def commit(self):
        """Saves the state (the point a failure returns to), then checks for
        host updates. Collective: every rank commits at the same points."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Collective: rank 0's view of host updates decides for every rank;
        raises HostsUpdatedInterrupt when there is one."""
        if self._rank() == 0:
            from perseus_tf.config import elastic_rounds as _elastic
            update = _elastic.hosts_updated()  # under perseusrun --min-np/--max-np
            if update is not None:
                self._host_updates.append((update[0], "removed" if update[1] else "added"))
        previous = self._last_updated_timestamp
        timestamp, removed_only = previous, True
        for stamp, update in self._host_updates:
            if stamp > timestamp:
                timestamp = stamp
            removed_only = removed_only and update == "removed"
        self._host_updates = []
        previous, timestamp, removed_only = self._bcast_object((previous, timestamp, removed_only))
        self._last_updated_timestamp = timestamp
        if timestamp > previous:
            raise HostsUpdatedInterrupt(skip_sync=removed_only)

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self):
        raise NotImplementedError()

    def reset(self):
        """Horovod's hook for states that hold size-dependent values."""


class ObjectState(State):
    """Plain Python attributes (given as keyword arguments) saved by commit,
    set back by restore, and broadcast from rank 0 by sync."""

    def __init__(self, bcast_object, get_rank, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {attr: copy.deepcopy(getattr(self, attr))
                             for attr in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for attr, value in self._saved_state.items():
            setattr(self, attr, copy.deepcopy(value))


def _reset():
    from perseus_tf import _native
    _native.shutdown()
    _native.init()


def run_fn(func, reset):
    """Horovod's elastic loop around func, with `reset` between attempts."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        resets = 0
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync()
                if resets and state._rank() == 0:
                    from perseus_tf.config import elastic_rounds as _elastic
                    _elastic.record_resume(state)  # for perseusrun's reset line
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            except Exception as e:  # noqa: BLE001 - only collective failures are caught
                from perseus_tf.ops import is_collective_failure
                if not isinstance(e, HorovodInternalError) and not is_collective_failure(e):
                    raise
                state.restore()
                skip_sync = False
            resets += 1
            if _RESET_LIMIT is not None and resets > _RESET_LIMIT:
                raise HorovodInternalError(f"elastic run: more than {_RESET_LIMIT} resets")
            reset()
            state.on_reset()

    return wrapper


def run(func):
    """Decorator: func(state, ...) runs again from the last commit after a
    collective failure, on every rank (see the module docstring)."""
    return run_fn(func, _reset)


def _broadcast_object(obj):
    from perseus_tf.horovod.functions import broadcast_object
    return broadcast_object(obj, root_rank=0)


def _rank():
    from perseus_tf.horovod import rank
    return rank()


def _build_optimizer(optimizer, model):
    """Creates the optimizer's slots and step counter if it has none yet:
    Keras builds them at the first step, so a worker joining a running job
    (Horovod's Keras elastic example) has none while the others have theirs,
    and the state sync must broadcast the same variables everywhere."""
    trainable = list(getattr(model, "trainable_variables", []))
    if not trainable:
        return
    if hasattr(optimizer, "stateless_apply"):  # Keras 3
        if not optimizer.built:
            optimizer.build(trainable)
    elif hasattr(optimizer, "_create_all_weights"):  # Keras 2 legacy (OptimizerV2)
        optimizer._create_all_weights(trainable)
    elif hasattr(optimizer, "build") and not getattr(optimizer, "_built", False):
        optimizer.build(trainable)  # Keras 2's current optimizers


def _variables_of(optimizer):
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowKerasState(ObjectState):
    """A Keras model and its optimizer (their variables, kept in memory at
    each commit) plus any keyword attributes (epoch, batch, ...)."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        self.backend = backend
        self._save_model(gather=False)   # (the first sync saves it whole)
        super().__init__(bcast_object=_broadcast_object, get_rank=_rank, **kwargs)

    def save(self):
        self._save_model()
        super().save()

    def restore(self):
        self._load_model()
        super().restore()

    def reset(self):
        """After the world changed: a sharded optimizer's state shared out
        anew (shard_optimizer_state=True: every rank kept all of it at the
        last commit), and the model's step traced again."""
        if self.optimizer is None:
            return
        from perseus_tf.strategy import keras_shard
        if keras_shard.reshard(self.optimizer, _variables_of(self.optimizer),
                               self._saved_optimizer):
            keras_shard.assign_whole(self.optimizer, _variables_of(self.optimizer),
                                     self._saved_optimizer)
            self.model.train_function = None

    def sync(self):
        from perseus_tf.horovod.functions import allgather_object, broadcast_variables
        from perseus_tf.strategy import keras_shard
        if self.optimizer is not None:
            _build_optimizer(self.optimizer, self.model)
        variables = list(self.model.variables)
        shapes = [tuple(v.shape) for v in variables]
        sharded = set()
        if self.optimizer is not None:
            optimizer_variables = _variables_of(self.optimizer)
            variables += optimizer_variables
            shapes += keras_shard.whole_shapes(self.optimizer, optimizer_variables)
            sharded = keras_shard.sharded_state_ids(self.optimizer)
        # What each rank would broadcast, compared first: a worker that
        # joins with a model or optimizer built differently would otherwise
        # pair other variables with rank 0's (a stall, or wrong values).
        mine = [(i, tuple(int(d) for d in shape), getattr(v.dtype, "name", str(v.dtype)))
                for i, (v, shape) in enumerate(zip(variables, shapes))]
        everyone = allgather_object(mine)
        if any(theirs != everyone[0] for theirs in everyone):
            differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
            raise ValueError(
                "hvd.elastic state sync: the ranks' models and optimizers hold different "
                "variables (" + "; ".join(
                    f"rank {r}: {len(everyone[r])} variables, first shapes "
                    f"{[s for _, s, _ in everyone[r][:3]]}" for r in [0] + differ) +
                "). Build the model (call it once, or give it an Input) and compile it "
                "the same way on every worker before hvd.elastic.run")
        broadcast_variables([v for v in variables if id(v) not in sharded], root_rank=0)
        if sharded:
            # Rank 0's whole sharded state, as its last commit (or restore)
            # holds it, and each rank keeps its share: a rank that has just
            # joined holds none of it.
            from perseus_tf.horovod.functions import broadcast_object
            saved = self._saved_optimizer
            whole = broadcast_object(
                [value if id(v) in sharded else None
                 for v, value in zip(optimizer_variables, saved)]
                if len(saved) == len(optimizer_variables) else [],   # (saved before a build)
                root_rank=0, name="perseus.elastic.sharded_state")
            keras_shard.assign_whole(self.optimizer, optimizer_variables, whole)
        self._save_model()
        super().sync()

    def _save_model(self, gather=True):
        # A sharded optimizer's state is kept whole (its owners' shares
        # gathered: collective), so that the survivors of a failure hold it all.
        from perseus_tf.strategy import keras_shard
        self._saved_model = [v.numpy() for v in self.model.variables]
        self._saved_optimizer = (
            keras_shard.whole_values(self.optimizer, _variables_of(self.optimizer), gather)
            if self.optimizer is not None else [])

    def _load_model(self):
        from perseus_tf.strategy import keras_shard
        for v, value in zip(self.model.variables, self._saved_model):
            v.assign(value)
        if self.optimizer is not None:
            keras_shard.assign_whole(self.optimizer, _variables_of(self.optimizer),
                                     self._saved_optimizer)


class TensorFlowState(ObjectState):
    """A list of TF variables plus keyword attributes."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlowState needs `variables` (a list of tf.Variable): "
                             "TF2 has no global variable collection")
        self.variables = list(variables)
        self.session = session
        self._values = [v.numpy() for v in self.variables]
        super().__init__(bcast_object=_broadcast_object, get_rank=_rank, **kwargs)

    def save(self):
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self):
        for v, value in zip(self.variables, self._values):
            v.assign(value)
        super().restore()

    def sync(self):
        from perseus_tf.horovod.functions import broadcast_variables
        broadcast_variables(self.variables, root_rank=0)
        self._values = [v.numpy() for v in self.variables]
        super().sync()
