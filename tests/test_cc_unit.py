"""C++ unit tests of the native code's pure parts (cc/**/*_test.cc, with the
small framework in cc/testing/check.h): fp16 conversion and reductions,
cycle message coding, negotiation decisions, plan bucket sizing and extras,
the offline plan's state machine, the allreduce algorithm choice, the
simulated device's hazard checks, and NCCL loaded at run time (against a fake
libnccl.so.2 built here from cc/testing/fake_nccl.cc: bootstrap, sums,
non-blocking creation, asynchronous errors, deadlines and aborts).
Built with g++ from the sources they test (no Gloo, no TensorFlow, no GPU),
listed once in cc/testing/unit_tests.bzl (BUILD loads the same lists); a
binary is compiled once per change of its inputs and kept in build/cc-unit/."""

import ast
import glob
import json
import os
import subprocess
import sys

import pytest

from harness import inputs_hash

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-std=c++17", "-O1", "-Wall", "-Wno-sign-compare", "-pthread", "-I" + ROOT]
# Built binaries are kept here, named by the hash of what went into them.
CACHE = os.path.join(ROOT, "build", "cc-unit")


def unit_test_lists():
    """The lists of cc/testing/unit_tests.bzl (the ones BUILD loads)."""
    with open(os.path.join(ROOT, "cc", "testing", "unit_tests.bzl")) as f:
        tree = ast.parse(f.read())
    return {node.targets[0].id: ast.literal_eval(node.value)
            for node in tree.body if isinstance(node, ast.Assign)}


LISTS = unit_test_lists()
SOURCES = LISTS["UNIT_LIBRARY_SOURCES"]
GLOO_TESTS = LISTS["GLOO_UNIT_TESTS"]


def _inputs_hash(cmd, sources):
    """What a build's output depends on: the command, the compiler, the
    sources and every header of the tree (an include may reach any of them)."""
    headers = sorted(glob.glob(os.path.join(ROOT, "cc", "**", "*.h"), recursive=True))
    return inputs_hash(sorted(set(sources)) + headers, json.dumps(cmd),
                       subprocess.run(["g++", "--version"], capture_output=True).stdout)


def _build(out, sources, extra=(), libs=(), cache=True):
    """Compiles sources into `out` with g++; with `cache`, reuses a binary
    built from the same inputs before (build/cc-unit/<hash>/), so only the
    first run after a change compiles."""
    paths = [s if os.path.isabs(s) else os.path.join(ROOT, s) for s in sources]
    cmd = ["g++"] + FLAGS + list(extra) + paths + ["-o", "OUT"] + list(libs) + ["-ldl"]
    if not cache:
        return _compile(cmd, str(out))
    kept = os.path.join(CACHE, _inputs_hash(cmd, paths), os.path.basename(str(out)))
    if not os.path.exists(kept):
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        partial = f"{kept}.{os.getpid()}.partial"
        _compile(cmd, partial)
        os.replace(partial, kept)  # whole or absent, even with two builds at once
    return kept


