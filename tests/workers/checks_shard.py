"""PerseusStrategy(shard_optimizer_state=True) against the unsharded strategy,
at 2, 3 and 4 ranks (tests/test_shard.py; 3: owners that do not divide evenly).

Every rank trains the same model on the same global data twice, through two
PerseusStrategy instances in one process: sharded and not. Their weights must
agree within 1e-6 after 20 steps, the slots a rank owns must equal the
unsharded run's, and the others must take no memory. The unsharded run is the
reference because Keras 3 clips each replica's gradients before they are
summed: a single-process run clips the sum, and differs from both.

The same checks run on Keras 2 (TF 2.15's keras; tf_keras where
TF_USE_LEGACY_KERAS=1), which clips the sums; where Keras 2 lacks an
optimizer or an option, the check says so in its code.
"""

import os
import tempfile

import numpy as np
import tensorflow as tf

import perseus_tf as ptf
from perseus_tf import _backprop_order
from perseus_tf import ops as perseus_ops
from perseus_tf.strategy import keras_shard

from perseus_tf import _keras
from rank_checks import expect, interrupting_callback, same_on_all_ranks, shared_tempdir

if _keras.legacy_requested():
    import tf_keras as keras
else:
    import keras

KERAS2 = keras.__version__.startswith("2.")

# The checks Keras 2 (tests/test_shard.py's second pass) runs at 4 ranks as
# well as at 2 and 3: where 4 ranks place, split, clip, skip or save
# differently (owners and pieces over 4 ranks, norms of variables split 4
# ways, an overflow on rank 3, files going on from 3 ranks' save, Keras 2's
# TensorFlow checkpoints and the shim's owners). Keras 3 runs every check at 4.
KERAS2_AT_4_RANKS = ("check_owners_balance_bytes_and_agree",
                     "check_buckets_cover_every_variable_once_aligned_and_balanced",
                     "check_oversized_variables_are_allreduced_where_that_sends_less",
                     "check_place_keeps_every_share_within_1_percent_at_any_size",
                     "check_adam_in_small_buckets",
                     "check_clipnorm_clipvalue_and_global_clipnorm",
                     "check_mixed_precision_with_an_overflow_on_the_last_rank",
                     "check_saved_sharded_loads_unsharded_and_the_reverse",
                     "check_keras2_tensorflow_checkpoints_hold_the_whole_state",
                     "check_shim_sharded_equals_the_shims_allreduce")

R = N = PLAIN = SHARDED = None
STEPS = 20
GLOBAL_BATCH = 12          # divides among 2, 3 and 4 ranks
TOL = 1e-6
rng = np.random.default_rng(7)
X = rng.normal(size=(STEPS * GLOBAL_BATCH, 4, 4, 2)).astype(np.float32)
Y = rng.normal(size=(STEPS * GLOBAL_BATCH, 2)).astype(np.float32)


def setup():
    global R, N, PLAIN, SHARDED
    PLAIN = ptf.PerseusStrategy()
    SHARDED = ptf.PerseusStrategy(shard_optimizer_state=True)
    R, N = ptf.rank(), ptf.size()
    return R


def make_model(constraint=None):
    # A 4-D kernel (Adafactor factors the last two dimensions), biases that
    # AdamW's exclusion names, and variables of unequal sizes (the largest,
    # hidden's kernel, is split into pieces by element-wise optimizers).
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((4, 4, 2)), keras.layers.Conv2D(3, 2, activation="tanh", name="conv"),
        keras.layers.Flatten(), keras.layers.Dense(16, activation="tanh", name="hidden",
                                                   kernel_constraint=constraint),
        keras.layers.Dense(8, activation="tanh", name="narrow"),
        keras.layers.Dense(2, name="out")])


def dataset(x=X, y=Y):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)


def train(strategy, make_optimizer, x=X, y=Y, model=None):
    with strategy.scope():
        if model is None:
            model = make_model()
            model.compile(optimizer=make_optimizer(), loss="mse")
    model.fit(dataset(x, y), epochs=1, verbose=0)
    return model


def slots(optimizer):
    """The optimizer's variables' values, in order."""
    return [v.numpy() for v in _inner(optimizer).variables]


def compare(make_optimizer, x=X, y=Y, tol=TOL):
    plain = train(PLAIN, make_optimizer, x, y)
    sharded = train(SHARDED, make_optimizer, x, y)
    for a, b in zip(plain.weights, sharded.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=tol, err_msg=a.name)
    same_on_all_ranks([w.numpy() for w in sharded.weights])
    compare_state(_inner(sharded.optimizer), _inner(plain.optimizer), tol)
    return plain, sharded


