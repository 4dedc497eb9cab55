"""Every Keras our users run (perseus_tf/_keras.py, tests/keras_versions.py):
the oldest Keras 3 each supported TensorFlow accepts (3.0, 3.2, 3.5, 3.10,
3.12) and tf_keras, each put first on the ranks' PYTHONPATH over the TF 2.21
venv (the newest Keras 3 is the venv's own: every other test file runs it).
At 2 ranks, for each: README's two quick starts train with identical weights
on every rank; PerseusStrategy's checks (tests/workers/checks_strategy.py:
equality with one process in fit and custom loops, metrics, accumulation,
mixed precision, BackupAndRestore, saving) pass; and a real model trains
under PerseusStrategy equal to one process (tests/model_matrix.py's worker:
MobileNetV2 on 3.0, 3.5 and tf_keras, TF's tutorial CNN on the others).
At the two ends, Keras 3.0 and tf_keras, the Horovod shim's Keras checks
(checks_horovod_keras.py: DistributedOptimizer, accumulation, mixed
precision, callbacks, elastic state) pass too.
"""

import json
import os
import re
import sys
import tempfile

import pytest

from harness import WORKERS, check_names, launch, run_checks
from keras_versions import VERSIONS, env, path
from test_docs import _quick_start

NAMES = list(VERSIONS)


@pytest.fixture(params=NAMES)
def version(request):
    name = request.param
    assert os.path.isdir(path(name)), f"{path(name)} is missing: run `make keras-versions`"
    return name


def _quick_starts(directory, name):
    """README's quick-start scripts (read as test_docs.py reads them) written
    into `directory`; under tf_keras their `import keras` reads `import
    tf_keras as keras`, as such a script would."""
    files = []
    for script, code in sorted(_quick_start()[0].items()):
        if name == "tf_keras":
            code = code.replace("\nimport keras\n", "\nimport tf_keras as keras\n")
        target = os.path.join(directory, script)
        with open(target, "w") as f:
            f.write(code)
        files.append(target)
    assert len(files) == 2, files
    return files


def test_quick_starts_train_identical_ranks(version):
    with tempfile.TemporaryDirectory() as out:
        scripts = _quick_starts(out, version)
        proc = launch(2, [sys.executable, os.path.join(WORKERS, "quickstart_worker.py"), out]
                      + scripts, env=env(version), timeout=400)
        output = (proc.stdout + proc.stderr)[-4000:]
        assert proc.returncode == 0, output
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    expected = "tf_keras" if version == "tf_keras" else "keras " + version.split("-")[1]
    for script in ("train_strategy.py", "train_horovod.py"):
        assert ranks[0][script]["keras"].startswith(expected), ranks[0]
        assert ranks[0][script]["weights"] == ranks[1][script]["weights"], (script, output)
    accuracies = re.findall(r"^\[0\] accuracy ([\d.]+)$", proc.stdout, re.M)
    assert len(accuracies) == 2 and all(float(a) > 0.8 for a in accuracies), output


def _all_checks_pass(module, version, **extra):
    launched = run_checks(module, 2, timeout=900,
                          env=dict(env(version), PERSEUS_STALL_TIMEOUT_SECONDS="30", **extra))
    failed = []
    for check in check_names(module):
        try:
            launched.assert_ok(check)
        except AssertionError as e:
            failed.append(str(e)[:3000])
    assert not failed, "\n\n".join(failed)
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]


def test_strategy_checks(version):
    _all_checks_pass("checks_strategy", version, PERSEUS_ALLREDUCE_DTYPE="1")


@pytest.mark.parametrize("name", ["keras-3.0.5", "tf_keras"])
def test_horovod_keras_checks(name):
    _all_checks_pass("checks_horovod_keras", name)


# MobileNetV2 (batch normalisation) at the ends and where the gradient
# reduction changes; TF's tutorial CNN on the others.
MODEL = {"keras-3.0.5": "mobilenet:fit", "keras-3.5.0": "mobilenet:fit",
         "tf_keras": "mobilenet:fit"}


def test_real_model_equals_one_process(version):
    """A real model in fit under PerseusStrategy, exact settings: trainable
    weights identical on both ranks and equal to one process."""
    item = MODEL.get(version, "cnn:fit")
    with tempfile.TemporaryDirectory() as out:
        results = os.path.join(out, "results.json")
        proc = launch(2, [sys.executable, os.path.join(WORKERS, "model_matrix_worker.py"),
                          results, item],
                      env=dict(env(version), PERSEUS_ALLREDUCE_DTYPE="1",
                               PERSEUS_STALL_TIMEOUT_SECONDS="120"), timeout=400)
        outcome = json.load(open(results)) if os.path.exists(results) else {}
    assert outcome.get(item) == "ok", (outcome, (proc.stdout + proc.stderr)[-3000:])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
