"""Starts N ranks under perseusrun and collects what each rank reports.

Each process imports TensorFlow (seconds), so checks are batched: a worker
module defines many `check_*` functions, `workers/run_checks.py` runs all of
them in one launch on every rank, in the same order, and writes one JSON file
per rank ({check name: "ok" or the failure text}). Tests then look results up
by name, so one launch backs many test items.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")


EXAMPLES_PACKAGES = os.path.join(ROOT, ".examples-packages")


def use_examples_packages():
    """Puts .examples-packages (scikit-learn, for the examples' digits data:
    Makefile) on this process's PYTHONPATH, so the ranks it launches have it,
    when the interpreter does not have scikit-learn of its own. Test files
    that run the examples call it at import."""
    import importlib.util
    if importlib.util.find_spec("sklearn") is None:
        assert os.path.isdir(EXAMPLES_PACKAGES), f"{EXAMPLES_PACKAGES} is missing: run `make native`"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            filter(None, [EXAMPLES_PACKAGES, os.environ.get("PYTHONPATH")]))


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


def read_results(out, np_, kind=""):
    """{rank: {check: outcome}} from the rank<R>.json files run_checks.py wrote
    (kind ".seconds": {rank: {check: seconds}})."""
    results = {}
    for rank in range(np_):
        path = os.path.join(out, f"rank{rank}{kind}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[rank] = json.load(f)
    return results


def record_check_times(module, np_, env, seconds):
    """Appends each check's slowest rank's wall time to the file named by
    PERSEUS_CHECK_TIMES (one JSON object a line; tools/ci_report.py --checks
    lists the slowest), so a slow check shows by name, not only its file."""
    path = os.environ.get("PERSEUS_CHECK_TIMES")
    if not path:
        return
    names = sorted({n for per_rank in seconds.values() for n in per_rank})
    config = ",".join(f"{k}={v}" for k, v in sorted((env or {}).items())
                      if k != "PERSEUS_CHECKS_NAMES")
    with open(path, "a") as f:
        for name in names:
            worst = max(per_rank.get(name, 0.0) for per_rank in seconds.values())
            f.write(json.dumps({"module": module, "np": np_, "env": config, "check": name,
                                "seconds": worst}) + "\n")


# Scripts whose ranks may start forked from a process that has imported
# TensorFlow already (tests/zygote.py): they import it, compute and report,
# and test nothing of how a rank starts or ends. Workers that kill or stop
# themselves or their launcher, benchmarks and launcher tests start as plain
# processes; so do batched checks of modules that never import TensorFlow
# (the runtime through `_core`: a plain start costs them nothing).
FORKABLE = {os.path.join(WORKERS, name) for name in (
    "run_checks.py", "model_matrix_worker.py", "keras_version_worker.py",
    "backup_worker.py")} | {
    os.path.join(ROOT, "examples", name) for name in (
        "keras_digits.py", "hvd_keras_digits.py", "hvd_estimator.py", "hvd_tape.py",
        "hvd_monitored_session.py", "digits_collectives.py")}
ZYGOTE = os.path.join(ROOT, "tests", "zygote.py")


def _forkable(argv):
    if len(argv) < 2 or argv[0] != sys.executable or argv[1] not in FORKABLE:
        return False
    if os.path.basename(argv[1]) != "run_checks.py":
        return True
    with open(os.path.join(WORKERS, argv[2] + ".py")) as f:
        return any(line.startswith("import tensorflow") for line in f)


def launch(np_, argv, env=None, timeout=300, hosts=None):
    """Runs `perseusrun -np N [-H hosts] -- argv`; returns CompletedProcess.
    A FORKABLE script on this host starts through tests/zygote.py."""
    argv = list(argv)
    if not hosts and _forkable(argv):
        argv = [sys.executable, ZYGOTE, "run"] + argv[1:]
    cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", str(np_)]
    if hosts:
        cmd += ["-H", hosts]
    cmd += ["--"] + argv
    return subprocess.run(cmd, env=rank_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def launch_report(proc, per_rank=1500):
    """What a failed launch said, for an assertion message: perseusrun's own
    lines, then the end of each rank's lines (stdout and stderr), so that the
    rank that failed first is not lost behind the others' tracebacks."""
    own, ranks = [], {}
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.match(r"\[(\d+)\] ", line)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(line)
        else:
            own.append(line)
    parts = [f"perseusrun rc={proc.returncode}:"] + own[-40:]
    for rank in sorted(ranks):
        parts.append(f"-- rank {rank}, last {per_rank} characters:")
        parts.append("\n".join(ranks[rank])[-per_rank:])
    return "\n".join(parts)


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
                "\n--- output ---\n" + launch_report(self.proc))


def run_checks(module, np_, env=None, timeout=600, hosts=None, names=None):
    """Runs every check_* of tests/workers/<module>.py on np_ ranks (only
    those in `names`, when given)."""
    if names is not None:
        env = dict(env or {}, PERSEUS_CHECKS_NAMES=",".join(sorted(names)))
    with tempfile.TemporaryDirectory() as out:
        proc = launch(np_, [sys.executable, os.path.join(WORKERS, "run_checks.py"), module, out],
                      env=env, timeout=timeout, hosts=hosts)
        results = read_results(out, np_)
        record_check_times(module, np_, env, read_results(out, np_, ".seconds"))
    return CheckResults(np_, results, proc)