def compare_state(opt, ref, tol=TOL):
    """A sharded optimizer's variables against the unsharded one's: the
    slots of the variables this rank owns equal, its pieces of split ones
    equal to those pieces of the whole, the others placeholders of shape (0,)."""
    assert len(opt.variables) == len(ref.variables)
    shards = opt._perseus_shards
    owned = [shards.owner[i] == R for i in range(len(shards.owner))]
    assert any(owned) or shards.pieces, "this rank owns no variable and no piece"
    state = keras_shard.per_variable_state(opt)
    for v, r in zip(opt.variables, ref.variables):
        entry = state.get(id(v))
        if entry is None or owned[entry[1]]:
            assert tuple(v.shape) == tuple(r.shape), (v.name, v.shape, r.shape)
            np.testing.assert_allclose(v.numpy(), r.numpy(), rtol=0, atol=tol, err_msg=v.name)
        elif entry[1] in shards.pieces:   # this rank's piece of a split variable's slot
            start, count = shards.pieces[entry[1]][R]
            assert tuple(v.shape) == (count,), (v.name, v.shape, count)
            np.testing.assert_allclose(v.numpy(), r.numpy().reshape(-1)[start:start + count],
                                       rtol=0, atol=tol, err_msg=v.name)
        elif id(v) in shards.slots:
            assert tuple(v.shape) == (0,), (v.name, v.shape)  # another rank's slot
    if shards.slots:
        assert keras_shard.state_bytes(opt) < keras_shard.state_bytes(ref)


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


def check_owners_balance_bytes_and_agree():
    sizes = [400, 300, 300, 200, 100, 100, 1, 1]
    owner = keras_shard.owners(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(3)]
    assert max(loads) - min(loads) <= 100, loads
    assert keras_shard.owners(sizes, 3) == owner  # the same answer every time
    same_on_all_ranks([np.array(keras_shard.owners(sizes, N))])


def check_buckets_cover_every_variable_once_aligned_and_balanced():
    sizes = [(40, 3), (7,), (100,), (5, 5), (1,), (64,), (33, 2), (9,)]
    variables = [tf.zeros(s, tf.float32) for s in sizes] + [tf.zeros((6,), tf.float64)]
    owner = keras_shard.owners([int(np.prod(v.shape)) * v.dtype.size for v in variables], N)
    buckets = keras_shard._layout(variables, owner, N, limit=256 * N)
    seen = []
    for tag, dtype, per_rank, segment, _ in buckets:
        align = 64 // dtype.size
        assert segment % align == 0, (tag, segment)
        for r, placed in enumerate(per_rank):
            end = 0
            for pos, offset, count in placed:
                assert owner[pos] == r and variables[pos].dtype == dtype
                assert offset % align == 0 and offset >= end, (tag, placed)
                end = offset + count
                seen.append(pos)
            assert end <= segment
    assert sorted(seen) == list(range(len(variables))), seen
    assert len(buckets) > 2  # 256 bytes a rank: the float32 variables take several


