"""Starts N ranks under perseusrun and collects what each rank reports.

Each process imports TensorFlow (seconds), so checks are batched: a worker
module defines many `check_*` functions, `workers/run_checks.py` runs all of
them in one launch on every rank, in the same order, and writes one JSON file
per rank ({check name: "ok" or the failure text}). Tests then look results up
by name, so one launch backs many test items.
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


def rank_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("GLOO_TIMEOUT_SECONDS", "60")
    # A failed check can leave ranks making different calls: error, not hang.
    env.setdefault("PERSEUS_STALL_TIMEOUT_SECONDS", "60")
    return apply_env(env, extra)


def apply_env(env, extra):
    """env updated by extra, where a None value removes the variable."""
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env


def collect(procs, timeout):
    """Waits for every process (one shared deadline) and returns their
    stdout texts; kills any still running when the wait ends, even by an
    exception."""
    import time
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return outs


def read_results(out, np_):
    """{rank: {check: outcome}} from the rank<R>.json files run_checks.py wrote."""
    results = {}
    for rank in range(np_):
        path = os.path.join(out, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[rank] = json.load(f)
    return results


def launch(np_, argv, env=None, timeout=300, hosts=None):
    """Runs `perseusrun -np N [-H hosts] -- argv`; returns CompletedProcess."""
    cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", str(np_)]
    if hosts:
        cmd += ["-H", hosts]
    cmd += ["--"] + list(argv)
    return subprocess.run(cmd, env=rank_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


class CheckResults:
    """Results of one batched launch: results[rank][check] == "ok" or an error."""

    def __init__(self, np_, results, proc):
        self.np = np_
        self.results = results
        self.proc = proc

    def assert_ok(self, check):
        problems = []
        for rank in range(self.np):
            outcome = self.results.get(rank, {}).get(check)
            if outcome is None:
                problems.append(f"rank {rank}: did not report {check}")
            elif outcome != "ok":
                problems.append(f"rank {rank}: {outcome}")
        if problems:
            raise AssertionError(
                f"{check} at {self.np} ranks failed:\n" + "\n".join(problems) +
                # The ranks' output too: the runtime says there why a plan
                # was left, what stalled, which rank failed first.
                "\n--- output tail ---\n" + self.proc.stdout[-3000:] + self.proc.stderr[-3000:])


def run_checks(module, np_, env=None, timeout=600, hosts=None):
    """Runs every check_* of tests/workers/<module>.py on np_ ranks."""
    with tempfile.TemporaryDirectory() as out:
        proc = launch(np_, [sys.executable, os.path.join(WORKERS, "run_checks.py"), module, out],
                      env=env, timeout=timeout, hosts=hosts)
        results = read_results(out, np_)
    return CheckResults(np_, results, proc)


def check_names(module):
    """The check_* names a worker module defines, without importing it."""
    names = []
    with open(os.path.join(WORKERS, module + ".py")) as f:
        for line in f:
            if line.startswith("def check_"):
                names.append(line[4:line.index("(")])
    return names


def cuda_devices():
    """How many CUDA devices libperseus_cuda.so sees here (0: none, or the
    library is not built: tests that need a GPU skip then)."""
    import ctypes
    lib = os.path.join(ROOT, "perseus_tf", "libperseus_cuda.so")
    if not os.path.exists(lib):
        return 0
    count = ctypes.c_int(0)
    try:
        rc = ctypes.CDLL(lib).perseus_cuda_device_count(ctypes.byref(count))
    except OSError:
        return 0
    return count.value if rc == 0 else 0

