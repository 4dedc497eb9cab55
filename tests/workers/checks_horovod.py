"""The Horovod TensorFlow API (`perseus_tf.horovod`) on every rank, against
numpy references.

Run by tests/test_horovod.py through harness.run_checks at 2 and 4 ranks.
Data depend only on the rank and a seed, so each rank computes what every
other rank contributed and builds the numpy answer locally. Every check
makes the same collective calls on every rank whatever its outcome.
"""

import contextlib
import os
import tempfile
import warnings

import numpy as np
import tensorflow as tf

import perseus_tf as ptf
import perseus_tf.horovod as hvd
from perseus_tf import ops

from rank_checks import assert_barrier_waits, data, expect, same_on_all_ranks

# The checks that run at 4 ranks too (tests/test_horovod.py; every check runs
# at 2): two senders and two zero-row ranks in alltoall's
# gradient; reduce-scatter offsets past the first short block; a barrier that
# waits for only some ranks; process sets {0, 2} and {1, 3} (a root that is a
# global rank, not its position); three ranks joining in turn; Adasum's
# second tree level (and its refusal of 3-rank sets, which needs 4 ranks).
# hvd.broadcast from every root is checks_ops.check_broadcast_from_every_root
# (the same op, in 9 dtypes) and, through the shim, the graph-mode check here.
AT_4_RANKS = ("check_alltoall_with_and_without_splits",
              "check_graph_mode_gradients_and_zero_row_alltoall",
              "check_reducescatter_average_by_default_and_grouped", "check_barrier",
              "check_process_sets", "check_join", "check_adasum_allreduce_against_numpy",
              "check_adasum_grouped_has_coefficients_per_tensor",
              "check_adasum_gradient_tape_and_optimizers",
              "check_adasum_refuses_a_non_power_of_two_set",
              "check_tf1_adasum_optimizer_combines_weight_changes")

R = N = None


def setup():
    global R, N
    hvd.init()
    R, N = hvd.rank(), hvd.size()
    return R


def teardown():
    # Shutdown is collective: a rank that finished early would shut the
    # runtime down under a rank still running its last (local) check.
    hvd.barrier()


def normal(rank, shape, seed=0):
    return np.random.default_rng(1000 * rank + seed).normal(size=shape).astype(np.float32)


@contextlib.contextmanager
def counting_native_calls():
    """Counts perseus_tf.ops.grouped_allreduce / allreduce calls made by the shim."""
    calls = {"grouped": [], "single": 0}
    grouped, single = ops.grouped_allreduce, ops.allreduce

    def grouped_spy(tensors, *args, **kwargs):
        tensors = list(tensors)
        calls["grouped"].append([t.dtype for t in tensors])
        return grouped(tensors, *args, **kwargs)

    def single_spy(*args, **kwargs):
        calls["single"] += 1
        return single(*args, **kwargs)

    ops.grouped_allreduce, ops.allreduce = grouped_spy, single_spy
    try:
        yield calls
    finally:
        ops.grouped_allreduce, ops.allreduce = grouped, single


# ---- basics ----------------------------------------------------------------

def check_topology_and_build_flags():
    assert hvd.is_initialized()
    assert (hvd.size(), hvd.rank()) == (ptf.size(), ptf.rank())
    assert (hvd.local_size(), hvd.local_rank()) == (ptf.local_size(), ptf.local_rank())
    assert (hvd.cross_size(), hvd.cross_rank()) == (ptf.cross_size(), ptf.cross_rank())
    assert hvd.is_homogeneous() is True  # perseusrun -np N: one host
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.gloo_enabled() and hvd.gloo_built()
    assert not (hvd.mpi_enabled() or hvd.mpi_built() or hvd.ddl_built() or hvd.ccl_built())
    # Every install builds the CUDA data plane; NCCL is loaded at run time
    # (none here: tests/test_cc_unit.py gives it a stand-in NCCL).
    assert hvd.cuda_built() is True and not hvd.rocm_built()
    assert hvd.nccl_built() == 0
    expect(ValueError, hvd.mpi_threads_supported, "MPI")
    assert int(hvd.size_op()) == N and int(hvd.rank_op()) == R
    assert hvd.global_process_set.size() == N and hvd.global_process_set.included()
    assert hvd.global_process_set.ranks == list(range(N))
    # HOROVOD_* variables, as horovodrun sets them
    assert os.environ["HOROVOD_RANK"] == str(R) and os.environ["HOROVOD_SIZE"] == str(N)
    assert os.environ["HOROVOD_LOCAL_RANK"] == str(hvd.local_rank())


