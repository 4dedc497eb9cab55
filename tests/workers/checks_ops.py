"""TensorFlow collective ops on every rank, against numpy references.

Run by tests/test_ops.py through harness.run_checks at 2 and 4 ranks. Every
rank can compute what every other rank contributed (data depends only on
rank and a seed), so each check builds the numpy answer locally.
"""

import os

import numpy as np
import tensorflow as tf

import perseus_tf as ptf

from rank_checks import assert_barrier_waits, data, expect

# The checks that run at 4 ranks too (tests/test_ops.py; every check runs at
# 2): what 2 ranks cannot show. Roots 2 and 3; blocks at non-zero offsets;
# zero splits to other ranks; the offset clamp of uneven rows (and the TCP
# ring's reduce-scatter); a barrier that waits for only some ranks; process
# sets of 2 among 4 with non-members; set positions that are not world ranks;
# three ranks joining one after another; fp16 through a multi-step ring;
# two threads' calls of one name failing on every rank, not only two.
AT_4_RANKS = ("check_unnamed_eager_calls_from_two_threads_fail_on_every_rank",
              "check_broadcast_from_every_root", "check_allgather_different_first_dims",
              "check_alltoall_with_and_without_splits", "check_reducescatter_uneven_rows",
              "check_reducescatter_float16_compression",
              "check_shard_reducescatter_reads_pieces_at_their_offsets",
              "check_barrier", "check_process_sets", "check_process_set_errors",
              "check_join_uneven_steps", "check_fp16_compression_against_numpy_model")

# Shared memory at 3 ranks (tests/test_ops.py): its reduce-scatter and
# allgather with blocks and parts of three sizes, and process sets beside them.
AT_3_RANKS_SHM = ("check_allgather_different_first_dims", "check_reducescatter_uneven_rows",
                  "check_reducescatter_float16_compression",
                  "check_shard_reducescatter_reads_pieces_at_their_offsets",
                  "check_process_sets")

R = N = None
NUMERIC = [np.float16, tf.bfloat16.as_numpy_dtype, np.float32, np.float64, np.int32, np.int64,
           np.uint8, np.int8]


def setup():
    global R, N
    ptf.init()
    R, N = ptf.rank(), ptf.size()
    return R


def all_data(shape, dtype, seed=0, **kw):
    return [data(r, shape, dtype, seed, **kw) for r in range(N)]


def as_f64(x):
    return np.asarray(x).astype(np.float64)


def check_allreduce_every_dtype_and_op():
    for i, dt in enumerate(NUMERIC):
        xs = all_data((3, 5), dt, seed=i)
        stacked = np.stack([as_f64(x) for x in xs])
        refs = {ptf.Sum: stacked.sum(0), ptf.Min: stacked.min(0), ptf.Max: stacked.max(0),
                ptf.Product: stacked.prod(0)}
        if np.issubdtype(np.dtype(dt), np.integer):
            refs[ptf.Average] = np.trunc(stacked.sum(0) / N)
        else:
            refs[ptf.Average] = stacked.sum(0) / N
        for op, ref in refs.items():
            got = ptf.allreduce(tf.constant(xs[R]), op=op)
            assert got.dtype == tf.as_dtype(dt), (dt, got.dtype)
            np.testing.assert_allclose(as_f64(got.numpy()), ref, rtol=1e-2 if dt in (
                np.float16, tf.bfloat16.as_numpy_dtype) else 1e-6, err_msg=f"{dt} op {op}")


def check_allreduce_bool_min_max():
    xs = [np.array([True, r % 2 == 0, False, r == 0]) for r in range(N)]
    got_max = ptf.allreduce(tf.constant(xs[R]), op=ptf.Max).numpy()
    got_min = ptf.allreduce(tf.constant(xs[R]), op=ptf.Min).numpy()
    np.testing.assert_array_equal(got_max, np.logical_or.reduce(xs))
    np.testing.assert_array_equal(got_min, np.logical_and.reduce(xs))


def check_allreduce_random_float_and_scales():
    xs = [np.random.default_rng(r).normal(size=(257, 3)).astype(np.float32) for r in range(N)]
    got = ptf.allreduce(tf.constant(xs[R]), op=ptf.Sum, prescale_factor=0.5,
                        postscale_factor=3.0).numpy()
    np.testing.assert_allclose(got, sum(0.5 * x for x in xs) * 3.0, rtol=1e-5, atol=1e-5)
    got = ptf.allreduce(tf.constant(xs[R].astype(np.float64)), op=ptf.Average).numpy()
    np.testing.assert_allclose(got, np.mean(np.stack(xs).astype(np.float64), 0), rtol=1e-12)
    scalar = ptf.allreduce(tf.constant(float(R)), op=ptf.Sum).numpy()
    assert scalar == sum(range(N)), scalar


