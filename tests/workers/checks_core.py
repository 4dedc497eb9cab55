"""The runtime through the pybind11 module (no TensorFlow), at 2 and 4 ranks.

This is the path the GPU machines use too. It lets a test choose the exact
order in which each rank enqueues its requests.
"""

import os

import numpy as np

from perseus_tf import _native, _testing
from perseus_tf._native import (
    COMPRESS_FP16, DTYPE_CODES, OP_ALLGATHER, OP_ALLREDUCE, OP_ALLTOALL, OP_BROADCAST,
    OP_REDUCESCATTER, _core)

from rank_checks import expect, start_native

R = N = None


def setup():
    global R, N
    R, N = start_native()
    return R


def allreduce_async(x, name, reduce_op=0):
    return _core.submit(OP_ALLREDUCE, x, name, DTYPE_CODES[x.dtype.name], reduce_op=reduce_op,
                        output=np.empty_like(x))


def check_many_tensors_enqueued_in_different_orders():
    names = [f"order.{i}" for i in range(200)]
    order = list(range(200))
    np.random.default_rng(R).shuffle(order)  # a different order on every rank
    handles = {}
    for i in order:
        handles[i] = allreduce_async(np.full(i % 13 + 1, R + i, np.float32), names[i])
    for i in range(200):
        got = handles[i].wait()[0]
        np.testing.assert_array_equal(got, np.full(i % 13 + 1, sum(r + i for r in range(N))))


def check_fusion_counters():
    before = _native.stats()
    handles = [allreduce_async(np.ones(100, np.float32), f"fuse.{i}") for i in range(40)]
    for h in handles:
        np.testing.assert_array_equal(h.wait()[0], np.full(100, N))
    after = _native.stats()
    fused = after["fused_responses"] - before["fused_responses"]
    responses = after["responses"] - before["responses"]
    if os.environ.get("PERSEUS_FUSION_THRESHOLD") == "0":
        assert fused == 0 and responses == 40, (fused, responses)
    else:
        assert fused >= 1 and responses < 40, (fused, responses)
    assert after["control_bytes_sent"] > before["control_bytes_sent"]
    assert sum(s["bytes"] for s in after["streams"]) > sum(s["bytes"] for s in before["streams"])
    # Online requests wait at least for a negotiation cycle before they run.
    waited = sum(s["wait_seconds"] for s in after["streams"]) - sum(
        s["wait_seconds"] for s in before["streams"])
    assert waited > 0, waited


def check_runtime_threads_are_named():
    # top -H, perf and the benchmarks' --threads tell the runtime's CPU time
    # from the program's by these names.
    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        except OSError:  # a short-lived thread (the connecting one) ended meanwhile
            continue
    streams = _native.stats()["streams"]
    want = {"perseus-control"} | {f"perseus-exec{s}" for s in range(len(streams))}
    assert want <= names, (sorted(want - names), sorted(names))


def check_large_tensor_and_fp16_reduce():
    x = np.random.default_rng(R).normal(size=3_000_001).astype(np.float32)
    ref = sum(np.random.default_rng(r).normal(size=3_000_001).astype(np.float32)
              for r in range(N))
    np.testing.assert_allclose(allreduce_async(x, "big").wait()[0], ref, rtol=1e-5, atol=1e-5)
    h = np.random.default_rng(R + 7).normal(size=1001).astype(np.float16)
    ref16 = sum(np.random.default_rng(r + 7).normal(size=1001).astype(np.float16).astype(
        np.float32) for r in range(N))
    np.testing.assert_allclose(allreduce_async(h, "half").wait()[0].astype(np.float32), ref16,
                               rtol=2e-2, atol=2e-2)