def check_elastic_run_restores_the_last_commit_and_resets_after_a_failed_collective():
    """Horovod's elastic loop: the last rank aborts and raises
    HorovodInternalError mid-epoch, so the others' next collective fails
    too; every rank restores the last commit, resets into the job's next
    round, syncs from rank 0 and trains on. The weights then equal those of
    the same schedule run without the failure."""
    from perseus_tf import _core, _native
    keras = tf.keras
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    model(np.zeros((1, 3), np.float32))
    opt = keras.optimizers.SGD(0.05)
    hvd.broadcast_variables(model.variables, root_rank=0)  # what run()'s first sync does
    initial = [v.numpy() for v in model.variables]

    def batch_data(epoch, batch):
        rng = np.random.default_rng(1000 * epoch + 10 * batch + R)
        return rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        steps.append(1)

    epochs, batches = 2, 4
    fail = {"armed": True}
    steps, entries = [], []

    def train(state):
        entries.append((state.epoch, state.batch))
        while state.epoch < epochs:
            while state.batch < batches:
                if (state.epoch, state.batch) == (1, 1) and fail["armed"]:
                    fail["armed"] = False  # batch 0 of epoch 1 is done but not committed
                    if R == N - 1:
                        _native.abort("elastic check: this rank fails")
                        raise hvd.elastic.HorovodInternalError("injected")
                step(*batch_data(state.epoch, state.batch))
                state.batch += 1
                if state.batch % 2 == 0:
                    state.commit()
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    round_before = _core.stats()["round"]
    state = hvd.elastic.TensorFlowKerasState(model, opt, epoch=0, batch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    hvd.elastic.run(train)(state)
    assert resets == [N] and _core.stats()["round"] == round_before + 1, (resets, _core.stats())
    assert (state.epoch, state.batch) == (epochs, 0)
    # Re-entered at the last commit (epoch 1, batch 0), whose batch ran again:
    # without restore() it would have gone on at batch 1 (8 steps, entries
    # (0, 0), (1, 1)); without the weights restored, batch 0 would count twice.
    assert entries == [(0, 0), (1, 0)] and len(steps) == epochs * batches + 1, (entries, steps)
    elastic = [v.numpy() for v in model.variables]
    same_on_all_ranks(np.concatenate([w.ravel() for w in elastic]))
    # The same schedule, uninterrupted, from the same start.
    for v, w in zip(model.variables, initial):
        v.assign(w)
    plain = hvd.elastic.ObjectState(bcast_object=lambda o: o, get_rank=hvd.rank, epoch=0, batch=0)
    plain.commit = lambda: None
    train(plain)  # fail["armed"] is down: no failure this time
    for got, want in zip(elastic, [v.numpy() for v in model.variables]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def check_keras_elastic_callbacks_keep_the_state_current():
    import perseus_tf.horovod.keras as hvd_keras
    keras = tf.keras
    model = keras.Sequential([keras.layers.Dense(1)])
    model(np.zeros((1, 3), np.float32))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    state = hvd_keras.elastic.KerasState(model, epoch=0, batch=0)
    commits = []
    real_commit = state.commit
    state.commit = lambda: (commits.append((state.epoch, state.batch)), real_commit())
    x, y = np.ones((12, 3), np.float32), np.ones((12, 1), np.float32)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[
        hvd_keras.elastic.UpdateBatchStateCallback(state),
        hvd_keras.elastic.UpdateEpochStateCallback(state),
        hvd_keras.elastic.CommitStateCallback(state, batches_per_commit=2)])
    assert (state.epoch, state.batch) == (2, 0), (state.epoch, state.batch)
    # Every 2 batches (3 an epoch: after batch 1, then after batch 0 of the
    # next epoch, the count carrying on) and at each epoch's end, each made
    # once the callbacks have seen that end (as the next batch or epoch
    # begins): the state says how many batches of which epoch the weights
    # hold. The last epoch's batch 2 and its end are one commit.
    assert commits == [(0, 2), (1, 0), (1, 1), (2, 0)], commits


# ---- allreduce -------------------------------------------------------------

def check_allreduce_default_is_average_and_every_op():
    for i, dt in enumerate([np.float32, np.float64, np.int32, np.int64, np.float16]):
        xs = [data(r, (3, 4), dt, seed=i) for r in range(N)]
        stacked = np.stack([x.astype(np.float64) for x in xs])
        mean = stacked.mean(0)
        if np.issubdtype(dt, np.integer):
            mean = np.trunc(mean)
        tol = 1e-2 if dt == np.float16 else 1e-6
        got = hvd.allreduce(tf.constant(xs[R]))  # no op: Average, as in Horovod
        assert got.dtype == tf.as_dtype(dt)
        np.testing.assert_allclose(got.numpy().astype(np.float64), mean, rtol=tol)
        refs = {hvd.Sum: stacked.sum(0), hvd.Min: stacked.min(0), hvd.Max: stacked.max(0),
                hvd.Product: stacked.prod(0), hvd.Average: mean}
        for op, ref in refs.items():
            got = hvd.allreduce(tf.constant(xs[R]), op=op).numpy().astype(np.float64)
            np.testing.assert_allclose(got, ref, rtol=tol, err_msg=f"{dt} op {op}")


def check_allreduce_deprecated_average_flag_and_scales():
    xs = [normal(r, (5, 3)) for r in range(N)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summed = hvd.allreduce(tf.constant(xs[R]), average=False).numpy()
        averaged = hvd.allreduce(tf.constant(xs[R]), average=True).numpy()
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    np.testing.assert_allclose(summed, sum(xs), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(averaged, sum(xs) / N, rtol=1e-5, atol=1e-6)
    expect(ValueError, lambda: hvd.allreduce(tf.constant(xs[R]), average=True, op=hvd.Sum),
           "supersedes")
    got = hvd.allreduce(tf.constant(xs[R]), op=hvd.Sum, prescale_factor=0.5,
                        postscale_factor=3.0).numpy()
    np.testing.assert_allclose(got, 1.5 * sum(xs), rtol=1e-5, atol=1e-5)
    got = hvd.allreduce(tf.Variable(xs[R]), op=hvd.Average, postscale_factor=2.0).numpy()
    np.testing.assert_allclose(got, 2.0 * sum(xs) / N, rtol=1e-5, atol=1e-5)
    # Adasum takes the scale factors too (more in the Adasum checks below).
    got = hvd.allreduce(tf.constant(xs[R]), op=hvd.Adasum, postscale_factor=2.0).numpy()
    np.testing.assert_allclose(got, 2.0 * adasum_reference(xs), rtol=1e-5, atol=1e-6)


def check_allreduce_fp16_compression():
    xs = [normal(r, (64,)) for r in range(N)]
    compressed, ctx = hvd.Compression.fp16.compress(tf.constant(xs[R]))
    assert compressed.dtype == tf.float16 and ctx == tf.float32
    got = hvd.allreduce(tf.constant(xs[R]), compression=hvd.Compression.fp16)
    assert got.dtype == tf.float32
    ref = np.mean([x.astype(np.float16).astype(np.float64) for x in xs], 0)
    np.testing.assert_allclose(got.numpy(), ref, atol=5e-3)
    # Not exactly the fp32 answer: the data really travelled as float16.
    assert not np.array_equal(got.numpy(), np.mean(xs, 0, dtype=np.float32))
    ints = hvd.allreduce(tf.constant([R, 1]), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert ints.dtype == tf.int32 and list(ints.numpy()) == [N * (N - 1) // 2, N]
    assert hvd.Compression.none.compress(tf.constant(xs[R]))[0].dtype == tf.float32


def _slices(rank):
    rows = rank + 1  # ranks contribute different numbers of rows
    values = data(rank, (rows, 3), np.float32, seed=7)
    indices = np.array([(rank + j) % 5 for j in range(rows)], np.int64)
    return values, indices


def _to_dense(values, indices):
    out = np.zeros((5, 3), np.float64)
    np.add.at(out, indices, values)
    return out


def check_allreduce_indexed_slices_gathers_values_and_indices():
    values, indices = _slices(R)
    slices = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([5, 3]))
    total = sum(_to_dense(*_slices(r)) for r in range(N))
    for op, ref in ((hvd.Sum, total), (hvd.Average, total / N), (None, total / N)):
        got = hvd.allreduce(slices, op=op)
        assert isinstance(got, tf.IndexedSlices)
        assert got.values.shape[0] == sum(r + 1 for r in range(N))
        np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), ref, rtol=1e-6)
    expect(NotImplementedError, lambda: hvd.allreduce(slices, op=hvd.Max), "Sum and Average")
    expect(NotImplementedError, lambda: hvd.allreduce(slices, prescale_factor=2.0), "scale")


def check_grouped_allreduce_mixed_dtypes_and_slices():
    xs = [[data(r, (i + 2, 3), dt, seed=i) for i, dt in
           enumerate([np.float32, np.float64, np.int32, np.float32])] for r in range(N)]
    values, indices = _slices(R)
    mine = [tf.constant(x) for x in xs[R]]
    mine.insert(2, tf.IndexedSlices(tf.constant(values), tf.constant(indices), [5, 3]))
    got = hvd.grouped_allreduce(mine, op=hvd.Sum)
    assert isinstance(got[2], tf.IndexedSlices)
    np.testing.assert_allclose(tf.convert_to_tensor(got.pop(2)).numpy(),
                               sum(_to_dense(*_slices(r)) for r in range(N)))
    for i, g in enumerate(got):
        assert g.dtype == mine[i if i < 2 else i + 1].dtype
        np.testing.assert_array_equal(g.numpy(), sum(x[i] for x in xs))
    avg = hvd.grouped_allreduce([tf.constant(x) for x in xs[R] if x.dtype != np.int32])
    np.testing.assert_allclose(avg[0].numpy(), sum(x[0] for x in xs) / N, rtol=1e-6)
    assert hvd.grouped_allreduce([]) == []


# ---- other collectives -----------------------------------------------------

def check_allgather_and_grouped_allgather():
    mine = data(R, (R + 1, 2), np.int64)
    got = hvd.allgather(tf.constant(mine)).numpy()
    np.testing.assert_array_equal(got, np.concatenate([data(r, (r + 1, 2), np.int64)
                                                       for r in range(N)]))
    a, b = hvd.grouped_allgather([tf.fill([R + 2], R), tf.constant([[float(R)]])])
    np.testing.assert_array_equal(a.numpy(), np.concatenate([[r] * (r + 2) for r in range(N)]))
    np.testing.assert_array_equal(b.numpy(), np.arange(N, dtype=np.float32).reshape(N, 1))


def check_int16_and_uint16_in_every_collective():
    """Horovod's allgather, broadcast and alltoall take uint16 and int16;
    ours reduce them too."""
    for dt in (np.uint16, np.int16):
        base = np.array([1, 300, 2000], dt)
        mine = base + dt(R)
        got = hvd.allreduce(tf.constant(mine), op=hvd.Sum)
        assert got.dtype == tf.as_dtype(dt)
        np.testing.assert_array_equal(got.numpy(), sum(base + dt(r) for r in range(N)))
        np.testing.assert_array_equal(hvd.allreduce(tf.constant(mine), op=hvd.Max).numpy(),
                                      base + dt(N - 1))
        gathered = hvd.allgather(tf.constant(np.full([R + 1], 7 * R, dt)))
        np.testing.assert_array_equal(
            gathered.numpy(), np.concatenate([np.full([r + 1], 7 * r, dt) for r in range(N)]))
        np.testing.assert_array_equal(hvd.broadcast(tf.constant(mine), N - 1).numpy(),
                                      base + dt(N - 1))
        out = hvd.alltoall(tf.constant(np.full([N], R + 40000 if dt == np.uint16 else -R, dt)))
        np.testing.assert_array_equal(
            out.numpy(), [r + 40000 if dt == np.uint16 else -r for r in range(N)])
        scattered = hvd.reducescatter(tf.constant(np.ones([N, 2], dt) * dt(R + 1)), op=hvd.Sum)
        np.testing.assert_array_equal(scattered.numpy(), np.full([1, 2], N * (N + 1) // 2, dt))


def check_alltoall_with_and_without_splits():
    rows = np.arange(N * 2, dtype=np.float32).reshape(N * 2, 1) + 100 * R
    # Without splits Horovod returns the tensor alone; with splits (equal
    # ones too) the tensor and the received splits.
    out = hvd.alltoall(tf.constant(rows))
    assert tf.is_tensor(out), type(out)
    np.testing.assert_array_equal(out.numpy().ravel(), np.concatenate(
        [np.arange(2 * R, 2 * R + 2) + 100 * r for r in range(N)]))
    out2, received = hvd.alltoall(tf.constant(rows), splits=[2] * N)
    np.testing.assert_array_equal(received.numpy(), [2] * N)
    np.testing.assert_array_equal(out2.numpy(), out.numpy())
    splits = [(R + d) % 2 + 1 for d in range(N)]  # rank R sends splits[d] rows to d
    mine = np.full((sum(splits),), R, np.int32)
    out, received = hvd.alltoall(tf.constant(mine), splits=splits)
    expected_counts = [(r + R) % 2 + 1 for r in range(N)]
    np.testing.assert_array_equal(received.numpy(), expected_counts)
    np.testing.assert_array_equal(out.numpy(), np.repeat(np.arange(N), expected_counts))


def check_graph_mode_gradients_and_zero_row_alltoall():
    """TF1 Session graphs, with Horovod's gradient conventions: allgather
    (first dimensions differ per rank, grouped too), broadcast from every
    root, reducescatter (Sum and Average, grouped), alltoall and its
    gradient, alltoall where some ranks send no rows, and an empty alltoall."""
    rows = [3, 2, 7, 4][:N]
    with tf.Graph().as_default():
        fetch = {}
        x = tf.ones([rows[R], 5]) * R
        xs = [tf.ones([rows[R] + i, 2]) * (R + i) for i in range(3)]
        ys = tf.concat([tf.ones([rows[r], 5]) * r for r in range(N)], 0)
        fetch["allgather"] = tf.gradients(hvd.allgather(x), x, ys)[0]
        gathered = hvd.grouped_allgather(xs)
        gys = [tf.concat([tf.ones([rows[r] + i, 2]) * (r + i) for r in range(N)], 0)
               for i in range(3)]
        fetch["grouped_allgather"] = tf.gradients(gathered, xs, gys)
        b = tf.ones([4, 3]) * R
        fetch["broadcast"] = [tf.gradients(hvd.broadcast(b, root), b, tf.ones([4, 3]))[0]
                              for root in range(N)]
        rs = tf.ones([N * 4, 2])
        fetch["reducescatter_sum"] = tf.gradients(
            hvd.reducescatter(rs, op=hvd.Sum), rs, tf.ones([4, 2]))[0]
        fetch["reducescatter_avg"] = tf.gradients(hvd.reducescatter(rs), rs, tf.ones([4, 2]))[0]
        group = [tf.ones([N * 2, 3]), tf.ones([N, 1])]
        fetch["grouped_reducescatter"] = tf.gradients(
            hvd.grouped_reducescatter(group, op=hvd.Sum), group,
            [tf.ones([2, 3]), tf.ones([1, 1])])
        a = tf.ones([N * (R + 1), 2])
        sent = [R + 1] * N
        out, received = hvd.alltoall(a, splits=sent)
        fetch["alltoall"] = (out, received, tf.gradients(out, a, tf.ones_like(out))[0])
        active = R < max(1, N // 2)
        z = tf.fill([N if active else 0, 4], R)
        fetch["zero_rows"] = hvd.alltoall(z, splits=[1 if active else 0] * N)
        fetch["empty"] = hvd.alltoall(tf.zeros([N, 0]))
        with tf.compat.v1.Session() as sess:
            got = sess.run(fetch)
    np.testing.assert_array_equal(got["allgather"], np.ones([rows[R], 5]) * R)
    for i, g in enumerate(got["grouped_allgather"]):
        np.testing.assert_array_equal(g, np.ones([rows[R] + i, 2]) * (R + i))
    for root, g in enumerate(got["broadcast"]):
        np.testing.assert_array_equal(g, np.ones([4, 3]) * (1.0 if R == root else 0.0))
    np.testing.assert_array_equal(got["reducescatter_sum"], np.full([N * 4, 2], float(N)))
    np.testing.assert_array_equal(got["reducescatter_avg"], np.ones([N * 4, 2]))
    np.testing.assert_array_equal(got["grouped_reducescatter"][0], np.full([N * 2, 3], float(N)))
    np.testing.assert_array_equal(got["grouped_reducescatter"][1], np.full([N, 1], float(N)))
    out, received, grad = got["alltoall"]
    np.testing.assert_array_equal(received, [r + 1 for r in range(N)])
    assert out.shape == (N * (N + 1) // 2, 2), out.shape
    np.testing.assert_array_equal(grad, np.ones([N * (R + 1), 2]))
    zout, zreceived = got["zero_rows"]
    senders = [r for r in range(N) if r < max(1, N // 2)]
    np.testing.assert_array_equal(zreceived, [1 if r in senders else 0 for r in range(N)])
    np.testing.assert_array_equal(zout, np.repeat(np.array(senders, np.int32), 1)[:, None]
                                  * np.ones([1, 4], np.int32))
    assert got["empty"].shape == (N, 0), got["empty"].shape


def check_reducescatter_average_by_default_and_grouped():
    rows = 2 * N + 1
    xs = [data(r, (rows, 3), np.float32) for r in range(N)]
    counts = [rows // N + (1 if r < rows % N else 0) for r in range(N)]
    start = sum(counts[:R])
    got = hvd.reducescatter(tf.constant(xs[R]))
    np.testing.assert_allclose(got.numpy(), (sum(xs) / N)[start:start + counts[R]], rtol=1e-6)
    a, b = hvd.grouped_reducescatter([tf.constant(xs[R]), tf.constant(xs[R] * 2)], op=hvd.Sum)
    np.testing.assert_allclose(a.numpy(), sum(xs)[start:start + counts[R]])
    np.testing.assert_allclose(b.numpy(), 2 * sum(xs)[start:start + counts[R]])


def check_barrier():
    assert_barrier_waits(hvd.barrier)


def check_mismatched_shapes_dtypes_roots_raise():
    expect(tf.errors.FailedPreconditionError,
           lambda: hvd.allreduce(tf.ones([2 + R]), name="hvd.mm.shape"), "hvd.mm.shape", "shape")
    dt = tf.float32 if R == 0 else tf.float64
    expect(tf.errors.FailedPreconditionError,
           lambda: hvd.allreduce(tf.ones([2], dt), name="hvd.mm.dtype"), "dtype")
    expect(tf.errors.FailedPreconditionError,
           lambda: hvd.broadcast(tf.ones([2]), min(R, 1), name="hvd.mm.root"), "root")
    # allgather: the first dimension may differ, the others may not.
    expect(tf.errors.FailedPreconditionError,
           lambda: hvd.allgather(tf.ones([2, 1 + R]), name="hvd.mm.gather"), "hvd.mm.gather")
    expect(tf.errors.FailedPreconditionError,
           lambda: hvd.grouped_allreduce([tf.ones([1]), tf.ones([1 + R])], name="hvd.mm.group"),
           "hvd.mm.group")
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy(), [N, N])


# ---- process sets and join (native support from perseus_tf.ops) ------------

def check_process_sets():
    evens_ranks = list(range(0, N, 2))
    evens = hvd.add_process_set(evens_ranks)
    odds = hvd.add_process_set(hvd.ProcessSet(range(1, N, 2)))
    assert evens.process_set_id not in (None, 0) and odds.process_set_id != evens.process_set_id
    mine, members = (evens, evens_ranks) if R % 2 == 0 else (odds, list(range(1, N, 2)))
    other = odds if mine is evens else evens
    assert mine.size() == len(members) and mine.included() and not other.included()
    assert mine.rank() == members.index(R)
    expect(ValueError, other.rank, "not part")
    got = hvd.allreduce(tf.constant([float(R)]), op=hvd.Sum, process_set=mine).numpy()
    assert got[0] == sum(members), got
    got = hvd.allreduce(tf.constant([float(R)]), process_set=mine).numpy()
    assert got[0] == np.mean(members), got
    gathered = hvd.allgather(tf.constant([R]), process_set=mine).numpy()
    np.testing.assert_array_equal(gathered, members)
    root = members[-1]  # a global rank, as in Horovod
    got = hvd.broadcast(tf.constant([R]), root, process_set=mine).numpy()
    assert got[0] == root, got
    assert hvd.broadcast_object(("from", R), root_rank=root, process_set=mine) == ("from", root)
    assert hvd.allgather_object(R, process_set=mine) == members
    expect(ValueError, lambda: hvd.broadcast(tf.constant([R]), other.ranks[0], process_set=mine),
           "not a member")
    # The gradient path honours the set: gradients are averaged among its members.
    w = tf.Variable([1.0, 2.0])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(R + 1))
    grad = hvd.DistributedGradientTape(tape, process_set=mine).gradient(loss, [w])[0]
    np.testing.assert_allclose(grad.numpy(), [np.mean(members) + 1] * 2)
    hvd.barrier(process_set=mine)
    assert hvd.remove_process_set(odds) is True and hvd.remove_process_set(evens) is True
    assert evens.process_set_id is None and evens.size() is None
    assert hvd.remove_process_set(hvd.global_process_set) is False
    expect(ValueError, lambda: hvd.allreduce(tf.ones([1]), process_set=evens), "not registered")
    expect(ValueError, lambda: hvd.add_process_set([0, N]), "subset")
    first = hvd.ProcessSet([0])
    hvd.init(process_sets=[first])  # registers sets given to init (collective)
    assert first.process_set_id not in (None, 0) and first.included() == (R == 0)
    assert hvd.remove_process_set(first)


def check_join():
    # Rank r has r + 1 batches; joined ranks contribute zeros to the others' sums.
    for step in range(R + 1):
        got = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum, name="join.step").numpy()
        assert got[0] == sum(1 for r in range(N) if r >= step), (step, got)
    assert int(hvd.join()) == N - 1
    # Usable again afterwards, e.g. once per epoch.
    np.testing.assert_array_equal(hvd.allreduce(tf.ones([1]), op=hvd.Sum).numpy(), [N])
    assert int(hvd.join()) in range(N)


# ---- variables and objects ------------------------------------------------

def check_broadcast_variables_and_objects():
    variables = [tf.Variable(normal(R, (3, 2))), tf.Variable(R, dtype=tf.int64)]
    hvd.broadcast_variables(variables, root_rank=N - 1)
    np.testing.assert_array_equal(variables[0].numpy(), normal(N - 1, (3, 2)))
    assert variables[1].numpy() == N - 1
    obj = {"rank": R, "payload": list(range(R + 3)), "name": "x" * R}
    got = hvd.broadcast_object(obj, root_rank=1 if N > 1 else 0)
    assert got == {"rank": 1, "payload": [0, 1, 2, 3], "name": "x"}, got
    everyone = hvd.allgather_object(obj)
    assert everyone == [{"rank": r, "payload": list(range(r + 3)), "name": "x" * r}
                        for r in range(N)], everyone
    assert hvd.broadcast_object_fn(root_rank=0)(("tuple", R)) == ("tuple", 0)
    expect(RuntimeError, lambda: hvd.broadcast_global_variables(0), "eager")


def check_inplace_broadcast_of_variables_from_every_root():
    """hvd.broadcast_ (Horovod's in-place broadcast): one variable or a list,
    eagerly, in tf.function and in a TF1 graph, in the dtypes Horovod's own
    test uses; it returns the new values."""
    dtypes = (tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64,
              tf.bool)
    for root in range(N):
        made = [tf.Variable(tf.cast(tf.fill([3, 2], R % 2 if d == tf.bool else R + 1), d))
                for d in dtypes]
        values = hvd.broadcast_(made, root_rank=root)
        for d, var, value in zip(dtypes, made, values):
            want = np.full([3, 2], root % 2 if d == tf.bool else root + 1)
            np.testing.assert_array_equal(var.numpy().astype(np.int64), want, err_msg=str(d))
            np.testing.assert_array_equal(value.numpy().astype(np.int64), want, err_msg=str(d))
    one = tf.Variable(normal(R, (5,)))
    traced = tf.function(lambda: hvd.broadcast_(one, root_rank=N - 1, name="one"))()
    np.testing.assert_array_equal(traced.numpy(), normal(N - 1, (5,)))
    np.testing.assert_array_equal(one.numpy(), normal(N - 1, (5,)))
    with tf.Graph().as_default():
        v = tf.compat.v1.get_variable("v", initializer=tf.constant(normal(R, (4,))))
        out = hvd.broadcast_([v], root_rank=0)
        with tf.compat.v1.Session() as sess:
            sess.run(v.initializer)
            got, = sess.run(out)
            now = sess.run(v)
    np.testing.assert_array_equal(got, normal(0, (4,)))
    np.testing.assert_array_equal(now, normal(0, (4,)))
    expect(TypeError, lambda: hvd.broadcast_([tf.constant(1.0)], 0), "hvd.broadcast for tensors")


def check_broadcast_global_variables_in_a_graph():
    with tf.Graph().as_default():
        a = tf.compat.v1.get_variable("a", initializer=tf.constant(normal(R, (4,))))
        b = tf.compat.v1.get_variable("b", initializer=tf.constant([R, 2 * R]))
        bcast = hvd.broadcast_global_variables(0)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(bcast)
            av, bv = sess.run([a, b])
            obj = hvd.broadcast_object({"r": R}, root_rank=0, session=sess)
    np.testing.assert_array_equal(av, normal(0, (4,)))
    np.testing.assert_array_equal(bv, [0, 0])
    assert obj == {"r": 0}


# ---- DistributedGradientTape ------------------------------------------------

def _linear_problem(seed=0):
    w0 = normal(99, (4, 2), seed=seed)
    xs = [normal(r, (6, 4), seed=seed + 1) for r in range(N)]
    ys = [normal(r, (6, 2), seed=seed + 2) for r in range(N)]
    # d/dw mean((xw - y)^2) = 2 x^T (xw - y) / (rows * cols)
    grads = [2 * x.T @ (x @ w0 - y) / y.size for x, y in zip(xs, ys)]
    return w0, xs, ys, grads


def check_fp16_gradients_convert_in_the_runtime_with_horovods_values():
    """Compression.fp16 of float32 gradients: the float32 tensors go to the
    runtime, which converts while packing (no TF Cast per gradient), and the
    result is Horovod's: float16(g) summed in float16, averaged after. Large
    values (30000 / N per rank, over 6550 = float16's max / the default
    gradient scale of 10) must not overflow: the scale is cancelled."""
    rng = np.random.default_rng(7)
    per_rank = []
    for r in range(N):
        g = (rng.normal(size=512) * 10.0 ** rng.integers(-4, 2, size=512)).astype(np.float32)
        g[:8] = 30000.0 / N * (1 + 0.01 * r)  # the average's sum stays under 65504
        per_rank.append(g)
    coeff = tf.constant(per_rank[R])
    w = tf.Variable(tf.zeros([512]))
    v64 = tf.Variable(tf.zeros([4], tf.float64))
    seen = []
    grouped = ops.grouped_allreduce

    def spy(tensors, *args, **kwargs):
        tensors = list(tensors)
        seen.append(([t.dtype for t in tensors], kwargs.get("compression")))
        return grouped(tensors, *args, **kwargs)

    @tf.function
    def step(op):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * coeff) + tf.cast(tf.reduce_sum(v64 * (R + 1.0)), tf.float32)
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16, op=op)
        return tape.gradient(loss, [w, v64])

    ops.grouped_allreduce = spy
    try:
        gw, g64 = step(hvd.Average)
        gw_sum, _ = step(hvd.Sum)
    finally:
        ops.grouped_allreduce = grouped
    # float32 travels as itself with the runtime's fp16; float64 is cast by TF.
    assert ([tf.float32], "fp16") in seen and ([tf.float16], "none") in seen, seen
    halves = [h.astype(np.float16) for h in per_rank]
    total = halves[0]
    for h in halves[1:]:
        total = (total + h).astype(np.float16)
    got_sum = gw_sum.numpy()
    assert np.all(np.isfinite(got_sum)) and got_sum.dtype == np.float32
    if N == 2:  # one float16 addition: the same bits whatever the order
        np.testing.assert_array_equal(got_sum, total.astype(np.float32))
        np.testing.assert_array_equal(gw.numpy(), total.astype(np.float32) / N)
    else:  # the ring's order of float16 additions may differ from numpy's
        np.testing.assert_allclose(got_sum, total.astype(np.float32), rtol=4e-3, atol=1e-6)
        np.testing.assert_allclose(gw.numpy(), total.astype(np.float32) / N, rtol=4e-3,
                                   atol=1e-6)
    np.testing.assert_allclose(g64.numpy(), np.full(4, (N + 1) / 2.0), rtol=1e-3)
    # The collectives too: hvd.allreduce and hvd.grouped_allreduce with
    # Compression.fp16 hand float32 to the runtime's fp16, eagerly and in a
    # graph; float64 in the same grouped call is cast by TF.
    single, group = ops.allreduce, ops.grouped_allreduce
    calls = []

    def spy_single(tensor, *args, **kwargs):
        calls.append(("allreduce", tensor.dtype, kwargs.get("compression", "none")))
        return single(tensor, *args, **kwargs)

    def spy_group(tensors, *args, **kwargs):
        tensors = list(tensors)
        calls.append(("grouped", tuple(t.dtype for t in tensors),
                      kwargs.get("compression", "none")))
        return group(tensors, *args, **kwargs)

    ops.allreduce, ops.grouped_allreduce = spy_single, spy_group
    try:
        fp16 = hvd.Compression.fp16
        outs = [hvd.allreduce(coeff, op=hvd.Sum, compression=fp16, name="fp16.single"),
                hvd.grouped_allreduce([coeff, tf.constant([R + 1.0], tf.float64)], op=hvd.Sum,
                                      compression=fp16, name="fp16.group")[0],
                tf.function(lambda: hvd.allreduce(coeff, op=hvd.Average,
                                                  compression=fp16))() * N]
    finally:
        ops.allreduce, ops.grouped_allreduce = single, group
    assert ("allreduce", tf.float32, "fp16") in calls, calls
    assert ("grouped", (tf.float32,), "fp16") in calls and \
        ("grouped", (tf.float16,), "none") in calls, calls
    for out in outs:
        assert out.dtype == tf.float32 and np.all(np.isfinite(out.numpy()))
        if N == 2:
            np.testing.assert_array_equal(out.numpy(), total.astype(np.float32))
        else:
            np.testing.assert_allclose(out.numpy(), total.astype(np.float32), rtol=4e-3,
                                       atol=1e-6)


def check_gradient_tape_average_sum_predivide_and_fp16():
    w0, xs, ys, grads = _linear_problem()
    w = tf.Variable(w0)
    bias = tf.Variable(tf.zeros([2], tf.float64))

    def tape_grads(**kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((xs[R] @ w + tf.cast(bias, tf.float32) - ys[R]) ** 2)
        return hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, [w, bias])

    with counting_native_calls() as calls:
        gw, gb = tape_grads()
    # One fused request per dtype (float32 weight, float64 bias), no per-tensor allreduce.
    assert sorted(map(str, calls["grouped"])) == ["[tf.float32]", "[tf.float64]"], calls
    assert calls["single"] == 0
    np.testing.assert_allclose(gw.numpy(), np.mean(grads, 0), rtol=1e-5, atol=1e-6)
    gw_sum, _ = tape_grads(op=hvd.Sum)
    np.testing.assert_allclose(gw_sum.numpy(), np.sum(grads, 0), rtol=1e-5, atol=1e-6)
    gw_pre, _ = tape_grads(gradient_predivide_factor=float(N))
    np.testing.assert_allclose(gw_pre.numpy(), np.mean(grads, 0), rtol=1e-5, atol=1e-6)
    gw_fp16, _ = tape_grads(compression=hvd.Compression.fp16)
    assert gw_fp16.dtype == tf.float32
    np.testing.assert_allclose(gw_fp16.numpy(), np.mean(grads, 0), rtol=1e-2, atol=1e-2)
    expect(ValueError, lambda: tape_grads(op=hvd.Sum, gradient_predivide_factor=2.0), "op")
    gw_adasum, gb_adasum = tape_grads(op=hvd.Adasum)
    np.testing.assert_allclose(gw_adasum.numpy(), adasum_reference(grads), rtol=1e-5, atol=1e-6)
    assert gb_adasum.dtype == tf.float64


def check_gradient_tape_groups_and_tf_function():
    ws = [tf.Variable(normal(50 + i, (3,))) for i in range(5)]
    x = normal(R, (3,), seed=3)

    def run(**kwargs):
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(w * x * (i + 1)) for i, w in enumerate(ws))
        return hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, ws)

    ref = [np.mean([normal(r, (3,), seed=3) for r in range(N)], 0) * (i + 1) for i in range(5)]
    for kwargs, requests in (({}, 1), ({"groups": 2}, 2), ({"num_groups": 3}, 3),
                             ({"groups": [[ws[0], ws[4]], [ws[2]]]}, 4)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with counting_native_calls() as calls:
                got = run(**kwargs)
        assert len(calls["grouped"]) == requests, (kwargs, calls)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g.numpy(), r, rtol=1e-6)
    expect(ValueError, lambda: run(groups=-1), "groups")

    step = tf.function(lambda: run())
    for _ in range(2):
        for g, r in zip(step(), ref):
            np.testing.assert_allclose(g.numpy(), r, rtol=1e-6)


def check_gradient_tape_sparse_and_sparse_as_dense():
    table = tf.Variable(normal(7, (5, 3)))
    ids = tf.constant([(R + j) % 5 for j in range(R + 1)])

    def run(**kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids))
        return hvd.DistributedGradientTape(tape, **kwargs).gradient(loss, [table])[0]

    counts = np.zeros((5, 3))
    for r in range(N):
        for j in range(r + 1):
            counts[(r + j) % 5] += 1
    sparse = run()
    assert isinstance(sparse, tf.IndexedSlices)
    np.testing.assert_allclose(tf.convert_to_tensor(sparse).numpy(), counts / N, rtol=1e-6)
    dense = run(sparse_as_dense=True)
    assert not isinstance(dense, tf.IndexedSlices)
    np.testing.assert_allclose(dense.numpy(), counts / N, rtol=1e-6)


def check_partial_gradient_tape_keeps_local_layers_local():
    keras = tf.keras
    shared, local = keras.layers.Dense(2, use_bias=False), keras.layers.Dense(1, use_bias=False)
    x = tf.constant(normal(R, (4, 3), seed=11))
    shared.build((None, 3))
    local.build((None, 2))
    shared.kernel.assign(normal(0, (3, 2), seed=12))
    local.kernel.assign(normal(0, (2, 1), seed=13))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    raw = tape.gradient(loss, [shared.kernel, local.kernel])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    got = tape.gradient(loss, [shared.kernel, local.kernel])
    # The shared gradient is averaged; the local one stays local, divided by size.
    everyone = ptf.allgather(tf.expand_dims(raw[0], 0)).numpy()
    np.testing.assert_allclose(got[0].numpy(), everyone.mean(0), rtol=1e-5)
    np.testing.assert_allclose(got[1].numpy(), raw[1].numpy() / N, rtol=1e-6)
    # Horovod 0.28's split of the same: (local pairs, global pairs), each in
    # the order of the sources, the same values as gradient().
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
    local_pairs, global_pairs = tape.get_local_and_global_gradients(
        loss, [shared.kernel, local.kernel])
    assert [v is local.kernel for v, _ in local_pairs] == [True], local_pairs
    assert [v is shared.kernel for v, _ in global_pairs] == [True], global_pairs
    np.testing.assert_allclose(local_pairs[0][1].numpy(), raw[1].numpy() / N, rtol=1e-6)
    np.testing.assert_allclose(global_pairs[0][1].numpy(), everyone.mean(0), rtol=1e-5)
    # A plain DistributedGradientTape has it too: everything global.
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(local(shared(x)))
    local_pairs, global_pairs = hvd.DistributedGradientTape(tape).get_local_and_global_gradients(
        loss, [shared.kernel, local.kernel])
    assert local_pairs == [] and len(global_pairs) == 2, (local_pairs, global_pairs)


# ---- Adasum ---------------------------------------------------------------------

def adasum_reference(vectors):
    """The published Adasum of per-rank vectors (numpy): pairs (0,1), (2,3),
    ... then their results, each pair combined as
    (1 - ab/2|a|^2) a + (1 - ab/2|b|^2) b, with dot products in float64;
    float16 combines in float32."""
    dtype = vectors[0].dtype

    def combine(a, b):
        a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
        dot, aa, bb = a64 @ b64, a64 @ a64, b64 @ b64
        ca = 1.0 - dot / (2 * aa) if aa != 0 else 1.0
        cb = 1.0 - dot / (2 * bb) if bb != 0 else 1.0
        if dtype == np.float16:
            out = np.float32(ca) * a.astype(np.float32) + np.float32(cb) * b.astype(np.float32)
        else:
            out = ca * a.astype(np.float64) + cb * b.astype(np.float64)
        return out.astype(dtype).reshape(a.shape)

    level = list(vectors)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


_ADASUM_TOL = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}


