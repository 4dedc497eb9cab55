"""The test suite's own plumbing: every test file runs in `make test`, the
tiers name files that exist, the timing table adds up, the lanes run every
job once (heaviest first), and a batched launch runs exactly the checks it
names. No TensorFlow."""

import json
import os
import subprocess
import sys
import threading

import pytest

import tiers
from harness import ROOT, WORKERS, check_names, four_rank_checks

sys.path.insert(0, os.path.join(ROOT, "tools"))
import ci_report  # noqa: E402
import run_tests  # noqa: E402

TESTS = os.path.join(ROOT, "tests")


def test_every_test_file_runs_in_the_first_pass():
    files = sorted(f for f in os.listdir(TESTS) if f.startswith("test_") and f.endswith(".py"))
    first = {j.file for j in tiers.FIRST_PASS}
    assert sorted(first) == files, (
        f"not in tests/tiers.py FIRST_PASS: {sorted(set(files) - first)}; "
        f"named there but missing: {sorted(first - set(files))}")


def _collected(run, args):
    env = dict(os.environ, **run.env)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--collect-only"] + args, cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [l for l in out.stdout.splitlines() if "::" in l]


@pytest.mark.parametrize("run", tiers.runs("test"), ids=lambda r: r.name)
def test_a_file_split_into_parts_runs_each_of_its_tests_once(run):
    # A file run as several jobs of one pass (tiers.SHARD_JOBS): the parts'
    # selections together collect every test the file has in that pass, and
    # none twice. (Collected with this venv's pytest and the pass's
    # environment: collection imports no TensorFlow.)
    split = {}
    for job in run.jobs:
        split.setdefault(job.file, []).append(job)
    split = {f: jobs for f, jobs in split.items() if len(jobs) > 1}
    if run.name == tiers.FIRST:
        assert "test_shard.py" in split, sorted(split)
    for file, jobs in split.items():
        assert all(j.select and j.part for j in jobs), [j.name for j in jobs]
        whole = _collected(run, [os.path.join("tests", file)])
        parts = [_collected(run, j.pytest_args()) for j in jobs]
        together = [i for p in parts for i in p]
        assert sorted(together) == sorted(whole), (
            f"{file}: in no part {sorted(set(whole) - set(together))}; "
            f"in more than one {sorted(i for i in set(together) if together.count(i) > 1)}")


@pytest.mark.parametrize("tier", ["check", "test"])
def test_tier_jobs_name_existing_files_once(tier):
    for run in tiers.runs(tier):
        names = [j.name for j in run.jobs]
        assert len(names) == len(set(names)), names
        for job in run.jobs:
            assert os.path.exists(os.path.join(TESTS, job.file)), job.file
            assert job.weight > 0, job.name
    second = tiers.runs("test")[1]
    assert second.venv == ".venv-tf215" and second.env["PERSEUS_TEST_PASS"] == tiers.SECOND


def test_four_rank_lists_name_checks_of_their_module(tmp_path, monkeypatch):
    modules = [f[:-3] for f in os.listdir(WORKERS) if f.startswith("checks_")]
    with_lists = [m for m in modules if four_rank_checks(m)]
    assert {"checks_ops", "checks_horovod", "checks_horovod_keras"} <= set(with_lists)
    for module in with_lists:
        assert set(four_rank_checks(module)) < set(check_names(module)), module
    # A name that is no check of the module is an error, not an empty launch.
    (tmp_path / "fake_checks.py").write_text(
        "AT_4_RANKS = ('check_a', 'check_typo')\ndef check_a():\n    pass\n")
    import harness
    monkeypatch.setattr(harness, "WORKERS", str(tmp_path))
    with pytest.raises(AssertionError, match="check_typo"):
        harness.four_rank_checks("fake_checks")


FAKE_WORKER = """
ran = []
def setup():
    return 0
def check_a():
    ran.append("a")
def check_b():
    raise ValueError("b fails")
def check_c():
    ran.append("c")
"""


def _run_checks(tmp_path, names):
    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), PERSEUS_CHECKS_NAMES=names)
    return subprocess.run([sys.executable, os.path.join(WORKERS, "run_checks.py"), "fake_worker",
                           str(out)], env=env, capture_output=True, text=True, timeout=60), out


