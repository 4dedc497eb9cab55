"""Sharded optimizer state under PerseusStrategy, Keras 3 (ZeRO stage 1 with
stage 2's gradient sharding).

`PerseusStrategy(shard_optimizer_state=True)` (PERSEUS_SHARD_OPTIMIZER_STATE=1)
gives each trainable variable one owner rank. Only the owner keeps that
variable's optimizer slots (Adam's moments, momentum, accumulators); the other
ranks hold a slot of shape (0,) in its place, so that every rank's optimizer
has the same variables in the same order and files keep their layout. A step:

1. Keras unscales, clips and decays as it does unsharded (clipping acts on each
   rank's local gradients before they are summed, as Keras 3's TF optimizer
   does under any strategy; weight decay is applied by every rank to every
   variable, which needs no state);
2. the gradients are summed by one reduce-scatter per dtype (compressed as
   PERSEUS_ALLREDUCE_DTYPE says), each rank receiving the sums of the
   variables it owns;
3. each rank runs the user's optimizer on the variables it owns;
4. one allgather per dtype hands every rank the owners' new values.

Whole variables are owned, not pieces of them: every optimizer sees each
variable whole, as it does unsharded (Adafactor factors a variable's last two
dimensions, per-variable norms and weight-decay exclusions need the whole
variable), so any Keras optimizer gives the unsharded numbers. Owners are
chosen largest variable first, each to the rank with the fewest bytes so far:
a rank's share is at most 1/N of the state plus the largest variable, and much
closer for models of many variables (docs/sharding.md has the figures).

Saving writes what an unsharded run writes: the owners' slots are gathered
(one allgather per dtype), so every rank must call the save, as every worker
does under MultiWorkerMirroredStrategy. Loading keeps the slots each rank owns.
"""

import functools
import threading

import numpy as np
import tensorflow as tf

from perseus_tf import _gradient_marks
from perseus_tf import _native
from perseus_tf import ops as perseus_ops

_creating = threading.local()


def creating_slots():
    """Whether this thread is creating a sharded optimizer's slot: its initial
    value (deterministic) is not broadcast, since ranks create different shapes."""
    return getattr(_creating, "on", False)


def owners(sizes, ranks):
    """The owner rank of each variable, given its bytes: largest first, each
    to the rank with the fewest bytes so far (ties: the lower rank, then the
    earlier variable), so every rank computes the same answer."""
    loads = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += sizes[i]
    return owner


def _nbytes(variable):
    return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


class _Shards:
    """Which rank owns each of an optimizer's variables, and its slots."""

    def __init__(self, optimizer, strategy):
        self.rank, self.size = strategy.extended._rank, strategy.extended._size
        variables = list(optimizer._trainable_variables)
        self.owner = owners([_nbytes(v) for v in variables], self.size)
        self.slots = {}   # id(slot) -> (slot, index of its variable)


def _refuse(optimizer, strategy):
    """Options the sharding cannot honour: an error naming each, before anything runs."""
    name = type(optimizer).__name__
    what = None
    if getattr(optimizer, "use_ema", False):
        what = f"{name}(use_ema=True) averages every weight on every rank"
    elif getattr(optimizer, "gradient_accumulation_steps", None):
        what = (f"{name}(gradient_accumulation_steps=...) keeps full-size accumulators; use "
                "PERSEUS_ACCUMULATE_N_STEPS (PerseusStrategy(accumulate_n_steps=N)) instead")
    elif len(strategy.extended._devices) > 1:
        what = f"a strategy with {len(strategy.extended._devices)} devices in one process"
    else:
        code = _native.gradient_compression()
        if code in (_native.COMPRESS_TOPK, _native.COMPRESS_DOWNSAMPLE):
            what = ("top-k or downsampling compression (PERSEUS_TOPK_ALLREDUCE, "
                    "PERSEUS_DOWNSAMPLE_N_ELEMENTS), which keep full-size residuals")
    if what:
        raise ValueError(
            f"shard_optimizer_state=True (PERSEUS_SHARD_OPTIMIZER_STATE=1) cannot shard {what}; "
            "turn that option off, or set shard_optimizer_state=False")


def _strategy(optimizer):
    """The sharding PerseusStrategy an optimizer runs under, or None."""
    strategy = getattr(optimizer, "_distribution_strategy", None)
    if not getattr(strategy, "_shard_optimizer_state", False):
        current = tf.distribute.get_strategy()
        if getattr(current, "_shard_optimizer_state", False) and current is not strategy:
            raise ValueError(
                f"optimizer {optimizer.name} was created outside the scope of the "
                "PerseusStrategy(shard_optimizer_state=True) it trains under; create it (or "
                "compile the model with it) inside strategy.scope()")
        return None
    if strategy.extended._size < 2:
        return None
    return strategy


