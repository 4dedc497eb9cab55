"""Perseus-TF's Horovod shim against Horovod itself, on the same machine.

The same worker code runs twice per round: once as `import horovod.tensorflow
as hvd` under `horovodrun --gloo`, once as `import perseus_tf.horovod as hvd`
under `perseusrun`, with the same interpreter and the same TensorFlow. Rounds
alternate which goes first. Workloads:

  gradients:<profile>  one training step's gradients (the profile's shapes,
                       values ~N(0, 1e-3)) averaged by hvd.DistributedGradientTape
                       inside a tf.function (the loss is sum_i <w_i, c_i>, so
                       computing the gradients costs one multiply per element)
  small                500 gradients of 1 KiB the same way
  keras                a Keras MLP trained with hvd.DistributedOptimizer and
                       model.fit (compute and communication)

Both sides run with their defaults: no compression (the shim follows
Horovod's `compression=` argument), fusion and cycle time as shipped. The
first step's result is checked against the exact average on every rank.

With --hosts 2,4,8 each job runs one rank on each of N hosts made of network
namespaces (tests/netns_hosts.py, links shaped to --rate with tc's token
bucket), both sides started the same way: one process per host, Horovod's
ranks with Horovod's rendezvous server on host 0 (as horovodrun starts it),
Perseus-TF's with rank 0 serving the store (root; --np is then ignored).

Needs an interpreter with TensorFlow and Horovod (0.28 was built for this:
see docs/performance.md). Usage:
  .venv-hvd/bin/python benchmarks/horovod_compare.py --np 2 \\
      --workloads gradients:resnet50,small,keras
  .venv-hvd/bin/python benchmarks/horovod_compare.py --hosts 2,4,8 \\
      --workloads gradients:resnet50,small
"""

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILES = os.path.join(ROOT, "perseus_tf", "profiles")
CHECK = 1024  # elements of each tensor checked against the exact average


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--workloads", default="gradients:resnet50,small,keras",
                   help="comma-separated: gradients:<profile>, small, keras")
    p.add_argument("--rounds", type=int, default=2, help="launches of each side per workload")
    p.add_argument("--steps", type=int, default=20, help="timed steps per launch")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--width", type=int, default=1024, help="keras: hidden width of the MLP")
    p.add_argument("--global-batch", type=int, default=64, help="keras: global batch")
    p.add_argument("--hosts", default="",
                   help="host counts, comma-separated: one rank on each of N namespace hosts")
    p.add_argument("--rate", default="400mbit",
                   help="with --hosts: tc rate of each host's link (default 400mbit)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter with TensorFlow and Horovod (default: this one)")
    p.add_argument("--worker", choices=["horovod", "perseus"], help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one launch (in every rank) ---------------------------------------------

def gradient_sizes(workload):
    if workload == "small":
        return [256] * 500
    with open(os.path.join(PROFILES, workload.split(":", 1)[1] + ".json")) as f:
        return [int(t["elements"]) for t in json.load(f)["tensors"]]


def run_gradients(hvd, tf, np, args):
    rank, size = hvd.rank(), hvd.size()
    sizes = gradient_sizes(args.workload)
    # loss = sum_i <w_i, c_i>: the gradient of w_i is c_i, this rank's
    # values, at the cost of one multiply per element.
    values = [np.random.default_rng([rank, i]).normal(0, 1e-3, n).astype(np.float32)
              for i, n in enumerate(sizes)]
    consts = [tf.constant(v) for v in values]
    weights = [tf.Variable(tf.zeros([n])) for n in sizes]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(w * c) for w, c in zip(weights, consts)])
        return hvd.DistributedGradientTape(tape).gradient(loss, weights)

    first = step()
    worst = 0.0
    for i, (n, got) in enumerate(zip(sizes, first)):
        k = min(n, CHECK)
        want = sum(np.random.default_rng([r, i]).normal(0, 1e-3, n).astype(np.float32)[:k]
                   .astype(np.float64) for r in range(size)) / size
        worst = max(worst, float(np.max(np.abs(got.numpy()[:k] - want))))
    times = []
    for i in range(args.warmup + args.steps):
        hvd.allreduce(tf.constant(0.0), name="sync")
        start = time.perf_counter()
        out = step()
        out[0].numpy()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return times, worst < 1e-6, f"max abs error {worst:.2e}"