def check_oversized_variables_are_allreduced_where_that_sends_less():
    # A variable of c elements among stretches of m (keras_shard._mark):
    # allreduced when c(N-2) > Nm, so never at 2 ranks; the rest in buckets.
    m = 1 << 20
    sizes = [12 * m] + [m // 4] * 40
    variables = [tf.zeros((n,), tf.float32) for n in sizes]
    saved = _backprop_order._MIN_GROUP_BYTES
    _backprop_order._MIN_GROUP_BYTES = 4 << 20
    try:
        whole = keras_shard._oversized(variables, N, limit=4 * m * N)   # m a stretch
        assert keras_shard._mark(tf.float32, sum(sizes), N, 4 * m * N) == m
    finally:
        _backprop_order._MIN_GROUP_BYTES = saved
    assert whole == (set() if N == 2 else {0}), whole
    # (check_adam_in_small_buckets trains through such allreduces at 3 and 4.)


def check_adam_in_small_buckets():
    # Several reduce-scatters and allgathers a step: backprop runs of a few
    # variables each (_backprop_order._MIN_GROUP_BYTES), cut into buckets
    # (keras_shard._BUCKET_BYTES), the pieces of split variables in buckets
    # of their own; at 3 and 4 ranks the two largest kernels are allreduced
    # (keras_shard._oversized) where they are not split: Adafactor's, the
    # shim's. A bucket's weights are gathered in chunks of 128 bytes
    # (keras_shard._GATHER_BYTES): several a bucket, split ones' too.
    saved = (keras_shard._BUCKET_BYTES, _backprop_order._MIN_GROUP_BYTES,
             keras_shard._GATHER_BYTES)
    (keras_shard._BUCKET_BYTES, _backprop_order._MIN_GROUP_BYTES,
     keras_shard._GATHER_BYTES) = 512, 256, 128
    try:
        model = make_model()
        whole = keras_shard._oversized(model.trainable_variables, N)
        assert len(whole) == (0 if N == 2 else 2), whole
        _, sharded = compare(lambda: keras.optimizers.Adam(0.01))
        assert _pieces(sharded)
        assert _chunked(sharded, split=True)
        _, sharded = compare(lambda: keras.optimizers.Adafactor(0.05))
        assert _chunked(sharded, split=False)
        shim_compare(lambda: keras.optimizers.Adam(0.01))
    finally:
        (keras_shard._BUCKET_BYTES, _backprop_order._MIN_GROUP_BYTES,
         keras_shard._GATHER_BYTES) = saved


def _chunked(model, split):
    """Whether some bucket of the model's sharded step (of split variables'
    pieces, or not) has its weights gathered in several chunks; checks that
    every bucket's chunks hold each of its entries once."""
    opt = _inner(model.optimizer)
    runs = keras_shard._run_layout(opt, opt._perseus_shards, model.trainable_variables)
    for bucket, _, pieces in runs:
        _chunks_hold_each_entry_once(bucket, pieces)
    return any(len(keras_shard._chunks(b)) > 1 for b, _, pieces in runs
               if bool(pieces) == split)


def _chunks_hold_each_entry_once(bucket, split):
    """The gathers' chunks of a bucket (keras_shard._chunks) hold each of its
    entries once, in order, at offsets from the chunk's first, every rank's
    piece of a split variable in the same chunk."""
    chunks = keras_shard._chunks(bucket)
    for r, mine in enumerate(bucket[2]):
        held = [(pos, count) for c in chunks for pos, _, count in c[2][r]]
        assert held == [(pos, count) for pos, _, count in mine], (r, held, mine)
        for c in chunks:
            part = c[2][r]
            if part:
                first = [e for e in mine if e[0] == part[0][0]][0][1]
                assert [(p, o + first) for p, o, _ in part] == \
                    [(p, o) for p, o, _ in mine if p in {q for q, _, _ in part}], (r, part)
    for pos in split:
        where = {j for j, c in enumerate(chunks) for m in c[2] for p, _, _ in m if p == pos}
        assert len(where) == 1, (pos, where)


def check_buckets_follow_backprop():
    # A step's buckets come in the order backprop makes the gradients (the
    # last layers' first), so each one's reduce-scatter can start while the
    # earlier layers' gradients are computed: bucket k holds the k-th stretch
    # of every rank's variables, taken from the last.
    sizes = [4000, 40, 4000, 40, 2400, 24, 2400, 24, 4000, 40, 800, 8]   # kernels, biases
    variables = [tf.zeros((s // 4,), tf.float32) for s in sizes]
    owner = keras_shard.owners(sizes, N)
    saved = _backprop_order._MIN_GROUP_BYTES
    _backprop_order._MIN_GROUP_BYTES = 1000
    try:
        buckets = keras_shard._layout(variables, owner, N)
    finally:
        _backprop_order._MIN_GROUP_BYTES = saved
    assert [b[4] for b in buckets] == list(range(len(buckets)))
    assert len(buckets) >= 2, buckets
    seen = []
    for r in range(N):
        mine = [pos for b in buckets for pos, _, _ in b[2][r]]
        assert mine == sorted((p for p in range(len(sizes)) if owner[p] == r), reverse=True), \
            (r, mine)
        seen += mine
    assert sorted(seen) == list(range(len(sizes))), seen
    same_on_all_ranks([np.array(owner)])


def _ancestors(op):
    seen, todo = set(), [op]
    while todo:
        o = todo.pop()
        if o.name not in seen:
            seen.add(o.name)
            todo.extend(t.op for t in o.inputs)
            todo.extend(o.control_inputs)
    return seen


def check_allgathers_overlap_backprop():
    # A traced sharded step, in runs of a few hundred bytes: each run's
    # allgather waits for its own run's reduction, not for the last one (the
    # first runs' weights travel while backprop computes the rest), no
    # reduction waits for an allgather, and on a
    # rank that owns some of the first run, backprop's third stage waits for
    # that run's update (TensorFlow would otherwise run it once backprop is
    # done). Numerics: every other check trains through the same step.
    saved = _backprop_order._MIN_GROUP_BYTES
    _backprop_order._MIN_GROUP_BYTES = 64
    try:
        with SHARDED.scope():
            model = make_model()
            opt = keras.optimizers.Adam(0.01)
            opt.build(model.trainable_variables)
        rows = GLOBAL_BATCH // N

        @tf.function
        def step(x, y):
            def replica(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
            SHARDED.run(replica, args=(x, y))

        graph = step.get_concrete_function(tf.constant(X[:rows]), tf.constant(Y[:rows])).graph
    finally:
        _backprop_order._MIN_GROUP_BYTES = saved
    ops = graph.get_operations()

    def named(prefix):
        return [op for op in ops if op.type.startswith("Perseus") and
                op.get_attr("tensor_name").decode().startswith(prefix)]

    gathers = named("perseus.shard.weights.")
    reductions = named("perseus.shard.gradients.")
    assert len(gathers) >= 3 and len(reductions) == len(gathers), \
        ([op.name for op in gathers], [op.name for op in reductions])
    last = reductions[-1].name
    for gather in gathers[:-1]:
        assert last not in _ancestors(gather), (gather.name, "waits for", last)
    names = {op.name for op in gathers}
    for reduction in reductions:
        assert not names & _ancestors(reduction), (reduction.name, "waits for",
                                                   names & _ancestors(reduction))
    gated = [op for op in ops if "perseus_backprop_order" in op.name and "/gate_" in op.name]
    everywhere = perseus_ops.allreduce(tf.constant(float(len(gated))), op=perseus_ops.Sum,
                                       name="checks_shard.gated").numpy()
    assert everywhere > 0, "no rank's backprop waits for an update"


def check_a_gate_that_would_make_a_cycle_is_refused():
    # Stages.gate holds a later stage back only when that cannot deadlock
    # the step: not on ops computed from that stage, nor on ops that write a
    # variable the stage reads (automatic control dependencies would order
    # the write after the read).
    v = tf.Variable(tf.ones([3]))
    results = {}

    @tf.function
    def traced(x):
        a = tf.tanh(x * 2.0)
        b = tf.tanh(a * 3.0)
        c = tf.tanh(b * tf.reduce_sum(v.read_value()))   # stage 2 reads v
        stages = _backprop_order.staged([[a], [b], [c]])
        results["from_later"] = stages.gate(2, [tf.identity(c * 2.0).op])
        results["writes_v"] = stages.gate(2, [v.assign_add(tf.reshape(a, [3])).op])
        results["fine"] = stages.gate(2, [tf.identity(a * 5.0).op])
        return c

    traced(tf.constant([1.0, 2.0, 3.0]))
    assert results == {"from_later": False, "writes_v": False, "fine": True}, results


def check_sgd_momentum_nesterov():
    compare(lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True))


def check_adam_amsgrad():
    _, sharded = compare(lambda: keras.optimizers.Adam(0.01, amsgrad=True))
    # Adam is element-wise: the largest kernels are split into pieces (place);
    # this small model's share needs every variable split to come within
    # keras_shard._SPLIT_SLACK of 1/N. With more slack, a step of whole
    # variables and pieces together:
    assert _pieces(sharded), "nothing split"
    counts = [int(np.prod(v.shape)) for v in make_model().trainable_variables]
    saved = keras_shard._SPLIT_SLACK
    keras_shard._SPLIT_SLACK = next(
        slack for slack in (0.05, 0.1, 0.2, 0.3, 0.5) if 0 < len(keras_shard.place(
            counts, [4] * len(counts), N, range(len(counts)), slack)[1]) < len(counts))
    try:
        _, sharded = compare(lambda: keras.optimizers.Adam(0.01, amsgrad=True))
    finally:
        keras_shard._SPLIT_SLACK = saved
    owner = _inner(sharded.optimizer)._perseus_shards.owner
    assert _pieces(sharded) and max(owner) >= 0, (owner, _pieces(sharded))


def _pieces(model):
    return _inner(model.optimizer)._perseus_shards.pieces


def check_place_keeps_every_share_within_1_percent_at_any_size():
    # The gradient shapes of ResNet-50, BERT-base and VGG-16 (perseus_tf/profiles;
    # VGG-16's first dense kernel is 74% of its weights) at sizes up to 256:
    # with whole variables only, a share grows to 1/N plus the largest variable.
    import json
    folder = os.path.join(os.path.dirname(ptf.__file__), "profiles")
    for profile in ("resnet50", "bert_base", "vgg16"):
        with open(os.path.join(folder, profile + ".json")) as f:
            counts = [t["elements"] for t in json.load(f)["tensors"]]
        for ranks in (2, 3, 4, 8, 16, 64, 256):
            owner, pieces = keras_shard.place(counts, [4] * len(counts), ranks,
                                              range(len(counts)))
            loads = [0] * ranks
            for i, r in enumerate(owner):
                assert (r == -1) == (i in pieces), (profile, ranks, i)
                if r >= 0:
                    loads[r] += counts[i]
            for i, each in pieces.items():
                at = 0
                for r, (start, count) in enumerate(each):
                    assert start == at and (count == 0 or start % 16 == 0), (i, each)
                    at += count
                    loads[r] += count
                assert at == counts[i], (profile, ranks, i, each)
            share = max(loads) / (sum(counts) / ranks)
            assert share <= 1.01, (profile, ranks, share)
            assert keras_shard.place(counts, [4] * len(counts), ranks,
                                     range(len(counts))) == (owner, pieces)
            # Nothing splittable: the whole variables of owners().
            assert keras_shard.place(counts, [4] * len(counts), ranks) == \
                (keras_shard.owners([4 * c for c in counts], ranks), {})


def check_adamw_excluding_biases_from_weight_decay():
    def make():
        opt = keras.optimizers.AdamW(0.01, weight_decay=0.1)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt
    compare(make)


def check_rmsprop_centered_with_momentum():
    compare(lambda: keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True))


def check_adagrad():
    compare(lambda: keras.optimizers.Adagrad(0.05, initial_accumulator_value=0.2))


def check_adafactor_and_its_factored_state_saved_whole():
    plain, sharded = compare(lambda: keras.optimizers.Adafactor(0.05))
    assert not _pieces(sharded)   # not element-wise: whole variables
    path = os.path.join(tempfile.mkdtemp(prefix=f"shard{R}-"), "adafactor.keras")
    sharded.save(path)
    with PLAIN.scope():
        loaded = keras.models.load_model(path)
    for i, (a, b) in enumerate(zip(slots(loaded.optimizer), slots(plain.optimizer))):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL, err_msg=f"optimizer variable {i}")


def check_more_keras_optimizers():
    for name in ("Nadam", "Adamax", "Lion", "Ftrl", "Lamb", "Adadelta"):
        cls = getattr(keras.optimizers, name, None)
        if cls is None:     # Keras 2 has no Lamb
            continue
        if KERAS2 and name == "Nadam":
            # Keras 2's Nadam advances one u_product once per variable updated.
            expect(ValueError, lambda: train(SHARDED, lambda: cls(0.01)), "u_product",
                   "shard_optimizer_state")
            continue
        _, sharded = compare(lambda: cls(0.01))
        assert bool(_pieces(sharded)) == (name != "Lamb"), name   # Lamb: a variable's norm


def check_learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=5, decay_rate=0.5)
    compare(lambda: keras.optimizers.Adam(schedule))


def check_clipnorm_clipvalue_and_global_clipnorm():
    # Small limits, so that clipping acts on every step.
    _, sharded = compare(lambda: keras.optimizers.Adam(0.01, clipnorm=0.05))
    # Split (Keras 2 clips each variable's sum: a piece by its variable's norm).
    assert _pieces(sharded)
    if KERAS2:   # under SGD, whose step scales with the gradient
        compare(lambda: keras.optimizers.SGD(0.5, momentum=0.5, clipnorm=1e-3))
    compare(lambda: keras.optimizers.SGD(0.05, clipvalue=0.005))
    compare(lambda: keras.optimizers.SGD(0.05, momentum=0.5, global_clipnorm=0.05))


def check_mixed_precision_with_an_overflow_on_the_last_rank():
    x = X.copy()
    x[3 * GLOBAL_BATCH + GLOBAL_BATCH - 1] = 1e6   # float16 overflows on the last rank only
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain, sharded = compare(lambda: keras.optimizers.Adam(0.01), x=x, tol=1e-5)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    scales = [_loss_scale(m.optimizer) for m in (plain, sharded)]
    assert scales[0] == scales[1] and scales[0] < 32768.0, scales


def _loss_scale(optimizer):
    return float((optimizer.loss_scale if KERAS2 else optimizer.dynamic_scale).numpy())


def check_accumulation_sharded_equals_unsharded():
    plain = ptf.PerseusStrategy(accumulate_n_steps=2)
    sharded = ptf.PerseusStrategy(accumulate_n_steps=2, shard_optimizer_state=True)
    models = [train(s, lambda: keras.optimizers.Adam(0.01)) for s in (plain, sharded)]
    for a, b in zip(*[m.weights for m in models]):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=TOL, err_msg=a.name)
    # Ten apply steps of twenty batches (Keras 3 counts every batch).
    counted = [int(_inner(m.optimizer).iterations.numpy()) for m in models]
    assert counted == [STEPS // 2 if KERAS2 else STEPS] * 2, counted


def check_saved_sharded_loads_unsharded_and_the_reverse():
    folder = tempfile.mkdtemp(prefix=f"shard{R}-")
    make = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    plain, sharded = compare(make)
    sharded_file = os.path.join(folder, "sharded.keras")
    plain_file = os.path.join(folder, "plain.keras")
    sharded.save(sharded_file)   # every rank saves (the slots are gathered)
    plain.save(plain_file)
    # Sharded -> unsharded: every slot whole, equal to the unsharded run's.
    with PLAIN.scope():
        loaded = keras.models.load_model(sharded_file)
    got, want = slots(loaded.optimizer), slots(plain.optimizer)
    assert len(got) == len(want) and len(want) > 2
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL, err_msg=f"optimizer variable {i}")
    # Unsharded -> sharded, and both go on training alike.
    with SHARDED.scope():
        resumed = keras.models.load_model(plain_file)
    more = slice(0, 5 * GLOBAL_BATCH)
    train(SHARDED, None, X[more], Y[more], model=resumed)
    train(PLAIN, None, X[more], Y[more], model=plain)
    for a, b in zip(plain.weights, resumed.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=TOL, err_msg=a.name)
    assert keras_shard.state_bytes(resumed.optimizer) < keras_shard.state_bytes(plain.optimizer)
    _resume_at_another_world_size(sharded)