def check_names(module):
    """The check_* names a worker module defines, without importing it."""
    names = []
    with open(os.path.join(WORKERS, module + ".py")) as f:
        for line in f:
            if line.startswith("def check_"):
                names.append(line[4:line.index("(")])
    return names


def four_rank_checks(module, tuple_name="AT_4_RANKS"):
    """The checks a worker module runs at 4 ranks as well as at 2: the names
    in its AT_4_RANKS tuple (read without importing it), each a check that 4
    ranks test something in that 2 cannot (roots 2 and 3, uneven splits,
    process sets of 2 among 4, several joined ranks). Every name must be a
    check of the module. tuple_name: another such tuple of the module."""
    import ast
    with open(os.path.join(WORKERS, module + ".py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == tuple_name:
            names = list(ast.literal_eval(node.value))
            unknown = sorted(set(names) - set(check_names(module)))
            assert not unknown, f"{module}.{tuple_name} names no check: {unknown}"
            return names
    return []


def checks_at(module, np_):
    """The checks a worker module runs at np_ ranks: every one at 2, its
    AT_4_RANKS at 4."""
    return check_names(module) if np_ == 2 else four_rank_checks(module)


def run_checks_at(module, np_, **kwargs):
    """run_checks of the checks `module` runs at np_ ranks (checks_at)."""
    names = None if np_ == 2 else four_rank_checks(module)
    return run_checks(module, np_, names=names, **kwargs)


def cases(module, rank_counts):
    """(ranks, check) pairs of checks_at for each rank count."""
    return [(np_, name) for np_ in rank_counts for name in checks_at(module, np_)]


def inputs_hash(paths, *also):
    """A short hash of the files' names and contents and of the strings in
    `also`: what a cached build was made from (test_cc_unit, the Bazel test)."""
    import hashlib
    h = hashlib.sha256()
    for text in also:
        h.update(text if isinstance(text, bytes) else str(text).encode())
    for path in paths:
        h.update(path.encode())
        with open(path if os.path.isabs(path) else os.path.join(ROOT, path), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:20]


def fake_cuda_env():
    """The environment that makes libperseus_cuda.so run on the CPU: the
    stand-in CUDA driver and NVRTC of cc/testing/fake_cuda.cc, built here
    (into build/fake_cuda/, again when it or the kernels changed) with
    cc/cuda/kernels.cu compiled as host code."""
    import subprocess
    out = os.path.join(ROOT, "build", "fake_cuda")
    lib = os.path.join(out, "libfake_cuda.so")
    sources = [os.path.join(ROOT, "cc", "testing", "fake_cuda.cc"),
               os.path.join(ROOT, "cc", "cuda", "kernels.cu"),
               os.path.join(ROOT, "cc", "cuda", "kernel_list.h")]
    if not os.path.exists(lib) or \
            os.path.getmtime(lib) < max(os.path.getmtime(p) for p in sources):
        os.makedirs(out, exist_ok=True)
        partial = f"{lib}.{os.getpid()}.partial"
        subprocess.run(["g++", "-std=c++20", "-O2", "-shared", "-fPIC", "-I" + ROOT, sources[0],
                        "-o", partial, "-lpthread"], check=True, capture_output=True, text=True)
        os.replace(partial, lib)
    return {"PERSEUS_CUDA_DRIVER": lib, "PERSEUS_NVRTC_LIBRARY": lib,
            "PERSEUS_KERNEL_CACHE": os.path.join(out, "kernel-cache")}


def tf_gpu_harness(python=sys.executable):
    """Builds tools/tf_gpu_harness.cc (TF's GPU kernels on a stand-in GPU
    device) against `python`'s TensorFlow into build/tf_gpu_harness/, again
    when it changed; returns its path."""
    import subprocess
    out = os.path.join(ROOT, "build", "tf_gpu_harness")
    lib = os.path.join(out, "libtf_gpu_harness.so")
    sources = [os.path.join(ROOT, "tools", "tf_gpu_harness.cc"),
               os.path.join(ROOT, "cc", "cuda", "driver.cc"),
               os.path.join(ROOT, "cc", "core", "shared_library.cc"),
               os.path.join(ROOT, "cc", "cuda", "driver.h"),
               os.path.join(ROOT, "cc", "core", "shared_library.h")]
    # This file too: a change in how it builds (what it compiles) rebuilds it.
    if os.path.exists(lib) and \
            os.path.getmtime(lib) >= max(map(os.path.getmtime, sources + [__file__])):
        return lib
    os.makedirs(out, exist_ok=True)
    flags = subprocess.run(
        [python, "-c", "import os, tensorflow as tf; print(' '.join(tf.sysconfig.get_compile_flags()"
         "));print(' '.join(tf.sysconfig.get_link_flags())); print(os.path.dirname(tf.__file__))"],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-3:]
    partial = f"{lib}.{os.getpid()}.partial"
    subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", "-shared", "-w", "-I" + ROOT] +
                   flags[0].split() + sources[:3] + ["-o", partial] + flags[1].split() +
                   ["-Wl,-rpath," + flags[2]], check=True, capture_output=True, text=True)
    os.replace(partial, lib)
    return lib


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

