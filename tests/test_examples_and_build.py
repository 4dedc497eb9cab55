"""The README's example, the pip build's artifacts, and the Bazel build."""

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from harness import ROOT, inputs_hash, launch, launch_report, rank_env, use_examples_packages

use_examples_packages()  # the examples' digits data (scikit-learn)


@pytest.mark.parametrize("script,metric", [("keras_digits.py", "val_accuracy"),
                                           ("digits_collectives.py", "test accuracy")])
def test_examples_train_on_two_ranks(script, metric):
    proc = launch(2, [sys.executable, os.path.join(ROOT, "examples", script), "--epochs", "4"],
                  timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if metric in l]
    assert len(lines) == 4 and all(l.startswith("[0] ") for l in lines), proc.stdout
    accuracy = float(re.search(metric + r" ([\d.]+)", lines[-1]).group(1))
    assert accuracy > 0.85, lines
    if script == "keras_digits.py":  # what `make demo` shows
        assert re.search(r"^\[0\] Training a small neural network .* handwritten digits: "
                         r".* 2 ranks \(processes\) share each batch", proc.stdout, re.M), \
            proc.stdout
        assert "shuffle=True" not in proc.stderr, proc.stderr[-3000:]


def test_make_demo_installs_no_bazel_and_rebuilds_only_when_sources_change(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    for stamp in (".deps", ".native"):
        (venv / stamp).write_text("")
    def plan():
        return subprocess.run(["make", "-n", "demo", f"VENV={venv}"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60).stdout
    fresh = plan()
    assert "perseusrun -np 2" in fresh and "pip install" not in fresh, fresh
    assert "bazel" not in fresh, fresh
    os.utime(venv / ".native", (0, 0))  # older than every native source
    stale = plan()
    assert "pip install -q --no-build-isolation --no-deps -e ." in stale, stale


_digits_runs = {}


def _digits(env, np_=2, hosts=None):
    """(mean validation accuracy of the last four epochs, MiB sent) of the
    example under `env`; a run with the same arguments is made once (the
    uncompressed reference serves two tests)."""
    key = (tuple(sorted(env.items())), np_, hosts)
    if key not in _digits_runs:
        _digits_runs[key] = _run_digits(env, np_, hosts)
    return _digits_runs[key]


def _run_digits(env, np_, hosts):
    proc = launch(np_, [sys.executable, os.path.join(ROOT, "examples", "keras_digits.py"),
                        "--epochs", "12", "--lr", "0.01"], env=env, timeout=300, hosts=hosts)
    assert proc.returncode == 0, launch_report(proc)
    accuracy = [float(m) for m in re.findall(r"\[0\] epoch .* val_accuracy ([\d.]+)", proc.stdout)]
    mib = float(re.search(r"\[0\] perseus: \d+ collectives, ([\d.]+) MiB", proc.stdout).group(1))
    # Mean of the last four epochs, at a learning rate low enough for a
    # steady curve: one epoch's validation accuracy can move by 1-5% from one
    # epoch to the next at the example's default 0.05, which would hide or
    # fake a 1% difference. (The initial weights are seeded: a run repeats.)
    return sum(accuracy[-4:]) / 4, mib


NONE = {"PERSEUS_ALLREDUCE_DTYPE": "1"}


def test_fp16_gradient_compression_trains_to_the_same_accuracy():
    acc_fp16, mib_fp16 = _digits({"PERSEUS_ALLREDUCE_DTYPE": "0"})  # the default
    acc_none, mib_none = _digits(NONE)
    assert abs(acc_fp16 - acc_none) <= 0.01, (acc_fp16, acc_none)
    assert acc_fp16 > 0.85
    # Gradients are most of the traffic, and they travelled at half the size.
    assert mib_fp16 < 0.6 * mib_none, (mib_fp16, mib_none)


def test_mixed_compression_on_two_hosts_trains_to_the_same_accuracy():
    hosts = "127.0.0.1:2,127.0.0.2:2"
    acc_mixed, mib_mixed = _digits({"PERSEUS_ALLREDUCE_DTYPE": "2"}, 4, hosts)
    acc_none, mib_none = _digits(NONE, 4, hosts)
    assert abs(acc_mixed - acc_none) <= 0.01, (acc_mixed, acc_none)
    assert acc_mixed > 0.85
    # What crossed hosts travelled as float16.
    assert mib_mixed < 0.6 * mib_none, (mib_mixed, mib_none)


def test_topk_compression_trains_to_the_same_accuracy():
    # The first layer's kernel (8192 floats) is the one tensor above the
    # threshold: 1% of it (82 elements) per rank per step, with residuals.
    acc_topk, mib_topk = _digits({"PERSEUS_ALLREDUCE_DTYPE": "1", "PERSEUS_TOPK_ALLREDUCE": "1",
                                  "PERSEUS_TOPK_THRESHOLD": "16384",
                                  "PERSEUS_TOPK_RATIO": "0.01"})
    acc_none, mib_none = _digits(NONE)
    assert abs(acc_topk - acc_none) <= 0.01, (acc_topk, acc_none)
    assert acc_topk > 0.85
    assert mib_topk < 0.3 * mib_none, (mib_topk, mib_none)


def test_one_runtime_shared_by_op_library_and_pybind_module():
    code = ("import tensorflow as tf, perseus_tf as ptf\n"
            "from perseus_tf import _native\n"
            "_native.init(streams=3)\n"  # started through pybind11...
            "ptf.allreduce(tf.ones([2]))\n"  # ...used by the TF op library
            "maps = open('/proc/self/maps').read()\n"
            "assert maps.count('libperseus_core.so') > 0\n"
            "assert len({l.split()[-1] for l in maps.splitlines() if 'libperseus_core' in l}) == 1\n"
            "assert _native.stats()['requests'] == 1 and len(_native.stats()['streams']) == 3\n"
            "print('SHARED OK')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=rank_env(), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert "SHARED OK" in proc.stdout, proc.stderr[-3000:]


def _gloo_unit_binaries():
    """BUILD's binary of each GLOO_UNIT_TESTS entry (cc/testing/unit_tests.bzl)."""
    import ast
    with open(os.path.join(ROOT, "cc", "testing", "unit_tests.bzl")) as f:
        tree = ast.parse(f.read())
    tests = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and node.targets[0].id == "GLOO_UNIT_TESTS")
    return [os.path.basename(test)[:-len(".cc")] for test in tests]


GLOO_UNIT_BINARIES = _gloo_unit_binaries()
BAZEL_TARGETS = ["cc_unit"] + GLOO_UNIT_BINARIES + ["libfake_nccl.so"]


def _bazel_inputs_hash():
    """What the Bazel build reads: its files, the native sources, the
    configure and build scripts, and the TensorFlow and Python it builds
    against."""
    import glob
    files = ["BUILD", "WORKSPACE", ".bazelrc", ".bazelversion", "tools/bazel_build.sh",
             "tools/configure_bazel.py"]
    for pattern in ("cc/**/*", "third_party/**/*"):
        files += sorted(os.path.relpath(p, ROOT) for p in glob.glob(
            os.path.join(ROOT, pattern), recursive=True) if os.path.isfile(p))
    return inputs_hash(files, f"{sys.executable} {sys.version}",
                       importlib.metadata.version("tensorflow"), " ".join(BAZEL_TARGETS))


def bazel_build():
    """The Bazel build's outputs (build/bazel/<inputs hash>/): built on the
    first call after a change of its inputs, reused afterwards."""
    out = os.path.join(ROOT, "build", "bazel", _bazel_inputs_hash())
    if os.path.exists(os.path.join(out, "done")):
        return out
    partial = out + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "bazel_build.sh"), partial],
                          env=rank_env({"PYTHON": sys.executable, "JOBS": "2",
                                        "EXTRA_TARGETS": " ".join(BAZEL_TARGETS)}),
                          capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The script stops Bazel's server: no JVM of this tree stays behind.
    left = subprocess.run(["pgrep", "-f", f"--workspace_directory={ROOT} "],
                          capture_output=True, text=True).stdout.split()
    assert not left, f"Bazel's server for {ROOT} still runs: pids {left}"
    open(os.path.join(partial, "done"), "w").close()
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)
    return out


