"""PerseusStrategy at 2 ranks: equivalence with single-process training,
global metrics, reductions, checkpoints, and local + cross-process reduction
(tests/workers/checks_strategy.py says why 2 ranks; `fit` at 4 ranks runs in
tests/test_model_matrix.py); predict at 3 ranks too, where a global batch
splits unevenly. Both passes of `make test` run it: Keras 3 and Keras 2."""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_strategy")


@pytest.fixture(scope="module")
def launched():
    # Compression off: the equivalence checks compare with float32 training
    # within 1e-5 (fp16 gradients are tested in test_examples_and_build.py).
    # The ranks' offline plans are compared every 3 plan steps.
    return run_checks("checks_strategy", 2, timeout=900,
                      env={"PERSEUS_ALLREDUCE_DTYPE": "1", "PERSEUS_OFFLINE_NEG_CHECK_N_STEPS": "3"})


@pytest.mark.parametrize("check", CHECKS)
def test_strategy(launched, check):
    launched.assert_ok(check)


def test_clean_exit(launched):
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]


PREDICT = "check_predict_returns_every_row_in_order_on_every_rank"


def test_predict_at_3_ranks():
    # A global batch of 16 splits 6/5/5 and a last batch of one row leaves
    # two ranks' slices empty: every rank still gets every row, in order.
    launched = run_checks("checks_strategy", 3, names=[PREDICT], timeout=600,
                          env={"PERSEUS_STALL_TIMEOUT_SECONDS": "60"})
    launched.assert_ok(PREDICT)
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]