def check_grouped_allreduce_fused_or_not():
    before = ptf.stats()["fused_responses"]
    shapes = [(i + 1, 3) for i in range(30)]
    xs = [[data(r, s, np.float32, seed=i) for i, s in enumerate(shapes)] for r in range(N)]
    got = ptf.grouped_allreduce([tf.constant(x) for x in xs[R]], op=ptf.Average)
    for i, g in enumerate(got):
        np.testing.assert_allclose(g.numpy(), sum(x[i] for x in xs) / N, rtol=1e-6)
    fused = ptf.stats()["fused_responses"] - before
    if os.environ.get("PERSEUS_FUSION_THRESHOLD") == "0":
        assert fused == 0, f"fusion is off but {fused} responses were fused"
    else:
        assert fused >= 1, "30 small tensors in one group were not fused"


def check_grouped_allreduce_mixed_dtypes_reused_and_new_buffers():
    """One grouped call with several dtypes, an empty tensor and inputs the
    kernel can and cannot reuse (computed in the function vs captured), so
    outputs come both from forwarded inputs and from the shared allocation."""
    specs = [((3, 2), np.float32), ((5,), np.int32), ((0,), np.float64), ((7,), np.float16),
             ((2, 2, 2), np.int64), ((1,), np.float32)]
    xs = [all_data(shape, dt, seed=40 + i) for i, (shape, dt) in enumerate(specs)]
    captured = [tf.constant(x[R]) for x in xs]

    @tf.function
    def step():
        # Even positions computed here (the kernel may write in place), odd
        # ones captured (it must allocate).
        inputs = [t * tf.ones_like(t) if i % 2 == 0 else t for i, t in enumerate(captured)]
        return ptf.grouped_allreduce(inputs, op=ptf.Sum, name="mixed_group")

    for _ in range(2):
        got = step()
        for (shape, dt), x, g in zip(specs, xs, got):
            assert g.dtype.as_numpy_dtype == dt and tuple(g.shape) == shape, (g.dtype, g.shape)
            want = np.sum(np.stack([as_f64(v) for v in x]), axis=0)
            np.testing.assert_allclose(as_f64(g.numpy()), want, rtol=2e-3 if dt == np.float16 else 1e-6)
    # The captured inputs are untouched (the results went to new buffers).
    for x, t in zip(xs, captured):
        np.testing.assert_array_equal(t.numpy(), x[R])


def check_many_independent_ops_in_tf_function():
    shapes = [(i % 7 + 1,) for i in range(60)]

    @tf.function
    def step(xs):
        return [ptf.allreduce(x, op=ptf.Sum) for x in xs]

    xs = [[data(r, s, np.float32, seed=i) for i, s in enumerate(shapes)] for r in range(N)]
    for _ in range(2):
        got = step([tf.constant(x) for x in xs[R]])
        for i, g in enumerate(got):
            np.testing.assert_array_equal(g.numpy(), sum(x[i] for x in xs))


def check_broadcast_from_every_root():
    for root in range(N):
        for i, dt in enumerate(NUMERIC + [np.bool_]):
            xs = [data(r, (4, 2), dt, seed=i, low=0, high=2 if dt == np.bool_ else 9)
                  for r in range(N)]
            got = ptf.broadcast(tf.constant(xs[R]), root_rank=root).numpy()
            np.testing.assert_array_equal(got, xs[root], err_msg=f"root {root} {dt}")


def check_allgather_different_first_dims():
    for i, dt in enumerate(NUMERIC + [np.bool_]):
        # rank 0 contributes no rows at all: allowed, as in Horovod.
        xs = [data(r, (r, 3), dt, seed=i, low=0, high=2 if dt == np.bool_ else 9)
              for r in range(N)]
        got = ptf.allgather(tf.constant(xs[R])).numpy()
        np.testing.assert_array_equal(got, np.concatenate(xs), err_msg=str(dt))
    got = ptf.allgather(tf.constant([R, R * 10], tf.int64)).numpy()
    np.testing.assert_array_equal(got, np.array([[r, 10 * r] for r in range(N)]).ravel())


