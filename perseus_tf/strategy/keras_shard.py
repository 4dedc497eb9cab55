"""Sharded optimizer state under PerseusStrategy and the Horovod shim, Keras 3
and Keras 2 (ZeRO stage 1 with stage 2's gradient sharding).

`PerseusStrategy(shard_optimizer_state=True)` (PERSEUS_SHARD_OPTIMIZER_STATE=1)
gives each trainable variable one owner rank (or splits it, one piece a
rank: below). Only the owner keeps that variable's optimizer slots (Adam's
moments, momentum, accumulators); the other ranks hold a slot of shape (0,)
in its place, so that every rank's optimizer
has the same variables in the same order and files keep their layout. A step:

1. Keras unscales, clips and decays as it does unsharded (clipping acts on each
   rank's local gradients before they are summed, as Keras 3's TF optimizer
   does under any strategy; weight decay is applied by every rank to every
   variable, which needs no state);
2. the gradients are summed by reduce-scatters (compressed as
   PERSEUS_ALLREDUCE_DTYPE says), each rank receiving the sums of the
   variables it owns; the runtime reads the gradients in place and writes
   each rank's sums into its own gradients' buffers
   (ops.shard_reducescatter), in buckets of at most 64 MiB;
3. each rank runs the user's optimizer on the variables it owns, bucket by
   bucket as each reduce-scatter ends (_pipelined);
4. allgathers, bucket by bucket, hand every rank the owners' new values,
   each as soon as its bucket's update is done, a bucket's in chunks of at
   most 16 MiB (_chunks), one after another, so that a step holds little
   more than a chunk's gathered weights at a time.

Keras 2 (TF 2.15's keras, tf_keras) has its own section below: its
apply_gradients sums, clips and decays in another order, and its optimizers
are saved in TensorFlow checkpoints too.

The Horovod shim's `hvd.DistributedOptimizer(..., shard_optimizer_state=True)`
does the same without a strategy (shim_apply, at the end): its reducer's op,
scale factors and compression, its LossScaleOptimizer agreeing on skipped
steps over the ranks' shares, global_clipnorm over every rank's share. Its
update is the Keras optimizer's own apply, of this rank's owned variables
and pieces (a piece decays as its variable: _decays_as_its_variable).

Owners are given whole variables (place): every optimizer then sees each
variable whole, as it does unsharded (Adafactor factors a variable's last two
dimensions, Lamb takes a variable's norm). Owners are chosen largest variable
first, each to the rank with the fewest bytes so far: a rank's share is at
most 1/N of the state plus the largest variable. Where that is more than
_SPLIT_SLACK above 1/N (one large embedding; any model at scale), and the
optimizer updates each element alone (_ELEMENT_WISE: SGD, Adam, ...), the
largest variables are split instead, few enough to bring every share within:
each rank keeps a flat piece of each one's slots, and updates its piece of
the weights as a variable of its own (_piece_variables); the pieces travel
in buckets of their own (_split_layout). docs/sharding.md has the figures.

Saving writes what an unsharded run writes: the owners' slots are gathered
(allgathers), so every rank must call the save, as every worker
does under MultiWorkerMirroredStrategy. Loading keeps the slots each rank owns.

Under hvd.elastic (KerasState), each commit keeps the whole state on every
rank and each reset shares it out again for the new world, split anew (the
last section).
"""

import functools
import heapq
import threading

import numpy as np
import tensorflow as tf

from perseus_tf import _backprop_order
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
    return _greedy(sizes, [0] * ranks)


def _greedy(sizes, loads, skip=()):
    """owners(), the ranks already holding `loads` bytes; -1 for `skip`."""
    heap = [(load, r) for r, load in enumerate(loads)]
    heapq.heapify(heap)
    owner = [-1] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if i in skip:
            continue
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + sizes[i], r))
    return owner


# A rank's share of the state may exceed 1/N of it by this much before the
# largest variables are split into pieces (place).
_SPLIT_SLACK = 0.005