def _shards(optimizer):
    """The optimizer's _Shards when its state is sharded, else None."""
    strategy = _strategy(optimizer)
    if strategy is None or not getattr(optimizer, "_trainable_variables", None):
        return None
    shards = getattr(optimizer, "_perseus_shards", None)
    if shards is None:
        _refuse(optimizer, strategy)
        shards = _Shards(optimizer, strategy)
        optimizer._perseus_shards = shards
    return shards


def _index_of(optimizer, variable):
    try:
        return optimizer._get_variable_index(variable)
    except KeyError:
        return None


# -- the patches -----------------------------------------------------------------


def shard_optimizer_state(patching, flavour):
    base = "{keras}.src.optimizers.base_optimizer.BaseOptimizer"
    patching.wrap(base + ".add_variable_from_reference", _slot_maker)
    patching.wrap("{keras}.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step",
                  _update_step)
    patching.wrap(base + ".save_own_variables", _saver)
    patching.wrap(base + ".load_own_variables", _loader)


def _slot_maker(original):
    @functools.wraps(original)
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        shards = _shards(self)
        index = None if shards is None else _index_of(self, reference_variable)
        if index is None:
            return original(self, reference_variable, name=name, initializer=initializer)
        _creating.on = True
        try:
            if shards.owner[index] == shards.rank:
                slot = original(self, reference_variable, name=name, initializer=initializer)
            else:
                label = getattr(reference_variable, "path", reference_variable.name)
                slot = self.add_variable(
                    shape=(0,), initializer="zeros", dtype=reference_variable.dtype,
                    name=f"{str(label).replace('/', '_').replace(':', '_')}_{name or 'var'}")
        finally:
            _creating.on = False
        shards.slots[id(slot)] = (slot, index)
        return slot
    return add_variable_from_reference


def _local(distribution, value):
    return distribution.experimental_local_results(value)[0]


def _layout(variables, owner, ranks):
    """Per dtype: [(position in `variables`, offset in its owner's segment,
    elements)] for each rank, and the segment length (the longest rank's)."""
    layouts = {}
    for pos, v in enumerate(variables):
        dtype = tf.as_dtype(v.dtype)
        per_rank, _ = layouts.setdefault(dtype, ([[] for _ in range(ranks)], None))
        mine = per_rank[owner[pos]]
        offset = mine[-1][1] + mine[-1][2] if mine else 0
        mine.append((pos, offset, int(np.prod(v.shape))))
    out = {}
    for dtype, (per_rank, _) in layouts.items():
        segment = max((m[-1][1] + m[-1][2]) if m else 0 for m in per_rank)
        out[dtype] = (per_rank, max(segment, 1))
    return out


def _segment(parts, length, dtype):
    """The parts flattened end to end, padded with zeros to `length`."""
    flat = [tf.reshape(p, [-1]) for p in parts]
    used = sum(int(np.prod(p.shape)) for p in parts)
    if used < length:
        flat.append(tf.zeros([length - used], dtype))
    return tf.concat(flat, 0) if len(flat) > 1 else flat[0]


def _compression_for(dtype):
    """(float16 travel, scale) for a float32 gradient reduce-scatter."""
    if dtype != tf.float32:
        return False, 1.0
    code = _native.gradient_compression()
    cfg = _native.config()
    scale = float(getattr(cfg, "gradient_scale", 10.0))
    if code == _native.COMPRESS_FP16:
        return True, scale
    if code == _native.COMPRESS_MIXED:
        # Float16 wherever the sums cross hosts (the reduce-scatter is one
        # group: within a single host it stays float32).
        return perseus_ops.cross_size() > 1, scale
    return False, 1.0


def _reduce_scatter(grads, per_rank, segment, dtype):
    """This rank's segment of the summed gradients."""
    size = len(per_rank)
    rows = []
    for r in range(size):
        rows.append(_segment([grads[pos] for pos, _, _ in per_rank[r]], segment, dtype))
    buffer = tf.concat(rows, 0)
    half, scale = _compression_for(dtype)
    name = f"perseus.shard.gradients.{dtype.name}"
    if half:
        out = perseus_ops.reducescatter(tf.cast(buffer * scale, tf.float16), name=name)
        return tf.cast(out, dtype) / scale
    return perseus_ops.reducescatter(buffer, name=name)


def _sharded_step(optimizer, shards, variables, learning_rate, distribution, grads):
    grads = [tf.convert_to_tensor(_local(distribution, g)) for g in grads]
    owner = [shards.owner[_index_of(optimizer, v)] for v in variables]
    layouts = _layout(variables, owner, shards.size)
    mine = []
    for dtype, (per_rank, segment) in layouts.items():
        cast = [tf.cast(g, dtype) if g.dtype != dtype else g for g in grads]
        summed = _reduce_scatter(cast, per_rank, segment, dtype)
        for pos, offset, count in per_rank[shards.rank]:
            mine.append((tf.reshape(summed[offset:offset + count], variables[pos].shape),
                         variables[pos]))
    # The user's optimizer, on the variables this rank owns.
    optimizer._distributed_tf_update_step(distribution, mine, learning_rate)
    for dtype, (per_rank, segment) in layouts.items():
        own = [tf.convert_to_tensor(variables[pos]) for pos, _, _ in per_rank[shards.rank]]
        gathered = perseus_ops.allgather(_segment(own, segment, dtype),
                                         name=f"perseus.shard.weights.{dtype.name}")
        for r in range(shards.size):
            if r == shards.rank:
                continue
            for pos, offset, count in per_rank[r]:
                start = r * segment + offset
                value = tf.reshape(gathered[start:start + count], variables[pos].shape)
                distribution.extended.update(variables[pos], _assign, args=(value,), group=False)
    return tf.constant(True)