def check_alltoall_with_and_without_splits():
    splits = [[(r + d) % 3 for d in range(N)] for r in range(N)]
    xs = [np.arange(sum(splits[r]) * 2, dtype=np.float32).reshape(-1, 2) + 100 * r
          for r in range(N)]
    out, recv = ptf.alltoall(tf.constant(xs[R]), splits=splits[R])
    pieces = []
    for s in range(N):
        start = sum(splits[s][:R])
        pieces.append(xs[s][start:start + splits[s][R]])
    np.testing.assert_array_equal(out.numpy(), np.concatenate(pieces))
    np.testing.assert_array_equal(recv.numpy(), [splits[s][R] for s in range(N)])
    even = np.arange(2 * N, dtype=np.int64) + 10 * R
    out, recv = ptf.alltoall(tf.constant(even))
    np.testing.assert_array_equal(out.numpy(), [10 * s + 2 * R + k for s in range(N)
                                                for k in range(2)])


def check_reducescatter_uneven_rows():
    rows = 2 * N + 1
    xs = all_data((rows, 2), np.float32, seed=5)
    total = sum(xs)
    base, extra = divmod(rows, N)
    start = R * base + min(R, extra)
    mine = base + (1 if R < extra else 0)
    got = ptf.reducescatter(tf.constant(xs[R]), op=ptf.Sum).numpy()
    np.testing.assert_array_equal(got, total[start:start + mine])
    got = ptf.reducescatter(tf.constant(xs[R]), op=ptf.Average).numpy()
    np.testing.assert_allclose(got, total[start:start + mine] / N, rtol=1e-6)
    # Fewer rows than ranks (the last rank gets none), other dtypes and
    # trailing dimensions; at 4 ranks this runs the TCP ring (shm is off).
    for rows, dtype, trailing in ((N - 1, np.int32, (3,)), (3 * N + 2, np.float64, (2, 3))):
        xs = all_data((rows,) + trailing, dtype, seed=rows)
        total = sum(xs)
        base, extra = divmod(rows, N)
        start = R * base + min(R, extra)
        mine = base + (1 if R < extra else 0)
        got = ptf.reducescatter(tf.constant(xs[R]), op=ptf.Sum).numpy()
        assert got.shape == (mine,) + trailing, (got.shape, mine, trailing)
        np.testing.assert_array_equal(got, total[start:start + mine])
    # 68 MB: more than one 64 MiB chunk of scratch (collectives.cc), with
    # blocks that differ by a row, so the last chunk's spans differ too.
    rows, width = 261, 1 << 16
    pattern = (np.arange(rows * width, dtype=np.int32) % 1009).reshape(rows, width)
    base, extra = divmod(rows, N)
    start = R * base + min(R, extra)
    mine = base + (1 if R < extra else 0)
    got = ptf.reducescatter(tf.constant(pattern + R), op=ptf.Sum).numpy()
    np.testing.assert_array_equal(got, pattern[start:start + mine] * N + N * (N - 1) // 2)


def check_barrier():
    assert_barrier_waits(ptf.barrier)


def check_gradients():
    w = [float(r + 1) for r in range(N)]
    # allreduce(sum): d/dx_r of sum_s w_s * sum(allreduce(x)) = sum_s w_s
    x = tf.Variable(np.ones(3, np.float32) * (R + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ptf.allreduce(x, op=ptf.Sum)) * w[R]
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), [sum(w)] * 3)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ptf.allreduce(x, op=ptf.Average)) * w[R]
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), [sum(w) / N] * 3, rtol=1e-6)
    # Horovod's conventions. allgather: the ranks' gradients are averaged,
    # then sliced: loss_r = w_r * sum(gathered**2) -> 2 x_r mean_s w_s
    xg = tf.Variable(np.arange(R + 1, dtype=np.float32) + 1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ptf.allgather(xg) ** 2) * w[R]
    np.testing.assert_allclose(tape.gradient(loss, xg).numpy(), 2 * xg.numpy() * sum(w) / N,
                               rtol=1e-6)
    # broadcast: only the root's input matters; it gets the average
    root = N - 1
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ptf.broadcast(x, root_rank=root)) * w[R]
    expected = sum(w) / N if R == root else 0.0
    np.testing.assert_allclose(tape.gradient(loss, x).numpy(), [expected] * 3, rtol=1e-6)
    # reducescatter(sum) of an (N, 2) tensor: each rank keeps row R; the
    # gradient is allgather(grad) times the size
    xr = tf.Variable(np.ones((N, 2), np.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ptf.reducescatter(xr, op=ptf.Sum)) * w[R]
    np.testing.assert_allclose(tape.gradient(loss, xr).numpy(),
                               np.repeat(np.array(w, np.float32)[:, None], 2, 1) * N)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ptf.reducescatter(xr, op=ptf.Average)) * w[R]
    np.testing.assert_allclose(tape.gradient(loss, xr).numpy(),
                               np.repeat(np.array(w, np.float32)[:, None], 2, 1))
    # alltoall: the gradient goes back to where each row came from
    xa = tf.Variable(np.ones((N,), np.float32))
    with tf.GradientTape() as tape:
        out, _ = ptf.alltoall(xa)
        loss = tf.reduce_sum(out) * w[R]
    np.testing.assert_allclose(tape.gradient(loss, xa).numpy(), w)