def check_shared_memory_allreduce_when_one_host():
    # One host: allreduce runs through shared memory unless turned off, and
    # every portion is summed by one rank in rank order, so the result is the
    # float32 sum taken in rank order, bit for bit, on every rank.
    shm = os.environ.get("PERSEUS_SHM_ALLREDUCE") != "0"
    assert _native.stats()["shm"] is shm, _native.stats()["shm"]
    slot = (4 << 20) // N // 4  # float32 elements per rank slot (one chunk)
    for i, n in enumerate([1, 3, 17, N * 16 + 5, 1000, 2 * slot + 13]):
        parts = [np.random.default_rng(100 * r + i).normal(size=n).astype(np.float32)
                 for r in range(N)]
        got = allreduce_async(parts[R].copy(), f"shm.f32.{i}").wait()[0]
        ordered = parts[0].copy()
        for p in parts[1:]:
            ordered = ordered + p
        if shm:
            np.testing.assert_array_equal(got, ordered)
        else:
            np.testing.assert_allclose(got, ordered, rtol=1e-5, atol=1e-6)
        bits = got.view(np.int32).copy()
        lo = allreduce_async(bits.copy(), f"shm.bits.min.{i}", reduce_op=2).wait()[0]
        hi = allreduce_async(bits.copy(), f"shm.bits.max.{i}", reduce_op=3).wait()[0]
        np.testing.assert_array_equal(lo, bits)  # identical on every rank
        np.testing.assert_array_equal(hi, bits)
    ints = np.arange(slot + 7, dtype=np.int64) * (R + 1)
    np.testing.assert_array_equal(allreduce_async(ints, "shm.i64").wait()[0],
                                  np.arange(slot + 7, dtype=np.int64) * (N * (N + 1) // 2))
    small = np.array([R, -R, 5], np.int32)
    np.testing.assert_array_equal(allreduce_async(small, "shm.min", reduce_op=2).wait()[0],
                                  [0, -(N - 1), 5])
    np.testing.assert_array_equal(allreduce_async(small, "shm.max", reduce_op=3).wait()[0],
                                  [N - 1, 0, 5])
    prod = np.full(33, 2.0, np.float64)
    np.testing.assert_array_equal(allreduce_async(prod, "shm.prod", reduce_op=4).wait()[0],
                                  np.full(33, 2.0 ** N))


def check_small_buckets_cross_hosts_by_recursive_doubling():
    """Across hosts (or with shared memory off), a bucket from 4 bytes a rank
    up to PERSEUS_ALLREDUCE_DOUBLING_BYTES reduces by recursive doubling,
    others by the ring (the timeline names each); either way the sums match
    numpy's and every rank holds the same bits (NaN under min included)."""
    import json
    import tempfile
    doubling = _native.stats()["allreduce_doubling_bytes"]  # the line in force
    flat = not _native.stats()["shm"] and N > 1
    path = os.path.join(tempfile.mkdtemp(), f"doubling.rank{R}.json")
    _core.start_timeline(path, False)
    for n, name in ((3, "tiny"), (1000, "small"), (300_000, "large")):
        parts = [np.random.default_rng(7 * r + n).normal(size=n) for r in range(N)]
        got = allreduce_async(parts[R].copy(), f"doubling.{name}").wait()[0]
        np.testing.assert_allclose(got, np.sum(parts, axis=0), rtol=1e-12, atol=1e-12)
        low = parts[R].astype(np.float32)
        low[0] = np.nan if R == N - 1 else low[0]
        lo = allreduce_async(low, f"doubling.min.{name}", reduce_op=2).wait()[0]
        every = _core.submit(OP_ALLGATHER, lo.view(np.int32).copy(), f"doubling.bits.{name}",
                             DTYPE_CODES["int32"]).wait()[0].reshape(N, -1)
        assert (every == every[0]).all(), f"{name}: the ranks' minima differ in their bits"
    _core.stop_timeline()
    with open(path) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    doubled = [e for e in spans if e["name"].startswith("gloo allreduce, doubling")]
    ringed = [e for e in spans if e["name"] == "gloo allreduce"]
    if flat and not _native.stats()["hierarchical"]:
        # In order: the float64 sum, then the float32 minimum, of 3, 1000 and
        # 300000 elements. Doubling from 4 bytes a rank up to the setting.
        sizes = [b for n in (3, 1000, 300_000) for b in (8 * n, 4 * n)]
        want = ["doubling" if 4 * N <= b <= doubling else "ring" for b in sizes]
        got = ["doubling" if "doubling" in e["name"] else "ring"
               for e in sorted(doubled + ringed, key=lambda e: e["ts"])]
        assert got == want, (want, [e["name"] for e in spans])
    elif doubling == 0:
        assert not doubled, [e["name"] for e in spans]


def _doubling_line(n, alpha, beta, gamma):
    """cost_model.h's line, written again: the largest bucket for which
    recursive doubling's alpha-beta-gamma time is below the ring's."""
    p = 1 << (n.bit_length() - 1)
    steps = p.bit_length() - 1 + (0 if p == n else 2)
    share = (n - 1) / n
    gain = (2 * (n - 1) - steps) * alpha
    loss = (steps - 2 * share) / beta + (steps - share) * gamma
    if gain <= 0:
        return 0
    return 16 << 20 if loss <= 0 else min(16 << 20, int(gain / loss))


def check_the_cost_model_draws_one_line_on_every_rank():
    """Unless PERSEUS_ALLREDUCE_DOUBLING_BYTES sets it, the line between
    doubling and the ring comes from latency, bandwidth and reduction speed
    measured at init (or PERSEUS_LINK_*), averaged so that every rank draws
    the same line: the same bits on every rank, and the line the model's
    formula gives for them. One host with shared memory never crosses hosts
    flat: nothing is measured."""
    st = _native.stats()
    keys = ("allreduce_doubling_bytes", "link_latency_us", "link_bandwidth_mbytes",
            "reduce_mbytes")
    mine = np.array([float(st[k]) for k in keys], np.float64)
    every = _core.submit(OP_ALLGATHER, mine.copy(), "cost.model", DTYPE_CODES["float64"]
                         ).wait()[0].reshape(N, -1)
    assert (every == every[0]).all(), f"the ranks drew different lines: {every}"
    cfg = _native.config()
    line, alpha_us, beta_mb, reduce_mb = mine
    if cfg.allreduce_doubling_bytes is not None:
        assert line == cfg.allreduce_doubling_bytes and alpha_us == 0, st
    elif st["shm"] and _native.topology()["cross_size"] == 1:
        assert line == 0 and alpha_us == 0 and beta_mb == 0, st
    else:
        assert alpha_us > 0 and beta_mb > 0 and reduce_mb > 0, st
        if cfg.link_latency_us is not None:
            assert np.isclose(alpha_us, cfg.link_latency_us, rtol=1e-9), alpha_us
        if cfg.link_bandwidth_mbytes is not None:
            assert np.isclose(beta_mb, cfg.link_bandwidth_mbytes, rtol=1e-9), beta_mb
        want = _doubling_line(N, alpha_us * 1e-6, beta_mb * 1e6, 1e-6 / reduce_mb)
        assert abs(line - want) <= max(1, 1e-6 * want), (line, want, st)


def check_raw_gloo_allreduce():
    x = np.full(1000, R + 1, np.float32)
    _testing.raw_allreduce(x, DTYPE_CODES["float32"])
    np.testing.assert_array_equal(x, np.full(1000, N * (N + 1) / 2))


def check_raw_allgather_by_bruck_equals_the_ring():
    """The negotiation cycle's allgather (Bruck's rounds) gives every rank's
    bytes in rank order, as Gloo's ring allgather does, at 1 to 600 bytes a
    rank."""
    for length in (1, 13, 512, 600):
        mine = bytes((R * 37 + i) % 251 for i in range(length))
        want = b"".join(bytes((r * 37 + i) % 251 for i in range(length)) for r in range(N))
        assert _testing.raw_allgather(mine, bruck=True) == want, length
        assert _testing.raw_allgather(mine, bruck=False) == want, length


def check_a_name_called_twice_in_flight_fails_on_every_rank():
    # Two calls of one name in flight at once, as two threads make them (or a
    # call made again before the first completed). Refusing only the second
    # call on each rank, as before, paired the first calls across ranks, and
    # with two threads those may be different threads' calls (a silently
    # wrong sum, cc/runtime/request_table_test.cc). Both calls fail on every
    # rank instead, and the name is free once they have.
    #
    # The window docs/design.md names: a rank's first call may complete
    # (every rank had submitted it) before its second is made. The second is
    # then a new call, and each of the two sums as a call of its own or fails
    # with another rank's refusal. Each round below waits a different short
    # time between the two calls on each rank, so that some rounds fall in
    # that window on some ranks and not on others; whatever happened, the
    # ranks' next call of the name pairs with every rank's next call (once
    # refusals arriving after other ranks' calls left the ranks out of step:
    # a stall naming the tensor).
    import random
    import time
    jitter = random.Random(1000 + R)
    refused = window = 0
    for round_ in range(24):
        first = allreduce_async(np.full(4, R + 1.0, np.float32), "twice")
        time.sleep(jitter.choice([0.0, 0.0005, 0.002, 0.005]))
        try:
            second = allreduce_async(np.full(4, 100.0 * (R + 1), np.float32), "twice")
        except _core.InvalidArgumentError as e:
            refused += 1
            assert f"two calls of this name were in flight at once on rank {R}" in str(e), e
            expect(_core.InvalidArgumentError, lambda: first.wait(),
                   "'twice'", "two calls of this name were in flight at once on rank")
        else:
            window += 1
            for handle, scale in ((first, 1.0), (second, 100.0)):
                try:
                    np.testing.assert_array_equal(handle.wait()[0],
                                                  np.full(4, scale * N * (N + 1) / 2))
                except _core.InvalidArgumentError as e:
                    assert "two calls of this name were in flight at once on rank" in str(e), e
        got = allreduce_async(np.full(4, R + 1.0 + round_, np.float32), "twice").wait()[0]
        np.testing.assert_array_equal(got, np.full(4, N * (N + 1) / 2 + N * round_))
    # The rounds exercised the refusal on this rank at least once.
    assert refused, (refused, window)


def check_ranks_waiting_for_a_late_rank_use_little_cpu():
    # While the others wait for rank 0's call, every rank's negotiation
    # thread keeps cycling. At one cycle a millisecond that took about a
    # fifth of a core per rank (0.4 s of CPU in these 2 s); after a quiet
    # spell cycles slow to a tenth of the wait, at most 20 ms apart.
    import resource
    import time
    allreduce_async(np.ones(4, np.float32), "late.warm").wait()
    before = resource.getrusage(resource.RUSAGE_SELF)
    if R == 0:
        time.sleep(2.0)
    got = allreduce_async(np.full(4, R + 1.0, np.float32), "late").wait()[0]
    after = resource.getrusage(resource.RUSAGE_SELF)
    np.testing.assert_array_equal(got, np.full(4, N * (N + 1) / 2))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.25, f"rank {R} used {cpu:.2f} s of CPU while the ranks waited 2 s"


def check_group_naming_a_tensor_twice_is_rejected_and_leaves_nothing_pending():
    f32 = DTYPE_CODES["float32"]
    arrays = [np.full(3, R + 1.0, np.float32) for _ in range(3)]
    expect(_core.InvalidArgumentError,
           lambda: _core.submit_group(arrays, ["twice.a", "twice.b", "twice.a"], f32),
           "the call names this tensor twice")
    # Nothing of the refused call stayed pending: the same names run now.
    _core.submit_group(arrays[:2], ["twice.a", "twice.b"], f32).wait()
    for a in arrays[:2]:
        np.testing.assert_array_equal(a, np.full(3, N * (N + 1) / 2))


def check_allgather_and_broadcast_numpy():
    got = _core.submit(OP_ALLGATHER, np.full((R + 1, 2), R, np.int32), "ag", 4).wait()[0]
    np.testing.assert_array_equal(got, np.concatenate([np.full((r + 1, 2), r) for r in range(N)]))
    x = np.full(3, R, np.float64)
    got = _core.submit(OP_BROADCAST, x, "bc", 3, root=N - 1, output=np.empty_like(x)).wait()[0]
    np.testing.assert_array_equal(got, [N - 1] * 3)


def check_alltoall_reducescatter_fp16_and_in_place():
    """The collectives with no device path of their own (staged through the
    host on a device) and the fp16 compressor's device casts."""
    f32, f64 = DTYPE_CODES["float32"], DTYPE_CODES["float64"]
    # Uneven alltoall: rank r sends p + 1 rows to rank p.
    splits = [p + 1 for p in range(N)]
    x = np.concatenate([np.full((p + 1, 2), 10 * R + p, np.float32) for p in range(N)])
    got, received = _core.submit(OP_ALLTOALL, x, "a2a", f32, splits=splits).wait()
    assert list(received) == [R + 1] * N, received
    np.testing.assert_array_equal(
        got, np.concatenate([np.full((R + 1, 2), 10 * p + R, np.float32) for p in range(N)]))
    # Reduce-scatter of 2N + 1 rows: the lower ranks take the extra row.
    y = np.arange((2 * N + 1) * 3, dtype=np.float64).reshape(2 * N + 1, 3) * (R + 1)
    got = _core.submit(OP_REDUCESCATTER, y, "rs", f64).wait()[0]
    whole = np.arange((2 * N + 1) * 3, dtype=np.float64).reshape(2 * N + 1, 3) * (N * (N + 1) / 2)
    first = 2 * R + min(R, 1)
    np.testing.assert_array_equal(got, whole[first:first + 2 + (1 if R < 1 else 0)])
    # fp16 with the gradient scale, and an in-place sum (output is input).
    z = np.linspace(-1, 1, 3001, dtype=np.float32) * (R + 1)
    got = _core.submit(OP_ALLREDUCE, z, "fp16", f32, compression=COMPRESS_FP16,
                       output=np.empty_like(z)).wait()[0]
    np.testing.assert_allclose(got, np.linspace(-1, 1, 3001) * N * (N + 1) / 2, rtol=2e-3,
                               atol=2e-3)
    w = np.full(7, R + 1, np.int64)
    _core.submit(OP_ALLREDUCE, w, "inplace", DTYPE_CODES["int64"], output=w).wait()
    np.testing.assert_array_equal(w, np.full(7, N * (N + 1) // 2))


def check_the_simulated_device_carries_the_data_when_asked():
    """PERSEUS_TEST_DEVICE=sim puts every array on the simulated device: the
    device ran work then, and none otherwise (so the sim runs test it)."""
    before = _testing.sim_device_launches()
    x = np.full(5, R, np.float32)
    allreduce_async(x, "sim.used").wait()
    ran = _testing.sim_device_launches() - before
    if os.environ.get("PERSEUS_TEST_DEVICE") == "sim":
        assert ran >= 3, ran  # the producer's write, the runtime's copies
    else:
        assert ran == 0, ran
    # The runtime's own device buffers are reported, sized to what it moved.
    big = [np.ones(300_000, np.float32), np.ones(200_000, np.float32)]
    _core.submit_group(big, ["sim.buffers.a", "sim.buffers.b"], DTYPE_CODES["float32"]).wait()
    stats = _core.stats()
    if os.environ.get("PERSEUS_TEST_DEVICE") in ("sim", "cuda"):
        fused = sum(b.nbytes for b in big)  # one bucket: packed on the device
        assert stats["device_buffer_bytes"] >= fused, stats
        if os.environ.get("PERSEUS_GPU_TRANSPORT") != "nccl":  # staged through the host
            assert stats["staging_buffer_bytes"] >= fused, stats
        else:  # NCCL reduces the bucket where it lies: nothing of it is staged
            assert stats["staging_buffer_bytes"] < fused, stats
    else:
        assert stats["device_buffer_bytes"] == stats["staging_buffer_bytes"] == 0, stats


def check_staged_collectives_copy_through_pinned_memory():
    """Collectives with no device path of their own (allgather, alltoall,
    reducescatter) stage device tensors through the plane's pinned buffers:
    the stand-in driver of CI counts asynchronous copies from the device
    into pageable host memory (synchronous on a GPU), and these make none."""
    if os.environ.get("PERSEUS_TEST_DEVICE") != "cuda":
        return
    import ctypes
    counter = getattr(ctypes.CDLL(os.environ.get("PERSEUS_CUDA_DRIVER") or "libcuda.so.1"),
                      "fake_cuda_pageable_d2h", None)
    f32 = DTYPE_CODES["float32"]
    before = counter() if counter else 0
    got = _core.submit(OP_ALLGATHER, np.full((R + 1, 2), R, np.float32), "pinned.ag",
                       f32).wait()[0]
    np.testing.assert_array_equal(got, np.concatenate([np.full((r + 1, 2), r) for r in range(N)]))
    got = _core.submit(OP_REDUCESCATTER, np.ones((2 * N, 3), np.float32), "pinned.rs",
                       f32).wait()[0]
    np.testing.assert_array_equal(got, np.full((2, 3), N, np.float32))
    splits = [1] * N
    got, _ = _core.submit(OP_ALLTOALL, np.full((N, 2), R, np.float32), "pinned.a2a", f32,
                          splits=splits).wait()
    np.testing.assert_array_equal(got[:, 0], np.arange(N, dtype=np.float32))
    if counter:
        assert counter() - before == 0, f"{counter() - before} copies into pageable memory"


def check_steady_steps_create_no_cuda_events():
    """On the CUDA plane events come from a pool (the producer's, the
    completions', the transports' markers): once warm, steps create none.
    The stand-in driver of CI counts them; on a GPU the steps only run."""
    if os.environ.get("PERSEUS_TEST_DEVICE") != "cuda":
        return
    import ctypes
    counter = getattr(ctypes.CDLL(os.environ.get("PERSEUS_CUDA_DRIVER") or "libcuda.so.1"),
                      "fake_cuda_event_creates", None)

    def steps(k):
        for i in range(k):
            x = np.full(1000, R + i, np.float32)
            allreduce_async(x, f"events.{i % 4}").wait()

    steps(20)
    before = counter() if counter else 0
    steps(100)
    if counter:
        assert counter() - before == 0, f"{counter() - before} events created by 100 warm steps"


def _step(names, k, plannable=True, shapes=None):
    """One training-like step: every name submitted (last first), then waited."""
    arrays = [np.full((shapes or {}).get(n, 3 + i % 4), float(R + 1 + k), np.float32)
              for i, n in enumerate(names)]
    handles = [_core.submit(OP_ALLREDUCE, a, n, DTYPE_CODES["float32"], output=a,
                            plannable=plannable) for n, a in zip(names, arrays)][::-1]
    errors = {}
    for n, h in zip(names[::-1], handles):
        try:
            h.wait()
        except _core.MismatchError as e:
            errors[n] = str(e)
    expected = sum(r + 1 + k for r in range(N))
    for n, a in zip(names, arrays):
        if n not in errors:
            np.testing.assert_array_equal(a, np.full(a.shape, expected), err_msg=n)
    return errors


def _group_step(names, k, elements):
    """One training-like step as one grouped call (as the TF kernel submits it)."""
    arrays = [np.full(elements, float(R + 1 + k), np.float32) for _ in names]
    _core.submit_group(arrays, names, DTYPE_CODES["float32"], plannable=True).wait()
    expected = sum(r + 1 + k for r in range(N))
    for n, a in zip(names, arrays):
        np.testing.assert_array_equal(a, np.full(a.shape, expected), err_msg=n)


def _delta(fn):
    before = _core.stats()
    out = fn()
    after = _core.stats()
    return out, {k: after[k] - before[k] for k in ("control_bytes_sent", "cycles", "plans",
                                                    "plan_exits", "offline_steps", "responses")}


def _steady(d):
    return d["control_bytes_sent"] == 0 and d["cycles"] == 0 and d["offline_steps"] == 1


def _steps_until_planned(names, tag, at_least=4, at_most=40):
    """Runs steps until the last two ran from a plan on every rank (at least
    `at_least`, at most `at_most` steps); returns (per-step deltas, total).
    How many steps learning takes depends on when negotiation cycles end,
    which a loaded machine moves; the ranks agree after each step (an
    online allreduce outside the step's window) so that all stop together."""
    before = _core.stats()
    deltas = []
    for k in range(at_most):
        deltas.append(_delta(lambda k=k: _step(names, k))[1])
        flag = np.array([len(deltas) >= at_least and all(map(_steady, deltas[-2:]))], np.float32)
        _core.submit(OP_ALLREDUCE, flag, f"plan.{tag}.agree{k}", DTYPE_CODES["float32"],
                     output=flag).wait()
        if flag[0] == N:
            break
    after = _core.stats()
    return deltas, {key: after[key] - before[key] for key in deltas[0]}


def check_offline_plan_zero_control_bytes_replan_and_divergence():
    names = [f"plan.g{i}" for i in range(40)]
    # Counted over the whole run of steps: the runtime enters a plan at the
    # end of a negotiation cycle, which may come just after a step's last
    # result (between two per-step windows).
    deltas, total = _steps_until_planned(names, "first")
    assert total["plans"] == 1, (total, deltas)
    # Steady state: no control messages at all, every step from the plan.
    assert all(map(_steady, deltas[-2:])) and deltas[-1]["responses"] >= 1, deltas
    # A collective outside the plan still runs (online, on demand).
    x = np.ones(3, np.float32)
    _core.submit(OP_ALLREDUCE, x, "plan.adhoc", DTYPE_CODES["float32"], output=x).wait()
    np.testing.assert_array_equal(x, [N] * 3)
    # The step changes (names dropped and added): leave the plan once, re-plan.
    changed = names[5:] + [f"plan.h{i}" for i in range(3)]
    deltas, total = _steps_until_planned(changed, "changed")
    assert total["plan_exits"] == 1, (total, deltas)
    assert total["plans"] == 1, (total, deltas)
    assert all(map(_steady, deltas[-2:])), deltas
    # A rank that diverges (a planned name with another shape) is caught:
    # every rank leaves the plan and online negotiation names the tensor.
    bad = {"plan.g9": 7} if R == N - 1 else {}
    errors, d = _delta(lambda: _step(changed, 9, shapes=bad))
    assert list(errors) == ["plan.g9"], errors
    assert "plan.g9" in errors["plan.g9"] and "shape" in errors["plan.g9"], errors
    assert d["plan_exits"] == 1, d
    # And training goes on, re-planning again.
    deltas, total = _steps_until_planned(changed, "again")
    assert total["plans"] == 1 and all(map(_steady, deltas[-2:])), (total, deltas)


def check_requests_not_marked_plannable_stay_online():
    names = [f"online.g{i}" for i in range(10)]
    deltas = [_delta(lambda k=k: _step(names, k, plannable=False))[1] for k in range(4)]
    assert all(d["plans"] == 0 and d["control_bytes_sent"] > 0 for d in deltas), deltas


def check_plan_buckets_follow_fusion_granularity():
    """An offline plan's buckets: PERSEUS_ALLREDUCE_FUSION=G splits the step
    into G buckets of about 1/G of its bytes; unset, one bucket for a small
    step (at least 4 MiB each), none with PERSEUS_FUSION_THRESHOLD=0."""
    names = [f"fusion.g{i}" for i in range(40)]
    # One grouped call (100 KB each, 4 MB per step): separate calls that
    # complete in different negotiation cycles never share a bucket.
    deltas = [_delta(lambda k=k: _group_step(names, k, 25_000))[1] for k in range(6)]
    steady = deltas[-1]
    assert steady["offline_steps"] == 1 and steady["control_bytes_sent"] == 0, deltas
    granularity = os.environ.get("PERSEUS_ALLREDUCE_FUSION")
    if granularity:
        want = int(granularity) if int(granularity) > 0 else 40
    elif os.environ.get("PERSEUS_FUSION_THRESHOLD") == "0":
        want = 40
    else:
        want = 1
    assert steady["responses"] == want, (steady, want)