def _assign(variable, value):
    return variable.assign(value)


def _update_step(original):
    from keras.src import backend

    @functools.wraps(original)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        shards = _shards(self)
        if shards is None:
            return original(self, grads, trainable_variables, learning_rate)
        variables = [v.value if isinstance(v, backend.Variable) else v
                     for v in trainable_variables]
        pending = _gradient_marks.pending_step()

        def merged(distribution, grads):
            step = functools.partial(_sharded_step, self, shards, variables, learning_rate,
                                     distribution, grads)
            if pending is None:
                return step()
            # Accumulating (PERSEUS_ACCUMULATE_N_STEPS): only apply steps communicate.
            return tf.cond(pending, step, lambda: tf.constant(False))

        tf.__internal__.distribute.interim.maybe_merge_call(
            merged, self._distribution_strategy, list(grads))
    return _backend_update_step


def _sharded_slots(optimizer):
    shards = getattr(optimizer, "_perseus_shards", None)
    if shards is None or _strategy(optimizer) is None:
        return None
    return shards


def per_variable_state(optimizer):
    """id(optimizer variable) -> (the variable, the index of the model variable
    it serves, the shape it has on that variable's owner), for every slot the
    sharding made and every other variable the optimizer keeps one of per
    model variable (a list as long as the model's, such as Adafactor's
    factored rows and columns: only the owner updates those)."""
    shards = optimizer._perseus_shards
    variables = optimizer._trainable_variables
    mine = {id(v): v for v in optimizer.variables}
    out = {}
    for name, value in vars(optimizer).items():
        if name in ("_variables", "_trainable_variables") or not isinstance(value, (list, tuple)):
            continue
        if len(value) != len(variables) or not any(id(x) in mine for x in value):
            continue
        for i, x in enumerate(value):
            if x is not None and id(x) in mine:
                out[id(x)] = (x, i, tuple(x.shape))
    for slot, i in shards.slots.values():
        out[id(slot)] = (slot, i, tuple(variables[i].shape))
    return out


def _saver(original):
    @functools.wraps(original)
    def save_own_variables(self, store):
        shards = _sharded_slots(self)
        if shards is None:
            return original(self, store)
        full = _gathered_slots(self, shards)
        for i, variable in enumerate(self.variables):
            store[str(i)] = full[id(variable)] if id(variable) in full else variable.numpy()
    return save_own_variables


def _gathered_slots(optimizer, shards):
    """id(variable) -> the whole value, from its owner, of every variable
    per_variable_state names (one allgather per dtype)."""
    state = per_variable_state(optimizer)
    position = {id(v): i for i, v in enumerate(optimizer.variables)}
    entries = sorted(state.values(), key=lambda e: position[id(e[0])])
    owner = [shards.owner[index] for _, index, _ in entries]
    stand_ins = [tf.zeros(shape, v.dtype) for v, _, shape in entries]
    layouts = _layout(stand_ins, owner, shards.size)
    full = {}
    with tf.device("/cpu:0"):
        for dtype, (per_rank, segment) in layouts.items():
            own = [tf.convert_to_tensor(entries[pos][0]) for pos, _, _ in per_rank[shards.rank]]
            gathered = perseus_ops.allgather(_segment(own, segment, dtype),
                                             name=f"perseus.shard.save.{dtype.name}").numpy()
            for r in range(shards.size):
                for pos, offset, count in per_rank[r]:
                    start = r * segment + offset
                    full[id(entries[pos][0])] = \
                        gathered[start:start + count].reshape(entries[pos][2])
    return full


def _loader(original):
    @functools.wraps(original)
    def load_own_variables(self, store):
        shards = _sharded_slots(self)
        if shards is None or len(store.keys()) != len(self.variables):
            return original(self, store)
        for i, variable in enumerate(self.variables):
            entry = shards.slots.get(id(variable))
            if entry is not None and shards.owner[entry[1]] != shards.rank:
                continue  # another rank owns this slot: a placeholder here
            variable.assign(store[str(i)])
    return load_own_variables


def state_bytes(optimizer):
    """The bytes of an optimizer's variables on this rank (its slots, sharded
    or not, and its counters)."""
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in optimizer.variables)
