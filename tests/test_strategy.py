"""PerseusStrategy at 2 and 4 ranks: equivalence with single-process training,
global metrics, reductions, checkpoints, and local + cross-process reduction."""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_strategy")


@pytest.fixture(scope="module", params=[2, 4])
def launched(request):
    # Compression off: the equivalence checks compare with float32 training
    # within 1e-5 (fp16 gradients are tested in test_examples_and_build.py).
    # The ranks' offline plans are compared every 3 plan steps.
    return run_checks("checks_strategy", request.param, timeout=900,
                      env={"PERSEUS_ALLREDUCE_DTYPE": "1", "PERSEUS_OFFLINE_NEG_CHECK_N_STEPS": "3"})


@pytest.mark.parametrize("check", CHECKS)
def test_strategy(launched, check):
    launched.assert_ok(check)


def test_clean_exit(launched):
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]