def check_adasum_allreduce_against_numpy():
    for dtype in (np.float16, np.float32, np.float64):
        for shape in ((5,), (3, 4), (1000,)):
            every = [normal(r, shape, seed=31).astype(dtype) for r in range(N)]
            got = hvd.allreduce(tf.constant(every[R]), op=hvd.Adasum).numpy()
            assert got.dtype == dtype
            np.testing.assert_allclose(got.astype(np.float64),
                                       adasum_reference(every).astype(np.float64),
                                       rtol=_ADASUM_TOL[dtype], atol=_ADASUM_TOL[dtype])
            same_on_all_ranks([got])
    # What makes it Adasum: orthogonal gradients add up, identical ones
    # count once (no sum, no average of a half).
    basis = np.zeros(N, np.float32)
    basis[R] = 1.0
    np.testing.assert_allclose(hvd.allreduce(tf.constant(basis), op=hvd.Adasum).numpy(),
                               np.ones(N, np.float32), rtol=1e-6)
    same = np.arange(1, 7, dtype=np.float32)
    np.testing.assert_allclose(hvd.allreduce(tf.constant(same), op=hvd.Adasum).numpy(), same,
                               rtol=1e-6)
    # Zeros everywhere stay zeros (a zero norm leaves its coefficient at 1).
    assert not hvd.allreduce(tf.zeros([3]), op=hvd.Adasum).numpy().any()
    # Scale factors apply before and after, as in Horovod.
    every = [normal(r, (6,), seed=32) for r in range(N)]
    got = hvd.allreduce(tf.constant(every[R]), op=hvd.Adasum, prescale_factor=0.5,
                        postscale_factor=3.0).numpy()
    np.testing.assert_allclose(got, 3.0 * adasum_reference([0.5 * v for v in every]), rtol=1e-5)


