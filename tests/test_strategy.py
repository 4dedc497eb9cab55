"""PerseusStrategy at 2 and 4 ranks: equivalence with single-process training,
global metrics, reductions, checkpoints, and local + cross-process reduction."""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_strategy")


@pytest.fixture(scope="module", params=[2, 4])
def launched(request):
    return run_checks("checks_strategy", request.param, timeout=900)


@pytest.mark.parametrize("check", CHECKS)
def test_strategy(launched, check):
    launched.assert_ok(check)


def test_clean_exit(launched):
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]
