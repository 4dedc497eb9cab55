"""The Horovod-style examples (examples/hvd_*.py) train on 2 ranks."""

import importlib.util
import os
import re
import sys

import pytest

from harness import ROOT, launch, use_examples_packages

use_examples_packages()  # the examples' digits data (scikit-learn)

HAS_ESTIMATOR = importlib.util.find_spec("tensorflow_estimator") is not None


def _accuracy(proc, metric):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if metric in l]
    assert lines and all(l.startswith("[0] ") for l in lines), proc.stdout[-3000:]
    return lines, float(re.search(metric + r" ([\d.]+)", lines[-1]).group(1))


def _run(script, *args):
    return launch(2, [sys.executable, os.path.join(ROOT, "examples", script), *args],
                  timeout=300)


def test_keras_example_with_callbacks():
    lines, accuracy = _accuracy(_run("hvd_keras_digits.py", "--epochs", "4"), "val_accuracy")
    assert len(lines) == 4, lines
    assert accuracy > 0.85, lines
    # LearningRateWarmupCallback: lr / size at the start, the full rate after 2 epochs.
    rates = [float(re.search(r"lr ([\d.]+)", l).group(1)) for l in lines]
    assert rates[0] < rates[1] == pytest.approx(0.05) == rates[3], rates


@pytest.mark.parametrize("script", ["hvd_tape.py", "hvd_monitored_session.py",
                                    "hvd_estimator.py"])
def test_tf_examples(script):
    if script == "hvd_estimator.py" and not HAS_ESTIMATOR:
        pytest.skip("tf.estimator was removed in TF 2.16")
    lines, accuracy = _accuracy(_run(script), "test accuracy")
    assert accuracy > 0.85, lines