def run_keras(hvd_keras, tf, np, args):
    keras = tf.keras
    rank, size = hvd_keras.rank(), hvd_keras.size()
    batch = args.global_batch // size
    rng = np.random.default_rng(rank)
    x = rng.normal(size=(batch * (args.warmup + args.steps), 256)).astype(np.float32)
    y = rng.integers(0, 10, size=len(x))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Input((256,)),
        keras.layers.Dense(args.width, activation="relu"),
        keras.layers.Dense(args.width, activation="relu"),
        keras.layers.Dense(args.width, activation="relu"),
        keras.layers.Dense(10)])
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    times = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if batch >= args.warmup:
                times.append(time.perf_counter() - self.start)

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), Clock()])
    # Same weights everywhere after training: the updates were averaged.
    w = model.get_weights()[0]
    spread = float(np.max(np.abs(
        hvd_keras.allreduce(tf.constant(w), name="wcheck").numpy() - w)))
    return times, spread < 1e-5, f"weights differ from the ranks' mean by {spread:.2e}"


def worker(args):
    import numpy as np
    import tensorflow as tf

    if args.workload == "keras":
        if args.worker == "horovod":
            import horovod.tensorflow.keras as hvd
        else:
            import perseus_tf.horovod.keras as hvd
        hvd.init()
        times, ok, detail = run_keras(hvd, tf, np, args)
    else:
        if args.worker == "horovod":
            import horovod.tensorflow as hvd
        else:
            import perseus_tf.horovod as hvd
        hvd.init()
        times, ok, detail = run_gradients(hvd, tf, np, args)
    if hvd.rank() == 0:
        print("RESULT " + json.dumps({"ms": [t * 1e3 for t in times], "ok": ok,
                                      "detail": detail, "tf": tf.__version__}), flush=True)


# ---- the comparison (parent) -------------------------------------------------