def check_adasum_grouped_has_coefficients_per_tensor():
    shapes = [(4, 3), (0,), (7,), (2, 2)]
    every = [[normal(r, s, seed=40 + i) * (10.0 ** i) for i, s in enumerate(shapes)]
             for r in range(N)]
    every[0][2] = every[0][2] * 0  # one rank's tensor is zero
    mine = [tf.constant(t) for t in every[R]]

    @tf.function
    def reduce_all(tensors):
        return hvd.grouped_allreduce(tensors, op=hvd.Adasum)

    for got in (hvd.grouped_allreduce(mine, op=hvd.Adasum), reduce_all(mine)):
        for i, shape in enumerate(shapes):
            assert tuple(got[i].shape) == shape, (i, got[i].shape)
            want = adasum_reference([every[r][i] for r in range(N)])
            np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-5, atol=1e-6)
    # Mixed dtypes in one call: one gather per dtype, the same answers.
    mixed = hvd.grouped_allreduce([mine[0], tf.cast(mine[2], tf.float64)], op=hvd.Adasum)
    assert mixed[1].dtype == tf.float64
    np.testing.assert_allclose(mixed[1].numpy(),
                               adasum_reference([every[r][2].astype(np.float64)
                                                 for r in range(N)]), rtol=1e-6)


