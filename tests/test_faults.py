"""Cases a fault probe and a soak found (tests/workers/checks_faults.py), at
2 and 4 ranks: a request that fails leaves nothing behind that could pair
with another rank's retry; no offline plan step is started by some ranks
only; grouped calls of different sizes fail on every rank at once, naming
the counts; a bad argument on one rank fails the others' calls at once;
add_process_set checks its list on every rank at once and keeps the ranks'
ids in step; init() with other runtime options after init() raises."""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_faults")
ENV = {"GLOO_TIMEOUT_SECONDS": "10", "PERSEUS_STALL_CHECK_TIME_SECONDS": "0",
       "PERSEUS_STALL_TIMEOUT_SECONDS": "2", "PERSEUS_TEST_ERROR_DISPATCH_DELAY_MS": "100"}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def launched(request):
    return run_checks("checks_faults", request.param, env=ENV, timeout=300)


@pytest.mark.parametrize("check", CHECKS)
def test_faults(launched, check):
    launched.assert_ok(check)


LATE_CALL = """
import os, sys, threading
import numpy as np
from perseus_tf import _core, _native
_native.init()
marker = os.environ["PERSEUS_TEST_ENQUEUE_PAUSE"]
outcome = {}

def submit():
    try:
        h = _core.submit(_native.OP_ALLREDUCE, np.ones(4, np.float32), "late",
                         _native.DTYPE_CODES["float32"])
    except RuntimeError as e:
        outcome["refused"] = str(e)
        return
    h.wait()  # with the race, nothing ever completes it
    outcome["ran"] = True

t = threading.Thread(target=submit, daemon=True)
t.start()
while not os.path.exists(marker):  # past its checks, paused before queuing
    t.join(0.01)
_native.shutdown()  # lands in that window
t.join(30)
print("HUNG" if t.is_alive() else outcome)
"""


