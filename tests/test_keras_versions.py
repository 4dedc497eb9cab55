"""Every Keras our users run (perseus_tf/_keras.py, tests/keras_versions.py):
the oldest Keras 3 each supported TensorFlow accepts (3.0, 3.2, 3.5, 3.10,
3.12), 3.7 and 3.8 (either side of the end of fit's loss-scaling backport),
3.9 (the last whose metric variables need the backport) and tf_keras, each
put first on the ranks' PYTHONPATH over the TF 2.21
venv (the newest Keras 3 is the venv's own: every other test file runs it).
At 2 ranks, for each: README's two quick starts train with identical weights
on every rank; PerseusStrategy's checks (tests/workers/checks_strategy.py:
equality with one process in fit and custom loops, metrics, accumulation,
mixed precision, BackupAndRestore, saving; between the ends, those of the
patches whose Keras internals change inside Keras 3: BETWEEN) pass; and a
real model trains under PerseusStrategy equal to one process
(tests/model_matrix.py's worker: TF's tutorial CNN).
All three run in one launch per release (tests/workers/keras_version_worker.py):
one TensorFlow import per rank, not three.
At the two ends, Keras 3.0 and tf_keras, the Horovod shim's Keras checks
(checks_horovod_keras.py: DistributedOptimizer, accumulation, mixed
precision, callbacks, elastic state) pass too, all but the one of gradient
groups overlapping backprop (12 trainings, the file's slowest): that is the
gradient marking of perseus_tf/_gradient_marks.py, whose Keras-dependent part
(_keras.optimizer_classes) checks_strategy's overlap check takes at the same
ends (and on the newest Keras 3 in tests/test_strategy.py).
"""

import json
import os
import re
import sys
import tempfile

import pytest

from harness import (WORKERS, CheckResults, check_names, launch, read_results,
                     record_check_times, run_checks)
from keras_versions import VERSIONS, env, path
from test_docs import _quick_start

NAMES = list(VERSIONS)

# The checks run between the ends (3.2, 3.5, 3.7, 3.8, 3.9, 3.10, 3.12): that every patch
# target exists and the patches apply in order (perseus_tf/patches.py), and those of the
# patches whose Keras internals change inside Keras 3 (perseus_tf/_keras.py
# lists them by release): gradient reduction and fit's loss scaling (3.5,
# 3.8), the TF optimizer's apply path, metric and statistics variables read
# on-read (3.7), the epoch iterator of step resume (3.7, 3.11), predict's
# reduction (3.3). Keras 3.0 and tf_keras run every check; so does the newest
# Keras 3 in tests/test_strategy.py. Patches whose internals are the same in
# every Keras 3 (saving, TensorBoard, ModelCheckpoint, XLA, the loss-scale
# check) are checked at the ends.
BETWEEN = ["check_keras_patches_in_order_found_and_undone",
           "check_fit_equals_single_process_sgd", "check_fit_with_last_partial_batch",
           "check_custom_training_loop_equals_single_process",
           "check_accumulation_equals_a_larger_batch",
           "check_backup_and_restore_resumes_on_every_rank",
           "check_batch_norm_moving_statistics_are_averaged_when_read",
           "check_predict_returns_every_row_in_order_on_every_rank",
           "check_sharded_optimizer_state_equals_unsharded"]
ENDS = ("keras-3.0.5", "tf_keras")


def strategy_checks(name):
    return check_names("checks_strategy") if name in ENDS else BETWEEN

# TF's tutorial CNN on every release (batch normalisation's statistics are
# checks_strategy's check_batch_norm_moving_statistics_are_averaged_when_read
# on each; tests/model_matrix.py trains MobileNetV2 on the newest Keras 3
# and on TF 2.15's Keras 2).
MODEL = "cnn:fit"


class Launch:
    """One release's launch of keras_version_worker.py and what it wrote."""

    def __init__(self, name, proc, out, env):
        self.name, self.proc = name, proc
        self.output = (proc.stdout + proc.stderr)[-4000:]
        self.checks = CheckResults(2, read_results(os.path.join(out, "checks"), 2), proc)
        record_check_times("checks_strategy", 2, env,
                           read_results(os.path.join(out, "checks"), 2, ".seconds"))
        self.quick = read_results(os.path.join(out, "quickstart"), 2)
        model = os.path.join(out, "model.json")
        self.model = json.load(open(model)) if os.path.exists(model) else {}


@pytest.fixture(scope="module", params=NAMES)
def launched(request):
    name = request.param
    assert os.path.isdir(path(name)), f"{path(name)} is missing: run `make keras-versions`"
    with tempfile.TemporaryDirectory() as out:
        scripts = _quick_starts(out, name)
        settings = dict(env(name), PERSEUS_ALLREDUCE_DTYPE="1", PERSEUS_STALL_TIMEOUT_SECONDS="60",
                        PERSEUS_CHECKS_NAMES=",".join(strategy_checks(name)))
        proc = launch(2, [sys.executable, os.path.join(WORKERS, "keras_version_worker.py"), out,
                          MODEL] + scripts, env=settings, timeout=1200)
        yield Launch(name, proc, out, settings)


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


def test_quick_starts_train_identical_ranks(launched):
    ranks = [launched.quick.get(r, {}) for r in range(2)]
    assert all(r and "error" not in r for r in ranks), (ranks, launched.output)
    name = launched.name
    expected = "tf_keras" if name == "tf_keras" else "keras " + name.split("-")[1]
    for script in ("train_strategy.py", "train_horovod.py"):
        assert ranks[0][script]["keras"].startswith(expected), ranks[0]
        assert ranks[0][script]["weights"] == ranks[1][script]["weights"], (script,
                                                                             launched.output)
    accuracies = re.findall(r"^\[0\] accuracy ([\d.]+)$", launched.proc.stdout, re.M)
    assert len(accuracies) == 2 and all(float(a) > 0.8 for a in accuracies), launched.output


def _all_pass(checks, names):
    failed = []
    for check in names:
        try:
            checks.assert_ok(check)
        except AssertionError as e:
            failed.append(str(e)[:3000])
    assert not failed, "\n\n".join(failed)


def test_strategy_checks(launched):
    _all_pass(launched.checks, strategy_checks(launched.name))


def test_real_model_equals_one_process(launched):
    """A real model in fit under PerseusStrategy, exact settings: trainable
    weights identical on both ranks and equal to one process."""
    assert launched.model.get(MODEL) == "ok", (launched.model, launched.output)
    assert launched.proc.returncode == 0, launched.output


# The shim's overlap check is left out here (module docstring).
SHIM_CHECKS = [n for n in check_names("checks_horovod_keras")
               if n != "check_gradient_reductions_overlap_backprop_with_unchanged_results"]


@pytest.mark.parametrize("name", ["keras-3.0.5", "tf_keras"])
def test_horovod_keras_checks(name):
    launched = run_checks("checks_horovod_keras", 2, timeout=900, names=SHIM_CHECKS,
                          env=dict(env(name), PERSEUS_STALL_TIMEOUT_SECONDS="30"))
    _all_pass(launched, SHIM_CHECKS)
    assert launched.proc.returncode == 0, launched.proc.stderr[-3000:]
