"""Runs a tier of the test suite (tests/tiers.py) in parallel lanes, times
every phase and prints CI's timing table at the end.

    python3 tools/run_tests.py check          the fast tier (make check)
    python3 tools/run_tests.py test           set-up, then every pass (make test, CI)
    python3 tools/run_tests.py test --lanes 1 --only test_core.py

Why lanes: the suite waits more than it computes. A launch of ranks spends
much of its time in deadlines the tests exercise, in sleeps of stuck ranks,
in sshd and Slurm start-up, and one pytest process keeps this 2-core machine
about half busy. Each lane is a worker that takes the next job (one test file
of one pass, or a named part of one) from a shared queue, longest first by
the weights in tests/tiers.py, and runs it as a pytest process of its own.
Jobs of one pass share nothing but the machine: each pytest run has its own
scratch folder (tests/conftest.py), and the files that make network
namespaces, Slurm clusters or Bazel builds name them per process.

What it writes under OUT (default build/ci, removed first):
  phases.txt                 NAME SECONDS STATUS per phase (tools/ci_report.py)
  <pass>/<job>.xml, .log     each job's JUnit XML and output
  check_times.jsonl          each batched check's time (tests/harness.py)

Only the standard library: `make test` starts it with the system Python,
before any venv exists.
"""

import argparse
import heapq
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import tiers  # noqa: E402  (tests/tiers.py: what runs in which tier and pass)