def check_keras2_tensorflow_checkpoints_hold_the_whole_state():
    # Keras 2 also writes TensorFlow checkpoints (save_weights' default
    # format, BackupAndRestore, tf.train.Checkpoint, SavedModel): they must
    # hold what the unsharded run's hold, and load either way. (Keras 3
    # writes .keras and .weights.h5 only: the check above.)
    if not KERAS2:
        return
    folder = tempfile.mkdtemp(prefix=f"shard{R}-")
    plain, sharded = compare(lambda: keras.optimizers.Adam(0.01))
    files = {}
    for label, model in (("plain", plain), ("sharded", sharded)):
        files[label] = os.path.join(folder, label, "ckpt")
        model.save_weights(files[label])   # every rank saves (the slots are gathered)
    readers = {k: tf.train.load_checkpoint(f) for k, f in files.items()}
    shapes = {k: r.get_variable_to_shape_map() for k, r in readers.items()}
    assert shapes["plain"] == shapes["sharded"], (shapes["plain"], shapes["sharded"])
    for key in shapes["plain"]:
        if "OBJECT_GRAPH" not in key:
            np.testing.assert_allclose(readers["sharded"].get_tensor(key),
                                       readers["plain"].get_tensor(key), rtol=0, atol=TOL,
                                       err_msg=key)
    # Loaded both ways (the sharded run's slots restored where the rank owns
    # them, before the optimizer is built), both go on training alike.
    more = slice(0, 5 * GLOBAL_BATCH)
    runs = []
    for strategy, source in ((PLAIN, "sharded"), (SHARDED, "plain"), (SHARDED, "sharded")):
        with strategy.scope():
            model = make_model()
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.load_weights(files[source])
        runs.append(train(strategy, None, X[more], Y[more], model=model))
    for run in runs[1:]:
        for a, b in zip(runs[0].weights, run.weights):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=TOL, err_msg=a.name)
    # A SavedModel of the sharded model holds the whole state too.
    saved = os.path.join(folder, "savedmodel")
    sharded.save(saved, save_format="tf")
    reader = tf.train.load_checkpoint(os.path.join(saved, "variables", "variables"))
    state = [k for k in shapes["plain"] if k.startswith("optimizer/_variables/")]
    assert len(state) > 8, sorted(shapes["plain"])
    for key in state:
        np.testing.assert_allclose(reader.get_tensor(key), readers["plain"].get_tensor(key),
                                   rtol=0, atol=TOL, err_msg=key)