def _compile(cmd, out):
    cmd = [out if a == "OUT" else a for a in cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


def test_unit_lists_name_files_that_exist():
    for path in SOURCES + [LISTS["UNIT_MAIN"], LISTS["FAKE_NCCL"]] + \
            [p for test, libs in GLOO_TESTS.items() for p in [test] + libs]:
        assert os.path.exists(os.path.join(ROOT, path)), f"cc/testing/unit_tests.bzl: {path}"


def test_the_build_is_reused_until_an_input_changes(tmp_path):
    source = tmp_path / "reuse_test.cc"
    source.write_text('#include "cc/testing/check.h"\nTEST(A) { CHECK(true); }\n'
                      "PERSEUS_TEST_MAIN()\n")
    first = _build(tmp_path / "reuse", [str(source)])
    stamp = os.stat(first).st_mtime_ns
    assert _build(tmp_path / "reuse", [str(source)]) == first
    assert os.stat(first).st_mtime_ns == stamp  # not compiled again
    source.write_text(source.read_text() + "// changed\n")
    assert _build(tmp_path / "reuse", [str(source)]) != first


@pytest.fixture(scope="module")
def unit_binary(tmp_path_factory):
    tests = sorted(os.path.relpath(p, ROOT)
                   for p in glob.glob(os.path.join(ROOT, "cc", "**", "*_test.cc"), recursive=True))
    tests = [t for t in tests if t not in GLOO_TESTS]
    assert len(tests) >= 4, tests
    return _build(tmp_path_factory.mktemp("cc") / "unit", SOURCES + tests + [LISTS["UNIT_MAIN"]])


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory):
    """The fake libnccl.so.2 the NCCL tests load (PERSEUS_TEST_FAKE_NCCL)."""
    return _build(tmp_path_factory.mktemp("nccl") / "libnccl.so.2", [LISTS["FAKE_NCCL"]],
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


def _run_gloo_test(tmp_path, test, want):
    """Builds a unit test of GLOO_UNIT_TESTS (its own binary, -lgloo) and runs it."""
    name = os.path.basename(test)[:-len(".cc")]
    binary = _build(tmp_path / name, GLOO_TESTS[test] + [test, LISTS["UNIT_MAIN"]],
                    libs=["-lgloo"])
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert want in proc.stdout, proc.stdout


def test_gloo_waits_end_when_aborted(tmp_path):
    """cc/transport/gloo_abortable.cc on real Gloo TCP contexts (loopback, two
    ranks as threads): wrapped contexts run Gloo's collectives; an abort ends
    a receive nobody would send to at once, with its reason, and later calls
    throw; a job-wide abort spares contexts made after it."""
    _run_gloo_test(tmp_path, "cc/transport/gloo_abortable_test.cc", "3 tests, 0 failed checks")


def test_recursive_doubling_and_bruck_allgather_on_every_world_size(tmp_path):
    """cc/transport/gloo_transport_test.cc: GlooTransport::AllreduceDoubling on
    real Gloo TCP contexts, every world size from 2 to 7 as threads (the
    non-powers of two fold pairs first): sums, min with a NaN, int64 and an
    order-dependent float sum, the same bits on every rank; tiny and empty
    buffers, twenty calls back to back. AllgatherBlocks (Bruck's rounds, the
    negotiation cycle's allgather) at every size from 2 to 9 and blocks of 1,
    13 and 512 bytes gives what Gloo's ring allgather gives. The cost model's
    measurement at 2, 3, 4 and 8 ranks: the same bits on every rank, alpha and
    beta as given when given."""
    _run_gloo_test(tmp_path, "cc/transport/gloo_transport_test.cc", "4 tests, 0 failed checks")


def test_the_health_monitor_names_ranks_and_fails_rounds_over_a_fake_store(tmp_path):
    """cc/runtime/health_test.cc: the health monitor over a store in memory
    (health.h's HealthStore): a dead, a departed and a stopped rank named, a
    survivor not; the heartbeat failing the round when a peer's connection
    closes and when the store falls silent (within its timeout), and ending
    every wait with the report; the marks of leaving; the slow-rank check; a
    stopped rank named as a watched wait times out (the beats read before
    it), not 1.5 s later."""
    _run_gloo_test(tmp_path, "cc/runtime/health_test.cc", "5 tests, 0 failed checks")


def test_the_controller_negotiates_runs_stops_and_fails_over_fakes(tmp_path):
    """cc/runtime/controller_test.cc: the controller with a real request
    table and executor over fakes_for_tests.h's world of two (the peer makes
    the same calls): a grouped call fused and completed with the right sums,
    an agreed shutdown stopping the thread, a failing control channel
    failing the round and its requests with what it said."""
    _run_gloo_test(tmp_path, "cc/runtime/controller_test.cc", "3 tests, 0 failed checks")


def test_a_failing_check_fails_the_run(tmp_path):
    failing = tmp_path / "failing_test.cc"
    failing.write_text('#include "cc/testing/check.h"\n'
                       "TEST(Fails) { CHECK_EQ(1 + 1, 3); CHECK(false); }\n"
                       "TEST(Passes) { CHECK(true); }\n"
                       "PERSEUS_TEST_MAIN()\n")
    binary = _build(tmp_path / "failing", [str(failing)], cache=False)
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "FAIL Fails" in proc.stdout and "ok   Passes" in proc.stdout, proc.stdout
    assert "1 + 1 == 3 (2 vs 3)" in proc.stderr and "2 failed checks" in proc.stdout


def test_horovod_build_flags_say_what_this_install_has(fake_nccl):
    """hvd.cuda_built(): the CUDA data plane every install builds;
    hvd.nccl_built(): NCCL's version code when it loads here, else 0."""
    code = ("import json, perseus_tf.horovod as hvd; "
            "print(json.dumps([hvd.cuda_built(), hvd.nccl_built()]))")
    for env, nccl in (({"PERSEUS_NCCL_LIBRARY": str(fake_nccl)}, 22304),
                      ({"PERSEUS_NCCL_LIBRARY": "/nonexistent/libnccl.so.2"}, 0)):
        full = dict(os.environ, **env)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, env=full, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, nccl], proc.stdout


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
