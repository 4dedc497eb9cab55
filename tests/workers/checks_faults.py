"""Cases a fault probe found, through the pybind11 module. Run by
tests/test_faults.py at 2 and 4 ranks with PERSEUS_STALL_TIMEOUT_SECONDS=2,
PERSEUS_STALL_CHECK_TIME_SECONDS=0 and the test-only
PERSEUS_TEST_ERROR_DISPATCH_DELAY_MS=100 (a caller woken by an error submits
its next request before the cycle's later responses are dispatched: the
window the probe hit 3 times in 30 by chance, every time).

Checks run in name order; each makes the same collectives on every rank
whatever its outcome, and ends with a barrier that tolerates stalls.
"""

import time

import numpy as np

from perseus_tf._native import DTYPE_CODES, OP_ALLREDUCE, OP_ALLTOALL, OP_BROADCAST, _core

from rank_checks import start_native

R = N = None
F32 = DTYPE_CODES["float32"]


def setup():
    global R, N
    R, N = start_native()
    return R


def _allreduce(name, value):
    x = np.full(4, value, np.float32)
    _core.submit(OP_ALLREDUCE, x, name, F32, output=x).wait()
    return float(x[0])


def _sync(tag):
    """A barrier that outlasts stalls: a rank whose attempt stalled out
    (the others were still busy) tries again until all meet."""
    for _ in range(20):
        try:
            _allreduce(f"sync.{tag}", 0.0)
            return
        except _core.MismatchError:
            continue
    raise AssertionError(f"ranks never met at sync.{tag}")


def check_a_a_failed_request_leaves_nothing_behind():
    # Rank 0 allreduces a{i} (nobody else does: it stalls out), then x{i};
    # the others allreduce x{i} and retry it once when it stalls out. x{i}
    # stalls on the others in the cycle rank 0's a{i} does, and rank 0
    # submits x{i} while that cycle is still dispatching: its x{i} fails
    # too. Once, a stale copy of rank 0's x{i} then stayed queued, met the
    # others' retry, and rank 0 took part with zeros: they got 2(N-1)
    # instead of 1 + 2(N-1), with no error anywhere. Every outcome must now
    # be the true sum or an error.
    want = 1.0 + 2.0 * (N - 1)
    outcomes = []
    for i in range(3):
        if R == 0:
            try:
                _allreduce(f"a{i}", 1.0)
                raise AssertionError(f"a{i}, which only rank 0 submitted, completed")
            except _core.MismatchError:
                pass
            try:
                outcomes.append(_allreduce(f"x{i}", 1.0))
            except _core.MismatchError:
                outcomes.append("error")
        else:
            for _ in range(2):
                try:
                    outcomes.append(_allreduce(f"x{i}", 2.0))
                    break
                except _core.MismatchError:
                    outcomes.append("error")
        _sync(f"a{i}")
    wrong = [o for o in outcomes if o not in ("error", want)]
    assert not wrong, f"rank {R}: sums {wrong} instead of {want} (all outcomes {outcomes})"


def check_b_no_plan_step_is_started_by_some_ranks_only():
    # The plan learned here is a step of (b, a): the first call holds b alone,
    # later steps call a, then b. At step 20 rank 1 comes late and calls b
    # before a: its b does not fit (its bucket is already past), so rank 1
    # votes in the step's last bucket (a). The other ranks had their b in
    # before a's bucket came back and once started step 21 at once with it;
    # on a's votes rank 1 left the plan and never ran that bucket: they
    # waited in their collective until GLOO_TIMEOUT_SECONDS (the soak's
    # shared-memory timeout). Now a step starts only once the previous
    # step's votes are known, alike everywhere: every rank leaves, and the
    # job goes on with right sums.
    # a is large enough (4.4 MB) that the runtime reduces it in place, after
    # the bucket's votes: a voted-down bucket must leave it untouched.
    def call(name, dtype, step):
        x = np.full(1_100_000 if name == "orphan.a" else 1000, R + step, dtype)
        return name, x, step, _core.submit_group([x], [name], DTYPE_CODES[dtype], plannable=True)

    def wait(handles):
        for name, x, step, handle in handles:
            handle.wait()
            want = sum(r + step for r in range(N))
            assert (x == want).all(), (name, step, x[:3], want)

    wait([call("orphan.b", "int64", 0)])
    for step in range(1, 30):
        if step == 20 and R == 1:
            time.sleep(0.1)
            handles = [call("orphan.b", "int64", step), call("orphan.a", "float32", step)]
        else:
            handles = [call("orphan.a", "float32", step)]
            time.sleep(0.005 if step >= 20 else 0.03)
            handles.append(call("orphan.b", "int64", step))
        wait(handles)
    st = _core.stats()
    assert st["plans"] >= 1 and st["plan_exits"] >= 1, st


