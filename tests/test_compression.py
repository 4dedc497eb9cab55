"""Compression (fp16, mixed, top-k, downsampling) and the two-level allreduce,
each launch checked against the numpy model in workers/checks_compression.py.

Two hosts run on this machine as 127.0.0.1 and 127.0.0.2 (-H).
"""

import pytest

from harness import check_names, run_checks

CHECKS = check_names("checks_compression")
HOSTS = "127.0.0.1:2,127.0.0.2:2"
LAUNCHES = {
    # Mixed: float32 inside each host, float16 between the hosts' leaders;
    # top-k (5%) for tensors of 40000 bytes and more.
    "2hosts-mixed-topk": (4, HOSTS, {"PERSEUS_ALLREDUCE_DTYPE": "2",
                                     "PERSEUS_TOPK_ALLREDUCE": "1",
                                     "PERSEUS_TOPK_RATIO": "0.05",
                                     "PERSEUS_TOPK_THRESHOLD": "40000"}),
    "2hosts-hierarchical-fp16": (4, HOSTS, {"PERSEUS_ALLREDUCE_MODE": "1",
                                            "PERSEUS_ALLREDUCE_DTYPE": "0",
                                            # plans compared every 2 plan steps
                                            "PERSEUS_OFFLINE_NEG_CHECK_N_STEPS": "2"}),
    # The host phases over Gloo (TCP) instead of shared memory.
    "2hosts-hierarchical-none-tcp": (4, HOSTS, {"PERSEUS_ALLREDUCE_MODE": "1",
                                                "PERSEUS_ALLREDUCE_DTYPE": "1",
                                                "PERSEUS_SHM_ALLREDUCE": "0"}),
    "2hosts-flat-none": (4, HOSTS, {"PERSEUS_ALLREDUCE_MODE": "0",
                                    "PERSEUS_ALLREDUCE_DTYPE": "1"}),
    "1host-topk-fp16-values": (2, None, {"PERSEUS_ALLREDUCE_DTYPE": "0",
                                         "PERSEUS_TOPK_ALLREDUCE": "1",
                                         "PERSEUS_TOPK_FP16": "1",
                                         "PERSEUS_TOPK_RATIO": "0.02",
                                         "PERSEUS_TOPK_THRESHOLD": "40000"}),
    "1host-downsample": (4, None, {"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "4",
                                   "PERSEUS_GRADIENT_MOMENTUM": "0.9"}),
    "1host-mixed": (2, None, {"PERSEUS_ALLREDUCE_DTYPE": "2"}),
    # On the simulated device: the fp16 casts and plan votes on the device,
    # top-k, downsampling and the two-level path staged through the host.
    "2hosts-mixed-topk-sim": (4, HOSTS, {"PERSEUS_ALLREDUCE_DTYPE": "2",
                                         "PERSEUS_TOPK_ALLREDUCE": "1",
                                         "PERSEUS_TOPK_RATIO": "0.05",
                                         "PERSEUS_TOPK_THRESHOLD": "40000",
                                         "PERSEUS_TEST_DEVICE": "sim"}),
    "1host-downsample-sim": (2, None, {"PERSEUS_DOWNSAMPLE_N_ELEMENTS": "4",
                                            "PERSEUS_GRADIENT_MOMENTUM": "0.9",
                                            "PERSEUS_TEST_DEVICE": "sim"}),
}


@pytest.fixture(scope="module", params=sorted(LAUNCHES))
def launched(request):
    np_, hosts, env = LAUNCHES[request.param]
    return run_checks("checks_compression", np_, env=env, hosts=hosts, timeout=300)


@pytest.mark.parametrize("check", CHECKS)
def test_compression(launched, check):
    launched.assert_ok(check)


def test_clean_exit(launched):
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]


# The cost model's two link classes at more hosts: 3 hosts (the leaders'
# doubling folds one leader in) and 4, two ranks each, shared memory and TCP.
WIDER = {"3hosts": (6, "127.0.0.1:2,127.0.0.2:2,127.0.0.3:2", {}),
         "4hosts-tcp": (8, "127.0.0.1:2,127.0.0.2:2,127.0.0.3:2,127.0.0.4:2",
                        {"PERSEUS_SHM_ALLREDUCE": "0"})}
WIDER_CHECKS = ["check_two_levels_where_the_cost_model_says", "check_two_level_allreduce_equals_flat"]


@pytest.fixture(scope="module", params=sorted(WIDER))
def wider(request):
    np_, hosts, env = WIDER[request.param]
    return run_checks("checks_compression", np_, env=env, hosts=hosts, timeout=300,
                      names=WIDER_CHECKS)


@pytest.mark.parametrize("check", WIDER_CHECKS)
def test_two_levels_at_more_hosts(wider, check):
    wider.assert_ok(check)
