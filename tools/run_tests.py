"""Runs a tier of the test suite (tests/tiers.py) in parallel lanes, times
every phase and prints CI's timing table at the end.

    python3 tools/run_tests.py check          the fast tier (make check)
    python3 tools/run_tests.py test           set-up, then every pass (make test, CI)
    python3 tools/run_tests.py test --lanes 1 --only test_core.py

Why lanes: the suite waits more than it computes. A launch of ranks spends
much of its time in deadlines the tests exercise, in sleeps of stuck ranks,
in sshd and Slurm start-up, and one pytest process keeps this 2-core machine
about half busy; two kept it 80% busy (CPU time over twice the wall time of
a whole `make test`), three about 90%. Each lane is a worker that takes the next job (one test file
of one pass, or a named part of one) from a shared queue, longest first by
the weights in tests/tiers.py, and runs it as a pytest process of its own.
Jobs of one pass share nothing but the machine: each pytest run has its own
scratch folder (tests/conftest.py), and the files that make network
namespaces, Slurm clusters or Bazel builds name them per process.

Every job has a deadline (PERSEUS_TEST_JOB_TIMEOUT, 1800 s, or a longer one
of its own in tests/tiers.py): one that runs past it is killed with what it
started and fails.

What it writes under OUT (default build/ci, removed first):
  phases.txt                 NAME SECONDS STATUS [CPU] per phase (tools/ci_report.py)
  <pass>/<job>.xml, .log     each job's JUnit XML and output
  check_times.jsonl          each batched check's time (tests/harness.py)

Only the standard library: `make test` starts it with the system Python,
before any venv exists.
"""

import argparse
import heapq
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_number(name, default, minimum):
    """An integer setting from the environment, checked."""
    text = os.environ.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise SystemExit(f"run_tests.py: {name}={text!r}: must be an integer of {minimum} or more")
    return value


# A job that runs longer is killed and fails (every wait in the tests has a
# deadline of its own; this one catches what slips through).
JOB_TIMEOUT = env_number("PERSEUS_TEST_JOB_TIMEOUT", 1800, 1)
# The sessions of the jobs running now: an interrupted run kills them (they
# are not in the terminal's process group, so Ctrl-C does not reach them).
RUNNING = set()
sys.path.insert(0, os.path.join(ROOT, "tests"))
import tiers  # noqa: E402  (tests/tiers.py: what runs in which tier and pass)