def check_adasum_gradient_tape_and_optimizers():
    x = normal(R, (4, 3), seed=50)
    w0 = normal(0, (3, 2), seed=51)
    grads_by_rank = [(normal(r, (4, 3), seed=50).T @ np.ones((4, 2), np.float32)) for r in range(N)]
    want = adasum_reference(grads_by_rank)
    w = tf.Variable(w0)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.matmul(tf.constant(x), w))
    got = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, [w])[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # A Keras optimizer: one SGD(1.0) step applies the Adasum of the gradients.
    keras = tf.keras
    dense = keras.layers.Dense(2, use_bias=False)
    dense.build((None, 3))
    dense.kernel.assign(w0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(dense(tf.constant(x)))
    grads = tape.gradient(loss, dense.trainable_variables)
    opt.apply_gradients(zip(grads, dense.trainable_variables))
    np.testing.assert_allclose(dense.kernel.numpy(), w0 - want, rtol=1e-5, atol=1e-6)
    # What Horovod refuses with Adasum, refused here too.
    expect(ValueError, lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Adasum,
                                                        gradient_predivide_factor=2.0),
           "gradient_predivide_factor")
    expect(ValueError, lambda: hvd.DistributedOptimizer(
        keras.optimizers.SGD(1.0), op=hvd.Adasum, backward_passes_per_step=2,
        average_aggregated_gradients=True), "average_aggregated_gradients")
    slices = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2]))
    expect(NotImplementedError, lambda: hvd.allreduce(slices, op=hvd.Adasum), "IndexedSlices")
    expect(ValueError, lambda: hvd.allreduce(tf.constant([1, 2]), op=hvd.Adasum),
           "float16, float32 and float64", "int32")