def check_graph_mode_session():
    with tf.Graph().as_default():
        a = ptf.allreduce(tf.constant([1.0, 2.0]) * (R + 1), op=ptf.Sum)
        g = ptf.allgather(tf.fill([R + 1], R))
        b = ptf.broadcast(tf.constant([R]), root_rank=0)
        with tf.compat.v1.Session() as sess:
            av, gv, bv = sess.run([a, g, b])
    tri = N * (N + 1) / 2
    np.testing.assert_allclose(av, [tri, 2 * tri])
    np.testing.assert_array_equal(gv, np.concatenate([[r] * (r + 1) for r in range(N)]))
    np.testing.assert_array_equal(bv, [0])


def check_mismatched_shape_dtype_root_op_raise():
    expect(tf.errors.FailedPreconditionError,
           lambda: ptf.allreduce(tf.ones([2 + R]), name="mm.shape"),
           "mm.shape", "shape", "rank 0 has [2]", "rank 1 has [3]")
    dt = tf.float32 if R == 0 else tf.float64
    expect(tf.errors.FailedPreconditionError,
           lambda: ptf.allreduce(tf.ones([2], dt), name="mm.dtype"),
           "mm.dtype", "dtype", "rank 0 has float32", "float64")
    expect(tf.errors.FailedPreconditionError,
           lambda: ptf.broadcast(tf.ones([2]), root_rank=min(R, 1), name="mm.root"),
           "mm.root", "root rank", "rank 0 has root 0")
    op = ptf.allgather if R == 0 else ptf.allreduce
    expect(tf.errors.FailedPreconditionError, lambda: op(tf.ones([2]), name="mm.op"),
           "mm.op", "operation", "rank 0 has allgather")
    # After mismatches the runtime still works.
    np.testing.assert_array_equal(ptf.allreduce(tf.ones([2])).numpy(), [N, N])


def check_invalid_arguments_raise_locally():
    expect(tf.errors.InvalidArgumentError,
           lambda: ptf.allreduce(tf.constant([True]), op=ptf.Sum), "bool")
    expect(tf.errors.InvalidArgumentError,
           lambda: ptf.broadcast(tf.ones([1]), root_rank=N), "root_rank", f"0 to {N - 1}")
    expect(tf.errors.InvalidArgumentError,
           lambda: ptf.alltoall(tf.ones([N + 1])), "divisible")
    expect(tf.errors.InvalidArgumentError,
           lambda: ptf.alltoall(tf.ones([3]), splits=[1] * N + [1]), "one per rank")
    expect(tf.errors.InvalidArgumentError, lambda: ptf.allgather(tf.constant(1.0)), "scalar")
    expect(NotImplementedError, lambda: ptf.reducescatter(tf.ones([N]), op=ptf.Adasum),
           "allreduce and grouped_allreduce only")
    # A dtype the kernels do not take: named, not TF's dump of the NodeDef.
    for fn in (ptf.allreduce, ptf.allgather, ptf.broadcast, ptf.reducescatter):
        expect(TypeError, lambda: fn(tf.constant([1 + 2j] * N, tf.complex64), name="cx"),
               "tensor 'cx'", "complex64 is not supported", "float32", "real and imaginary")
    expect(TypeError, lambda: ptf.grouped_allreduce([tf.ones([1]), tf.constant(["a"])]),
           "grouped_allreduce", "string is not supported")
    # Adasum of identical tensors is that tensor (not their sum).
    np.testing.assert_allclose(ptf.allreduce(tf.constant([1.0, 2.0]), op=ptf.Adasum).numpy(),
                               [1.0, 2.0], rtol=1e-6)


