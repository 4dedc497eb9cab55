"""Bounded waits and the cases that once hung or returned wrong data, through
the pybind11 module. Run by tests/test_bounded.py at 2 and 4 ranks with
short limits: GLOO_TIMEOUT_SECONDS=8 (plan deadline 2 s),
PERSEUS_STALL_CHECK_TIME_SECONDS=1, PERSEUS_STALL_TIMEOUT_SECONDS=3.

Checks run in name order; the stall checks come first (a_, b_), while no
plan runs.
"""

import time

import numpy as np

from perseus_tf._native import DTYPE_CODES, OP_ALLREDUCE, _core

from rank_checks import expect, start_native

R = N = None
F32 = DTYPE_CODES["float32"]


def setup():
    global R, N
    R, N = start_native()
    return R


def _sync(tag):
    x = np.zeros(1, np.float32)
    _core.submit(OP_ALLREDUCE, x, f"sync.{tag}", F32, output=x).wait()


def check_a_stall_timeout_fails_on_time_naming_the_ranks():
    # Rank 0 asks for a collective nobody else asks for: after
    # PERSEUS_STALL_TIMEOUT_SECONDS (3 s), not before and not much later, it
    # fails naming who submitted it and who did not.
    if R == 0:
        x = np.ones(4, np.float32)
        start = time.monotonic()
        try:
            _core.submit(OP_ALLREDUCE, x, "lonely", F32, output=x).wait()
            raise AssertionError("a collective only rank 0 submitted completed")
        except _core.MismatchError as e:
            took = time.monotonic() - start
            text = str(e)
        assert 3.0 <= took < 5.0, took
        assert "'lonely'" in text and "rank 0 has submitted it" in text, text
        others = ", ".join(str(r) for r in range(1, N))
        assert f"{others} ha" in text and "PERSEUS_STALL_TIMEOUT_SECONDS" in text, text
    else:
        time.sleep(3.2)  # rank 0 is back after about 3 s
    _sync("a")


def check_b_stall_inspector_reports_late_ranks():
    # Rank 0 waits about 2 s for the others: the inspector prints the
    # tensor and the missing ranks (tests/test_bounded.py reads stderr), and
    # the collective then completes normally.
    x = np.full(3, float(R + 1), np.float32)
    if R != 0:
        time.sleep(2.0)
    _core.submit(OP_ALLREDUCE, x, "late", F32, output=x).wait()
    np.testing.assert_array_equal(x, [N * (N + 1) / 2] * 3)


def _group(names, k, plannable=True):
    arrays = [np.full(5 + i, float(R + k), np.float32) for i in range(len(names))]
    return arrays, _core.submit_group(arrays, names, F32, plannable=plannable)


def _expect(arrays, k):
    for a in arrays:
        np.testing.assert_array_equal(a, np.full(a.shape, float(sum(r + k for r in range(N)))))


def check_c_sequential_calls_never_share_a_plan_bucket():
    # The fit hang: a step made of calls where each waits for the previous
    # one (as TF chains a tf.function's collectives). The plan must keep
    # them in separate buckets, run from the plan, and never time out.
    before = _core.stats()
    for k in range(10):
        for call in range(3):
            arrays, h = _group([f"seq.c{call}.{i}" for i in range(4)], k)
            h.wait()
            _expect(arrays, k)
    after = _core.stats()
    assert after["plans"] - before["plans"] == 1, (before, after)
    assert after["plan_exits"] == before["plan_exits"], (before, after)
    assert after["offline_steps"] - before["offline_steps"] >= 5, (before, after)
    assert after["plan_timeouts"] == before["plan_timeouts"], (before, after)


def _learn_pair(names_a, names_b, k):
    a, ha = _group(names_a, k)
    b, hb = _group(names_b, k)
    ha.wait()
    hb.wait()
    _expect(a + b, k)


def _learn_pair_as_one_bucket(names_a, names_b):
    # The two calls fuse into one plan bucket only when every rank submitted
    # both before a negotiation cycle ran; on a loaded machine a rank can be
    # descheduled between them and the plan learns two buckets. The plan is
    # the same on every rank, so every rank sees the same count and takes the
    # same branch: if the step ran as two buckets, leave the plan (an unknown
    # name) and learn again.
    for attempt in range(6):
        for k in range(6):
            _learn_pair(names_a, names_b, k)
        before = _core.stats()
        _learn_pair(names_a, names_b, 6)
        after = _core.stats()
        if (after["offline_steps"] - before["offline_steps"] == 1
                and after["responses"] - before["responses"] == 1):
            return
        _group([f"pair.reset{attempt}"], 0)[1].wait()
    raise AssertionError("six tries never learned the two calls as one plan bucket")


