"""C++ unit tests of the native code's pure parts (cc/**/*_test.cc, with the
small framework in cc/testing/check.h): fp16 conversion and reductions,
cycle message coding, negotiation decisions, plan bucket sizing and extras,
the offline plan's state machine, and the allreduce algorithm choice.
Built with g++ from the sources they test (no Gloo, no TensorFlow)."""

import glob
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["cc/core/common.cc", "cc/core/reduce.cc", "cc/core/timeline.cc",
           "cc/runtime/message.cc", "cc/runtime/negotiation.cc", "cc/runtime/negotiation_plan.cc",
           "cc/runtime/fusion.cc",
           "cc/runtime/plan.cc", "cc/transport/allreduce_algorithms.cc",
           "cc/device/sim_device.cc"]
FLAGS = ["-std=c++17", "-O1", "-Wall", "-Wno-sign-compare", "-pthread", "-I" + ROOT]


def _build(out, sources):
    cmd = ["g++"] + FLAGS + [os.path.join(ROOT, s) for s in sources] + ["-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


@pytest.fixture(scope="module")
def unit_binary(tmp_path_factory):
    tests = sorted(os.path.relpath(p, ROOT)
                   for p in glob.glob(os.path.join(ROOT, "cc", "**", "*_test.cc"), recursive=True))
    assert len(tests) >= 4, tests
    return _build(tmp_path_factory.mktemp("cc") / "unit", SOURCES + tests + ["cc/testing/main.cc"])


def test_cc_unit_tests_pass(unit_binary):
    proc = subprocess.run([str(unit_binary)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "0 failed checks" in proc.stdout
    ran = [l for l in proc.stdout.splitlines() if l.startswith("ok ")]
    assert len(ran) >= 20, proc.stdout


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