def check_adasum_refuses_a_non_power_of_two_set():
    # Horovod's rule: Adasum runs on 2, 4, 8, ... ranks only. A set of three
    # members (at 4 ranks) is refused on every member before any collective.
    if N != 4:
        return
    three = hvd.add_process_set([0, 1, 2])
    if R < 3:
        expect(NotImplementedError,
               lambda: hvd.allreduce(tf.ones([2]), op=hvd.Adasum, process_set=three),
               "power-of-two", "has 3")
    pair = hvd.add_process_set([1, 3])
    if R in (1, 3):
        every = {r: normal(r, (5,), seed=60) for r in (1, 3)}
        got = hvd.allreduce(tf.constant(every[R]), op=hvd.Adasum, process_set=pair).numpy()
        np.testing.assert_allclose(got, adasum_reference([every[1], every[3]]), rtol=1e-5)
    hvd.barrier()
    assert hvd.remove_process_set(pair) and hvd.remove_process_set(three)


# ---- tf.compat.v1 optimizer ---------------------------------------------------

def _graph_sgd(distributed_kwargs, lr, batches, reference=False):
    """Trains y = xw in a TF1 graph; returns (w after each run, global steps)."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4])
        y = tf.compat.v1.placeholder(tf.float32, [None, 2])
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(normal(99, (4, 2))))
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_mean((tf.matmul(x, w) - y) ** 2)
        opt = tf.compat.v1.train.GradientDescentOptimizer(lr)
        if not reference:
            opt = hvd.DistributedOptimizer(opt, **distributed_kwargs)
        train = opt.minimize(loss, global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])
            history = []
            for bx, by in batches:
                sess.run(train, {x: bx, y: by})
                history.append(sess.run(w))
            return history, sess.run(step)


def check_tf1_optimizer_averages_gradients():
    w0, xs, ys, grads = _linear_problem()
    history, steps = _graph_sgd({}, 0.1, [(xs[R], ys[R])])
    np.testing.assert_allclose(history[0], w0 - 0.1 * np.mean(grads, 0), rtol=1e-5, atol=1e-6)
    assert steps == 1
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.1))
    assert isinstance(opt, tf.compat.v1.train.Optimizer)
    expect(ValueError, lambda: hvd.DistributedOptimizer(object()), "optimizer")


def _graph_adasum(make_opt, passes, steps):
    """Trains y = xw on rank R's rows in a TF1 graph with a DistributedOptimizer
    op=Adasum; returns w after each run."""
    w0, xs, ys, _ = _linear_problem(seed=70)
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(w0))
        loss = tf.reduce_mean((tf.matmul(tf.constant(xs[R]), w) - tf.constant(ys[R])) ** 2)
        opt = hvd.DistributedOptimizer(make_opt(), op=hvd.Adasum,
                                       backward_passes_per_step=passes)
        train = opt.minimize(loss)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            history = []
            for _ in range(steps):
                sess.run(train)
                history.append(sess.run(w))
    return w0, xs, ys, history


def check_tf1_adasum_optimizer_combines_weight_changes():
    # Horovod's semantics: each rank applies its own gradients with the
    # wrapped optimizer; Adasum combines the ranks' weight changes.
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-8
    w0, xs, ys, history = _graph_adasum(
        lambda: tf.compat.v1.train.AdamOptimizer(lr, b1, b2, eps), 1, 1)
    deltas = []
    for x, y in zip(xs, ys):
        g = 2 * x.T @ (x @ w0 - y) / y.size
        lr_t = lr * np.sqrt(1 - b2) / (1 - b1)
        deltas.append((-lr_t * ((1 - b1) * g) / (np.sqrt((1 - b2) * g * g) + eps))
                      .astype(np.float32))
    np.testing.assert_allclose(history[0], w0 + adasum_reference(deltas), rtol=1e-5, atol=1e-6)
    same_on_all_ranks([history[0]])
    # Two local SGD steps, then one exchange of their sum.
    lr = 0.05
    w0, xs, ys, history = _graph_adasum(
        lambda: tf.compat.v1.train.GradientDescentOptimizer(lr), 2, 2)
    deltas = []
    for x, y in zip(xs, ys):
        w = w0.copy()
        for _ in range(2):
            w = w - lr * (2 * x.T @ (x @ w - y) / y.size)
        deltas.append((w - w0).astype(np.float32))
    local_first = w0 - lr * (2 * xs[R].T @ (xs[R] @ w0 - ys[R]) / ys[R].size)
    np.testing.assert_allclose(history[0], local_first, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history[1], w0 + adasum_reference(deltas), rtol=1e-4, atol=1e-6)
    same_on_all_ranks([history[1]])


def _micro_batches(k, steps, b=3, seed=20):
    """Rank R's micro-batches and the big batches (k * N * b rows) they make up."""
    rng = np.random.default_rng(seed)
    total = steps * k * N * b
    x = rng.normal(size=(total, 4)).astype(np.float32)
    y = rng.normal(size=(total, 2)).astype(np.float32)
    mine, big = [], []
    for t in range(steps):
        base = t * k * N * b
        big.append((x[base:base + k * N * b], y[base:base + k * N * b]))
        for j in range(k):
            lo = base + (j * N + R) * b
            mine.append((x[lo:lo + b], y[lo:lo + b]))
    return mine, big


