"""The runtime through the pybind11 module at 2 and 4 ranks, fused and unfused."""

import math
import os
import re
import sys

import pytest

from harness import WORKERS, check_names, cuda_devices, fake_cuda_env, launch, run_checks

# Two calls of one name in flight (checks_core) run in every launch below
# (2 and 4 ranks), and on their own at 3.
TWICE = "check_a_name_called_twice_in_flight_fails_on_every_rank"
CHECKS = check_names("checks_core")
CONFIGS = {(2, "fused"): {}, (4, "unfused"): {"PERSEUS_FUSION_THRESHOLD": "0"},
           (4, "fused"): {"PERSEUS_ALLREDUCE_STREAMS": "2", "PERSEUS_ALLREDUCE_FUSION": "4"},
           # Gloo over TCP instead of shared memory (what several hosts use),
           # the cost model's link given instead of measured.
           (4, "tcp"): {"PERSEUS_SHM_ALLREDUCE": "0", "PERSEUS_LINK_LATENCY_US": "50",
                        "PERSEUS_LINK_BANDWIDTH_MBYTES": "1250"},
           # Every array on the simulated device (cc/device/sim_device.h),
           # which checks the ordering of every access.
           (2, "sim"): {"PERSEUS_TEST_DEVICE": "sim"},
           (4, "sim-tcp"): {"PERSEUS_TEST_DEVICE": "sim", "PERSEUS_SHM_ALLREDUCE": "0",
                            "PERSEUS_ALLREDUCE_STREAMS": "2"},
           # Every array on a real GPU (sim_requests.h), staged through pinned
           # host memory: NCCL refuses two ranks on one GPU. Skipped without one.
           (2, "cuda"): {"PERSEUS_TEST_DEVICE": "cuda", "PERSEUS_GPU_TRANSPORT": "host"},
           (4, "cuda-tcp"): {"PERSEUS_TEST_DEVICE": "cuda", "PERSEUS_GPU_TRANSPORT": "host",
                             "PERSEUS_SHM_ALLREDUCE": "0", "PERSEUS_ALLREDUCE_STREAMS": "2"},
           # The same through the CUDA plane (cuda_plane.cc) and kernels.cc on
           # the CPU: the stand-in driver of cc/testing/fake_cuda.cc runs the
           # kernels' source as host code. Every machine runs these.
           (2, "cudaemu"): {"PERSEUS_TEST_DEVICE": "cuda", "PERSEUS_GPU_TRANSPORT": "host"},
           (4, "cudaemu-tcp"): {"PERSEUS_TEST_DEVICE": "cuda", "PERSEUS_GPU_TRANSPORT": "host",
                                "PERSEUS_SHM_ALLREDUCE": "0", "PERSEUS_ALLREDUCE_STREAMS": "2"},
           # Two stand-in devices, each rank on its local rank's, as on a
           # machine of several GPUs: the stand-in fails any launch, copy or
           # event of another device than the current context's.
           (2, "cudaemu-2gpus"): {"PERSEUS_TEST_DEVICE": "cuda", "PERSEUS_GPU_TRANSPORT": "host",
                                  "PERSEUS_TEST_CUDA_DEVICE": "local", "FAKE_CUDA_DEVICES": "2"}}


@pytest.fixture(scope="module", params=sorted(CONFIGS), ids=lambda k: f"{k[0]}ranks-{k[1]}")
def launched(request):
    env = dict(CONFIGS[request.param])
    if request.param[1].startswith("cudaemu"):
        env.update(fake_cuda_env())
    elif request.param[1].startswith("cuda") and cuda_devices() == 0:
        pytest.skip("no GPU here: the CUDA data plane runs on a GPU machine "
                    "(tools/gpu_session.sh)")
    return run_checks("checks_core", request.param[0], names=CHECKS, env=env, timeout=300)


@pytest.mark.parametrize("check", CHECKS)
def test_core(launched, check):
    launched.assert_ok(check)


def test_a_name_called_twice_in_flight_fails_on_every_rank_at_3_ranks():
    r = run_checks("checks_core", 3, names=[TWICE], timeout=300,
                   env={"PERSEUS_STALL_TIMEOUT_SECONDS": "20"})
    r.assert_ok(TWICE)
    assert r.proc.returncode == 0, r.proc.stderr[-3000:]


def test_clean_exit(launched):
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]


@pytest.mark.parametrize("fault,expected", [
    # The runtime reads an input before the producer's event fired: named
    # from the reader's side, or (when the producer's stream happened to run
    # its write after the runtime's read) from the writer's, as a write over
    # memory whose read it had no way to know had finished.
    ("skip_wait", r"stream \d+ read a \d+-byte allocation in '[^']+' before it knew that "
                  r"the write by stream \d+ \('the producer writes the input'\)|"
                  r"stream \d+ wrote a \d+-byte allocation in 'the producer writes the input' "
                  r"before it knew that a read by stream \d+ had finished"),
    # A request completes before the device work that writes its output:
    # named as work still queued, or (when the stream happened to run it
    # first) as a write the host had no way to know had finished.
    ("early_finish", r"the host read (memory in 'the caller reads the result' while '[^']+' "
                     r"on stream \d+ had not finished|a \d+-byte allocation in 'the caller "
                     r"reads the result' before it knew that the write by stream \d+ "
                     r"\('[^']+'\) had finished)"),
])
def test_the_simulated_device_catches_ordering_mistakes(fault, expected):
    """The runtime with one ordering step left out (a test-only fault): the
    simulated device names the hazard, so the sim runs above would fail on
    such a mistake however the timing falls."""
    got = run_checks("checks_core", 2, timeout=180,
                     env={"PERSEUS_TEST_DEVICE": "sim", "PERSEUS_TEST_SIM_FAULT": fault,
                          "PERSEUS_CHECKS_ONLY": "large_tensor"})
    for rank in range(2):
        message = got.results[rank]["check_large_tensor_and_fp16_reduce"]
        assert re.search(expected, message), message