@pytest.mark.skipif(shutil.which("bazel-4") is None and shutil.which("bazel") is None,
                    reason="Bazel is not installed (make system installs bazel-bootstrap)")
def test_bazel_build_produces_working_libraries(tmp_path):
    out = pathlib.Path(bazel_build())
    # A package made of the Python sources and the Bazel-built libraries.
    pkg = tmp_path / "pkg" / "perseus_tf"
    shutil.copytree(os.path.join(ROOT, "perseus_tf"), pkg,
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("libperseus_core.so", "_perseus_ops.so", "_core.so", "_testing.so",
                 "libperseus_cuda.so"):
        shutil.copy(out / name, pkg / name)
    code = ("import tensorflow as tf, perseus_tf as ptf, os, hmac\n"
            f"assert ptf.__file__.startswith({str(tmp_path)!r}), ptf.__file__\n"
            "v = ptf.allreduce(tf.ones([3]) * (ptf.rank() + 1), op=ptf.Sum).numpy()\n"
            "from perseus_tf import _testing\n"  # the test hooks' module, built by Bazel too
            "assert _testing.hmac_sha256(b'k', b'd') == hmac.digest(b'k', b'd', 'sha256')\n"
            "from perseus_tf import gpu\n"
            "assert gpu.cuda_info()['library'].startswith(os.path.dirname(ptf.__file__))\n"
            "assert list(v) == [3.0, 3.0, 3.0], v\n"
            "print('BAZEL OK')\n")
    proc = subprocess.run([sys.executable, "-m", "perseus_tf.runner", "-np", "2", "--",
                           sys.executable, "-c", code],
                          env=rank_env({"PYTHONPATH": str(tmp_path / "pkg")}),
                          capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    assert proc.stdout.count("BAZEL OK") == 2, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(shutil.which("bazel-4") is None and shutil.which("bazel") is None,
                    reason="Bazel is not installed (make system installs bazel-bootstrap)")
def test_bazel_builds_and_passes_the_cc_unit_tests():
    """BUILD's unit-test binaries, from the list tests/test_cc_unit.py also
    builds (cc/testing/unit_tests.bzl), pass when built by Bazel."""
    out = pathlib.Path(bazel_build())
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_NCCL")}
    env["PERSEUS_TEST_FAKE_NCCL"] = str(out / "libfake_nccl.so")
    assert len(GLOO_UNIT_BINARIES) >= 4, GLOO_UNIT_BINARIES
    for binary in ["cc_unit"] + GLOO_UNIT_BINARIES:  # every one BUILD makes
        proc = subprocess.run([str(out / binary)], capture_output=True, text=True, timeout=120,
                              env=env)
        ran = re.search(r"(\d+) tests, 0 failed checks", proc.stdout)
        assert proc.returncode == 0 and ran and int(ran.group(1)) >= 2, \
            binary + ":\n" + proc.stdout[-4000:] + proc.stderr[-3000:]


def test_horovod_example_porting_edits():
    """tools/run_horovod_examples.py changes Horovod's scripts only where
    porting notes in docs/horovod.md say."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        from run_horovod_examples import port
    finally:
        sys.path.pop(0)
    source = ("import horovod\nimport horovod.tensorflow.keras as hvd\n"
              "hvd.broadcast_variables(opt.variables(), root_rank=0)\n"
              "model.compile(loss=l, optimizer=opt,\n    experimental_run_tf_function=False)\n"
              "ModelCheckpoint('./checkpoint-{epoch}.h5')\n")
    assert port(source, keras3=True) == (
        "import perseus_tf.horovod as horovod\nimport perseus_tf.horovod.keras as hvd\n"
        "hvd.broadcast_variables(opt.variables, root_rank=0)\n"
        "model.compile(loss=l, optimizer=opt)\n"
        "ModelCheckpoint('./checkpoint-{epoch}.keras')\n")
    assert port("import horovod.tensorflow as hvd\nopt.variables()\n", keras3=False) == \
        "import perseus_tf.horovod as hvd\nopt.variables()\n"


def test_installing_again_keeps_the_libraries_of_a_running_job_intact(tmp_path):
    # A job maps the tree's libraries; `pip install -e .` (for instance the
    # TF 2.15 venv's, beside a running TF 2.21 job) places new builds there.
    # Written into the old file, the job dies of SIGBUS at its next page.
    code = f"""
import mmap, os, sys
sys.path.insert(0, {os.path.join(ROOT, "tools")!r})
import build_native
tree, out = {str(tmp_path / "tree")!r}, {str(tmp_path / "out")!r}
os.makedirs(tree); os.makedirs(out)
old = bytes(range(256)) * 4096
open(os.path.join(tree, "libperseus_core.so"), "wb").write(old)
open(os.path.join(out, "libperseus_core.so"), "wb").write(b"new" * 100)
with open(os.path.join(tree, "libperseus_core.so"), "rb") as f:
    mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
placed = build_native.place(os.path.join(out, "libperseus_core.so"), tree)
assert mapped[:] == old, "the running job's mapping changed"
assert open(placed, "rb").read() == b"new" * 100
assert sorted(os.listdir(tree)) == ["libperseus_core.so"], os.listdir(tree)
print("PLACED OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "PLACED OK" in proc.stdout, (proc.returncode,
                                                                proc.stderr[-3000:])