def check_unnamed_eager_calls_from_two_threads_fail_on_every_rank():
    # Unnamed eager calls share one name (the op's). Two threads making them
    # at once could pair rank 0's thread A with rank 1's thread B: each
    # thread adds its own value (1 or 1000, times rank + 1), so a pairing
    # across threads gives a sum no thread expects. In a round where no call
    # failed, every call sums its own thread's values; a round that failed
    # anywhere failed on every rank, each failure with the message; and at
    # least one round meets the two calls in flight together (a round's
    # outcome is compared after an allgather of who failed, named: not
    # paired). The window docs/design.md names: a rank whose two calls did
    # not overlap may have completed the first with the other thread's call
    # of a rank where they did; its other call then fails, so the process
    # hears of it, and the sum is still one of those calls' sums.
    import itertools
    import threading
    conflicts = 0
    for _ in range(5):
        start = threading.Barrier(2)
        results = [None, None]

        def call(t):
            value = (1.0 if t == 0 else 1000.0) * (R + 1)
            start.wait()
            try:
                results[t] = ptf.allreduce(tf.fill([64], value), op=ptf.Sum).numpy()
            except tf.errors.OpError as e:
                results[t] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=call, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
            assert not thread.is_alive(), "an allreduce from a thread did not return"
        failed = [isinstance(r, str) for r in results]
        for t, r in enumerate(results):
            if not failed[t]:
                expected = (1.0 if t == 0 else 1000.0) * N * (N + 1) / 2
                if not any(failed):
                    np.testing.assert_array_equal(r, np.full(64, expected),
                                                  err_msg=f"thread {t}")
                    continue
                # The window: this thread's own value plus either thread's
                # value of every other rank.
                own = (1.0 if t == 0 else 1000.0) * (R + 1)
                others = [[(q + 1) * 1.0, (q + 1) * 1000.0] for q in range(N) if q != R]
                sums = {own + sum(c) for c in itertools.product(*others)}
                assert len(set(r.tolist())) == 1 and r[0] in sums, (t, r[:4], sums)
            else:
                assert r.startswith("InvalidArgumentError"), r
                assert "two calls of this name were in flight at once" in r, r
                assert "name=" in r, r
        everyone = ptf.allgather(tf.constant([int(any(failed))]), name="unnamed.failed").numpy()
        # A round that failed anywhere failed everywhere.
        assert len(set(everyone.tolist())) == 1, (everyone, results)
        conflicts += int(everyone[0])
    # The threads start together: the calls overlap in (nearly) every round.
    assert conflicts >= 1, "no round had the two calls in flight together"


def check_process_sets():
    """Collectives inside sub-groups: evens, and {0, 1}; non-members refused."""
    evens = list(range(0, N, 2))
    pair = [0, 1]
    even_id = ptf.add_process_set(evens)
    pair_id = ptf.add_process_set([1, 0])  # order does not matter
    assert ptf.process_set_ranks(even_id) == tuple(evens)
    assert ptf.process_set_ranks(pair_id) == (0, 1)
    for set_id, members in ((even_id, evens), (pair_id, pair)):
        xs = {r: data(r, (4, 3), np.float32, seed=7) for r in members}
        if R in members:
            pos = members.index(R)
            got = ptf.allreduce(tf.constant(xs[R]), op=ptf.Average, process_set_id=set_id)
            np.testing.assert_allclose(got.numpy(), np.mean([xs[r] for r in members], 0),
                                       rtol=1e-6)
            grouped = ptf.grouped_allreduce([tf.constant(xs[R]), tf.constant([float(R)])],
                                            op=ptf.Sum, process_set_id=set_id)
            np.testing.assert_allclose(grouped[1].numpy(), [float(sum(members))])
            root = len(members) - 1  # a position in the set
            b = ptf.broadcast(tf.constant([float(R)]), root_rank=root, process_set_id=set_id)
            np.testing.assert_array_equal(b.numpy(), [float(members[root])])
            g = ptf.allgather(tf.fill([pos + 1], float(R)), process_set_id=set_id)
            np.testing.assert_array_equal(
                g.numpy(), np.concatenate([[float(r)] * (i + 1) for i, r in enumerate(members)]))
            ptf.barrier(process_set_id=set_id)
            # A gradient through a set-local allgather slices this rank's rows.
            v = tf.Variable(tf.ones([pos + 1]))
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(ptf.allgather(v, process_set_id=set_id) * 2.0)
            np.testing.assert_allclose(tape.gradient(loss, v).numpy(),
                                       np.full([pos + 1], 2.0))
        else:
            expect(tf.errors.InvalidArgumentError,
                   lambda: ptf.allreduce(tf.ones([1]), process_set_id=set_id),
                   "not a member of process set")
    # The world keeps working alongside the sets.
    np.testing.assert_array_equal(ptf.allreduce(tf.ones([2])).numpy(), [N, N])
    ptf.remove_process_set(even_id)
    ptf.remove_process_set(pair_id)
    expect(tf.errors.InvalidArgumentError,
           lambda: ptf.allreduce(tf.ones([1]), process_set_id=pair_id), "not a member")