def check_backup_and_restore_resumes_sharded_as_unsharded():
    # BackupAndRestore (Keras 3: .weights.h5; Keras 2: a TensorFlow
    # checkpoint) saves the sharded state at epoch 0's end; a new sharded
    # model resumes from it, and its epoch 1 ends where two unsharded epochs
    # end (Adam: slots restored wrong or not at all would show).
    directory = shared_tempdir("perseus-shard-backup-")
    make = lambda: keras.optimizers.Adam(0.01)  # noqa: E731
    with SHARDED.scope():
        model = make_model()
        model.compile(optimizer=make(), loss="mse")
    expect(RuntimeError, lambda: model.fit(
        dataset(), epochs=2, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(directory), interrupting_callback(keras)]),
        "interrupted")
    ptf.barrier()
    with SHARDED.scope():
        resumed = make_model()
        resumed.compile(optimizer=make(), loss="mse")
    history = resumed.fit(dataset(), epochs=2, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(directory)])
    assert history.epoch == [1], history.epoch
    with PLAIN.scope():
        plain = make_model()
        plain.compile(optimizer=make(), loss="mse")
    plain.fit(dataset(), epochs=2, verbose=0)
    for a, b in zip(plain.weights, resumed.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=TOL, err_msg=a.name)


def _resume_at_another_world_size(sharded):
    """tests/test_shard.py launches its world sizes in turn with one shared
    folder (3 then 4 ranks in one job): each writes its sharded file there,
    and each goes on from the file the previous world size wrote, sharded
    and unsharded alike (the owners of the slots change with the world
    size)."""
    folder = os.environ.get("PERSEUS_TEST_SHARD_FILES")
    if not folder:
        return
    mine = os.path.join(folder, f"at{N}.keras")
    earlier = sorted(f for f in os.listdir(folder) if f != f"at{N}.keras")
    sharded.save(mine if R == 0 else os.path.join(tempfile.mkdtemp(), "m.keras"))
    if not earlier:
        return
    more = slice(5 * GLOBAL_BATCH, 10 * GLOBAL_BATCH)
    models = []
    for strategy in (PLAIN, SHARDED):
        with strategy.scope():
            model = keras.models.load_model(os.path.join(folder, earlier[-1]))
        models.append(train(strategy, None, X[more], Y[more], model=model))
    for a, b in zip(models[0].weights, models[1].weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=TOL, err_msg=a.name)