def test_a_call_caught_by_shutdown_between_check_and_queue_is_refused(tmp_path):
    """A call that passed Enqueue's checks while the runtime ran, and is
    queued only after shutdown() finished (a test-only pause holds it in
    that window), is refused with shutdown's error; before the fix it sat
    in the pending table of a stopped runtime and its wait never returned."""
    import os
    import subprocess
    import sys
    from harness import ROOT, rank_env
    env = rank_env({"PERSEUS_TEST_ENQUEUE_PAUSE": str(tmp_path / "paused"),
                    "PERSEUS_RANK": None, "PERSEUS_SIZE": None})
    proc = subprocess.run([sys.executable, "-c", LATE_CALL], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "refused" in last and "shut down" in last, proc.stdout + proc.stderr[-2000:]
    assert os.path.exists(tmp_path / "paused")


@pytest.mark.parametrize("np_", [2, 4])
def test_a_new_process_joins_the_survivors_next_round(np_):
    """Rounds are the job's, not a process's: after a round shut down, the
    ranks that ran it and new processes taking the place of those that left
    (which have run no round) all init() into the same next round, read from
    the store. With a count kept per process, the survivors waited under
    round 1's keys and the newcomers under round 0's until the deadline.
    stats()["round"] says which round each ran: 0, then 1 for all."""
    import os
    import re
    import sys
    from harness import WORKERS, launch
    proc = launch(np_, [sys.executable, os.path.join(WORKERS, "rounds_worker.py")],
                  env={"GLOO_TIMEOUT_SECONDS": "20"}, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    first = re.findall(r"rank (\d+) first (\S+) round 0", out)
    second = re.findall(r"rank (\d+) second (\S+) round 1( \(replacement\))?", out)
    assert sorted(int(r) for r, _ in first) == list(range(np_)), out[-4000:]
    assert {v for _, v in first} == {f"{np_ * (np_ + 1) // 2:g}"}, first
    assert sorted(int(r) for r, _, _ in second) == list(range(np_)), out[-4000:]
    assert {v for _, v, _ in second} == {f"{100 * np_ * (np_ + 1) // 2:g}"}, second
    assert {int(r) for r, _, new in second if new} == set(range(1, np_, 2)), second


@pytest.mark.parametrize("np_,env", [
    (2, {}),
    (4, {"PERSEUS_SHM_ALLREDUCE": "0"}),
], ids=["2ranks", "4ranks-tcp"])
def test_abort_is_local_wakes_every_wait_and_the_job_goes_on_next_round(np_, env, tmp_path):
    """perseus_tf.abort() on rank 0 while every rank waits in Gloo for a
    stopped rank: rank 0's pending collective fails and abort() returns
    within seconds, not GLOO_TIMEOUT_SECONDS (120 here; without the closed
    connections its threads would wait that long); the other ranks' pending
    collectives fail too, the stopped one's as soon as it resumes into a
    round whose other ranks have all failed and gone (its heartbeat reads
    their census and closed connections; before, its Gloo wait on a pair
    closed while it was stopped lasted the whole timeout); then all init()
    into round 1 and sum right."""
    import os
    import re
    import sys
    from harness import WORKERS, launch
    proc = launch(np_, [sys.executable, os.path.join(WORKERS, "abort_worker.py")],
                  env=dict(env, GLOO_TIMEOUT_SECONDS="120", PERSEUS_STALL_CHECK_TIME_SECONDS="0",
                           ABORT_MARKS=str(tmp_path)),
                  timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    failed = {int(r): (float(t), m)
              for r, t, m in re.findall(r"rank (\d+) held failed at (\S+): (.*)", out)}
    assert sorted(failed) == list(range(np_)), out[-4000:]
    assert "called abort()" in failed[0][1] and "rank 0 gives up" in failed[0][1], failed[0]
    took = re.search(r"rank 0 abort took (\S+) s; the wait failed (\S+) s", out)
    assert took and float(took.group(1)) < 30 and float(took.group(2)) < 30, out[-4000:]
    began = float(re.search(r"rank 0 abort began at (\S+)", out).group(1))
    late = {r: round(t - began, 1) for r, (t, _) in failed.items() if t - began >= 30}
    assert not late, f"waits that failed 30 s or more after rank 0's abort: {late}\n{out[-4000:]}"
    again = re.findall(r"rank (\d+) next round 1 sum (\S+)", out)
    assert sorted(int(r) for r, _ in again) == list(range(np_)), out[-4000:]
    assert {s for _, s in again} == {f"{np_ * (np_ + 1) // 2:g}"}, again


def test_twenty_rounds_at_changing_sizes_leak_nothing(tmp_path):
    """shutdown()/abort() then init() twenty times in each process, at sizes
    4, 2, 3, 1, ... (rank and size read afresh from the environment at each
    init), with a process set in each round: every round's sums are right,
    its round number is the job's next, and each process ends with the
    threads, file descriptors, shared-memory mappings and process sets it
    had after its first round."""
    import os
    import re
    import sys
    from harness import WORKERS, launch
    proc = launch(4, [sys.executable, os.path.join(WORKERS, "lifecycle_worker.py"), str(tmp_path)],
                  env={"GLOO_TIMEOUT_SECONDS": "60"}, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    rounds = re.findall(r"process (\d+) round (\d+) size (\d+) (\S+)", out)
    assert {r[3] for r in rounds} == {"ok"}, [r for r in rounds if r[3] != "ok"]
    sizes = [4, 2, 3, 1, 4, 3, 2, 4, 1, 2, 4, 3, 2, 3, 4, 1, 3, 2, 4, 4]
    assert len(rounds) == sum(sizes), out[-3000:]
    # The job's rounds count those of several ranks; a runtime of one rank
    # uses no store and reports round 0.
    by_round = {}
    for p, rnd, size, _ in rounds:
        if size != "1":
            by_round.setdefault(int(rnd), set()).add((int(p), int(size)))
    several = [size for size in sizes if size > 1]
    assert sorted(by_round) == list(range(len(several))), sorted(by_round)
    for k, size in enumerate(several):
        assert by_round[k] == {(p, size) for p in range(size)}, (k, by_round[k])
    assert sorted(r[1] for r in rounds if r[2] == "1") == ["0"] * sizes.count(1), rounds
    assert len(re.findall(r"counts after the first round (.*) after the last \1$", out, re.M)) == 4, \
        out[-3000:]