def _plan_check_run(np_, check_every, swap=None, hosts=None, env=None, steps=16, argument=False):
    """Runs plan_check_worker.py; returns {rank: [(plan step, "OK"|"WRONG",
    control bytes so far)]}, {rank: failure message} and {rank: plan checks
    at the end}."""
    extra = {"PERSEUS_OFFLINE_NEG_CHECK_N_STEPS": None if argument else str(check_every),
             "PERSEUS_TEST_PLAN_SWAP": swap, **(env or {})}
    argv = [sys.executable, os.path.join(WORKERS, "plan_check_worker.py"), str(steps)]
    if argument:  # init(offline_neg_check_n_steps=...) instead of the variable
        argv.append(str(check_every))
    proc = launch(np_, argv, env=extra, hosts=hosts, timeout=180)
    steps_by_rank, failed, done = {}, {}, {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\[(\d+)\] (STEP \d+ (OK|WRONG) (\d+) (\d+)|FAILED \d+ (.*)|DONE (\d+))$", line)
        if not m:
            continue
        rank = int(m.group(1))
        if m.group(3):
            # offline_steps after the step; 0: the step was negotiated online.
            steps_by_rank.setdefault(rank, []).append(
                (int(m.group(4)) - 1, m.group(3), int(m.group(5))))
        elif m.group(6) is not None:
            failed[rank] = m.group(6)
        else:
            done[rank] = int(m.group(7))
    return proc, steps_by_rank, failed, done


@pytest.mark.parametrize("np_,victim,swap_at,every,hosts,env", [
    (2, 1, 5, 4, None, {}),
    (4, 2, 5, 4, None, {"PERSEUS_SHM_ALLREDUCE": "0"}),
    (4, 3, 4, 3, "127.0.0.1:2,127.0.0.2:2", {"PERSEUS_ALLREDUCE_MODE": "1"}),
], ids=["2ranks-shm", "4ranks-tcp", "2hosts-hierarchical"])
def test_plan_check_names_the_tensor_where_plans_differ(np_, victim, swap_at, every, hosts, env):
    # One rank's copy of the plan has two same-shaped tensors swapped from
    # plan step swap_at on: its requests still fit, so the votes see nothing
    # and the sums are wrong until the next check, which fails every rank
    # naming both tensors and which ranks hold which.
    proc, steps, failed, _ = _plan_check_run(np_, every, swap=f"{victim}:{swap_at}", hosts=hosts,
                                             env=env)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode != 0 and sorted(failed) == list(range(np_)), out
    check_at = math.ceil((swap_at + 1) / every) * every  # the first check after the swap
    for rank in range(np_):
        planned = [(s, v) for s, v, _ in steps[rank] if s >= 0]
        assert planned == [(s, "OK") for s in range(swap_at)] + \
            [(s, "WRONG") for s in range(swap_at, check_at)], (rank, steps[rank])
        message = failed[rank]
        assert f"offline plan check before plan step {check_at}" in message, message
        assert f"PERSEUS_OFFLINE_NEG_CHECK_N_STEPS={every}" in message, message
        held = dict(re.findall(r"(ranks? [\d, ]+) ha(?:s|ve) '([^']+)' \(float32 \[5\]\)", message))
        others = ", ".join(str(r) for r in range(np_) if r != victim)
        assert sorted(held) == sorted([f"rank {victim}", f"rank{'s' if np_ > 2 else ''} {others}"]), \
            message
        assert len(set(held.values())) == 2 and all(n.startswith("check.g") for n in held.values()), \
            message


def test_plan_swap_is_silent_without_the_check():
    # What the check guards against: with it off, the same fault gives wrong
    # sums on every step from the swap on, and nothing reports it.
    proc, steps, failed, done = _plan_check_run(2, 0, swap="1:3")
    assert proc.returncode == 0 and not failed and done == {0: 0, 1: 0}, proc.stderr[-3000:]
    for rank in range(2):
        planned = [(s, v) for s, v, _ in steps[rank] if s >= 0]
        assert len(planned) >= 8, steps[rank]
        assert planned == [(s, "OK") for s in range(3)] + \
            [(s, "WRONG") for s in range(3, len(planned))], steps[rank]


def test_plan_check_passes_when_plans_agree():
    # Two hosts x 2, hierarchical, the init() argument: checks before plan
    # steps 0, 3, 6, ... pass, every sum is right, and no control message is
    # sent for them.
    proc, steps, failed, done = _plan_check_run(4, 3, hosts="127.0.0.1:2,127.0.0.2:2",
                                                env={"PERSEUS_ALLREDUCE_MODE": "1"}, argument=True)
    assert proc.returncode == 0 and not failed, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(4):
        assert all(v == "OK" for _, v, _ in steps[rank]), steps[rank]
        plan_steps = steps[rank][-1][0] + 1
        control = [c for s, _, c in steps[rank] if s >= 1]
        assert control[0] == control[-1], steps[rank]  # from the plan's second step on
        assert plan_steps >= 8 and done[rank] == math.ceil(plan_steps / 3), (done, steps[rank])