def check_options_it_cannot_honour_are_refused():
    refused = [(lambda: keras.optimizers.Adam(0.01, use_ema=True), "use_ema")]
    if KERAS2:
        # Keras 2's legacy optimizers (OptimizerV2) are not sharded.
        refused.append((lambda: keras.optimizers.legacy.Adam(0.01), "keras.optimizers.legacy"))
    else:
        refused.append((lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
                        "PERSEUS_ACCUMULATE_N_STEPS"))
    for make, needle in refused:
        expect(ValueError, lambda: train(SHARDED, make), needle, "shard_optimizer_state")
    outside = keras.optimizers.SGD(0.1)
    with SHARDED.scope():
        model = make_model()
        model.compile(optimizer=outside, loss="mse")
    expect(ValueError, lambda: model.fit(dataset(), epochs=1, verbose=0), "inside strategy.scope()")


def check_float16_compression_as_unsharded():
    # Launched with PERSEUS_ALLREDUCE_DTYPE=0 (tests/test_shard.py): the
    # reduce-scatter carries float16 of (gradient x scale), summed in float16,
    # as the unsharded allreduce does, so the two runs agree as closely as
    # uncompressed ones; float32 sums would differ by float16's rounding.
    from perseus_tf import _native
    if _native.gradient_compression() != _native.COMPRESS_FP16:
        return
    compare(lambda: keras.optimizers.SGD(0.05, momentum=0.9))