def launch(side, workload, args):
    script = [args.python, os.path.abspath(__file__), "--worker", side, "--workload", workload,
              "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--width", str(args.width), "--global-batch", str(args.global_batch)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if side == "horovod":
        runner = os.path.join(os.path.dirname(args.python), "horovodrun")
        cmd = [runner, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo"] + script
    else:
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [args.python, "-m", "perseus_tf.runner", "-np", str(args.np), "--"] + script
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"{side} {workload} failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def launch_on_hosts(side, workload, args, hosts, n):
    """One job of one rank on each of the first n namespace hosts, every rank
    started directly in its namespace (no launcher on either side)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from netns_hosts import communicate_all
    from step_overlap import horovod_rendezvous
    script = [args.python, os.path.abspath(__file__), "--worker", side, "--workload", workload,
              "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--width", str(args.width), "--global-batch", str(args.global_batch)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rendezvous = None
    if side == "horovod":
        rendezvous, hvd_port = horovod_rendezvous(hosts, n)
    port = 20000 + secrets.randbelow(10000)
    secret, job = secrets.token_hex(16), "hvd-" + secrets.token_hex(4)
    procs = []
    try:
        for h in range(n):
            if side == "horovod":
                henv = dict(env, HOROVOD_GLOO_RENDEZVOUS_ADDR=hosts.addrs[0],
                            HOROVOD_GLOO_RENDEZVOUS_PORT=str(hvd_port), HOROVOD_CONTROLLER="gloo",
                            HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="eth0",
                            HOROVOD_HOSTNAME=hosts.names[h], HOROVOD_RANK=str(h),
                            HOROVOD_SIZE=str(n), HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1",
                            HOROVOD_CROSS_RANK=str(h), HOROVOD_CROSS_SIZE=str(n))
            else:
                henv = dict(env, PERSEUS_MASTER_ADDR=hosts.addrs[0],
                            PERSEUS_MASTER_PORT=str(port),
                            PERSEUS_RENDEZVOUS_SECRET=secret, PERSEUS_JOB_ID=job,
                            PERSEUS_RANK=str(h),
                            PERSEUS_SIZE=str(n), PERSEUS_LOCAL_RANK="0", PERSEUS_LOCAL_SIZE="1",
                            PERSEUS_CROSS_RANK=str(h), PERSEUS_CROSS_SIZE=str(n),
                            PERSEUS_HOST_ADDR=hosts.addrs[h])
            procs.append(hosts.popen(h, script, env=henv, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True))
        outputs = communicate_all(procs, 1800, f"{side} {workload} on {n} hosts")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if rendezvous:
            rendezvous.kill()
            rendezvous.communicate()
    for line in outputs[0].splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"{side} {workload} on {n} hosts failed:\n" + outputs[0][-3000:])


def compare(workloads, args, run):
    """Each workload's rounds, alternating which side goes first; prints a
    row per workload and returns [(workload, horovod ms, perseus ms)]."""
    rows = []
    for w in workloads:
        ms = {"horovod": [], "perseus": []}
        checks = []
        for r in range(args.rounds):
            for side in (("horovod", "perseus") if r % 2 == 0 else ("perseus", "horovod")):
                res = run(side, w)
                ms[side] += res["ms"]
                checks.append(f"{side}: {res['detail']}" if not res["ok"] else None)
                tf_version = res["tf"]
        h, p = statistics.median(ms["horovod"]), statistics.median(ms["perseus"])
        bad = [c for c in checks if c]
        rows.append((w, h, p))
        print(f"  {w:<20} {h:>10.2f} {p:>10.2f} {h / p:>7.2f}x  "
              f"{'; '.join(bad) if bad else 'results right on both'}  (TF {tf_version})",
              flush=True)
    return rows


def main_hosts(workloads, args):
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from netns_hosts import NetnsHosts, missing_requirements
    from step_overlap import horovod_hostnames, remove_horovod_hostnames
    why = missing_requirements()
    if why:
        sys.exit(f"horovod_compare.py --hosts: {why}")
    print(f"# Horovod against Perseus-TF's Horovod shim: one rank on each of N hosts (network "
          f"namespaces, links shaped to {args.rate}), {args.rounds} launches of each per "
          f"workload and N, {args.steps} timed steps each after {args.warmup}")
    print("# ms/step: median over all timed steps of rank 0; speed-up = horovod / perseus")
    rows = []
    for n in [int(x) for x in args.hosts.split(",")]:
        hosts = NetnsHosts(n, subnet=120 + n % 100)
        made = []
        try:
            made = horovod_hostnames(hosts)
            hosts.shape(args.rate)
            print(f"# {n} hosts: {'workload':<20} {'horovod_ms':>10} {'perseus_ms':>10} "
                  f"{'speed-up':>8}  check", flush=True)
            rows += [(f"{n} hosts {w}", h, p) for w, h, p in compare(
                workloads, args, lambda side, w: launch_on_hosts(side, w, args, hosts, n))]
        finally:
            remove_horovod_hostnames(made)
            hosts.close()
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in ("small", "keras") and not (
                w.startswith("gradients:") and
                os.path.exists(os.path.join(PROFILES, w.split(":", 1)[1] + ".json"))):
            sys.exit(f"unknown workload {w!r}: use gradients:<resnet50|vgg16|bert_base>, small "
                     f"or keras")
    if args.hosts:
        rows = main_hosts(workloads, args)
        slower = [w for w, h, p in rows if p >= h]
        print("target: Perseus-TF faster than Horovod at every N and workload: " +
              ("PASS" if not slower else "FAIL (" + ", ".join(slower) + ")"))
        return 0
    print(f"# Horovod against Perseus-TF's Horovod shim: {args.np} ranks on this machine "
          f"({os.cpu_count()} CPUs), {args.rounds} launches of each per workload, "
          f"{args.steps} timed steps each after {args.warmup}; interpreter {args.python}")
    mine = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("PERSEUS_"))
    print(f"# Perseus settings from the environment: {' '.join(mine) or 'none (defaults)'}; "
          f"HOROVOD_* settings: " + (" ".join(sorted(
              f"{k}={v}" for k, v in os.environ.items() if k.startswith("HOROVOD_"))) or
              "none (defaults)"))
    print("# ms/step: median over all timed steps of rank 0; speed-up = horovod / perseus")
    print(f"# {'workload':<20} {'horovod_ms':>10} {'perseus_ms':>10} {'speed-up':>8}  check")
    rows = compare(workloads, args, lambda side, w: launch(side, w, args))
    slower = [w for w, h, p in rows if p >= h]
    print("target: Perseus-TF faster than Horovod on every workload: " +
          ("PASS" if not slower else "FAIL (" + ", ".join(slower) + ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