def _even_pieces(count, ranks, align):
    """[(start, elements)] of each rank's piece of a variable of `count`
    elements split over `ranks`: equal pieces rounded up to `align` elements
    (each starts aligned, so that slicing it takes no copy), the last ones
    shorter or empty."""
    step = -(-count // (ranks * align)) * align
    return [(min(r * step, count), max(0, min(step, count - r * step))) for r in range(ranks)]


def place(counts, itemsizes, ranks, splittable=(), slack=None):
    """(owner, pieces) for variables of `counts` elements of `itemsizes`
    bytes. Whole variables go to owners (owners(): a rank's share is then
    within 1/N of the state plus one variable); where that leaves the
    largest share more than `slack` above 1/N, the largest `splittable`
    variables are split instead, few enough (the number bisected: more
    splits can balance the rest worse) and all of them if need be: each
    rank keeps a piece of each (pieces[i]: _even_pieces'), and owner[i] is
    -1."""
    slack = _SPLIT_SLACK if slack is None else slack
    sizes = [c * b for c, b in zip(counts, itemsizes)]
    target = sum(sizes) / ranks * (1 + slack)
    candidates = [i for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
                  if i in splittable]

    def attempt(k):
        pieces, loads = {}, [0] * ranks
        for i in candidates[:k]:
            pieces[i] = _even_pieces(counts[i], ranks, max(1, _ALIGN_BYTES // itemsizes[i]))
            for r, (_, count) in enumerate(pieces[i]):
                loads[r] += count * itemsizes[i]
        owner = _greedy(sizes, loads, skip=pieces)
        for i, r in enumerate(owner):
            if r >= 0:
                loads[r] += sizes[i]
        return (owner, pieces), max(loads) <= target

    found, ok = attempt(0)
    if ok or not candidates:
        return found
    lo, hi = 0, len(candidates)     # attempt(lo) fails; the fewest splits that do not
    best, _ = attempt(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tried, ok = attempt(mid)
        if ok:
            hi, best = mid, tried
        else:
            lo = mid
    return best


class _Shards:
    """Which rank owns each of an optimizer's variables, which are split
    into pieces (place), and its slots."""

    def __init__(self, optimizer, rank, size):
        self.rank, self.size = rank, size
        variables = list(_model_variables(optimizer))
        counts = [int(np.prod(v.shape)) for v in variables]
        itemsizes = [tf.as_dtype(v.dtype).size for v in variables]
        splittable = _splittable(optimizer, variables)
        self.owner, self.pieces = place(counts, itemsizes, size, splittable)
        self.slots = {}   # id(slot) -> (slot, index of its variable)
        # index of a split variable -> this rank's piece of its weights (the
        # variable the optimizer updates; _piece_variables), when not empty.
        self.piece = _piece_variables(optimizer, variables, self)
        # How many times hvd.elastic shared the state out again before this
        # layout (reshard): a step traced for an earlier one fails (_same_world).
        self.generation = optimizer.__dict__.get("_perseus_reshards_", 0)


def _refuse(optimizer, strategy):
    """Options the sharding cannot honour: an error naming each, before anything runs."""
    name = type(optimizer).__name__
    what = None
    if getattr(optimizer, "use_ema", False):
        what = f"{name}(use_ema=True) averages every weight on every rank"
    elif getattr(optimizer, "gradient_accumulation_steps", None):
        what = (f"{name}(gradient_accumulation_steps=...) keeps full-size accumulators; use "
                "PERSEUS_ACCUMULATE_N_STEPS (PerseusStrategy(accumulate_n_steps=N)) instead"
                if strategy is not None else
                f"{name}(gradient_accumulation_steps=...), which keeps full-size accumulators")
    elif hasattr(optimizer, "_u_product_counter"):
        what = (f"Keras 2's {name}, whose one u_product advances once for each variable "
                "it updates (each rank updates different variables); use Keras 3's or another "
                "optimizer")
    elif strategy is not None and len(strategy.extended._devices) > 1:
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


def _shim_sharded(optimizer):
    """Whether an optimizer is a Horovod shim DistributedOptimizer made with
    shard_optimizer_state=True (perseus_tf/horovod/keras/_optimizer.py), in
    a job of more than one rank."""
    settings = getattr(type(optimizer), "_perseus_settings", None)
    return bool(getattr(settings, "shard", False)) and perseus_ops.size() > 1


def _shards(optimizer):
    """The optimizer's _Shards when its state is sharded, else None."""
    if _shim_sharded(optimizer):
        strategy, rank, size = None, perseus_ops.rank(), perseus_ops.size()
    else:
        strategy = _strategy(optimizer)
        if strategy is None:
            return None
        rank, size = strategy.extended._rank, strategy.extended._size
    if not _model_variables(optimizer):
        return None
    shards = getattr(optimizer, "_perseus_shards", None)
    if shards is None:
        _refuse(optimizer, strategy)
        shards = _Shards(optimizer, rank, size)
        optimizer._perseus_shards = shards
    elif (shards.rank, shards.size) != (rank, size):
        raise ValueError(
            f"optimizer {optimizer.name}'s state was sharded for {shards.size} ranks (this "
            f"process as rank {shards.rank}), and the job now has {size} (this process: rank "
            f"{rank}). Under hvd.elastic, give the optimizer to hvd.elastic.KerasState (its "
            "reset shares the state out again for the new world)")
    return shards


# The optimizers whose update of an element of a variable needs only that
# element's gradient, weight and slots (and scalars): a rank can update a piece
# of a variable alone. Not Adafactor (it factors a variable's last two
# dimensions), Lamb (a variable's norm), nor a subclass (its update may differ).
_ELEMENT_WISE = frozenset(["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax",
                           "Nadam", "Lion", "Ftrl"])


def _element_wise(optimizer):
    """Whether place() may split the optimizer's variables into pieces: a
    Keras optimizer of _ELEMENT_WISE. (Under clipnorm, Keras 3 under
    PerseusStrategy clips each rank's gradients before they are summed,
    whole; Keras 2's step and the Horovod shim clip each variable's sum, so
    they clip a piece by its variable's norm: _clip_pieces.)"""
    cls = type(optimizer)
    module = cls.__module__ + "."
    return (cls.__name__ in _ELEMENT_WISE and module.split(".")[0] in ("keras", "tf_keras") and
            ".optimizers." in module and ".legacy." not in module)


def _splittable(optimizer, variables):
    """The positions of the variables place() may split. The shim's apply
    runs a variable's constraint on its owner only: a variable with one
    stays whole there (under PerseusStrategy every rank runs the
    constraints on the whole variables after the gathers)."""
    if not _element_wise(optimizer):
        return ()
    shim = _shim_sharded(optimizer)
    return [i for i, v in enumerate(variables)
            if not (shim and getattr(v, "constraint", None) is not None)]


def _piece_variables(optimizer, variables, shards):
    """index -> this rank's piece of the weights of each split variable (when
    not empty): a flat variable of its own, which the optimizer updates as
    if it were the model variable (its key in the optimizer's index maps to
    the variable's index, so it finds the piece's slots); _piece_pair sets it
    from the weights before each update. Not tracked: saving and loading see
    only the model variables and the slots."""
    from tensorflow.python.ops import resource_variable_ops

    out = {}
    shards.piece_of = {}   # id(piece) -> its model variable
    for index, pieces in shards.pieces.items():
        count = pieces[shards.rank][1]
        if not count:
            continue
        variable = variables[index]
        name = str(getattr(variable, "path", variable.name)).replace("/", "_").replace(":", "_")
        with tf.init_scope(), tf.device(_device_of(variable)):
            # (ResourceVariable itself: no strategy's creator makes it mirrored.)
            piece = resource_variable_ops.ResourceVariable(
                tf.zeros([count], tf.as_dtype(variable.dtype)), trainable=False,
                name=f"{name}_piece")
        key = optimizer._var_key(piece)
        if hasattr(optimizer, "_trainable_variables_indices"):    # Keras 3
            optimizer._trainable_variables_indices[key] = index
        else:                                                     # Keras 2
            optimizer._index_dict[key] = index
        out[index] = piece
        shards.piece_of[id(piece)] = variable
    return out


def _device_of(variable):
    value = getattr(variable, "_value", None)       # a Keras 3 variable's
    try:
        return (value if value is not None else variable).device or "/cpu:0"
    except (AttributeError, ValueError):
        return "/cpu:0"


def _piece_pair(piece, start, count, grad, variable):
    """(the sum of a piece's gradient, flat; the piece), the piece first set
    to `variable`'s weights as they are now (decayed, loaded, broadcast)."""
    piece.assign(tf.reshape(tf.convert_to_tensor(variable), [-1])[start:start + count],
                 read_value=False)
    return tf.reshape(grad, [-1]), piece


def _model_variables(optimizer):
    """The model variables an optimizer was built for, in its order (Keras 3
    keeps them; Keras 2's are recorded as it builds: _recorder)."""
    found = getattr(optimizer, "_trainable_variables", None)
    return found if found is not None else _keras2_variables(optimizer)


def _index_of(optimizer, variable):
    if hasattr(optimizer, "_get_variable_index"):        # Keras 3
        try:
            return optimizer._get_variable_index(variable)
        except KeyError:
            return None
    index = getattr(optimizer, "_index_dict", None)      # Keras 2
    return None if index is None else index.get(optimizer._var_key(variable))


# -- the patches -----------------------------------------------------------------


def shard_optimizer_state(patching, flavour):
    base = "{keras}.src.optimizers.base_optimizer.BaseOptimizer"
    patching.wrap(base + ".add_variable_from_reference", _slot_maker)
    patching.wrap("{keras}.src.backend.tensorflow.optimizer.TFOptimizer._backend_update_step",
                  _update_step)
    patching.wrap(base + ".save_own_variables", _saver)
    patching.wrap(base + ".load_own_variables", _loader)
    patching.wrap(base + "._use_weight_decay", _decays_as_its_variable)


def _decays_as_its_variable(original):
    """A piece of a split variable (_piece_variables) is decayed, or not, as
    its model variable is (exclude_from_weight_decay names variables and
    matches their names; the shim's apply decays the pieces it updates)."""
    @functools.wraps(original)
    def _use_weight_decay(self, variable):
        shards = getattr(self, "_perseus_shards", None)
        model_variable = getattr(shards, "piece_of", {}).get(id(variable))
        return original(self, variable if model_variable is None else model_variable)
    return _use_weight_decay


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
                # A piece's slot (flat), or a placeholder where another rank owns it.
                count = shards.pieces[index][shards.rank][1] if index in shards.pieces else 0
                label = getattr(reference_variable, "path", reference_variable.name)
                slot = self.add_variable(
                    shape=(count,), initializer=initializer if count else "zeros",
                    dtype=reference_variable.dtype,
                    name=f"{str(label).replace('/', '_').replace(':', '_')}_{name or 'var'}")
        finally:
            _creating.on = False
        shards.slots[id(slot)] = (slot, index)
        return slot
    return add_variable_from_reference


def _local(distribution, value):
    return distribution.experimental_local_results(value)[0]


# Each variable starts 64 bytes into its segment from the last: slicing the
# reduce-scatter's and the allgather's results along their only dimension at
# such offsets takes no copy in TensorFlow.
_ALIGN_BYTES = 64


# The most one reduce-scatter or allgather of a step carries (every rank's
# part together): a model's gradients go in several, so that no buffer of a
# step is the size of the model (TensorFlow's allocator reuses the memory of
# a step's many small tensors for buckets of this size, not for one of the
# model's).
_BUCKET_BYTES = 64 << 20

# The most one allgather of the owners' new weights carries (every rank's
# part together): a bucket's weights are gathered in chunks of about this
# size, each once the one before is assigned (_chunks), so that the gathered
# weights a step holds at a time are a chunk's, not a bucket's. A bucket's
# reduce-scatter writes into the gradients' own buffers; its gather needs a
# buffer of the bucket's size, and two runs' gathers are in flight
# (_pipelined): at 64 MiB, 128 MiB of BERT-base's 417 MiB saving at 2 ranks.
_GATHER_BYTES = 16 << 20


def _mark(dtype, total, ranks, limit):
    """Elements of one rank's stretch of a bucket (_layout), for `total`
    elements of `dtype`."""
    align = max(1, _ALIGN_BYTES // dtype.size)
    run = max(_backprop_order._MIN_GROUP_BYTES // dtype.size, total // _backprop_order._GROUPS)
    return max(align, min(limit // ranks // dtype.size, run // ranks))


def _oversized(variables, ranks, limit=None):
    """The positions of the variables whose gradients an allreduce carries
    in fewer bytes than their bucket's reduce-scatter would (BERT-base's word
    embedding at 4 ranks, VGG-16's first dense kernel). In a bucket such a
    variable of c elements is one rank's part and the others' parts are a
    stretch (_mark, m) at most; a ring reduce-scatter sends the ranks less
    one times the largest part, (N-1)c, where the bucket without it and an
    allreduce of it send (N-1)m + 2(N-1)c/N: fewer when c(N-2) > Nm (never at
    2 ranks). Its owner keeps the sum; the others hold it for the step (the
    memory of one gradient)."""
    limit = _BUCKET_BYTES if limit is None else limit
    totals = {}
    for v in variables:
        dtype = tf.as_dtype(v.dtype)
        totals[dtype] = totals.get(dtype, 0) + int(np.prod(v.shape))
    marks = {dtype: _mark(dtype, total, ranks, limit) for dtype, total in totals.items()}
    return {pos for pos, v in enumerate(variables)
            if int(np.prod(v.shape)) * (ranks - 2) > ranks * marks[tf.as_dtype(v.dtype)]}


def _layout(variables, owner, ranks, limit=None, skip=()):
    """The buckets a step's variables travel in: [(tag, dtype, per_rank,
    segment, run)], per_rank[r] = [(position in `variables`, offset in rank
    r's segment, elements)], `run` numbering them in order. Each rank's
    variables of one dtype are taken in the order backprop produces their
    gradients (the last layers' first) and cut at the same per-rank byte
    marks: about a quarter of the rank's share (as the unsharded strategy's
    backprop groups, _backprop_order: at least 1 MiB in all), at most
    `limit` / ranks (64 MiB in all). So bucket k holds the k-th stretch of
    every rank's variables, its ranks' parts about even (owners() balances
    the shares), and its reduce-scatter can start while backprop computes
    the earlier layers' gradients. `skip`: positions left out."""
    limit = _BUCKET_BYTES if limit is None else limit
    by_dtype = {}
    for pos, v in enumerate(variables):
        if pos not in skip:
            by_dtype.setdefault(tf.as_dtype(v.dtype), []).append(pos)
    out = []
    for dtype, positions in by_dtype.items():
        align = max(1, _ALIGN_BYTES // dtype.size)
        counts = {p: int(np.prod(variables[p].shape)) for p in positions}
        mark = _mark(dtype, sum(counts.values()), ranks, limit)
        buckets = {}
        for r in range(ranks):
            at = 0
            for pos in (p for p in reversed(positions) if owner[p] == r):
                mine = buckets.setdefault(at // mark, [[] for _ in range(ranks)])[r]
                end = mine[-1][1] + mine[-1][2] if mine else 0
                mine.append((pos, -(-end // align) * align, counts[pos]))
                at += counts[pos]
        for k in sorted(buckets):
            per_rank = buckets[k]
            segment = max((m[-1][1] + m[-1][2]) if m else 0 for m in per_rank)
            out.append((f"{dtype.name}.{k}", dtype, per_rank,
                        max(align, -(-segment // align) * align), len(out)))
    return out


def _split_layout(variables, pieces, ranks, limit=None):
    """The buckets of the split variables (`pieces`: position in `variables`
    -> place()'s pieces), as _layout's: each holds every piece of its
    variables (rank r's part: their r-th pieces), taken in backprop's order
    and cut at _layout's marks."""
    limit = _BUCKET_BYTES if limit is None else limit
    by_dtype = {}
    for pos in sorted(pieces):
        by_dtype.setdefault(tf.as_dtype(variables[pos].dtype), []).append(pos)
    out = []
    for dtype, positions in by_dtype.items():
        align = max(1, _ALIGN_BYTES // dtype.size)
        mark = _mark(dtype, sum(int(np.prod(variables[p].shape)) for p in positions), ranks,
                     limit)
        groups, at = [[]], 0
        for pos in reversed(positions):
            if at >= mark:
                groups.append([])
                at = 0
            groups[-1].append(pos)
            at += pieces[pos][0][1]
        for k, group in enumerate(groups):
            per_rank = []
            for r in range(ranks):
                mine, end = [], 0
                for pos in group:
                    count = pieces[pos][r][1]
                    if count:
                        mine.append((pos, -(-end // align) * align, count))
                        end = mine[-1][1] + count
                per_rank.append(mine)
            segment = max((m[-1][1] + m[-1][2]) if m else 0 for m in per_rank)
            out.append((f"{dtype.name}.split.{k}", dtype, per_rank,
                        max(align, -(-segment // align) * align), len(out)))
    return out


def _in_backprop_order(grads, runs):
    """Each run's gradients computed before backprop goes on past it
    (_backprop_order), so that its reduction overlaps the rest. runs:
    _run_layout's. Returns the _backprop_order.Stages (stage k: run k's), or
    None."""
    return _backprop_order.staged(
        [[grads[pos] for pos in dict.fromkeys(pos for mine in bucket[2] for pos, _, _ in mine)]
         if whole is None else [grads[whole]] for bucket, whole, _ in runs])


def _segment(parts, placed, length, dtype):
    """The parts flattened at their offsets (`placed`: the layout's entries),
    zeros between them and to `length`."""
    if not placed:
        return tf.zeros([length], dtype)
    flat, at = [], 0
    for part, (_, offset, count) in zip(parts, placed):
        if offset > at:
            flat.append(tf.zeros([offset - at], dtype))
        flat.append(tf.reshape(part, [-1]))
        at = offset + count
    if length > at:
        flat.append(tf.zeros([length - at], dtype))
    return tf.concat(flat, 0) if len(flat) > 1 else flat[0]


def _compression_for(dtype):
    """The runtime's compression for a gradient reduce-scatter of `dtype`:
    PERSEUS_ALLREDUCE_DTYPE's, for float32 (the runtime sends float16 times
    the gradient scale; mixed: only when the job spans hosts)."""
    if dtype != tf.float32:
        return _native.COMPRESS_NONE
    code = _native.gradient_compression()
    if code in (_native.COMPRESS_FP16, _native.COMPRESS_MIXED):
        return code
    return _native.COMPRESS_NONE


def _reduce_scatter(part, per_rank, segment, dtype, tag, rank, chain=None, **kwargs):
    """The sums of this rank's own gradients, in its layout's order: one
    reducescatter of the vector the gradients make at their layout's places,
    read by the runtime from the gradients themselves, and written into this
    rank's own gradients' buffers (ops.shard_reducescatter: no concatenated
    copy, no new buffer when nothing else reads them). part(r, pos): the
    gradient (or piece of one) at rank r's entry for `pos`. chain:
    _two_at_a_time's."""
    placed = [(r * segment + offset, part(r, pos)) for r, mine in enumerate(per_rank)
              for pos, offset, _ in mine]
    first = sum(len(mine) for mine in per_rank[:rank])
    kwargs.setdefault("compression", _compression_for(dtype))
    with tf.device("/cpu:0"), _two_at_a_time(chain):
        summed = perseus_ops.shard_reducescatter(
            [g for _, g in placed], [at for at, _ in placed], len(per_rank) * segment,
            name=f"perseus.shard.gradients.{tag}",
            owned=list(range(first, first + len(per_rank[rank]))), **kwargs)
    if summed:
        _made(summed[0], chain)
    return summed


def _two_at_a_time(chain):
    """The reductions of a step two at a time (`chain`: a list holding the
    last two made, or None): each starts once the one before the previous
    ended, so that two buckets' reduction buffers are in use at once, not
    the model's (when every gradient is ready together). (One at a time,
    a reduction's start would wait for the executor to get round to it
    after the previous one ends: behind backprop, on a busy core.)"""
    return tf.control_dependencies((chain or [])[:-1])


def _made(output, chain=None):
    """A collective of the sharded step made (`output`: one of its outputs):
    TensorFlow may start it as soon as its inputs are ready (_independent),
    and `chain` (_two_at_a_time's, when given) holds it."""
    if tf.executing_eagerly():
        return
    _independent(output.op)
    if chain is not None:
        chain[:] = chain[-1:] + [output.op]


def _buckets(optimizer, shards, variables, skip=()):
    return _layout(variables, [shards.owner[_index_of(optimizer, v)] for v in variables],
                   shards.size, skip=skip)


def _bucket_sums(shards, grads, variables, bucket, split, options, chain=None):
    """[(the sum of a variable's gradient over the ranks, the variable)] for
    the variables of `bucket` this rank owns, and (the sum of a piece's,
    the piece: _piece_pair) for the pieces of split ones: one reduce-scatter.
    split: _run_layout's. options(dtype): its keyword arguments."""
    tag, dtype, per_rank, segment, _ = bucket
    cast = {pos: grads[pos] if grads[pos].dtype == dtype else tf.cast(grads[pos], dtype)
            for mine in per_rank for pos, _, _ in mine}

    def part(r, pos):
        if pos not in split:
            return cast[pos]
        start, count = split[pos][0][r]
        return tf.reshape(cast[pos], [-1])[start:start + count]

    summed = _reduce_scatter(part, per_rank, segment, dtype, tag, shards.rank, chain,
                             **options(dtype))
    out = []
    for (pos, _, _), g in zip(per_rank[shards.rank], summed):
        if pos in split:
            pieces, piece = split[pos]
            out.append(_piece_pair(piece, *pieces[shards.rank], g, variables[pos]))
        else:
            out.append((tf.reshape(g, variables[pos].shape), variables[pos]))
    return out


def _allreduced_sum(optimizer, shards, grads, variables, pos, options, chain=None):
    """[(the sum of an _oversized variable's gradient, the variable)] on its
    owner, [] elsewhere: one allreduce."""
    variable = variables[pos]
    dtype = tf.as_dtype(variable.dtype)
    grad = grads[pos] if grads[pos].dtype == dtype else tf.cast(grads[pos], dtype)
    kwargs = dict(options(dtype))
    kwargs.setdefault("compression", _compression_for(dtype))
    with tf.device("/cpu:0"), _two_at_a_time(chain):
        summed = perseus_ops.allreduce(grad, name=f"perseus.shard.gradients.whole.{pos}",
                                       **kwargs)
    _made(summed, chain)
    if shards.owner[_index_of(optimizer, variable)] != shards.rank:
        return []
    return [(tf.reshape(summed, variable.shape), variable)]


def _run_layout(optimizer, shards, variables):
    """The step's runs in the order backprop produces their gradients:
    [(the run's bucket, the position of its _oversized variable or None,
    split)]. A run is a bucket's reduce-scatter, or one _oversized variable's
    allreduce, whose allgather's bucket is that variable alone, from its
    owner. Split variables (place) travel in buckets of their own
    (_split_layout); split: position -> (its pieces, this rank's piece
    variable or None) for those of the run's bucket."""
    split = {}
    for pos, v in enumerate(variables):
        index = _index_of(optimizer, v)
        if index in shards.pieces:
            split[pos] = (shards.pieces[index], shards.piece.get(index))
    whole = _oversized(variables, shards.size) - set(split)
    last = lambda b: max(pos for mine in b[2] for pos, _, _ in mine)  # noqa: E731
    runs = [(last(b), b, None, {})
            for b in _buckets(optimizer, shards, variables, skip=whole | set(split))]
    runs += [(last(b), b, None, {pos: split[pos] for mine in b[2] for pos, _, _ in mine})
             for b in _split_layout(variables, {pos: p for pos, (p, _) in split.items()},
                                    shards.size)]
    for pos in whole:
        owner = shards.owner[_index_of(optimizer, variables[pos])]
        count = int(np.prod(variables[pos].shape))
        alone = [[(pos, 0, count)] if r == owner else [] for r in range(shards.size)]
        runs.append((pos, (f"whole.{pos}", tf.as_dtype(variables[pos].dtype), alone, count, -1),
                     pos, {}))
    return [run[1:] for run in sorted(runs, key=lambda run: -run[0])]


def _runs(optimizer, shards, grads, variables, options):
    """([(a run's bucket, its split (_run_layout's), a function making its
    reduction and returning [(the sum of a variable's gradient, the
    variable)] for the variables of the run this rank owns, and the pieces')],
    in backprop's order (_run_layout); the
    _backprop_order.Stages that compute each run's gradients before backprop
    goes on past it, or None)."""
    runs = _run_layout(optimizer, shards, variables)
    stages = _in_backprop_order(grads, runs)
    chain = []
    return [(bucket, split,
             functools.partial(_bucket_sums, shards, grads, variables, bucket, split, options,
                               chain)
             if pos is None else
             functools.partial(_allreduced_sum, optimizer, shards, grads, variables, pos, options,
                               chain))
            for bucket, pos, split in runs], stages


def _owned_sums(optimizer, shards, grads, variables, options=lambda dtype: {}):
    """[(the sum of a variable's gradient, the variable)] for every variable
    this rank owns: every run's reduction (_runs), made in backprop's order."""
    return [pair for _, _, sums in _runs(optimizer, shards, grads, variables, options)[0]
            for pair in sums()]


# Backprop's stage k + _LAG waits for run k's update (_pipelined).
_LAG = 2


def _pipelined(optimizer, shards, grads, variables, apply, assign, options=lambda dtype: {}):
    """The step run by run (_runs): a run's reduction, `apply` of this
    rank's sums of it, then its allgather of the owners' new values, which
    waits for that update and for the assigns of the run two before (so
    that two runs' gathered weights are held at a time). So the first runs'
    updates and allgathers overlap the rest of backprop and the later runs'
    reductions, instead of every allgather waiting for the last
    reduce-scatter. (For optimizers whose update of one variable needs no
    other's gradient: not global_clipnorm, which needs every sum first.)

    TensorFlow's executor would run an update only once backprop is done
    (ops made ready by a collective's completion queue behind the ops
    backprop keeps making ready), so backprop's stage k + _LAG waits for
    run k's update and its allgather's input, where that cannot make a cycle
    (_backprop_order.Stages.gate): the update runs, and the allgather starts,
    while the wire carries the next runs' reductions. (At _LAG 1 a stage
    would wait for the previous run's reduction too, and backprop with it.)"""
    runs, stages = _runs(optimizer, shards, grads, variables, options)
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    assigned = [[], []]
    for k, (bucket, split, sums) in enumerate(runs):
        made = len(graph.get_operations()) if graph is not None else 0
        mine = sums()
        if mine:
            apply(mine)
        own = _own_segment(shards, variables, bucket, split)
        if stages is not None and graph is not None and mine:
            stages.gate(k + _LAG, graph.get_operations()[made:])
        assigned = [assigned[1], _bucket_gather(shards, variables, bucket, assign, assigned[0],
                                                own, split)]


def _independent(op):
    """Lets TensorFlow start `op` (a collective of the sharded step) as soon
    as its inputs are ready, not after every stateful op made before it
    (automatic control dependencies chain those in program order): the
    runtime matches collectives across ranks by name, in any order. A
    reduce-scatter then does not wait for an earlier run's allgather, nor an
    allgather for a later run's reduce-scatter."""
    manager = getattr(op.graph, "experimental_acd_manager", None)
    if manager is not None:
        manager.run_independently(op)


def _sharded_step(optimizer, shards, variables, learning_rate, distribution, grads):
    grads = [tf.convert_to_tensor(_local(distribution, g)) for g in grads]
    # The user's optimizer, on the variables this rank owns and its pieces
    # of split ones, run by run.
    def apply(mine):
        whole = [(g, v) for g, v in mine if id(v) not in shards.piece_of]
        if whole:
            optimizer._distributed_tf_update_step(distribution, whole, learning_rate)
        for g, piece in mine:
            if id(piece) in shards.piece_of:     # (not mirrored: updated as it is)
                optimizer.update_step(g, piece, learning_rate)

    _pipelined(optimizer, shards, grads, variables, apply, _strategy_assign(distribution))
    return tf.constant(True)


def _strategy_assign(distribution):
    return lambda v, value: distribution.experimental_local_results(
        distribution.extended.update(v, _assign, args=(value,), group=False))


def _assign(variable, value):
    return variable.assign(value, read_value=False)


def _update_step(original):
    from keras.src import backend

    @functools.wraps(original)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # (The Horovod shim's sharded optimizers apply their own variables
        # here, the communication done: shim_apply below.)
        shards = None if _shim_sharded(self) else _shards(self)
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
    if shards is None or (not _shim_sharded(optimizer) and _strategy(optimizer) is None):
        return None
    return shards


def sharded_state_ids(optimizer):
    """The ids of the variables of `optimizer` (or of the optimizer a
    LossScaleOptimizer wraps) that are one rank's share of sharded state:
    what a broadcast of the optimizer's variables must leave alone."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    if _sharded_slots(inner) is None:
        return set()
    return set(per_variable_state(inner))


def per_variable_state(optimizer):
    """id(optimizer variable) -> (the variable, the index of the model variable
    it serves, the shape it has on that variable's owner), for every slot the
    sharding made and every other variable the optimizer keeps one of per
    model variable (a list as long as the model's, such as Adafactor's
    factored rows and columns: only the owner updates those)."""
    shards = optimizer._perseus_shards
    variables = _model_variables(optimizer)
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
    full = _gathered_pieces(shards, [e for e in entries if e[1] in shards.pieces])
    entries = [e for e in entries if e[1] not in shards.pieces]
    owner = [shards.owner[index] for _, index, _ in entries]
    stand_ins = [tf.zeros(shape, v.dtype) for v, _, shape in entries]
    with tf.device("/cpu:0"):
        for tag, dtype, per_rank, segment, _ in _layout(stand_ins, owner, shards.size):
            starts, lengths = _parts(per_rank, max(1, _ALIGN_BYTES // dtype.size))
            placed = per_rank[shards.rank]
            own = [tf.convert_to_tensor(entries[pos][0]) for pos, _, _ in placed]
            gathered = perseus_ops.allgather(_segment(own, placed, lengths[shards.rank], dtype),
                                             name=f"perseus.shard.save.{tag}").numpy()
            for r in range(shards.size):
                for pos, offset, count in per_rank[r]:
                    start = starts[r] + offset
                    full[id(entries[pos][0])] = \
                        gathered[start:start + count].reshape(entries[pos][2])
    return full


def _gathered_pieces(shards, entries):
    """_gathered_slots' for the slots of split variables (`entries`:
    per_variable_state's): one allgather per dtype of each rank's pieces,
    laid end to end in the entries' order."""
    full, by_dtype = {}, {}
    for entry in entries:
        by_dtype.setdefault(tf.as_dtype(entry[0].dtype), []).append(entry)
    with tf.device("/cpu:0"):
        for dtype, group in by_dtype.items():
            own = [tf.reshape(tf.convert_to_tensor(v), [-1]) for v, _, _ in group]
            gathered = perseus_ops.allgather(
                tf.concat(own, 0) if len(own) > 1 else own[0],
                name=f"perseus.shard.save.{dtype.name}.split").numpy()
            at, parts = 0, {id(v): [] for v, _, _ in group}
            for r in range(shards.size):
                for v, index, _ in group:
                    count = shards.pieces[index][r][1]
                    parts[id(v)].append(gathered[at:at + count])
                    at += count
            for v, _, shape in group:
                full[id(v)] = np.concatenate(parts[id(v)]).reshape(shape)
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
                # This rank's piece of a split variable's slot, or nothing:
                # another rank owns it (a placeholder here).
                if entry[1] in shards.pieces:
                    variable.assign(_piece_of(shards, entry[1], store[str(i)]))
                continue
            variable.assign(store[str(i)])
    return load_own_variables


def _piece_of(shards, index, whole):
    """This rank's piece of the whole value of a split variable's slot."""
    start, count = shards.pieces[index][shards.rank]
    return np.reshape(np.asarray(whole), [-1])[start:start + count]


def state_bytes(optimizer):
    """The bytes of an optimizer's variables on this rank (its slots, sharded
    or not, and its counters)."""
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in optimizer.variables)


# -- Keras 2 (TF 2.15's keras, tf_keras) ------------------------------------------
#
# Keras 2's optimizers sum the gradients, then clip the sums and decay the
# weights, in apply_gradients; a LossScaleOptimizer sums them itself and asks
# its inner optimizer to skip that. The sharded apply_gradients does the same
# steps on the variables this rank owns: the sums by reduce-scatter (or this
# rank's share of sums already made), clipping (global_clipnorm's norm over
# every rank's share), weight decay and the update, then the allgather; the
# constraints run on every variable afterwards, as unsharded.
#
# Keras 2 also saves optimizers in TensorFlow checkpoints (save_weights'
# default format, SavedModel, BackupAndRestore, tf.train.Checkpoint), which
# write each variable as it is. Each variable of per_variable_state serializes
# to its whole value (the first one a save reaches gathers them all, once
# per save, on every rank alike), and a rank restores only the slots it owns.


class _Recorded:
    """The model variables of a Keras 2 optimizer (not a tracked attribute:
    a checkpoint's object graph stays the unsharded one)."""

    def __init__(self, variables):
        self.variables = list(variables)


def shard_optimizer_state_keras2(patching, flavour):
    base = "{keras}.src.optimizers.optimizer"
    patching.wrap(base + "._BaseOptimizer._build_index_dict", _recorder)
    patching.wrap(base + ".Optimizer.add_variable_from_reference", _slot_maker_keras2)
    patching.wrap(base + ".Optimizer.apply_gradients", _apply_keras2)
    patching.wrap(base + "._BaseOptimizer.save_own_variables", _saver)
    patching.wrap(base + "._BaseOptimizer.load_own_variables", _loader)
    patching.wrap(base + "._BaseOptimizer._use_weight_decay", _decays_as_its_variable)


def _recorder(original):
    @functools.wraps(original)
    def _build_index_dict(self, var_list):
        self._perseus_recorded = _Recorded(var_list)
        return original(self, var_list)
    return _build_index_dict


def _keras2_variables(optimizer):
    recorded = getattr(optimizer, "_perseus_recorded", None)
    return None if recorded is None else recorded.variables


def _slot_maker_keras2(original):
    @functools.wraps(original)
    def add_variable_from_reference(self, model_variable, variable_name, shape=None,
                                    initial_value=None):
        shards = _shards(self)
        index = None if shards is None else _index_of(self, model_variable)
        if index is None:
            return original(self, model_variable, variable_name, shape, initial_value)
        _creating.on = True
        try:
            if shards.owner[index] == shards.rank:
                slot = original(self, model_variable, variable_name, shape, initial_value)
            elif index in shards.pieces and shards.pieces[index][shards.rank][1]:
                # This rank's piece of a split variable's slot (flat), made
                # as Keras 2 makes a slot, but restoring its piece of a
                # checkpoint's whole value: a restore pending for it runs as
                # it joins the optimizer's variables.
                start, count = shards.pieces[index][shards.rank]
                initial_value = (tf.zeros([count], model_variable.dtype) if initial_value is None
                                 else tf.reshape(initial_value, [-1])[start:start + count])
                slot = tf.Variable(initial_value=initial_value, trainable=False,
                                   name=f"{variable_name}/{model_variable._shared_name}",
                                   dtype=model_variable.dtype)
                _restoring_piece(slot, model_variable, (start, count))
                self._variables.append(slot)
            else:
                slot = self.add_variable(shape=(0,), dtype=model_variable.dtype,
                                         name=f"{variable_name}/{model_variable._shared_name}")
        finally:
            _creating.on = False
        shards.slots[id(slot)] = (slot, index)
        _checkpoint_whole(self, slot, owned=shards.owner[index] == shards.rank,
                          piece=shards.pieces.get(index, [None] * shards.size)[shards.rank])
        return slot
    return add_variable_from_reference


def _apply_keras2(original):
    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                        **kwargs):
        if (_strategy(self) is None or self._mesh or self._run_with_dtensor or
                tf.distribute.in_cross_replica_context()):
            return original(self, grads_and_vars, name=name,
                            skip_gradients_aggregation=skip_gradients_aggregation, **kwargs)
        reduce = (not skip_gradients_aggregation and
                  kwargs.pop("experimental_aggregate_gradients", True))
        self._compute_current_learning_rate()
        pairs = [(g, v) for g, v in grads_and_vars]
        if not pairs:
            return self._iterations
        with tf.name_scope(name or self.name or "optimizer"):
            with tf.init_scope():
                self.build([v for _, v in pairs])
            pairs = [(g, v) for g, v in pairs if g is not None]
            if not pairs:
                raise ValueError(f"No gradients provided for any variable of {self.name}")
            shards = _shards(self)
            _checkpoint_state_whole(self, shards)
            variables = [v for _, v in pairs]
            pending = _gradient_marks.pending_step()

            def merged(distribution, grads):
                def step():
                    _keras2_step(self, shards, distribution, grads, variables, reduce)
                    return tf.constant(True)
                if pending is None:
                    return step()
                # Accumulating (PERSEUS_ACCUMULATE_N_STEPS): only apply steps communicate.
                return tf.cond(pending, step, lambda: tf.constant(False))

            tf.__internal__.distribute.interim.maybe_merge_call(
                merged, self._distribution_strategy, [g for g, _ in pairs])
            for variable in variables:
                if variable.constraint is not None:
                    variable.assign(variable.constraint(variable))
            return self._iterations
    return apply_gradients


def _keras2_step(optimizer, shards, distribution, grads, variables, reduce):
    grads = [tf.convert_to_tensor(_local(distribution, g)) for g in grads]

    def update_one(variable, grad):
        if optimizer.jit_compile:
            return optimizer._update_step_xla(grad, variable, id(optimizer._var_key(variable)))
        return optimizer._update_step(grad, variable)

    def update(pairs, clipped=False):
        # Keras 2 clips the sums (clipnorm, clipvalue: each variable's own),
        # decays the weights, then updates.
        if not clipped:
            pairs = list(zip(optimizer._clip_gradients([g for g, _ in pairs]),
                             [v for _, v in pairs]))
        for _, v in pairs:
            if optimizer.weight_decay is None:
                break
            if id(v) in shards.piece_of:     # a piece, decayed as its variable would be
                _gradient_marks.decay_weight(optimizer, v, decide=shards.piece_of[id(v)])
            else:
                distribution.extended.update(
                    v, functools.partial(_gradient_marks.decay_weight, optimizer), group=False)
        for g, v in pairs:
            if id(v) in shards.piece_of:     # (not mirrored: updated as it is)
                optimizer._update_step(g, v)
            else:
                distribution.extended.update(v, update_one, args=(g,), group=False)

    global_clip = optimizer.global_clipnorm and optimizer.global_clipnorm > 0
    # clipnorm of a split variable needs the norm of every rank's pieces.
    if reduce and not global_clip and not _clips_pieces(optimizer, shards):
        # Each variable's clipping, decay and update need its own sum only.
        _pipelined(optimizer, shards, grads, variables, update, _strategy_assign(distribution))
        optimizer.iterations.assign_add(1)
        return
    if reduce:
        owned = _owned_sums(optimizer, shards, grads, variables)
    else:   # summed already (a LossScaleOptimizer): this rank's share
        owned = []
        for g, v in zip(grads, variables):
            index = _index_of(optimizer, v)
            if shards.owner[index] == shards.rank:
                owned.append((g, v))
            elif index in shards.piece:
                start, count = shards.pieces[index][shards.rank]
                owned.append(_piece_pair(shards.piece[index], start, count,
                                         tf.reshape(g, [-1])[start:start + count], v))
    if global_clip:
        owned = _clip_globally(optimizer, owned)
    owned = _clip_pieces(optimizer, shards, owned)
    if owned:
        update(owned, clipped=global_clip)
    _gather_weights(optimizer, shards, variables, _strategy_assign(distribution))
    optimizer.iterations.assign_add(1)


def _checkpoint_state_whole(optimizer, shards):
    """Every variable of per_variable_state checkpoints whole (once built)."""
    if getattr(shards, "checkpoint_hooked", False):
        return
    for variable, index, _ in per_variable_state(optimizer).values():
        if id(variable) not in shards.slots:
            _checkpoint_whole(optimizer, variable, owned=shards.owner[index] == shards.rank,
                              piece=shards.pieces.get(index, [None] * shards.size)[shards.rank])
    shards.checkpoint_hooked = True


def _restoring_piece(slot, model_variable, piece):
    """Until _checkpoint_whole: a new piece's slot restores its piece of a
    checkpoint's whole value (TensorFlow asks a restored variable for its
    tensors first, for their names and types only: zeros here, and no
    collective)."""
    from tensorflow.python.trackable import base as trackable

    slot.__dict__["_serialize_to_tensors"] = lambda: {
        trackable.VARIABLE_VALUE_KEY: tf.zeros(model_variable.shape, slot.dtype)}
    slot.__dict__["_restore_from_tensors"] = _restorer(slot, False, piece)


def _restorer(variable, owned, piece):
    """The _restore_from_tensors of a sharded optimizer's variable: the whole
    value where this rank owns it, its piece (`piece`: (start, elements), of
    a split variable's), or nothing (a placeholder)."""
    from tensorflow.python.trackable import base as trackable

    def restore(restored):
        if owned or piece is not None:
            value = restored[trackable.VARIABLE_VALUE_KEY]
            if not owned:
                value = tf.reshape(value, [-1])[piece[0]:piece[0] + piece[1]]
            for component in getattr(variable, "_values", None) or (variable,):
                component.assign(value, read_value=False)
        return tf.no_op()
    return restore


def _checkpoint_whole(optimizer, variable, owned, piece=None):
    """`variable` (a slot or per-variable state of a sharded Keras 2
    optimizer) writes its whole value to TensorFlow checkpoints, and restores
    what this rank keeps of it (_restorer)."""
    from tensorflow.python.trackable import base as trackable

    def serialize():
        if not tf.executing_eagerly():
            raise ValueError(
                f"optimizer {optimizer.name}'s state is sharded "
                "(PERSEUS_SHARD_OPTIMIZER_STATE=1) and is saved whole only by eager saves "
                "(model.save, save_weights, BackupAndRestore, tf.train.Checkpoint.save)")
        return {trackable.VARIABLE_VALUE_KEY: _whole_value(optimizer, variable)}

    # Per instance, not per class: only these variables (TensorFlow's
    # checkpointing looks for both on the instance first).
    variable.__dict__["_serialize_to_tensors"] = serialize
    variable.__dict__["_restore_from_tensors"] = _restorer(variable, owned, piece)


def _whole_value(optimizer, variable):
    """The whole value of one of per_variable_state's variables, from its
    owner. The first such variable a save reaches gathers every one of them
    (every rank saves the same variables in the same order); later ones take
    theirs from that gather."""
    shards = optimizer._perseus_shards
    gathered = getattr(shards, "gathered", None)
    if not gathered or id(variable) not in gathered:
        gathered = shards.gathered = _gathered_slots(optimizer, shards)
    return tf.constant(gathered.pop(id(variable)), dtype=variable.dtype)


# -- the Horovod shim (no strategy) ----------------------------------------------


def shim_apply(optimizer, grads, variables, base_apply, reducer, reduced=False,
               all_variables=None):
    """hvd.DistributedOptimizer(..., shard_optimizer_state=True), Keras 3:
    the gradients reduce-scattered as `reducer` (the optimizer's
    GradientReducer) would reduce them, `base_apply(grads, variables)` (the
    Keras optimizer's own apply) on the variables this rank owns, the owners'
    weights allgathered. reduced: `grads` are already this rank's reduced
    share, for `variables` (a LossScaleOptimizer reduced them to check them);
    `all_variables` are then the step's variables, for the allgather."""
    shards = _shards(optimizer)
    with tf.control_dependencies([_same_world(optimizer, shards)]):
        _shim_apply(optimizer, shards, grads, variables, base_apply, reducer, reduced,
                    all_variables)


def _shim_apply(optimizer, shards, grads, variables, base_apply, reducer, reduced,
                all_variables):
    pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
    if reduced:
        owned = pairs
        everyone = list(all_variables)
    else:
        owned = shim_reduce(optimizer, shards, pairs, reducer)
        everyone = [v for _, v in pairs]
    owned = _clip_pieces(optimizer, shards, _clip_globally(optimizer, owned))
    # This rank's pieces of split variables first: Keras 3.5 to 3.7's apply
    # reads Keras attributes of the variables unless the first is a
    # tf.Variable (the pieces are).
    owned = sorted(owned, key=lambda pair: id(pair[1]) not in shards.piece_of)
    saved = optimizer.global_clipnorm
    optimizer.global_clipnorm = None   # applied above, over every rank's share
    try:
        base_apply([g for g, _ in owned], [v for _, v in owned])
    finally:
        optimizer.global_clipnorm = saved
    _gather_weights(optimizer, shards, everyone,
                    lambda v, value: _assign(v if isinstance(v, tf.Variable) else v.value, value))


def owned_share(optimizer, shards, pairs):
    """[(gradient, variable)] of `pairs` (the reduced gradients, whole) for
    the variables this rank owns, and (its piece's, its piece: _piece_pair)
    for the split ones."""
    out = []
    for g, v in pairs:
        index = _index_of(optimizer, v)
        if index in shards.pieces:
            piece = shards.piece.get(index)
            if piece is not None:
                start, count = shards.pieces[index][shards.rank]
                out.append(_piece_pair(piece, start, count,
                                       tf.reshape(g, [-1])[start:start + count], v))
        elif shards.owner[index] == shards.rank:
            out.append((g, v))
    return out


def shim_reduce(optimizer, shards, pairs, reducer):
    """[(this rank's share of the reduced gradient, its variable)]."""
    with tf.control_dependencies([_same_world(optimizer, shards)]):
        return _shim_reduce(optimizer, shards, pairs, reducer)


def _shim_reduce(optimizer, shards, pairs, reducer):
    from perseus_tf.horovod._collectives import Average, runtime_fp16
    from perseus_tf.horovod.compression import Compression
    op = perseus_ops.Average if reducer.op == Average else perseus_ops.Sum

    def options(dtype):
        # Compression.fp16 of float32, as the shim's allreduce does it: float16(x)
        # on the wire, summed in float16 (the runtime's scale cancelled).
        compression, pre, post = "none", reducer.prescale, reducer.postscale
        if reducer.compression is Compression.fp16 and dtype == tf.float32:
            compression, pre, post = runtime_fp16(pre, post)
        return dict(op=op, prescale_factor=pre, postscale_factor=post, compression=compression)

    return _owned_sums(optimizer, shards, [tf.convert_to_tensor(g) for g, _ in pairs],
                       [v for _, v in pairs], options)


def all_finite(grads):
    """Whether every rank's share of the gradients is finite (one allreduce)."""
    bad = tf.constant(0.0)
    for g in grads:
        bad += tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(g))), tf.float32)
    return tf.equal(perseus_ops.allreduce(bad, op=perseus_ops.Sum,
                                          name="perseus.shard.finite"), 0.0)


def _clip_globally(optimizer, owned):
    """global_clipnorm over the whole gradient (every rank's share), as the
    unsharded optimizer clips the reduced gradients."""
    clip = getattr(optimizer, "global_clipnorm", None)
    if not clip or clip <= 0:
        return owned
    squares = tf.add_n([tf.constant(0.0)] + [tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
                                             for g, _ in owned])
    norm = tf.sqrt(perseus_ops.allreduce(squares, op=perseus_ops.Sum,
                                         name="perseus.shard.global_norm"))
    scale = clip * tf.minimum(1.0 / norm, 1.0 / clip)
    return [(g * tf.cast(scale, g.dtype), v) for g, v in owned]


def _clips_pieces(optimizer, shards):
    """Whether the optimizer's clipnorm applies to split variables' pieces."""
    clip = getattr(optimizer, "clipnorm", None)
    return bool(clip and clip > 0 and shards.pieces)


def _clip_pieces(optimizer, shards, owned):
    """clipnorm for this rank's pieces of split variables: each scaled by its
    variable's norm (every rank's pieces' squares summed: one allreduce), as
    the unsharded optimizer clips the variable's sum. The optimizer's own
    clipping by the piece's norm then leaves a piece as it is (its norm is
    at most its clipped variable's, at most clipnorm); it clips the whole
    variables this rank owns."""
    if not _clips_pieces(optimizer, shards):
        return owned
    clip = optimizer.clipnorm
    order = {index: k for k, index in enumerate(sorted(shards.pieces))}
    slot = {id(piece): order[index] for index, piece in shards.piece.items()}
    squares = [tf.constant(0.0)] * len(order)
    for g, v in owned:
        if id(v) in slot:
            squares[slot[id(v)]] = tf.reduce_sum(tf.square(tf.cast(g, tf.float32)))
    norms = tf.sqrt(perseus_ops.allreduce(tf.stack(squares), op=perseus_ops.Sum,
                                          name="perseus.shard.piece_norms"))
    return [(g * tf.cast(clip / tf.maximum(norms[slot[id(v)]], clip), g.dtype), v)
            if id(v) in slot else (g, v) for g, v in owned]


def _gather_weights(optimizer, shards, variables, assign):
    """Every rank's owned variables' values, allgathered and assigned on the
    ranks that do not own them, one bucket at a time."""
    assigned = []
    for bucket, _, split in _run_layout(optimizer, shards, variables):
        assigned = _bucket_gather(shards, variables, bucket, assign, assigned, split=split)


def _parts(per_rank, align):
    """Where each rank's part of a bucket starts in the parts laid end to end
    (each rounded up to `align`), and each part's length: an allgather of
    the parts as they are, not padded to the largest."""
    lengths = [-(-(m[-1][1] + m[-1][2]) // align) * align if m else 0 for m in per_rank]
    starts = [sum(lengths[:r]) for r in range(len(per_rank))]
    return starts, lengths


def _chunks(bucket, limit=None):
    """A bucket cut for its weights' gathers, as buckets of their own: chunk
    k holds, of every rank's part, the entries that start in its k-th
    stretch of `limit` / ranks bytes (_GATHER_BYTES), their offsets taken
    from the chunk's first entry. So the chunks together hold every entry
    once, each chunk's parts are about even, a variable larger than a
    stretch is a chunk's part alone, and a split variable's pieces (at
    about the same offsets on every rank) travel in one chunk: the one
    where the last of them starts."""
    tag, dtype, per_rank, _, run = bucket
    limit = _GATHER_BYTES if limit is None else limit
    stretch = max(1, limit // len(per_rank) // dtype.size)
    starts = {}
    for mine in per_rank:
        for pos, offset, _ in mine:
            starts[pos] = max(starts.get(pos, 0), offset)
    keys = sorted({starts[pos] // stretch for pos in starts})
    if len(keys) <= 1:
        return [bucket]
    out = []
    for j, key in enumerate(keys):
        chunk = []
        for mine in per_rank:
            entries = [e for e in mine if starts[e[0]] // stretch == key]
            base = entries[0][1] if entries else 0
            chunk.append([(pos, offset - base, count) for pos, offset, count in entries])
        segment = max((m[-1][1] + m[-1][2]) if m else 0 for m in chunk)
        out.append((f"{tag}.{j}", dtype, chunk, segment, run))
    return out


def _own_segment(shards, variables, bucket, split=None):
    """This rank's parts of a bucket's allgathers (_chunks): its owned
    variables' values (its pieces', for split variables) at their places,
    one segment a chunk."""
    return [_chunk_segment(shards, variables, chunk, split) for chunk in _chunks(bucket)]


def _chunk_segment(shards, variables, chunk, split):
    _, dtype, per_rank, _, _ = chunk
    _, lengths = _parts(per_rank, max(1, _ALIGN_BYTES // dtype.size))
    placed = per_rank[shards.rank]
    own = [tf.convert_to_tensor(split[pos][1] if split and pos in split else variables[pos])
           for pos, _, _ in placed]
    return _segment(own, placed, lengths[shards.rank], dtype)


def _bucket_gather(shards, variables, bucket, assign, after, own=None, split=None):
    """The allgathers of one bucket's owned values, chunk by chunk (_chunks;
    `own`: _own_segment's, made here when None), assigned where this rank
    does not own them, and every split variable's pieces assigned
    everywhere. The first starts once `after` (an earlier bucket's assigns)
    ran, and each later one once the chunk before it is assigned, so that
    the gathered weights of a chunk or two are held at a time, not the
    model's. Returns this bucket's assigns."""
    split = split or {}
    if own is None:
        own = _own_segment(shards, variables, bucket, split)
    for chunk, segment in zip(_chunks(bucket), own):
        after = _chunk_gather(shards, variables, chunk, assign, after, segment, split)
    return after


def _chunk_gather(shards, variables, bucket, assign, after, own, split):
    tag, dtype, per_rank, _, _ = bucket
    starts, _ = _parts(per_rank, max(1, _ALIGN_BYTES // dtype.size))
    with tf.control_dependencies(after):
        gathered = perseus_ops.allgather(own, name=f"perseus.shard.weights.{tag}")
    _made(gathered)
    values, pieces = [], {}
    for r in range(shards.size):
        for pos, offset, count in per_rank[r]:
            start = starts[r] + offset
            if pos in split:     # its pieces in rank order: the variable, flat
                pieces.setdefault(pos, []).append(gathered[start:start + count])
            elif r != shards.rank:
                values.append((pos, gathered[start:start + count]))
    values += [(pos, tf.concat(p, 0) if len(p) > 1 else p[0]) for pos, p in pieces.items()]
    assigned = []
    for pos, value in values:
        done = assign(variables[pos], tf.reshape(value, variables[pos].shape))
        assigned.extend(x for x in tf.nest.flatten(done)
                        if isinstance(x, (tf.Operation, tf.Tensor)) and not tf.executing_eagerly())
    return assigned


# -- elastic jobs (hvd.elastic.KerasState) ---------------------------------------
#
# A commit keeps every rank's whole state in host memory (whole_values: the
# owners' shares allgathered), so that whichever ranks survive a failure
# hold all of it. After the reset, reshard shares it out for the new world:
# owners are chosen again for the new rank and size, each slot this rank now
# owns takes its whole value, each it no longer owns becomes a placeholder.
# A step traced before that fails (_same_world) rather than pair the ranks'
# parts by the old layout: Keras's fit traces again (KerasState drops the
# model's train function).


def _same_world(optimizer, shards):
    """[an op that fails a step traced for an earlier layout than the one
    now in force] (none when eager: the layout is the current one)."""
    world = optimizer.__dict__.get("_perseus_world_")
    if world is None:
        with tf.init_scope():
            world = tf.Variable(shards.generation, dtype=tf.int64, trainable=False,
                                name="perseus_shard_layout")
        optimizer.__dict__["_perseus_world_"] = world
    if tf.executing_eagerly():
        return []
    return [tf.debugging.assert_equal(
        world, tf.constant(shards.generation, tf.int64), message=(
            f"this step of optimizer {optimizer.name} was traced for the sharded layout of "
            f"{shards.size} ranks, and hvd.elastic has shared the state out again since; "
            "trace the step again (fit does so itself under hvd.elastic.KerasState; create "
            "a tf.function of your own anew in a reset callback)"))]


def whole_values(optimizer, variables, gather=True):
    """The values `variables` (the optimizer's) hold in an unsharded run:
    each sharded slot and per-variable state whole, from its owner (an
    allgather: every rank calls this together), the rest as they are.
    gather=False: None for the sharded ones (no collective)."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    shards = _sharded_slots(inner)
    if shards is None:
        full = {}
    elif gather:
        full = _gathered_slots(inner, shards)
    else:
        full = dict.fromkeys(per_variable_state(inner))
    return [full[id(v)] if id(v) in full else v.numpy() for v in variables]


def whole_shapes(optimizer, variables):
    """The shapes `variables` (the optimizer's) have in an unsharded run."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    state = per_variable_state(inner) if _sharded_slots(inner) is not None else {}
    return [state[id(v)][2] if id(v) in state else tuple(v.shape) for v in variables]


def assign_whole(optimizer, variables, values):
    """Sets `variables` (the optimizer's) to `values` (whole_values'): this
    rank's piece of each split variable's slot, nothing of the placeholders
    of the slots other ranks own (nor where a value is None)."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    shards = _sharded_slots(inner)
    slots = {} if shards is None else shards.slots
    for variable, value in zip(variables, values):
        if value is None:
            continue
        entry = slots.get(id(variable))
        if entry is not None and entry[1] in shards.pieces:
            variable.assign(_piece_of(shards, entry[1], value))
        elif tuple(variable.shape) == np.shape(value):
            variable.assign(value)


def reshard(optimizer, variables, values):
    """hvd.elastic, after a reset: the sharded state shared out for the
    world as it is now, each slot this rank now owns set from `values`
    (whole_values' of `variables`, the optimizer's, at the last commit).
    Returns whether the layout changed: then a step traced before must be
    traced again, and the optimizer's other variables are set with
    assign_whole (Keras 2's replaced slots are new objects at the same
    positions of its variables)."""
    inner = getattr(optimizer, "inner_optimizer", None) or optimizer
    old = getattr(inner, "_perseus_shards", None)
    rank, size = perseus_ops.rank(), perseus_ops.size()
    if old is None:
        # A job that began at one rank (where the shim applies unsharded)
        # and has grown: the whole slots it made become the ranks' shares.
        slots = _whole_slots(inner) if _shim_sharded(inner) else []
        if not slots:
            return False
        generation = inner.__dict__.get("_perseus_reshards_", 0)
    elif (old.rank, old.size) == (rank, size):
        return False   # (a restore has set what it holds)
    else:
        slots, generation = list(old.slots.values()), old.generation
    whole = {id(v): value for v, value in zip(variables, values)}
    inner.__dict__["_perseus_reshards_"] = generation + 1
    new = _Shards(inner, rank, size)
    keras2 = _keras2_variables(inner) is not None
    model_variables = _model_variables(inner)
    for slot, index in slots:
        owned = new.owner[index] == rank
        piece = new.pieces[index][rank] if index in new.pieces else None
        dtype = tf.as_dtype(slot.dtype).as_numpy_dtype
        if owned or piece:
            value = whole.get(id(slot))
            if value is None:   # not saved whole (a failure before the first sync ended)
                value = np.zeros(tuple(model_variables[index].shape), dtype)
            value = np.asarray(value, dtype)
            if piece:           # this rank's piece of a split variable's slot
                value = np.reshape(value, [-1])[piece[0]:piece[0] + piece[1]]
        else:                   # a placeholder: another rank owns it
            value = np.zeros((0,), dtype)
        fresh = _holding(inner, slot, value)
        new.slots[id(fresh)] = (fresh, index)
        if keras2:
            _checkpoint_whole(inner, fresh, owned, piece=piece)
    inner._perseus_shards = new
    if keras2:
        _checkpoint_state_whole(inner, new)
    world = inner.__dict__.get("_perseus_world_")
    if world is not None:
        world.assign(new.generation)
    return True


def _whole_slots(optimizer):
    """[(slot, index of its model variable)] for each per-variable state of an
    optimizer built unsharded that has its variable's shape (Adam's moments,
    momentum, accumulators; not Adafactor's factored rows and columns, which
    every rank keeps, as sharded from the start)."""
    model_variables = _model_variables(optimizer)
    if not model_variables:
        return []
    out, mine = [], {id(v) for v in optimizer.variables}
    for name, value in vars(optimizer).items():
        if name in ("_variables", "_trainable_variables") or not isinstance(value, (list, tuple)):
            continue
        if len(value) != len(model_variables):
            continue
        for i, x in enumerate(value):
            if (x is not None and id(x) in mine and
                    tuple(x.shape) == tuple(model_variables[i].shape)):
                out.append((x, i))
    return out


def _holding(optimizer, slot, value):
    """`slot` holding `value`, of whatever shape. Keras 3's variable takes a
    new TensorFlow variable inside (the object in the optimizer's lists
    stays); Keras 2's is replaced by a new tf.Variable in each of the
    optimizer's lists that holds it."""
    if tuple(slot.shape) == value.shape:
        slot.assign(value)
        return slot
    with tf.init_scope():
        if hasattr(slot, "_initialize") and hasattr(slot, "_shape"):       # Keras 3
            slot._shape = tuple(value.shape)
            if hasattr(slot, "_ndim"):
                slot._ndim = len(value.shape)
            slot._initialize(value)
            return slot
        fresh = tf.Variable(value, dtype=slot.dtype, trainable=False,
                            name=slot.name.split(":")[0])
    for held in vars(optimizer).values():
        if isinstance(held, list):
            for i, x in enumerate(held):
                if x is slot:
                    held[i] = fresh
    return fresh
