"""The runtime through the pybind11 module at 2 and 4 ranks, fused and unfused."""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_core")
CONFIGS = {(2, "fused"): {}, (4, "unfused"): {"PERSEUS_FUSION_THRESHOLD": "0"},
           (4, "fused"): {"PERSEUS_ALLREDUCE_STREAMS": "2", "PERSEUS_ALLREDUCE_FUSION": "4"},
           # Gloo over TCP instead of shared memory (what several hosts use).
           (4, "tcp"): {"PERSEUS_SHM_ALLREDUCE": "0"}}


@pytest.fixture(scope="module", params=sorted(CONFIGS), ids=lambda k: f"{k[0]}ranks-{k[1]}")
def launched(request):
    return run_checks("checks_core", request.param[0], env=CONFIGS[request.param], timeout=300)


@pytest.mark.parametrize("check", CHECKS)
def test_core(launched, check):
    launched.assert_ok(check)


def test_clean_exit(launched):
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]