def check_tf1_backward_passes_equal_a_k_times_larger_batch():
    k, steps, lr = 3, 4, 0.2
    mine, big = _micro_batches(k, steps)
    # Summed (not averaged) accumulation with lr / k is the big-batch mean with lr.
    history, global_steps = _graph_sgd(
        {"backward_passes_per_step": k}, lr / k, mine)
    ref, _ = _graph_sgd({}, lr, big, reference=True)
    assert global_steps == k * steps, global_steps  # every call advances global_step
    for t in range(steps):
        np.testing.assert_allclose(history[k * t + k - 1], ref[t], atol=1e-5)
        if t:  # between applies the weights do not move
            np.testing.assert_array_equal(history[k * t], history[k * t - 1])
    averaged, _ = _graph_sgd({"backward_passes_per_step": k,
                              "average_aggregated_gradients": True}, lr, mine)
    np.testing.assert_allclose(averaged[-1], ref[-1], atol=1e-5)


# ---- MonitoredTrainingSession and Estimator with the hook --------------------

class _Recorder(tf.compat.v1.train.SessionRunHook):
    """Reads every trainable variable right after the session is created."""

    def __init__(self):
        self.values = self.final = None

    def after_create_session(self, session, coord):
        self.values = session.run(tf.compat.v1.trainable_variables())

    def end(self, session):
        self.final = session.run(tf.compat.v1.global_variables())