class Phases:
    """Appends `NAME SECONDS STATUS [CPU_SECONDS]` lines to OUT/phases.txt."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()

    def add(self, name, seconds, status, cpu=None):
        with self.lock, open(self.path, "a") as f:
            f.write(f"{name} {seconds:.1f} {status}" + (f" {cpu:.1f}" if cpu is not None else "")
                    + "\n")


def run_phase(phases, name, argv, env=None):
    """Runs one set-up command; returns whether it passed."""
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
        self.cpu = 0.0
        self.summary = ""
        self.lane = None

    @property
    def needs(self):
        return self.run.needs + self.spec.needs

    @property
    def timeout(self):
        return max(self.spec.timeout or 0, JOB_TIMEOUT)

    def skip(self, lane, why):
        self.lane, self.rc, self.summary = lane, "not run", why

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
        # CPU of processes the job's own wait does not count (tests/zygote.py's
        # servers and the ranks they fork), written by tests/conftest.py.
        extra_cpu = xml[:-len(".xml")] + ".extra-cpu"
        env["PERSEUS_TEST_EXTRA_CPU"] = extra_cpu
        python = os.path.join(ROOT, self.run.venv, "bin", "python")
        argv = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                "-o", "junit_suite_name=" + self.run.name, "--durations=5"]
        argv += self.spec.pytest_args()
        start = time.monotonic()
        with open(log, "w") as f:
            f.write(" ".join(argv) + "\n")
            f.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            RUNNING.add(proc.pid)
            try:
                self.rc, self.cpu = wait_with_deadline(proc, start + self.timeout)
            finally:
                RUNNING.discard(proc.pid)
            try:
                with open(extra_cpu) as extra:
                    self.cpu = (self.cpu or 0) + float(extra.read())
                os.unlink(extra_cpu)
            except (OSError, ValueError):
                pass
            if self.rc is None:
                f.write(f"\nrun_tests.py: the job ran past its deadline ({self.timeout:.0f} s: "
                        f"PERSEUS_TEST_JOB_TIMEOUT, or its own in tests/tiers.py) "
                        f"and was killed\n")
                self.rc = "timeout"
        self.seconds = time.monotonic() - start
        with open(log) as f:
            lines = [l.strip() for l in f if l.strip()]
        self.summary = lines[-1] if lines else "(no output)"


def wait_with_deadline(proc, deadline):
    """(exit status or None when killed at the deadline, CPU seconds of the
    job and every descendant it waited for: os.wait4's rusage)."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and what it started in its session
            _, _, usage = os.wait4(proc.pid, 0)
            proc.returncode = -signal.SIGKILL
            return None, usage.ru_utime + usage.ru_stime
        time.sleep(0.2)


class SetupState:
    """The set-up phases that run beside the lanes: which have ended, and
    how (a job that needs one waits for it)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.ended = {}  # phase name -> passed

    def finish(self, name, passed):
        with self.cond:
            self.ended[name] = passed
            self.cond.notify_all()

    def blocked(self, needs):
        """None when every phase in `needs` passed; "wait" while one runs; the
        name of a failed one."""
        for name in needs:
            if name not in self.ended:
                return "wait"
            if not self.ended[name]:
                return name
        return None


def schedule(jobs, lanes, out, on_done, setup=None):
    """Runs jobs on `lanes` worker threads: each takes the heaviest job whose
    set-up phases have passed (a job whose phase failed fails unrun)."""
    setup = setup or SetupState()
    waiting = sorted(jobs, key=lambda j: -j.spec.weight)

    def take():
        with setup.cond:
            while waiting:
                for job in waiting:
                    why = setup.blocked(getattr(job, "needs", ()))
                    if why != "wait":
                        waiting.remove(job)
                        return job, why
                setup.cond.wait(timeout=1.0)
            return None, None

    def worker(lane):
        while True:
            job, failed_setup = take()
            if job is None:
                return
            if failed_setup:
                job.skip(lane, f"set-up phase {failed_setup} failed")
            else:
                job.execute(out, lane)
            on_done(job)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_jobs(phases, runs, lanes, out, setup=None):
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
                  f"({job.seconds:.0f} s, {job.cpu:.0f} s CPU)", flush=True)
        phases.add(f"{job.run.name}:{job.name}", job.seconds, status, job.cpu)

    schedule(jobs, lanes, out, done, setup)
    wall = time.monotonic() - start
    for run in runs:
        mine = [j for j in jobs if j.run is run]
        phases.add(f"pass-{run.name}(summed)", sum(j.seconds for j in mine),
                   "ok" if all(j.rc == 0 for j in mine) else "FAILED", sum(j.cpu for j in mine))
    phases.add("tests(wall,all-lanes)", wall, "ok" if all(j.rc == 0 for j in jobs) else "FAILED",
               sum(j.cpu for j in jobs))
    return [j for j in jobs if j.rc != 0]


def show_failures(failed, out):
    for job in failed:
        _, log = job.paths(out)
        if not os.path.exists(log):
            print(f"\n======== {job.run.name} {job.name} did not run: {job.summary} ========")
            continue
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
    parser.add_argument("--lanes", type=int, default=env_number("PERSEUS_TEST_LANES", 3, 1),
                        help="parallel pytest processes (default 3, or PERSEUS_TEST_LANES)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="jobs to run, nothing else: test files (test_core.py: all their "
                             "parts) or parts (test_shard.py[np2])")
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
    setup = SetupState()
    beside = []
    for name, target, background in (tiers.SETUP if args.tier == "test" else []):
        if args.no_setup:
            setup.finish(name, True)
            continue
        argv = ["make", "--no-print-directory", target]
        if not ok or not background:
            if ok and not run_phase(phases, name, argv):
                ok = False
            continue

        def side(name=name, argv=argv):
            setup.finish(name, run_phase(phases, name, argv))
        beside.append(threading.Thread(target=side, daemon=True))
        beside[-1].start()
    failed = []
    if ok:
        runs = tiers.runs(args.tier)
        if args.only is not None:
            runs = [r.subset(args.only) for r in runs]
            unknown = set(args.only) - {n for r in runs for j in r.jobs for n in (j.name, j.file)}
            if unknown:
                parser.error(f"--only: no job named {', '.join(sorted(unknown))} in tier "
                             f"'{args.tier}' (names are test files: test_core.py)")
        failed = run_jobs(phases, runs, args.lanes, args.out, setup)
        show_failures(failed, args.out)
    for thread in beside:
        thread.join()
    if not all(setup.ended.get(name, True) for name, _, _ in tiers.SETUP):
        ok = False
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


def stop_running_jobs(*_):
    for pid in list(RUNNING):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit("run_tests.py: interrupted; the running test jobs were killed")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop_running_jobs)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        stop_running_jobs()
