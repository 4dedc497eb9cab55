"""C++ unit tests of the native code's pure parts (cc/**/*_test.cc, with the
small framework in cc/testing/check.h): fp16 conversion and reductions,
cycle message coding, negotiation decisions, plan bucket sizing and extras,
the offline plan's state machine, the allreduce algorithm choice, the
simulated device's hazard checks, and NCCL loaded at run time (against a fake
libnccl.so.2 built here from cc/testing/fake_nccl.cc: bootstrap, sums,
non-blocking creation, asynchronous errors, deadlines and aborts).
Built with g++ from the sources they test (no Gloo, no TensorFlow, no GPU)."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["cc/core/common.cc", "cc/core/reduce.cc", "cc/core/timeline.cc",
           "cc/runtime/message.cc", "cc/runtime/negotiation.cc", "cc/runtime/negotiation_plan.cc",
           "cc/runtime/fusion.cc",
           "cc/runtime/plan.cc", "cc/transport/allreduce_algorithms.cc",
           "cc/device/sim_device.cc", "cc/transport/nccl.cc"]
# Unit tests that need Gloo (-lgloo), each built into a binary of its own.
GLOO_TESTS = ["cc/transport/gloo_abortable_test.cc"]
FLAGS = ["-std=c++17", "-O1", "-Wall", "-Wno-sign-compare", "-pthread", "-I" + ROOT]


def _build(out, sources, extra=(), libs=()):
    cmd = (["g++"] + FLAGS + list(extra) + [os.path.join(ROOT, s) for s in sources] +
           ["-o", str(out)] + list(libs) + ["-ldl"])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def unit_binary(tmp_path_factory):
    tests = sorted(os.path.relpath(p, ROOT)
                   for p in glob.glob(os.path.join(ROOT, "cc", "**", "*_test.cc"), recursive=True))
    tests = [t for t in tests if t not in GLOO_TESTS]
    assert len(tests) >= 4, tests
    return _build(tmp_path_factory.mktemp("cc") / "unit", SOURCES + tests + ["cc/testing/main.cc"])


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory):
    """The fake libnccl.so.2 the NCCL tests load (PERSEUS_TEST_FAKE_NCCL)."""
    return _build(tmp_path_factory.mktemp("nccl") / "libnccl.so.2", ["cc/testing/fake_nccl.cc"],
                  extra=["-shared", "-fPIC"])


def test_cc_unit_tests_pass(unit_binary, fake_nccl):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NCCL")}
    env["PERSEUS_TEST_FAKE_NCCL"] = str(fake_nccl)
    proc = subprocess.run([str(unit_binary)], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "0 failed checks" in proc.stdout
    ran = [l for l in proc.stdout.splitlines() if l.startswith("ok ")]
    assert len(ran) >= 20, proc.stdout


def test_gloo_waits_end_when_aborted(tmp_path):
    """cc/transport/gloo_abortable.cc on real Gloo TCP contexts (loopback, two
    ranks as threads): wrapped contexts run Gloo's collectives; an abort ends
    a receive nobody would send to at once, with its reason, and later calls
    throw; a job-wide abort spares contexts made after it."""
    binary = _build(tmp_path / "gloo_abortable",
                    ["cc/transport/gloo_abortable.cc", "cc/transport/gloo_abortable_test.cc",
                     "cc/testing/main.cc"],
                    libs=["-lgloo"])
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "3 tests, 0 failed checks" in proc.stdout, proc.stdout


def test_a_failing_check_fails_the_run(tmp_path):
    failing = tmp_path / "failing_test.cc"
    failing.write_text('#include "cc/testing/check.h"\n'
                       "TEST(Fails) { CHECK_EQ(1 + 1, 3); CHECK(false); }\n"
                       "TEST(Passes) { CHECK(true); }\n"
                       "PERSEUS_TEST_MAIN()\n")
    binary = _build(tmp_path / "failing", [str(failing)])
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "FAIL Fails" in proc.stdout and "ok   Passes" in proc.stdout, proc.stdout
    assert "1 + 1 == 3 (2 vs 3)" in proc.stderr and "2 failed checks" in proc.stdout


def _nccl_from_python(env):
    code = "import json; from perseus_tf import _native; print(json.dumps(_native.nccl_library()))"
    full = {k: v for k, v in os.environ.items() if k != "PERSEUS_NCCL_LIBRARY"}
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=full, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_nccl_library_is_found_at_run_time_or_says_why(fake_nccl):
    got = _nccl_from_python({"PERSEUS_NCCL_LIBRARY": str(fake_nccl)})
    assert got == {"available": True, "path": str(fake_nccl), "version": 22304, "why_not": ""}
    got = _nccl_from_python({"PERSEUS_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"})
    assert not got["available"] and "cannot open /nonexistent/libnccl.so.2" in got["why_not"], got
    # Without the variable: the wheels, then the system; absent, it says how to get it.
    got = _nccl_from_python({})
    assert got["available"] or "nvidia-nccl-cu12" in got["why_not"], got