def check_process_set_errors():
    expect(ValueError, lambda: ptf.add_process_set([0, N]), f"from 0 to {N - 1}")
    expect(ValueError, lambda: ptf.add_process_set([]), "non-empty")
    # Ranks that describe different sets all fail, naming what each gave.
    expect(ValueError, lambda: ptf.add_process_set([0] if R == 0 else [0, R]), "disagree",
           "rank 0 gave [0]")
    expect(ValueError, lambda: ptf.remove_process_set(999), "does not exist")
    # A mismatch inside a set names world ranks.
    set_id = ptf.add_process_set([0, N - 1])
    if R in (0, N - 1):
        expect(tf.errors.FailedPreconditionError,
               lambda: ptf.allreduce(tf.ones([1 + (R > 0)]), name="ps.mm", process_set_id=set_id),
               "ps.mm", "rank 0 has [1]", f"rank {N - 1} has [2]")
    ptf.remove_process_set(set_id)


def check_join_uneven_steps():
    """Rank r runs r + 1 steps; joined ranks count as zeros, rows as none."""
    for k in range(R + 1):
        got = ptf.allreduce(tf.constant([float(k + 1)]) * (R + 1), op=ptf.Sum, name=f"join.{k}")
        expected = (k + 1) * sum(r + 1 for r in range(k, N))
        np.testing.assert_allclose(got.numpy(), [expected], err_msg=f"step {k}")
        gathered = ptf.allgather(tf.constant([R]), name=f"join.gather.{k}")
        np.testing.assert_array_equal(gathered.numpy(), list(range(k, N)))
        avg = ptf.allreduce(tf.constant([2.0]), op=ptf.Average, name=f"join.avg.{k}")
        np.testing.assert_allclose(avg.numpy(), [2.0 * (N - k) / N])
    last = int(ptf.join().numpy())
    assert last == N - 1, last
    # join() again right away: every rank gets the same answer.
    again = int(ptf.join().numpy())
    agreed = ptf.allgather(tf.constant([again])).numpy()
    assert len(set(agreed.tolist())) == 1, agreed
    # Broadcast from a joined root fails clearly for the ranks still working.
    if R == 0:
        ptf.join()
    else:
        expect(tf.errors.FailedPreconditionError,
               lambda: ptf.broadcast(tf.ones([1]), root_rank=0, name="join.bcast"),
               "root rank 0 has joined")
        ptf.join()
    np.testing.assert_array_equal(ptf.allreduce(tf.ones([2])).numpy(), [N, N])


def _fp16_model(xs, scale, post):
    """What the runtime computes for a compressed float32 sum (2 ranks: exact)."""
    s32 = np.float32(scale)
    halves = [(x.astype(np.float32) * s32).astype(np.float16) for x in xs]
    total = halves[0]
    for h in halves[1:]:
        total = (total.astype(np.float32) + h.astype(np.float32)).astype(np.float16)
    return total.astype(np.float32) * np.float32(post / scale)


