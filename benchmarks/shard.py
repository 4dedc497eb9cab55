"""Sharded optimizer state against unsharded: optimizer-state bytes, peak
memory and step time, replaying a model's gradients.

For each profile (the gradient shapes of a real model, perseus_tf/profiles)
and each rank count, two jobs run on this machine, one after the other:
PerseusStrategy with Adam, unsharded and with shard_optimizer_state=True.
Each rank makes one variable per tensor of the profile, and each step
applies a fresh copy of fixed gradients through `optimizer.apply_gradients`
under the strategy (the collectives and the optimizer's update, no model's
compute). --api shim runs the Horovod shim instead, outside any strategy:
hvd.DistributedOptimizer(Adam, shard_optimizer_state=False, then True), its
`apply` given the same gradients. Every rank reports:

  state      the bytes of its optimizer's variables (Adam: two slots per
             weight, and a counter)
  peak       its process's peak resident memory after the steps (ru_maxrss)
  step       the median time of --steps steps after --warmup
  wire       (sharded, under the strategy) the elements its reduce-scatters
             and allgathers carry over those of an allreduce of the weights

The table prints the largest rank's state and peak, the median step, and
the ratios: state against 1/N of unsharded, the peak saving against the
state saving, and the step time sharded / unsharded.

--placement 8,16,...: instead, where keras_shard.place() puts each profile's
Adam state at those rank counts (no job runs): the largest rank's share over
1/N of the state, with whole variables only (what an optimizer that is not
element-wise gets) and with the largest variables split (Adam, SGD, ...).

Usage: python benchmarks/shard.py [--profiles resnet50,bert_base] [--np 2,4]
           [--steps 5] [--dtype 0] [--api strategy|shim] [--json FILE]
       python benchmarks/shard.py --placement 2,4,8,16,32,64,256
           [--profiles resnet50,bert_base,vgg16]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = os.path.join(ROOT, "perseus_tf", "profiles")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default="resnet50,bert_base")
    p.add_argument("--np", default="2,4", help="rank counts")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="0", help="PERSEUS_ALLREDUCE_DTYPE of both jobs")
    p.add_argument("--json", help="write the rows here too")
    p.add_argument("--api", choices=("strategy", "shim"), default="strategy",
                   help="PerseusStrategy, or the Horovod shim's DistributedOptimizer")
    p.add_argument("--bucket-mib", type=int,
                   help="the sharded step's bucket size (default: keras_shard's 64)")
    p.add_argument("--gather-mib", type=int,
                   help="the most one weights' allgather carries (default: keras_shard's 16)")
    p.add_argument("--placement", help="rank counts: print the placement table only")
    p.add_argument("--worker", nargs=2, metavar=("PROFILE", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def profile_sizes(name):
    with open(os.path.join(PROFILES, name + ".json")) as f:
        return [int(t["elements"]) for t in json.load(f)["tensors"]]


def worker(args):
    import resource
    import time

    import tensorflow as tf
    import keras

    import perseus_tf as ptf
    from perseus_tf.strategy import keras_shard

    profile, out = args.worker
    sizes = profile_sizes(profile)
    if args.bucket_mib:
        keras_shard._BUCKET_BYTES = args.bucket_mib << 20
    if args.gather_mib:
        keras_shard._GATHER_BYTES = args.gather_mib << 20
    shim = args.api == "shim"
    if shim:
        import perseus_tf.horovod.keras as hvd
        hvd.init()
    strategy = None if shim else ptf.PerseusStrategy()
    rank = ptf.rank()
    # The gradients: fixed values, copied each step as backprop would make
    # them (made first, so that their making is not the process's peak).
    sources = [tf.Variable(tf.fill([n], 1e-3 * (1 + i % 7))) for i, n in enumerate(sizes)]
    with contextlib.nullcontext() if shim else strategy.scope():
        weights = [keras.Variable(tf.zeros([n]), name=f"w{i}") for i, n in enumerate(sizes)]
        optimizer = keras.optimizers.Adam(1e-3)
        if shim:
            optimizer = hvd.DistributedOptimizer(
                optimizer, shard_optimizer_state=os.environ["PERSEUS_SHARD_OPTIMIZER_STATE"] == "1")
        optimizer.build(weights)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @tf.function
    def step():
        def apply():
            # Fresh buffers, as backprop makes: tf.identity would hand out
            # the sources' own buffers, which no reduction may write into.
            grads = [s * 1.0 for s in sources]
            optimizer.apply_gradients(zip(grads, weights))
        if shim:
            apply()
        else:
            strategy.run(apply)

    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        step()
        float(weights[0][0].numpy())   # the step's updates are done
        times.append(time.perf_counter() - start)
    ptf.barrier()
    # The elements a sharded step's reduce-scatters (the ranks times each
    # bucket's largest part: whole variables make the parts uneven), its
    # allreduces of the variables larger than an even share (twice each)
    # and its allgathers (the parts as they are) carry, over an allreduce's
    # (twice the weights: its reduce-scatter and allgather).
    shards = getattr(optimizer, "_perseus_shards", None)
    wire = None
    if shards is not None and not shim:
        runs = keras_shard._run_layout(optimizer, shards, [w.value for w in weights])
        wire = (sum(shards.size * bucket[3] for bucket, whole, _ in runs if whole is None) +
                sum(2 * sizes[whole] for _, whole, _ in runs if whole is not None) +
                sum(sum(keras_shard._parts(bucket[2], 16)[1])
                    for bucket, _, _ in runs)) / (2 * sum(sizes))
    result = {"rank": rank, "state": keras_shard.state_bytes(optimizer), "wire": wire,
              "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "peak_before_steps": before,
              # TensorFlow's allocator: the tensors alone (weights, slots,
              # gradients, the step's buffers), without the allocator's slack.
              "tensor_peak": tf.config.experimental.get_memory_info("CPU:0")["peak"],
              "step": statistics.median(times[args.warmup:]),
              "weights": sum(sizes) * 4}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def job(profile, np_, sharded, args):
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                   PERSEUS_ALLREDUCE_DTYPE=args.dtype,
                   PERSEUS_SHARD_OPTIMIZER_STATE="1" if sharded else "0")
        cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", str(np_), "--",
               sys.executable, os.path.abspath(__file__), "--worker", profile, out,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--api", args.api]
        if args.bucket_mib:
            cmd += ["--bucket-mib", str(args.bucket_mib)]
        if args.gather_mib:
            cmd += ["--gather-mib", str(args.gather_mib)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{profile} at {np_} ranks (sharded={sharded}) failed:\n"
                             f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(np_)]


def placement(args):
    from perseus_tf.strategy import keras_shard

    print("| profile | variables | largest variable / state | ranks | whole variables: "
          "largest share / (state / N) | split: largest share / (state / N) | "
          "variables split |")
    print("|---|---|---|---|---|---|---|")
    for profile in args.profiles.split(","):
        counts = profile_sizes(profile)
        for np_ in [int(n) for n in args.placement.split(",")]:
            shares = []
            for splittable in ((), range(len(counts))):
                owner, pieces = keras_shard.place(counts, [4] * len(counts), np_, splittable)
                loads = [0] * np_
                for i, r in enumerate(owner):
                    if r >= 0:
                        loads[r] += counts[i]
                for each in pieces.values():
                    for r, (_, count) in enumerate(each):
                        loads[r] += count
                shares.append(max(loads) / (sum(counts) / np_))
            print(f"| {profile} | {len(counts)} | {max(counts) / sum(counts):.3f} | {np_} | "
                  f"{shares[0]:.3f} | {shares[1]:.3f} | {len(pieces)} |", flush=True)


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    if args.placement:
        return placement(args)
    rows = []
    print("| profile | ranks | state unsharded | state sharded (largest rank) | "
          "sharded / (unsharded / N) | peak unsharded | peak sharded | "
          "peak saving / state saving | tensor peak saving / state saving | "
          "step unsharded | step sharded | sharded / unsharded | sharded wire / unsharded |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    mib = 1 << 20
    for profile in args.profiles.split(","):
        for np_ in [int(n) for n in args.np.split(",")]:
            plain = job(profile, np_, False, args)
            sharded = job(profile, np_, True, args)
            state0 = max(r["state"] for r in plain)
            state1 = max(r["state"] for r in sharded)
            peak0 = max(r["peak"] for r in plain)
            peak1 = max(r["peak"] for r in sharded)
            tensors0 = max(r["tensor_peak"] for r in plain)
            tensors1 = max(r["tensor_peak"] for r in sharded)
            step0 = statistics.median(r["step"] for r in plain)
            step1 = statistics.median(r["step"] for r in sharded)
            row = {"profile": profile, "ranks": np_, "api": args.api, "state_unsharded": state0,
                   "peak_before_steps": [max(r["peak_before_steps"] for r in plain),
                                         max(r["peak_before_steps"] for r in sharded)],
                   "state_sharded": state1, "share": state1 / (state0 / np_),
                   "peak_unsharded": peak0, "peak_sharded": peak1,
                   "peak_saving_ratio": (peak0 - peak1) / max(1, state0 - state1),
                   "tensor_peak": [tensors0, tensors1],
                   "tensor_peak_saving_ratio": (tensors0 - tensors1) / max(1, state0 - state1),
                   "step_unsharded": step0, "step_sharded": step1, "step_ratio": step1 / step0,
                   "wire_ratio": sharded[0]["wire"]}
            rows.append(row)
            wire = "-" if row["wire_ratio"] is None else f"{row['wire_ratio']:.2f}"
            print(f"| {profile} | {np_} | {state0 / mib:.1f} MiB | {state1 / mib:.1f} MiB | "
                  f"{row['share']:.3f} | {peak0 / mib:.0f} MiB | {peak1 / mib:.0f} MiB | "
                  f"{row['peak_saving_ratio']:.2f} | {row['tensor_peak_saving_ratio']:.2f} | "
                  f"{step0 * 1e3:.0f} ms | {step1 * 1e3:.0f} ms | "
                  f"{row['step_ratio']:.2f} | {wire} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