# -- the Horovod shim: hvd.DistributedOptimizer(..., shard_optimizer_state=True) --


def shim_train(make_optimizer, sharded, x=X, y=Y, compression=None, mixed=False, options=None,
               prepare=None, constraint=None):
    """The shim's `fit`, outside any strategy: each rank trains on its own
    rows of every global batch, as Horovod scripts shard their data.
    prepare(model, optimizer) runs before compile."""
    import perseus_tf.horovod.keras as hvd
    if mixed:
        keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model(constraint)
        kwargs = dict(options or {})
        if compression is not None:
            kwargs["compression"] = compression
        optimizer = make_optimizer()
        if prepare is not None:
            prepare(model, optimizer)
        model.compile(optimizer=hvd.DistributedOptimizer(
            optimizer, shard_optimizer_state=sharded, **kwargs), loss="mse")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    per_rank = GLOBAL_BATCH // N
    mine = np.concatenate([np.arange(b * GLOBAL_BATCH + R * per_rank,
                                     b * GLOBAL_BATCH + (R + 1) * per_rank)
                           for b in range(len(x) // GLOBAL_BATCH)])
    model.fit(x[mine], y[mine], batch_size=per_rank, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return model


def shim_compare(make_optimizer, tol=TOL, **kwargs):
    plain = shim_train(make_optimizer, False, **kwargs)
    sharded = shim_train(make_optimizer, True, **kwargs)
    for a, b in zip(plain.weights, sharded.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=0, atol=tol, err_msg=a.name)
    same_on_all_ranks([w.numpy() for w in sharded.weights])
    compare_state(_inner(sharded.optimizer), _inner(plain.optimizer), tol)
    return plain, sharded


def split(model, layer="hidden"):
    """Whether the sharded optimizer of `model` split the kernel of `layer`
    into pieces, and how many variables it split."""
    opt = _inner(model.optimizer)
    kernel = model.get_layer(layer).kernel
    pieces = opt._perseus_shards.pieces
    return any(keras_shard._model_variables(opt)[i] is kernel for i in pieces), len(pieces)


def check_shim_sharded_equals_the_shims_allreduce():
    import perseus_tf.horovod.keras as hvd
    # Element-wise optimizers split the largest variables, as under the
    # strategy: each rank keeps, and updates, a piece of hidden's kernel.
    _, sharded = shim_compare(lambda: keras.optimizers.Adam(0.01, amsgrad=True))
    assert split(sharded)[0], split(sharded)

    def adamw():
        opt = keras.optimizers.AdamW(0.01, weight_decay=0.1)
        opt.exclude_from_weight_decay(var_names=["bias"])
        return opt
    shim_compare(adamw)

    # A split variable excluded from weight decay by itself (not by a name):
    # its pieces are not decayed either. (The exclusion is made on the
    # optimizer given to hvd.DistributedOptimizer, which keeps it.)
    def exclude_hidden_kernel(model, optimizer):
        optimizer.exclude_from_weight_decay(var_list=[model.get_layer("hidden").kernel])
    plain, sharded = shim_compare(lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5),
                                  prepare=exclude_hidden_kernel)
    assert split(sharded)[0], split(sharded)
    for model in (plain, sharded):
        kernels = [model.get_layer(name).kernel for name in ("hidden", "narrow")]
        assert [_inner(model.optimizer)._use_weight_decay(k) for k in kernels] == [False, True]
    # A constraint runs on the owner of the whole variable: it is not split.
    _, sharded = shim_compare(lambda: keras.optimizers.Adam(0.05),
                              constraint=keras.constraints.MaxNorm(0.3))
    assert not split(sharded)[0], split(sharded)
    shim_compare(lambda: keras.optimizers.Adafactor(0.05))
    # The shim clips the averaged gradients: the norm of every rank's share.
    shim_compare(lambda: keras.optimizers.SGD(0.05, momentum=0.5, global_clipnorm=0.05))
    # clipnorm clips each variable's sum by its norm: a split variable's
    # pieces by the norm of all of them.
    _, sharded = shim_compare(lambda: keras.optimizers.Adam(0.01, clipnorm=0.05))
    assert split(sharded)[0], split(sharded)
    # A clipnorm that binds on every step, under SGD (whose step, unlike
    # Adam's, scales with the gradient): clipping each piece by its own norm
    # instead would move the split kernel further than the unsharded shim.
    plain, sharded = shim_compare(lambda: keras.optimizers.SGD(0.5, momentum=0.5, clipnorm=1e-3))
    assert split(sharded)[0], split(sharded)
    free = shim_train(lambda: keras.optimizers.SGD(0.5, momentum=0.5), False)
    kernels = [m.get_layer("hidden").kernel.numpy() for m in (plain, free)]
    moved = float(np.max(np.abs(kernels[0] - kernels[1])))
    assert moved > 1e-3, ("clipnorm=1e-3 did not bind", moved)
    shim_compare(lambda: keras.optimizers.SGD(0.05, clipvalue=0.004))
    # Compression.fp16 travels as the shim's allreduce sends it.
    # (At 2 ranks each sum is one float16 addition either way: the same bits.)
    shim_compare(lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                 compression=hvd.Compression.fp16, tol=TOL if N == 2 else 1e-4)


def check_shim_sharded_accumulates_backward_passes_as_unsharded():
    # backward_passes_per_step=2: each rank sums two passes locally, and every
    # second pass reduce-scatters the sums (averaged over the passes, or not).
    for average in (False, True):
        plain, sharded = shim_compare(
            lambda: keras.optimizers.SGD(0.05, momentum=0.9),
            options={"backward_passes_per_step": 2, "average_aggregated_gradients": average})
        counted = [int(_inner(m.optimizer).iterations.numpy()) for m in (plain, sharded)]
        assert counted[0] == counted[1], counted


def check_shim_sharded_mixed_precision_skips_an_overflow_everywhere():
    x = X.copy()
    x[3 * GLOBAL_BATCH + GLOBAL_BATCH - 1] = 1e6   # the last rank's rows of batch 3
    plain, sharded = shim_compare(lambda: keras.optimizers.Adam(0.01), tol=1e-5, x=x,
                                  mixed=True)
    assert split(sharded)[0], split(sharded)   # its pieces checked too
    scales = [_loss_scale(m.optimizer) for m in (plain, sharded)]
    assert scales[0] == scales[1] and scales[0] < 32768.0, scales


def check_shim_sharded_saves_whole_and_refuses_what_it_cannot_shard():
    import perseus_tf.horovod.keras as hvd
    plain, sharded = shim_compare(lambda: keras.optimizers.Adam(0.01))
    path = os.path.join(tempfile.mkdtemp(prefix=f"shard{R}-"), "shim.keras")
    sharded.save(path)
    loaded = keras.models.load_model(path, compile=True)
    for i, (a, b) in enumerate(zip(slots(loaded.optimizer), slots(plain.optimizer))):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL, err_msg=f"optimizer variable {i}")
    expect(ValueError, lambda: hvd.DistributedOptimizer(
        keras.optimizers.Adam(0.01), shard_optimizer_state=True, op=hvd.Adasum),
        "op must be", "shard_optimizer_state")
    if KERAS2:
        expect(ValueError, lambda: hvd.DistributedOptimizer(
            keras.optimizers.legacy.Adam(0.01), shard_optimizer_state=True),
            "legacy", "shard_optimizer_state")
    # hvd.elastic keeps the state whole at each commit (its reset shares it
    # out again: test_elastic.py). A step traced for an earlier layout
    # fails, naming what to do, rather than pair the ranks' parts wrongly.
    state = hvd.elastic.KerasState(sharded, batch=0, epoch=0)
    state.save()
    opt = _inner(sharded.optimizer)
    whole = [np.asarray(v) for v in state._saved_optimizer]
    for i, (a, b) in enumerate(zip(whole, slots(plain.optimizer))):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOL, err_msg=f"optimizer variable {i}")
    layout = opt.__dict__["_perseus_world_"]
    layout.assign_add(1)   # as hvd.elastic's reset does when the world changes
    expect(tf.errors.InvalidArgumentError,
           lambda: sharded.train_on_batch(X[:GLOBAL_BATCH // N], Y[:GLOBAL_BATCH // N]),
           "traced for the sharded layout", "trace the step again")
    layout.assign_add(-1)
    opt._perseus_shards.size += 1   # as if the world had grown under it
    sharded.train_function = None
    expect(ValueError,
           lambda: sharded.train_on_batch(X[:GLOBAL_BATCH // N], Y[:GLOBAL_BATCH // N]),
           f"sharded for {N + 1} ranks", "hvd.elastic.KerasState")
    opt._perseus_shards.size -= 1