def check_fp16_compression_against_numpy_model():
    from perseus_tf import _native

    scale = _native.config().gradient_scale
    xs = [np.random.default_rng(50 + r).normal(0, 1e-3, size=(257,)).astype(np.float32)
          for r in range(N)]
    exact = np.sum([x.astype(np.float64) for x in xs], 0)
    for op, post in ((ptf.Sum, 1.0), (ptf.Average, 1.0 / N)):
        got = ptf.allreduce(tf.constant(xs[R]), op=op, compression="fp16").numpy()
        grouped = ptf.grouped_allreduce([tf.constant(xs[R]), tf.constant(xs[R][:5])], op=op,
                                        compression="fp16")
        model = _fp16_model(xs, scale, post)
        if N == 2:  # one addition per element: the model is exact
            np.testing.assert_array_equal(got, model)
            np.testing.assert_array_equal(grouped[0].numpy(), model)
            np.testing.assert_array_equal(grouped[1].numpy(), model[:5])
        else:  # the ring adds in another order: within float16 rounding of the model
            np.testing.assert_allclose(got, model, rtol=0, atol=N * 2e-6)
            np.testing.assert_allclose(grouped[1].numpy(), model[:5], rtol=0, atol=N * 2e-6)
        np.testing.assert_allclose(got, exact * post, rtol=0, atol=N * 2e-6)
        # It really travelled as float16: not the float32 result.
        plain = ptf.allreduce(tf.constant(xs[R]), op=op).numpy()
        assert not np.array_equal(got, plain)
    # Other dtypes and reductions ignore compression and stay exact.
    ints = ptf.allreduce(tf.constant([R + 1, 1000003]), compression="fp16").numpy()
    np.testing.assert_array_equal(ints, [N * (N + 1) // 2, 1000003 * N])
    mx = ptf.allreduce(tf.constant([1e-3 * (R + 1)]), op=ptf.Max, compression="fp16").numpy()
    np.testing.assert_array_equal(mx, np.float32([1e-3 * N]))
    expect(ValueError, lambda: ptf.allreduce(tf.ones([1]), compression="int8"), "'fp16'")
    # Ranks must agree on compression like on anything else.
    expect(tf.errors.FailedPreconditionError,
           lambda: ptf.allreduce(tf.ones([2]), name="mm.comp",
                                 compression="fp16" if R == 0 else "none"),
           "mm.comp", "compression", "rank 0 has float16")


def _grouped_step_with_a_nan_fails_and_the_next_steps_run():
    """A NaN in one tensor of a grouped call fails that step on every rank;
    a loop that catches it and goes on runs its next steps (eagerly, in a
    tf.function, and through the Horovod shim's DistributedGradientTape).
    Once, the call's other tensors were given up on every rank while
    negotiation ran them, and every later collective failed."""
    import perseus_tf.horovod as hvd

    w = [tf.Variable(np.full(n, 1.0, np.float32)) for n in (4, 300, 1)]

    def grouped(bad):  # bad: the index of the tensor that holds a NaN on the last rank
        xs = [np.full(n, R + 1.0, np.float32) for n in (4, 300, 1)]
        if bad >= 0 and R == N - 1:
            xs[bad][-1] = np.nan
        return ptf.grouped_allreduce([tf.constant(x) for x in xs], name="nan.group")

    def tape(bad):
        with tf.GradientTape() as t:
            losses = [tf.reduce_sum(v) * (np.nan if i == bad and R == N - 1 else R + 1.0)
                      for i, v in enumerate(w)]
            loss = tf.add_n(losses)
        return hvd.DistributedGradientTape(t, op=hvd.Sum).gradient(loss, w)

    traced = tf.function(grouped)
    for what, step in (("eager", grouped), ("tf.function", traced), ("tape", tape)):
        for bad in (-1, 0, -1, 1, -1, 2, -1):
            if bad >= 0:
                expect(tf.errors.InvalidArgumentError, lambda: step(bad),
                       f"rank {N - 1} has NaN or Inf", "not applied on any rank")
                continue
            got = [g.numpy() for g in step(-1)]
            want = N * (N + 1) / 2
            for g in got:
                np.testing.assert_array_equal(g, np.full(g.shape, want, np.float32),
                                              err_msg=what)


def check_nancheck_names_tensor_and_rank():
    from perseus_tf import _native

    x = np.ones(4, np.float32)
    if R == N - 1:
        x[2] = np.nan
    if _native.config().nancheck:
        for op in (ptf.allreduce, lambda t, name: ptf.grouped_allreduce([t], name=name)[0]):
            expect(tf.errors.InvalidArgumentError, lambda: op(tf.constant(x), name="nan.grad"),
                   "nan.grad", f"rank {N - 1} has NaN or Inf", "PERSEUS_ALLREDUCE_NANCHECK")
        inf = np.float16([1, np.inf]) if R == 0 else np.float16([1, 1])
        expect(tf.errors.InvalidArgumentError,
               lambda: ptf.allreduce(tf.constant(inf), name="inf.grad"), "rank 0 has NaN or Inf")
        _grouped_step_with_a_nan_fails_and_the_next_steps_run()
    else:  # off: NaN passes through like any value
        got = ptf.allreduce(tf.constant(x), name="nan.grad").numpy()
        assert np.isnan(got[2]) and got[0] == N, got
    np.testing.assert_array_equal(ptf.allreduce(tf.ones([2])).numpy(), [N, N])


def check_reducescatter_float16_compression():
    """compression="fp16": float32 travels as float16 of x * the gradient
    scale, summed in float16, divided by the scale after (the sharded
    optimizer's gradients); other dtypes and "none" stay exact."""
    from perseus_tf import _native
    scale = float(_native.config().gradient_scale)
    rows = 4 * N + 1
    xs = [(np.linspace(0.1, 0.2, rows * 3, dtype=np.float32) + np.float32(1e-4) * r)
          .reshape(rows, 3) for r in range(N)]
    base, extra = divmod(rows, N)
    start = R * base + min(R, extra)
    mine = base + (1 if R < extra else 0)
    half = [(x * np.float32(scale)).astype(np.float16) for x in xs]
    model = half[0]
    for h in half[1:]:
        model = (model + h).astype(np.float16)
    model = model.astype(np.float32) / np.float32(scale)
    exact = sum(x.astype(np.float64) for x in xs)
    got = ptf.reducescatter(tf.constant(xs[R]), op=ptf.Sum, compression="fp16").numpy()
    # Within float16's rounding of the model; at 2 ranks the same bits.
    np.testing.assert_allclose(got, model[start:start + mine], rtol=2e-3 if N > 2 else 1e-6)
    assert np.abs(got - exact[start:start + mine]).max() > 1e-6, "float32 on the wire"
    got = ptf.reducescatter(tf.constant(xs[R]), op=ptf.Sum, compression="none").numpy()
    np.testing.assert_allclose(got, exact[start:start + mine], rtol=1e-6)
    ints = np.full((rows, 2), R + 1, np.int32)
    got = ptf.reducescatter(tf.constant(ints), op=ptf.Sum, compression="fp16").numpy()
    np.testing.assert_array_equal(got, np.full((mine, 2), N * (N + 1) // 2))
    expect(Exception, lambda: ptf.reducescatter(tf.constant(xs[R]),
                                                compression=_native.COMPRESS_TOPK),
           "compression")


def check_shard_reducescatter_reads_pieces_at_their_offsets():
    """ops.shard_reducescatter (a sharded optimizer's gradients): tensors of
    several shapes at increasing offsets, gaps of zeros, one rank's span
    ending inside a tensor; float32 exact and as float16, int64."""
    from perseus_tf import ops as perseus_ops
    segment = 11
    total = N * segment
    shapes = [(2, 3), (4,), (1,), (3, 2, 1)]
    offsets = [0, 7, 12, 14]        # gaps at 6, 11 and 13; the last tensor spans ranks
    whole = np.zeros(total, np.float64)
    pieces = []
    for i, (shape, at) in enumerate(zip(shapes, offsets)):
        n = int(np.prod(shape))
        values = np.arange(n, dtype=np.float64).reshape(shape) + 10 * i
        pieces.append(values)
        whole[at:at + n] = values.reshape(-1)
    for dtype in (np.float32, np.int64):
        tensors = [tf.constant((p * (R + 1)).astype(dtype)) for p in pieces]
        got = perseus_ops.shard_reducescatter(tensors, offsets, total, op=ptf.Sum).numpy()
        want = (whole * N * (N + 1) / 2)[R * segment:(R + 1) * segment]
        np.testing.assert_array_equal(got, want.astype(dtype))
    tensors = [tf.constant((p * 1e-2 * (R + 1)).astype(np.float32)) for p in pieces]
    got = perseus_ops.shard_reducescatter(tensors, offsets, total, op=ptf.Average,
                                  compression="fp16").numpy()
    want = (whole * 1e-2 * (N + 1) / 2)[R * segment:(R + 1) * segment]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-4)
    expect(Exception, lambda: perseus_ops.shard_reducescatter(
        [tf.constant(p.astype(np.float32)) for p in pieces], [0, 5, 12, 14], total),
        "overlaps")
    # owned=: the sums of the tensors inside this rank's part, shaped as they
    # are (rank 0 holds tensors 0 and 1, rank 1 tensors 2 and 3, the rest none),
    # also through a tf.function where TF may hand their buffers over.
    owned = {0: [0, 1], 1: [2, 3]}.get(R, [])
    for compression, tol in (("none", 0), ("fp16", 2e-3)):
        @tf.function
        def sums(scale):
            tensors = [tf.constant(p.astype(np.float32)) * scale for p in pieces]
            return perseus_ops.shard_reducescatter(tensors, offsets, total, op=ptf.Sum,
                                                   compression=compression, owned=owned)
        got = sums(tf.constant(1e-2 * (R + 1), tf.float32))
        assert len(got) == len(owned)
        for g, i in zip(got, owned):
            assert tuple(g.shape) == pieces[i].shape, (g.shape, pieces[i].shape)
            np.testing.assert_allclose(g.numpy(), pieces[i] * 1e-2 * N * (N + 1) / 2,
                                       rtol=tol or 1e-6, atol=1e-4 if tol else 0)
