"""TensorFlow ops, against numpy (tests/workers/checks_ops.py).

Every check runs at 2 ranks twice: with default fusion and shared memory,
and with fusion off (PERSEUS_FUSION_THRESHOLD=0), NaN checks on and shared
memory off, so both the fused and the unfused path, and both shared memory
and TCP (the reduce-scatter ring), are checked. The checks that 4 ranks test
further (the module's AT_4_RANKS) run at 4 ranks with the second settings,
and the shared-memory reduce-scatter and allgather at 3 (AT_3_RANKS_SHM).
The second pass of `make test` (TF 2.15: the op library built against it)
runs the first launch only.
"""

import pytest

from harness import checks_at, four_rank_checks, run_checks
from tiers import second_pass

UNFUSED = {"PERSEUS_FUSION_THRESHOLD": "0", "PERSEUS_ALLREDUCE_NANCHECK": "1",
           "PERSEUS_SHM_ALLREDUCE": "0"}
LAUNCHES = {"2ranks": (2, {}), "2ranks-unfused-tcp": (2, UNFUSED),
            "4ranks-unfused-tcp": (4, UNFUSED), "3ranks-shm": (3, {})}
if second_pass():
    LAUNCHES = {"2ranks": LAUNCHES["2ranks"]}


def _names(np_):
    if np_ == 3:
        return four_rank_checks("checks_ops", "AT_3_RANKS_SHM")
    return checks_at("checks_ops", np_)


CASES = [(launch, check) for launch, (np_, _) in LAUNCHES.items() for check in _names(np_)]

_launches = {}


def launched(launch):
    if launch not in _launches:
        np_, env = LAUNCHES[launch]
        _launches[launch] = run_checks("checks_ops", np_, names=_names(np_), env=env)
    return _launches[launch]


@pytest.mark.parametrize("launch,check", CASES, ids=[f"{l}-{c}" for l, c in CASES])
def test_ops(launch, check):
    launched(launch).assert_ok(check)


@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_launch_exit_status(launch):
    proc = launched(launch).proc
    assert proc.returncode == 0, proc.stderr[-3000:]