class Phases:
    """Appends `NAME SECONDS STATUS` lines to OUT/phases.txt."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()

    def add(self, name, seconds, status):
        with self.lock, open(self.path, "a") as f:
            f.write(f"{name} {seconds:.1f} {status}\n")


def run_phase(phases, name, argv, env=None):
    """Runs one set-up command in the foreground; returns whether it passed."""
    print(f"==> {name}: {' '.join(argv)}", flush=True)
    start = time.monotonic()
    rc = subprocess.call(argv, cwd=ROOT, env=env)
    phases.add(name, time.monotonic() - start, "ok" if rc == 0 else f"FAILED(rc={rc})")
    return rc == 0


class Job:
    """One pytest process: a test file (or part of one) of one pass."""

    def __init__(self, run, spec):
        self.run = run  # tiers.Run: the pass's name, venv and environment
        self.spec = spec  # tiers.Job
        self.name = spec.name
        self.rc = None
        self.seconds = 0.0
        self.summary = ""
        self.lane = None

    def paths(self, out):
        folder = os.path.join(out, self.run.name)
        return os.path.join(folder, self.name + ".xml"), os.path.join(folder, self.name + ".log")

    def execute(self, out, lane):
        self.lane = lane
        xml, log = self.paths(out)
        os.makedirs(os.path.dirname(xml), exist_ok=True)
        env = dict(os.environ)
        env.update(self.run.env)
        env["PERSEUS_CHECK_TIMES"] = os.path.join(out, "check_times.jsonl")
        python = os.path.join(ROOT, self.run.venv, "bin", "python")
        argv = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                "-o", "junit_suite_name=" + self.run.name, "--durations=5"]
        argv += self.spec.pytest_args()
        start = time.monotonic()
        with open(log, "w") as f:
            f.write(" ".join(argv) + "\n")
            f.flush()
            self.rc = subprocess.call(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        self.seconds = time.monotonic() - start
        with open(log) as f:
            lines = [l.strip() for l in f if l.strip()]
        self.summary = lines[-1] if lines else "(no output)"


def schedule(jobs, lanes, out, on_done):
    """Runs jobs on `lanes` worker threads, the heaviest waiting job first."""
    queue = [(-j.spec.weight, i, j) for i, j in enumerate(jobs)]
    heapq.heapify(queue)
    lock = threading.Lock()

    def worker(lane):
        while True:
            with lock:
                if not queue:
                    return
                _, _, job = heapq.heappop(queue)
            job.execute(out, lane)
            on_done(job)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_jobs(phases, runs, lanes, out):
    """Every job of every run in one queue; returns the jobs that failed."""
    jobs = [Job(run, spec) for run in runs for spec in run.jobs]
    print(f"==> {len(jobs)} test jobs on {lanes} lanes "
          f"({', '.join(f'{r.name}: {len(r.jobs)}' for r in runs)})", flush=True)
    start = time.monotonic()
    print_lock = threading.Lock()

    def done(job):
        status = "ok" if job.rc == 0 else f"FAILED(rc={job.rc})"
        with print_lock:
            print(f"  [lane {job.lane}] {job.run.name} {job.name}: {job.summary} "
                  f"({job.seconds:.0f} s)", flush=True)
        phases.add(f"{job.run.name}:{job.name}", job.seconds, status)

    schedule(jobs, lanes, out, done)
    wall = time.monotonic() - start
    for run in runs:
        mine = [j for j in jobs if j.run is run]
        phases.add(f"pass-{run.name}(summed)", sum(j.seconds for j in mine),
                   "ok" if all(j.rc == 0 for j in mine) else "FAILED")
    phases.add("tests(wall,all-lanes)", wall, "ok" if all(j.rc == 0 for j in jobs) else "FAILED")
    return [j for j in jobs if j.rc != 0]


def show_failures(failed, out):
    for job in failed:
        _, log = job.paths(out)
        with open(log) as f:
            text = f.read()
        print(f"\n======== {job.run.name} {job.name} failed (log: {log}) ========")
        print(text[-20000:])


def report(out, top):
    xmls = []
    for folder in sorted(os.listdir(out)):
        path = os.path.join(out, folder)
        if os.path.isdir(path):
            xmls += sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".xml"))
    argv = [sys.executable, os.path.join(ROOT, "tools", "ci_report.py"),
            os.path.join(out, "phases.txt"), "--top", str(top),
            "--checks", os.path.join(out, "check_times.jsonl")] + xmls
    subprocess.call(argv, cwd=ROOT)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tier", choices=["check", "test"])
    parser.add_argument("--lanes", type=int,
                        default=int(os.environ.get("PERSEUS_TEST_LANES", "2")),
                        help="parallel pytest processes (default 2, or PERSEUS_TEST_LANES)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="job names (test files, e.g. test_core.py) to run, nothing else")
    parser.add_argument("--no-setup", action="store_true",
                        help="test: skip the set-up phases (venvs and builds exist)")
    parser.add_argument("--out", default=os.path.join(ROOT, "build", "ci"))
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if args.lanes < 1:
        parser.error(f"--lanes (PERSEUS_TEST_LANES) must be 1 or more, got {args.lanes}")

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    phases = Phases(os.path.join(args.out, "phases.txt"))
    start = time.monotonic()
    ok = True
    if args.tier == "test" and not args.no_setup:
        for name, target in tiers.SETUP:
            if not run_phase(phases, name, ["make", "--no-print-directory", target]):
                ok = False
                break
    failed = []
    if ok:
        runs = tiers.runs(args.tier)
        if args.only is not None:
            runs = [r.subset(args.only) for r in runs]
            unknown = set(args.only) - {j.name for r in runs for j in r.jobs}
            if unknown:
                parser.error(f"--only: no job named {', '.join(sorted(unknown))} in tier "
                             f"'{args.tier}' (names are test files: test_core.py)")
        failed = run_jobs(phases, runs, args.lanes, args.out)
        show_failures(failed, args.out)
    phases.add("total", time.monotonic() - start, "ok" if ok and not failed else "FAILED")
    report(args.out, args.top)
    if not ok:
        print("\nset-up failed: see its output above", flush=True)
        return 1
    if failed:
        print(f"\n{len(failed)} test job(s) failed: "
              + ", ".join(f"{j.run.name} {j.name}" for j in failed), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
