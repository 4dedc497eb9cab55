"""Keras training throughput: PerseusStrategy vs MultiWorkerMirroredStrategy.

One invocation trains the same model on the same data three ways and prints
samples/s and the ratios:

  single     one process, no strategy (the work of one replica, for scale)
  perseus    PerseusStrategy under `perseusrun -np N`
  mwms       tf.distribute.MultiWorkerMirroredStrategy, N processes started
             here with TF_CONFIG on localhost (TF's collective ring)

The model is a wide MLP (about 4 * width^2 parameters) so that each step's
gradients are large and communication matters. Every mode uses the same
global batch; the time of `--steps` steps after `--warmup` steps is taken on
rank 0 by a Keras callback.

Usage: python benchmarks/keras_throughput.py [--np 2] [--width 1536] [--steps 30]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks for the distributed modes")
    p.add_argument("--width", type=int, default=1536, help="hidden width of the MLP")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--modes", default="single,perseus,mwms")
    p.add_argument("--worker", choices=["single", "perseus", "mwms"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one training run (in a worker process) ---------------------------------

def train(args):
    import numpy as np
    import tensorflow as tf

    try:
        import keras
    except ImportError:  # pragma: no cover
        keras = tf.keras

    if args.worker == "perseus":
        import perseus_tf

        strategy = perseus_tf.PerseusStrategy()
        rank = perseus_tf.rank()
    elif args.worker == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    else:
        strategy = tf.distribute.get_strategy()
        rank = 0

    n = args.global_batch * (args.steps + args.warmup)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, args.width)).astype(np.float32)
    y = rng.normal(size=(n, 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.global_batch)

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((args.width,))] +
                                 [keras.layers.Dense(args.width, activation="relu")
                                  for _ in range(3)] + [keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(1e-4)
    # A Keras model and optimizer in a custom loop (strategy.run + GradientTape):
    # the same code for every mode. Keras 3's fit() cannot run under
    # MultiWorkerMirroredStrategy in TF 2.21 (it fails converting PerReplica
    # values), so fit() would leave MWMS out.
    dist = iter(strategy.experimental_distribute_dataset(data))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            err = tf.reduce_sum((model(xb, training=True) - yb) ** 2, axis=1)
            loss = tf.nn.compute_average_loss(err, global_batch_size=args.global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(xb, yb):
        return strategy.reduce("SUM", strategy.run(replica_step, args=(xb, yb)), axis=None)

    for _ in range(args.warmup):
        float(step(*next(dist)))
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step(*next(dist))
    float(loss)
    seconds = time.perf_counter() - start
    if rank == 0:
        params = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
        print("RESULT " + json.dumps({"samples_per_s": args.global_batch * args.steps / seconds,
                                      "step_ms": 1000 * seconds / args.steps,
                                      "params": params}), flush=True)


# ---- the driver --------------------------------------------------------------

def _free_ports(k):
    socks = [socket.socket() for _ in range(k)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _result(outputs):
    for out in outputs:
        for line in out.splitlines():
            line = line.split("] ", 1)[-1] if line.startswith("[") else line
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
    raise RuntimeError("no RESULT line in:\n" + "\n".join(o[-2000:] for o in outputs))


def run_mode(mode, args, passthrough):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    me = [sys.executable, os.path.abspath(__file__), "--worker", mode] + passthrough
    if mode == "single":
        proc = subprocess.run(me, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        return _result([proc.stdout])
    if mode == "perseus":
        cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", str(args.np), "--"] + me
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        return _result([proc.stdout])
    ports = _free_ports(args.np)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for i in range(args.np):
        e = dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                             "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen(me, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(err[-3000:])
        outs.append(out)
    return _result(outs)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        train(args)
        return 0
    passthrough = ["--width", str(args.width), "--global-batch", str(args.global_batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
    import platform

    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_mode(mode, args, passthrough)
    params = next(iter(results.values()))["params"]
    print(f"# Keras training throughput, {args.np} ranks for perseus/mwms, global batch "
          f"{args.global_batch}, MLP width {args.width} ({params / 1e6:.1f}M parameters, "
          f"{params * 4 / 2**20:.0f} MiB of float32 gradients per step), "
          f"{args.steps} timed steps after {args.warmup}; {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")
    print(f"{'mode':<8} {'samples/s':>10} {'step_ms':>9} {'vs mwms':>8}")
    base = results.get("mwms", {}).get("samples_per_s")
    for mode, r in results.items():
        ratio = f"{r['samples_per_s'] / base:8.2f}" if base else "       -"
        print(f"{mode:<8} {r['samples_per_s']:>10.1f} {r['step_ms']:>9.1f} {ratio}")
    if base and "perseus" in results:
        ratio = results["perseus"]["samples_per_s"] / base
        print(f"target: PerseusStrategy >= 1.3x MultiWorkerMirroredStrategy: "
              f"{'PASS' if ratio >= 1.3 else 'FAIL'} ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