def test_a_launch_runs_exactly_the_checks_it_names(tmp_path):
    proc, out = _run_checks(tmp_path, "check_a,check_b")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "rank0.json").read_text())
    assert sorted(results) == ["check_a", "check_b"]
    assert results["check_a"] == "ok" and "b fails" in results["check_b"]
    seconds = json.loads((out / "rank0.seconds.json").read_text())
    assert sorted(seconds) == ["check_a", "check_b"] and all(s >= 0 for s in seconds.values())
    proc, _ = _run_checks(tmp_path, "check_a,check_zz")
    assert proc.returncode != 0 and "fake_worker has no check_zz" in proc.stderr, proc.stderr


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_alpha" name="test_one" time="10.5"/>
<testcase classname="tests.test_alpha" name="test_two[2]" time="2.0"><failure message="x"/></testcase>
<testcase classname="tests.test_beta" name="test_three" time="40.0"/>
<testcase classname="tests.test_beta" name="test_four" time="0.5"><skipped/></testcase>
</testsuite></testsuites>"""


def test_the_timing_table_sums_each_file_of_each_pass(tmp_path):
    for name in ("tf2.21", "tf2.15"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "job.xml").write_text(JUNIT)
    assert ci_report.file_times(str(tmp_path / "tf2.21" / "job.xml")) == {
        "test_alpha.py": (12.5, 2, 1), "test_beta.py": (40.5, 2, 0)}
    phases = tmp_path / "phases.txt"
    phases.write_text("set-up 61.0 ok\ntf2.21:test_beta.py 45.0 ok 80.6\ntotal 300.0 FAILED\n")
    times = tmp_path / "checks.jsonl"
    times.write_text(json.dumps({"module": "checks_x", "np": 4, "env": "A=1", "check": "check_slow",
                                 "seconds": 9.25}) + "\n")
    text = ci_report.report(ci_report.read_phases(str(phases)),
                            [str(tmp_path / "tf2.21" / "job.xml"),
                             str(tmp_path / "tf2.15" / "job.xml")], top=1, checks=str(times))
    lines = text.splitlines()
    assert any(l.split()[:2] == ["set-up", "61"] for l in lines), text
    assert any(l.split()[:2] == ["total", "300"] for l in lines), text
    assert any(l.split()[:2] == ["tf2.21:test_beta.py", "45"] and "81 s CPU" in l
               for l in lines), text
    assert "== pass tf2.21: 2 test files, 4 test ids, 1 failed, 53 s" in text, text
    assert "== pass tf2.15:" in text
    # --top 1: only the slowest file of each pass.
    assert text.count("test_beta.py") >= 2 and "test_alpha.py" not in text, text
    assert "9.2  4 ranks  checks_x.check_slow  [A=1]" in text, text


class _FakeJob:
    def __init__(self, weight, log, lock):
        self.spec = tiers.Job(f"w{weight}.py", weight)
        self.log, self.lock = log, lock

    def execute(self, out, lane):
        with self.lock:
            self.log.append((self.spec.weight, lane))


@pytest.mark.parametrize("lanes", [1, 3])
def test_lanes_run_every_job_once_heaviest_first(lanes):
    log, lock, done = [], threading.Lock(), []
    jobs = [_FakeJob(w, log, lock) for w in (5, 50, 1, 20, 7)]
    run_tests.schedule(jobs, lanes, "unused", done.append)
    assert sorted(w for w, _ in log) == [1, 5, 7, 20, 50] and len(done) == 5
    assert {lane for _, lane in log} <= set(range(lanes))
    if lanes == 1:
        assert [w for w, _ in log] == [50, 20, 7, 5, 1]


def test_a_job_past_its_deadline_is_killed_with_what_it_started(tmp_path):
    import time
    child = tmp_path / "child.pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"p = subprocess.Popen(['sleep', '300']); open({str(child)!r}, 'w').write(str(p.pid))\n"
         "time.sleep(300)"], start_new_session=True)
    while not child.exists() or not child.read_text():
        time.sleep(0.05)
    start = time.monotonic()
    rc, cpu = run_tests.wait_with_deadline(proc, time.monotonic() + 0.5)
    assert rc is None and cpu >= 0 and time.monotonic() - start < 30
    grandchild = int(child.read_text())
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
        try:  # killed, waiting for init to reap it
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{grandchild}"), "the job's child outlived the kill"
    rc, cpu = run_tests.wait_with_deadline(subprocess.Popen(["true"]), time.monotonic() + 30)
    assert rc == 0


def test_a_job_waits_for_the_set_up_it_needs_and_fails_unrun_when_it_failed():
    log, lock, done = [], threading.Lock(), []
    setup = run_tests.SetupState()
    first = _FakeJob(5, log, lock)
    later = _FakeJob(50, log, lock)
    later.needs = ("slow-phase",)
    broken = _FakeJob(1, log, lock)
    broken.needs = ("bad-phase",)
    skipped = []
    broken.skip = lambda lane, why: skipped.append(why)
    setup.finish("bad-phase", False)
    threading.Timer(0.5, setup.finish, ("slow-phase", True)).start()
    run_tests.schedule([first, later, broken], 1, "unused", done.append, setup)
    # The heaviest job waited for its phase; the others ran meanwhile.
    assert [w for w, _ in log] == [5, 50], log
    assert skipped == ["set-up phase bad-phase failed"] and len(done) == 3


@pytest.mark.parametrize("variable,value", [("PERSEUS_TEST_LANES", "0"),
                                            ("PERSEUS_TEST_JOB_TIMEOUT", "soon")])
def test_bad_settings_of_the_runner_are_named(variable, value):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "run_tests.py"), "check",
                           "--out", os.path.join(ROOT, "build", "ci-unused")],
                          env=dict(os.environ, **{variable: value}), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert f"{variable}={value!r}: must be an integer of 1 or more" in proc.stderr, proc.stderr


def _feature_index():
    import importlib.util
    path = os.path.join(ROOT, "tools", "gen_feature_index.py")
    spec = importlib.util.spec_from_file_location("gen_feature_index", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_readme_feature_names_checks_that_exist_and_the_index_is_current():
    """tests/features.py covers each row of README's feature table with
    checks that exist, and docs/testing.md's index is rendered from it; a
    row without checks, a misspelt check or a stale index fails."""
    gen = _feature_index()
    assert gen.problems() == [], gen.problems()
    page = open(gen.PAGE).read()
    assert gen.updated(page) == page, "run python tools/gen_feature_index.py"
    real = gen.features
    try:
        gen.features = lambda: real()[1:] + [("`perseusrun` over ssh", [
            "tests/test_runner.py::test_no_such_test", "checks_core.check_no_such_check",
            "tests/test_no_such_file.py"])]
        found = gen.problems()
    finally:
        gen.features = real
    assert any("without an entry" in p and "PerseusStrategy" in p for p in found), found
    assert any("has no test_no_such_test" in p for p in found), found
    assert any("no check checks_core.check_no_such_check" in p for p in found), found
    assert any("no file tests/test_no_such_file.py" in p for p in found), found
