"""Bounded waits, at 2 and 4 ranks (tests/workers/checks_bounded.py): the
stall timeout fires on time naming the ranks, the stall inspector names late
ranks, plan buckets never span sequential calls (the `fit` hang), a plan
bucket that cannot fill leaves the plan within its deadline, a plan exit
before online collectives gives right results, and `_core` checks buffers."""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_bounded")
ENV = {"GLOO_TIMEOUT_SECONDS": "8", "PERSEUS_STALL_CHECK_TIME_SECONDS": "1",
       "PERSEUS_STALL_TIMEOUT_SECONDS": "3"}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def launched(request):
    return run_checks("checks_bounded", request.param, env=ENV, timeout=240)


@pytest.mark.parametrize("check", CHECKS)
def test_bounded(launched, check):
    launched.assert_ok(check)


def test_stall_inspector_and_plan_deadline_speak(launched):
    err = launched.proc.stdout + launched.proc.stderr
    # Rank 0's inspector names the late tensor and the missing ranks.
    others = ", ".join(str(r) for r in range(1, launched.np))
    assert "Perseus stall inspector (rank 0)" in err, err[-3000:]
    # What the report means is said once; later reports say what still waits.
    assert err.count("(PERSEUS_STALL_CHECK_TIME_SECONDS)") == 1, err[-3000:]
    assert "Perseus stall inspector (rank 0): still waiting:" in err, err[-3000:]
    assert f"allreduce 'late' waiting" in err and f"{others} ha" in err, err[-3000:]
    # The plan bucket that could not fill says why it left the plan.
    assert "has waited" in err and "Leaving the plan" in err, err[-3000:]
    assert launched.proc.returncode == 0, err[-3000:]
