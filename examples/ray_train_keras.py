"""Keras `fit` with PerseusStrategy inside Ray Train's TensorflowTrainer.

Ray starts the workers and sets TF_CONFIG for each, as it does for
MultiWorkerMirroredStrategy; PerseusStrategy takes that strategy's place and
needs nothing else (the rendezvous store's secret goes through Ray).

    python examples/ray_train_keras.py --workers 2              # a local Ray cluster
    python examples/ray_train_keras.py --address HEAD:6379      # a running cluster

--strategy mwms runs the same training under MultiWorkerMirroredStrategy, to
compare. --out DIR makes each worker write its weights and step time there.
"""

import argparse
import json
import os
import time

import ray
from ray.train import ScalingConfig
from ray.train.tensorflow import TensorflowTrainer


def train_func(config):
    import numpy as np
    import tensorflow as tf
    import keras
    import perseus_tf

    if config["strategy"] == "perseus":
        strategy = perseus_tf.PerseusStrategy()
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rank = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 32)).astype("float32")
    y = (x[:, :16].sum(axis=1, keepdims=True) > 0).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((32,)),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)    # warm-up: tracing, first steps
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=64, epochs=config["epochs"], verbose=0)
    step_ms = 1000 * (time.perf_counter() - start) / (config["epochs"] * len(x) // 64)
    accuracy = history.history["accuracy"][-1]
    if rank == 0:
        print(f"{config['strategy']}: accuracy {accuracy:.3f}, {step_ms:.1f} ms a step",
              flush=True)
    if config["out"]:
        with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
            json.dump({"accuracy": accuracy, "step_ms": step_ms,
                       "weights": [w.ravel().tolist() for w in model.get_weights()]}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--address", default=None, help="a running Ray cluster (default: "
                        "start a local one)")
    parser.add_argument("--strategy", choices=["perseus", "mwms"], default="perseus")
    parser.add_argument("--spread", action="store_true",
                        help="one worker per Ray node (STRICT_SPREAD)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.workers, include_dashboard=False)
    try:
        scaling = ScalingConfig(num_workers=args.workers, use_gpu=False,
                                resources_per_worker={"CPU": 1},
                                placement_strategy="STRICT_SPREAD" if args.spread else "PACK")
        TensorflowTrainer(train_func, scaling_config=scaling,
                          train_loop_config={"strategy": args.strategy, "epochs": args.epochs,
                                             "out": args.out}).fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