def check_d_plan_bucket_that_cannot_fill_leaves_the_plan():
    # Learned with two calls submitted together (one bucket), then a step
    # where the first call is waited for before the second is submitted:
    # the bucket cannot fill, so within the plan deadline every rank leaves
    # the plan, and the results are still right.
    names_a = [f"pair.a{i}" for i in range(3)]
    names_b = [f"pair.b{i}" for i in range(3)]
    _learn_pair_as_one_bucket(names_a, names_b)
    before = _core.stats()
    start = time.monotonic()
    a, ha = _group(names_a, 7)
    ha.wait()
    b, hb = _group(names_b, 7)
    hb.wait()
    took = time.monotonic() - start
    _expect(a + b, 7)
    after = _core.stats()
    assert after["plan_exits"] - before["plan_exits"] == 1, (before, after)
    assert after["plan_timeouts"] - before["plan_timeouts"] == 1, (before, after)
    assert took < 6.0, took  # deadline 2 s, not GLOO_TIMEOUT_SECONDS
    # Training goes on.
    for k in range(8, 12):
        a, ha = _group(names_a, k)
        ha.wait()
        b, hb = _group(names_b, k)
        hb.wait()
        _expect(a + b, k)


def check_e_plan_exit_before_online_collectives_agrees_on_streams():
    # The probe that returned [3, 3, ..., 0, 0] as success: a grouped
    # plannable call whose tensor set changes (the plan is left) submitted
    # right before online collectives, every few steps.
    expected = N * (N + 1) / 2
    for step in range(30):
        count = [5, 6, 4][(step // 4) % 3]
        arrays = [np.full(100 + i, 1.0, np.float32) for i in range(count)]
        g = _core.submit_group(arrays, [f"probe.{i}" for i in range(count)], F32, plannable=True)
        online = []
        for j in range(3):
            x = np.full(8, float(R + 1), np.float32)
            online.append((x, _core.submit(OP_ALLREDUCE, x, f"probe.on{j}.{step}", F32, output=x)))
        g.wait()
        for a in arrays:
            np.testing.assert_array_equal(a, np.full(a.shape, float(N)), err_msg=f"step {step}")
        for x, h in online:
            h.wait()
            np.testing.assert_array_equal(x, [expected] * 8, err_msg=f"step {step}")


def check_f_core_checks_every_buffer():
    # Local checks before anything is queued: clear errors, never a crash.
    x = np.ones(8, np.float32)
    cases = [
        (lambda: _core.submit(OP_ALLREDUCE, x, "bad.dtype", DTYPE_CODES["float64"], output=x),
         "does not match dtype code"),
        (lambda: _core.submit(OP_ALLREDUCE, x, "bad.small", F32, output=np.ones(3, np.float32)),
         "needs the input's 8"),
        (lambda: _core.submit(OP_ALLREDUCE, np.ones((4, 4), np.float32)[:, 1], "bad.strided", F32,
                              output=np.ones(4, np.float32)), "C-contiguous"),
        (lambda: _core.submit(OP_ALLREDUCE, x, "bad.code", 42, output=x), "dtype code 42"),
        (lambda: _core.submit(OP_ALLREDUCE, x, "bad.op", F32, reduce_op=9, output=x), "reduce_op 9"),
        (lambda: _core.submit(OP_ALLREDUCE, x, "bad.out", F32, output=x.astype(np.int32)),
         "does not match dtype code"),
        (lambda: _core.submit(OP_ALLREDUCE, x, "bad.ro", F32,
                              output=np.frombuffer(bytes(32), np.float32)), "read-only"),
        (lambda: _core.submit_group([x, np.ones(2, np.int64)], ["g.0", "g.1"], F32),
         "does not match dtype code"),
    ]
    for call, text in cases:
        expect(_core.InvalidArgumentError, call, text)  # a bad buffer is refused
    # Nothing was queued: the runtime still works, and an allreduce with no
    # output array gets a fresh one.
    out, _ = _core.submit(OP_ALLREDUCE, np.full(2, float(R), np.float32), "good.fresh", F32).wait()
    np.testing.assert_array_equal(out, [sum(range(N))] * 2)