def check_c_grouped_calls_of_different_sizes_fail_on_every_rank():
    # Rank 0 groups two tensors, the others one: once, the others succeeded
    # silently and rank 0 stalled. Now every rank fails at once, naming the
    # counts, and rank 0's second tensor fails with its call.
    names = ["grp.a", "grp.b"] if R == 0 else ["grp.a"]
    arrays = [np.ones(3, np.float32) for _ in names]
    start = time.monotonic()
    try:
        _core.submit_group(arrays, names, F32).wait()
        raise AssertionError("grouped calls of different sizes completed")
    except _core.MismatchError as e:
        text = str(e)
    took = time.monotonic() - start
    assert took < 1.5, f"took {took:.1f} s (the stall timeout is 2 s)"
    assert "'grp.a'" in text and "number of tensors in the grouped call" in text, text
    assert "2 tensors" in text and "1 tensors" in text and "rank 0" in text, text
    _sync("c")


def check_d_a_bad_argument_on_one_rank_fails_the_others_at_once():
    # The last rank passes a bad argument; the others' calls are fine. The
    # others once waited for the stall timeout; now they fail at once, told
    # which rank refused and why.
    bad = N - 1
    cases = [
        ("broadcast root", lambda tag, wrong: _core.submit(
            OP_BROADCAST, np.ones(3, np.float32), f"bad.bc.{tag}", F32,
            root=N + 3 if wrong else 0, output=np.ones(3, np.float32))),
        ("negative splits", lambda tag, wrong: _core.submit(
            OP_ALLTOALL, np.ones((N, 2), np.float32), f"bad.a2a.{tag}", F32,
            splits=[-1, 2] + [1] * (N - 2) if wrong else [1] * N)),
    ]
    for i, (what, call) in enumerate(cases):
        start = time.monotonic()
        try:
            call(i, R == bad).wait()
            raise AssertionError(f"{what}: rank {R} completed")
        except _core.InvalidArgumentError as e:
            text = str(e)
        except _core.MismatchError as e:  # noqa: F841 - reported below
            text = "MismatchError: " + str(e)
        took = time.monotonic() - start
        assert took < 1.5, f"{what}: rank {R} took {took:.1f} s"
        if R == bad:
            assert "out of range" in text or "must not be negative" in text, text
        else:
            assert f"rank {bad} refused its call" in text, (what, text)
        _sync(f"d{i}")


def check_e_add_process_set_checks_its_list_and_keeps_ids_in_step():
    from perseus_tf import _native

    for bad in ([0, 0], "01", [0.5, 1], [True, 1]):
        try:
            _native.add_process_set(bad)
            raise AssertionError(f"add_process_set({bad!r}) was accepted")
        except ValueError as e:
            assert "ranks" in str(e), e
    # Only the last rank passes a rank out of range: every rank fails at
    # once (the others once waited for the stall timeout, and the ranks'
    # process-set ids then differed).
    ranks = [0, N + 5] if R == N - 1 else [0, 1]
    start = time.monotonic()
    try:
        _native.add_process_set(ranks)
        raise AssertionError(f"rank {R}: add_process_set({ranks}) was accepted")
    except ValueError as e:
        text = str(e)
    took = time.monotonic() - start
    assert took < 1.5, f"took {took:.1f} s"
    if R == N - 1:
        assert "from 0 to" in text, text
    else:
        assert f"rank(s) {N - 1} passed an invalid list" in text, text
    set_id = _native.add_process_set([0, 1])
    ids = np.array([set_id], np.int64)
    gathered, _ = _core.submit(_native.OP_ALLGATHER, ids, "faults.set_ids",
                               DTYPE_CODES["int64"]).wait()
    assert len(set(gathered.tolist())) == 1, f"process-set ids differ: {gathered.tolist()}"
    _native.remove_process_set(set_id)
    _sync("e")  # members leave the set later than the others


def check_f_init_with_other_options_after_init_raises():
    from perseus_tf import _native

    _sync("f")  # no rank has shut down yet
    running = _native._config_in_use.streams
    _native.init(streams=running)  # the same: fine
    other = 1 if running != 1 else 2
    try:
        _native.init(streams=other)
        raise AssertionError("init(streams=...) with another value was silently ignored")
    except ValueError as e:
        assert f"streams={other}" in str(e) and "shutdown() first" in str(e), e


def check_g_a_nan_prescale_is_named_as_such():
    # Once reported as "ranks disagree on the prescale/postscale factors".
    x = np.ones(3, np.float32)
    try:
        _core.submit(OP_ALLREDUCE, x, "nan.prescale", F32, prescale=float("nan"), output=x).wait()
        raise AssertionError("a NaN prescale was accepted")
    except _core.InvalidArgumentError as e:
        assert "must be finite numbers" in str(e) and "prescale_factor nan" in str(e), e
    _sync("g")