def _dense(x, units, name):
    """A TF1 dense layer from get_variable (tf.compat.v1.layers needs Keras 2)."""
    init = tf.compat.v1.random_normal_initializer(stddev=0.5)
    w = tf.compat.v1.get_variable(name + "/kernel", [x.shape[-1], units], initializer=init)
    b = tf.compat.v1.get_variable(name + "/bias", [units], initializer=init)
    return tf.matmul(x, w) + b


def _monitored_training(checkpoint_dir, steps=5):
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(R)  # every rank initialises differently
        x = tf.constant(normal(R, (8, 4), seed=30))
        y = tf.constant(normal(R, (8, 1), seed=31))
        hidden = tf.tanh(_dense(x, 5, "dense"))
        loss = tf.reduce_mean((_dense(hidden, 1, "dense_1") - y) ** 2)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.05, 0.9))
        train = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        recorder = _Recorder()
        hooks = [hvd.BroadcastGlobalVariablesHook(0), recorder,
                 tf.compat.v1.train.StopAtStepHook(last_step=steps)]
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoint_dir, hooks=hooks, save_checkpoint_secs=None,
                save_checkpoint_steps=1000 if checkpoint_dir else None, save_summaries_steps=None,
                save_summaries_secs=None, log_step_count_steps=None) as sess:
            while not sess.should_stop():
                sess.run(train)
        return recorder.values


def check_monitored_training_session_with_hook():
    start = _monitored_training(None)
    same_on_all_ranks(start)  # the hook broadcast rank 0's initial values
    # With rank 0 restoring a checkpoint, every rank starts from the restored values.
    with tempfile.TemporaryDirectory() as d:
        ckpt = d if R == 0 else None
        first = _monitored_training(ckpt, steps=3)   # rank 0 saves at the end
        second = _monitored_training(ckpt, steps=6)  # and restores here
        same_on_all_ranks(first)
        same_on_all_ranks(second)
        if R == 0:
            reader = tf.train.load_checkpoint(d)
            assert reader.get_tensor("global_step") == 6
    for a, b in zip(first, second):
        assert not np.allclose(a, b)  # the second run started from trained values


def check_monitored_training_session_final_weights_equal():
    with tf.Graph().as_default():
        x = tf.constant(normal(R, (8, 3), seed=40))
        w = tf.compat.v1.get_variable("w", initializer=tf.constant(normal(R, (3, 1), seed=41)))
        loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
        train = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.1)).minimize(
            loss, global_step=tf.compat.v1.train.get_or_create_global_step())
        recorder = _Recorder()
        hooks = [hvd.BroadcastGlobalVariablesHook(0), recorder,
                 tf.compat.v1.train.StopAtStepHook(last_step=4)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            while not sess.should_stop():
                sess.run(train)
    assert len(recorder.final) >= 4, recorder.final  # w, global_step, Adam slots
    same_on_all_ranks([np.asarray(v, np.float64) for v in recorder.final], tol=1e-6)


def check_estimator_with_hook():
    if not hasattr(tf, "estimator"):
        return  # tests/test_horovod.py skips this check: tf.estimator was removed in TF 2.16

    def model_fn(features, labels, mode):
        tf.compat.v1.set_random_seed(R)
        hidden = tf.tanh(_dense(features, 4, "dense"))
        pred = _dense(hidden, 1, "dense_1")
        loss = tf.reduce_mean((pred - labels) ** 2)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        train = opt.minimize(loss, global_step=tf.compat.v1.train.get_global_step())
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train)

    def input_fn():
        x, y = normal(R, (16, 3), seed=50), normal(R, (16, 1), seed=51)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()

    with tempfile.TemporaryDirectory() as d:
        est = tf.estimator.Estimator(model_fn, model_dir=os.path.join(d, f"rank{R}"))
        recorder = _Recorder()
        est.train(input_fn, hooks=[hvd.BroadcastGlobalVariablesHook(0), recorder], steps=5)
        same_on_all_ranks(recorder.values)
        names = sorted(n for n in est.get_variable_names() if "dense" in n)
        assert names, est.get_variable_names()
        same_on_all_ranks([est.get_variable_value(n) for n in names], tol=1e-6)
        assert est.get_variable_value("global_step") == 5
