"""TensorFlow ops at 2 and 4 ranks (one perseusrun launch per rank count).

2 ranks run with default fusion, 4 ranks with fusion off
(PERSEUS_FUSION_THRESHOLD=0), NaN checks on and shared memory off, so both the fused and the
unfused path, and both shared memory and TCP (the reduce-scatter ring), are checked against
numpy.
"""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_ops")
CONFIGS = {2: {}, 4: {"PERSEUS_FUSION_THRESHOLD": "0", "PERSEUS_ALLREDUCE_NANCHECK": "1",
                     "PERSEUS_SHM_ALLREDUCE": "0"}}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def launched(request):
    return run_checks("checks_ops", request.param, env=CONFIGS[request.param])


@pytest.mark.parametrize("check", CHECKS)
def test_ops(launched, check):
    launched.assert_ok(check)


def test_launch_exit_status(launched):
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]
