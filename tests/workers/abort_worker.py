"""abort() in a job (tests/test_faults.py): the last rank stops itself
(SIGSTOP) while every rank has a collective pending, so the others wait in
Gloo for it. Rank 0 then calls perseus_tf.abort() from another thread: its
own pending collective must fail at once and abort() return at once, long
before GLOO_TIMEOUT_SECONDS, and its closed connections must fail the
others. Rank 0 resumes the stopped rank (SIGCONT) only once the others have
failed and shut their runtime down (each leaves a file in ABORT_MARKS): the
stopped rank wakes in a round whose every peer is gone and must learn it at
once, not at GLOO_TIMEOUT_SECONDS. Every rank then shuts down what is left
of its runtime and init()s into the job's next round, where a sum must be
right. Prints one line per event for the test (times on the machine's
monotonic clock, which every process of the job shares)."""

import os
import signal
import threading
import time

import numpy as np

from perseus_tf import _core, _native

R = int(os.environ["PERSEUS_RANK"])
N = int(os.environ["PERSEUS_SIZE"])
VICTIM = N - 1
MARKS = os.environ["ABORT_MARKS"]
F32, F64 = _native.DTYPE_CODES["float32"], _native.DTYPE_CODES["float64"]


def say(text):
    print(f"rank {R} {text}", flush=True)


def stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


_native.init()
mine = np.zeros(N, np.float64)
mine[R] = os.getpid()
pids = _core.submit(_native.OP_ALLREDUCE, mine, "pids", F64).wait()[0].astype(int)
say(f"round {_core.stats()['round']} pids {list(pids)}")

if R == VICTIM:
    say("stopping")
    os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 resumes it after its abort
    say("resumed")

if R == 0:
    timing = {}

    def abort_when_victim_stops():
        deadline = time.monotonic() + 120
        while not stopped(pids[VICTIM]):
            if time.monotonic() > deadline:
                say("victim never stopped")
                os._exit(3)
            time.sleep(0.05)
        time.sleep(1.0)  # the collective below is waiting by now (or about to)
        timing["start"] = time.monotonic()
        _native.abort("test: rank 0 gives up on a stopped rank")  # perseus_tf.abort, without TF
        timing["abort"] = time.monotonic() - timing["start"]
        say(f"abort began at {timing['start']:.3f}")
        others = [os.path.join(MARKS, f"rank{r}") for r in range(1, VICTIM)]
        while not all(os.path.exists(m) for m in others):
            if time.monotonic() > deadline:
                say("the other ranks never shut down")
                os._exit(3)
            time.sleep(0.05)
        os.kill(pids[VICTIM], signal.SIGCONT)

    aborter = threading.Thread(target=abort_when_victim_stops)
    aborter.start()

failed_at = None
try:
    _core.submit(_native.OP_ALLREDUCE, np.ones(1 << 20, np.float32), "held", F32).wait()
    say("held completed")  # must not happen: the victim never submitted in round 0
except Exception as e:  # noqa: BLE001 - every rank's error is reported
    failed_at = time.monotonic()
    first = str(e).splitlines()[0]
    say(f"held failed at {failed_at:.3f}: {type(e).__name__}: {first}")

if R == 0:
    aborter.join()
    say(f"abort took {timing['abort']:.2f} s; the wait failed "
        f"{failed_at - timing['start']:.2f} s after it began")
_native.shutdown()  # what is left of a failed runtime (nothing, after abort)
with open(os.path.join(MARKS, f"rank{R}"), "w"):
    pass
_native.init()
out = _core.submit(_native.OP_ALLREDUCE, np.full(3, R + 1.0, np.float32), "again", F32).wait()[0]
say(f"next round {_core.stats()['round']} sum {out[0]:g}")
_native.shutdown()
