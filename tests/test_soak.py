"""A short soak of the runtime (tests/workers/soak_worker.py): random grouped
plannable allreduces whose sets change, mixed with every other collective
and a process set, random dtypes and shapes (empty included), each result
checked against numpy. 2, 3 and 4 ranks, shared memory and TCP. The long run is
`python tools/soak.py --np 4 --steps 10000` (docs/testing.md)."""

import os
import re
import sys

import pytest

from harness import WORKERS, launch

# "sim": every array on the simulated device (cc/device/sim_device.h), so the
# ordering a GPU relies on (producer events, staging, completion after the
# device work) is checked by the device on every access.
CONFIGS = [(2, "shm", 400, 11), (2, "tcp", 400, 12), (4, "shm", 250, 13), (4, "tcp", 250, 14),
           (2, "shm-sim", 250, 15), (4, "tcp-sim", 150, 16),
           # A world that is not a power of two: recursive doubling's fold,
           # and averages whose 1/size is inexact.
           (3, "tcp", 150, 5)]


@pytest.mark.parametrize("np_,transport,steps,seed", CONFIGS,
                         ids=[f"{c[0]}ranks-{c[1]}" for c in CONFIGS])
def test_soak(np_, transport, steps, seed):
    env = {"PERSEUS_SHM_ALLREDUCE": "1" if transport.startswith("shm") else "0",
           "PERSEUS_TEST_DEVICE": "sim" if transport.endswith("sim") else None,
           "GLOO_TIMEOUT_SECONDS": "20", "PERSEUS_STALL_TIMEOUT_SECONDS": "30"}
    proc = launch(np_, [sys.executable, os.path.join(WORKERS, "soak_worker.py"), str(steps),
                        str(seed)], env=env, timeout=240)
    out = proc.stdout + proc.stderr
    summaries = re.findall(r"SOAK rank (\d+) steps (\d+) ops (\d+) failures (\d+) plans (\d+) "
                           r"plan_exits (\d+) offline_steps \d+ seconds [\d.]+ in_place (\d+)", out)
    assert proc.returncode == 0 and len(summaries) == np_, out[-4000:]
    for rank, done, ops, failures, plans, exits, in_place in summaries:
        # Tensors of 4 MiB or more, which the runtime reduces in place, were
        # drawn and checked.
        assert int(in_place) > 0, summaries
        assert int(done) == steps and int(failures) == 0, out[-4000:]
        assert int(ops) > steps * 3, summaries
        # The gradient set changes every few dozen steps: plans are entered
        # and left many times.
        assert int(plans) >= 3 and int(exits) >= 2, summaries
