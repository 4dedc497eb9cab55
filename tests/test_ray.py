"""PerseusStrategy under Ray Train: TensorflowTrainer starts the workers and
sets TF_CONFIG, as for MultiWorkerMirroredStrategy; PerseusStrategy takes its
place with no other step (the rendezvous store's secret goes through Ray's
own key-value store). Two workers on a local Ray cluster train a Keras model
with fit and end with the same weights."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from harness import ROOT

HAS_RAY = importlib.util.find_spec("ray") is not None

SCRIPT = r"""
import json, os, sys
import ray
from ray.train import ScalingConfig
from ray.train.tensorflow import TensorflowTrainer


def train_func(config):
    import numpy as np
    import keras
    import perseus_tf

    strategy = perseus_tf.PerseusStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x[:, :4].sum(axis=1, keepdims=True) > 0).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=10, verbose=0)
    with open(os.path.join(config["out"], f"rank{perseus_tf.rank()}.json"), "w") as f:
        json.dump({"size": perseus_tf.size(), "accuracy": history.history["accuracy"][-1],
                   "weights": [w.ravel().tolist() for w in model.get_weights()]}, f)


ray.init(num_cpus=2, include_dashboard=False, _temp_dir=sys.argv[2])
try:
    trainer = TensorflowTrainer(train_func, train_loop_config={"out": sys.argv[1]},
                                scaling_config=ScalingConfig(num_workers=2, use_gpu=False))
    trainer.fit()
finally:
    ray.shutdown()
print("TRAINED", flush=True)
"""


@pytest.mark.skipif(not HAS_RAY and not os.environ.get("PERSEUS_TEST_PASS"),
                    reason="make check without Ray (make test installs it: make ray)")
def test_perseus_strategy_trains_under_ray_train_with_no_extra_step(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERSEUS_", "OMPI_", "HOROVOD_", "TF_CONFIG", "SLURM_"))}
    env["PYTHONPATH"] = ROOT
    (tmp_path / "script.py").write_text(SCRIPT)
    # Ray's sockets live under its temporary directory: a short path.
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        proc = subprocess.run([sys.executable, str(tmp_path / "script.py"), str(tmp_path),
                               ray_tmp], env=env, capture_output=True, text=True,
                              timeout=600, cwd=tmp_path)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "TRAINED" in proc.stdout, text[-5000:]
    assert "no secret" not in text, text[-3000:]
    results = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            results.append(json.load(f))
    assert [r["size"] for r in results] == [2, 2], results
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["accuracy"] > 0.75, results[0]["accuracy"]
