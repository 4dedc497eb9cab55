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
