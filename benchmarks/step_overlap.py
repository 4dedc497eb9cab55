"""End to end: training steps of real models on two hosts joined by a shaped link.

Makes two hosts out of network namespaces (tests/netns_hosts.py), shapes each
host's link to --rate each way with `tc tbf`, and runs one rank per host,
each pinned to its own core, for every contender, interleaved, in --rounds
rounds:

  compute         the same Keras `fit` with no distribution, on both hosts at once
  lockstep        compute, with the two hosts waiting for each other at the end
                  of every step (one byte each way over TCP): each step is the
                  slower host's, as in any synchronous step, so this is the
                  floor of a distributed step where compute time varies
  comm            a grouped allreduce of the model's gradient shapes through
                  perseus_tf.horovod (float32), nothing else
  comm fp16       the same with Compression.fp16
  strategy fp32   PerseusStrategy `fit`, PERSEUS_ALLREDUCE_DTYPE=1
  strategy        PerseusStrategy `fit`, defaults (float16 with the gradient scale)
  strategy sharded    PerseusStrategy `fit` (defaults) with shard_optimizer_state
                  (PERSEUS_SHARD_OPTIMIZER_STATE=1); "strategy fp32 sharded" likewise
  strategy, chained   PerseusStrategy `fit` (defaults) with the gradient groups
                  run one after another in program order, as before overlap
  X, TF order     contender X with the weight gradients in TF's own order
                  (perseus_tf._backprop_order off): with one inter-op thread
                  TF computes them all at the end of backprop
  shim none       `fit` with perseus_tf.horovod.keras.DistributedOptimizer
  shim fp16       the same with Compression.fp16
  mwms            MultiWorkerMirroredStrategy `fit` (TF 2.15 only: Keras 3's
                  `fit` fails under it)
  horovod         Horovod's own horovod.tensorflow.keras.DistributedOptimizer
                  (float32) over Gloo, where Horovod imports (the .venv-hvd of
                  docs/performance.md, TF 2.15); its Gloo rendezvous server runs on host 0

Every contender runs with TF_CPU_ALLOCATOR_USE_BFC=true (what `import
perseus_tf` sets), the baselines included. A step is the time between Keras's batch-end callbacks (rank 0, the median
of --steps after --warmup). Each contender's step is printed as a ratio to
max(compute, comm) and to compute + comm of the same round, and the table
gives the median over rounds. Per-replica batch --batch, synthetic data,
SGD with momentum.

Models: mobilenetv2 (MobileNetV2 at 96x96, 10 classes: 8.9 MB of gradients)
and mlp (a wide MLP where communication dominates: 4 x 1536 + 1024 inputs,
34.7 MB of float32 gradients).

Needs root, iproute2, tc and openssh-server. Usage:
    .venv/bin/python benchmarks/step_overlap.py --models mobilenetv2,mlp --rates 1gbit,10gbit
"""

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONTENDERS = ["compute", "lockstep", "comm", "comm fp16", "strategy fp32", "strategy",
              "strategy, chained", "strategy fp32 sharded", "strategy sharded", "shim none",
              "shim fp16", "mwms", "horovod"]

FP16 = {"strategy", "strategy, chained", "strategy sharded", "shim fp16"}


# ---- the worker (runs in a namespace, one per host) ------------------------

def _model(name, keras):
    if name == "mobilenetv2":
        return keras.applications.MobileNetV2(input_shape=(96, 96, 3), weights=None,
                                              classes=10), (96, 96, 3), 10
    if name == "mlp":
        layers = [keras.Input((1024,))] + [keras.layers.Dense(1536, activation="relu")
                                           for _ in range(4)] + [keras.layers.Dense(10)]
        return keras.Sequential(layers), (1024,), 10
    raise ValueError(f"--models: unknown model {name!r} (mobilenetv2, mlp)")


def _chain_groups():
    from tensorflow.python.framework import auto_control_deps as acd
    acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS = \
        acd.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS - frozenset(["PerseusGroupedAllreduce"])


def worker(args):
    import numpy as np
    import tensorflow as tf
    try:
        import keras
    except ImportError:
        keras = tf.keras
    import step_probes  # beside this file
    contender = args.worker
    if contender.endswith(", TF order"):
        from perseus_tf import _backprop_order
        _backprop_order.ENABLED = False
        contender = contender[:-len(", TF order")]
    steps = args.warmup + args.steps
    times = []

    cpu_at = []  # per-thread CPU seconds when the timed steps start and end
    core_at = []  # the pinned core's busy and softirq seconds, likewise
    faults_at = []  # this process's page faults, likewise

    profile_dir = []

    def mark():
        times.append(time.perf_counter())
        if len(times) in (args.warmup, steps):
            core_at.append(step_probes.core_times())
            faults_at.append(step_probes.page_faults())
        if args.threads and len(times) in (args.warmup, steps):
            cpu_at.append(step_probes.thread_cpu())
        if args.ops and len(times) == args.warmup:
            import tempfile
            profile_dir.append(tempfile.mkdtemp())
            tf.profiler.experimental.start(profile_dir[0])
        if args.ops and len(times) == steps:
            tf.profiler.experimental.stop()

    wait_for_other = []  # lockstep: the barrier with the other host

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            for wait in wait_for_other:
                wait()
            mark()

    def data(global_batch, shape, classes, seed):
        rng = np.random.default_rng(seed)
        x = rng.normal(size=(global_batch * 4,) + shape).astype(np.float32)
        y = rng.integers(0, classes, size=(global_batch * 4,))
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat()

    def fit(model, dataset):
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Clock()])

    def compile_(model, optimizer):
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def sgd():
        return keras.optimizers.SGD(0.01, momentum=0.9)

    rank = 0
    if contender == "lockstep":
        rank = int(os.environ["STEP_BARRIER_RANK"])
        wait_for_other.append(_barrier(os.environ["STEP_BARRIER"], rank, args.timeout))
    if contender in ("compute", "lockstep"):
        model, shape, classes = _model(args.model, keras)
        compile_(model, sgd())
        fit(model, data(args.batch, shape, classes, 0))
    elif contender.startswith("comm"):
        import perseus_tf.horovod as hvd
        hvd.init()
        rank = hvd.rank()
        model, _, _ = _model(args.model, keras)
        grads = [tf.random.normal(v.shape) for v in model.trainable_variables]
        compression = hvd.Compression.fp16 if contender == "comm fp16" else hvd.Compression.none

        @tf.function
        def reduce(grads):
            out = []
            for g in grads:
                c, ctx = compression.compress(g)
                out.append((c, ctx))
            reduced = hvd.grouped_allreduce([c for c, _ in out])
            return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, out)]

        for _ in range(steps):
            reduce(grads)[0].numpy()
            mark()
    elif contender.startswith("strategy") or contender == "mwms":
        if contender == "strategy, chained":
            _chain_groups()
        if contender == "mwms":
            strategy = tf.distribute.MultiWorkerMirroredStrategy()
            rank = strategy.cluster_resolver.task_id
        else:
            import perseus_tf
            strategy = perseus_tf.PerseusStrategy()
            rank = perseus_tf.rank()
        with strategy.scope():
            model, shape, classes = _model(args.model, keras)
            compile_(model, sgd())
        dataset = data(args.batch * strategy.num_replicas_in_sync, shape, classes, 0)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = \
            tf.data.experimental.AutoShardPolicy.DATA
        fit(model, dataset.with_options(options))
    elif contender.startswith("shim") or contender == "horovod":
        if contender == "horovod":
            import horovod.tensorflow.keras as hvd
        else:
            import perseus_tf.horovod.keras as hvd
        hvd.init()
        rank = hvd.rank()
        model, shape, classes = _model(args.model, keras)
        compression = hvd.Compression.fp16 if contender == "shim fp16" else hvd.Compression.none
        compile_(model, hvd.DistributedOptimizer(sgd(), compression=compression))
        fit(model, data(args.batch, shape, classes, rank))
    else:
        raise ValueError(f"unknown contender {contender!r}")
    gaps = [b - a for a, b in zip(times, times[1:])][args.warmup - 1:]
    result = {"ms": 1000 * statistics.median(gaps), "min": 1000 * min(gaps),
              "max": 1000 * max(gaps)}
    if len(core_at) == 2 and None not in core_at:
        result["core"] = {k: round(1000 * (core_at[1][i] - core_at[0][i]) / args.steps, 1)
                          for i, k in enumerate(("busy ms/step", "softirq ms/step"))}
        result["core"]["page faults/step"] = round((faults_at[1] - faults_at[0]) / args.steps, 1)
    if len(cpu_at) == 2:
        result["threads"] = step_probes.cpu_per_step(cpu_at[0], cpu_at[1], args.steps,
                                                     times[-1] - times[args.warmup - 1])
    if profile_dir:
        import shutil
        result["ops"] = step_probes.op_times(profile_dir[0], args.steps)
        shutil.rmtree(profile_dir[0])
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def _barrier(addr, rank, timeout):
    """A barrier of two hosts over one TCP connection (rank 0 listens at
    `addr`): each call sends one byte and waits for the other host's."""
    import socket
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    if rank == 0:
        with socket.create_server((host, int(port))) as server:
            server.settimeout(timeout)
            conn, _ = server.accept()
    else:
        while True:
            try:
                conn = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    conn.settimeout(timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def wait():
        conn.sendall(b"s")
        if conn.recv(1) != b"s":
            raise RuntimeError(f"lockstep: the other host closed {addr}")
    return wait


# ---- the driver -----------------------------------------------------------

def horovod_rendezvous(hosts, n=2):
    """Horovod's Gloo rendezvous server for one rank on each of the first n
    hosts, run on host 0 as horovodrun would run it; returns (process, port)."""
    names = ",".join(f"{name}:1" for name in hosts.names[:n])
    script = (
        "import sys\n"
        "from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts\n"
        "from horovod.runner.http.http_server import RendezvousServer\n"
        "server = RendezvousServer(0)\n"
        "port = server.start()\n"
        f"server.init(get_host_assignments(parse_hosts('{names}'), {n}))\n"
        "print(port, flush=True)\n"
        "sys.stdin.read()\n")
    proc = hosts.popen(0, [sys.executable, "-c", script], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        raise RuntimeError("Horovod's rendezvous server did not start")
    return proc, int(line)


def horovod_hostnames(hosts):
    """Horovod 0.28 builds its process-set Gloo contexts from gethostname(), so
    this machine's host name must resolve, in each namespace, to that host's
    own address: an /etc/netns/<ns>/hosts that `ip netns exec` mounts over
    /etc/hosts. Returns what it made, for removal in reverse order."""
    import socket
    made = []
    if not os.path.isdir("/etc/netns"):
        os.makedirs("/etc/netns")
        made.append("/etc/netns")
    me = socket.gethostname()
    with open("/etc/hosts") as f:  # less the lines that name this machine
        base = "".join(line for line in f if me not in line.split("#")[0].split()[1:])
    for name, addr in zip(hosts.names, hosts.addrs):
        d = os.path.join("/etc/netns", name)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "hosts")
        with open(path, "w") as f:
            f.write(f"{addr} {socket.gethostname()} {name}\n"
                    + "".join(f"{a} {n}\n" for n, a in zip(hosts.names, hosts.addrs) if n != name)
                    + base)
        made.append(path)
    return made


def remove_horovod_hostnames(made):
    """Undoes horovod_hostnames: the hosts files, then /etc/netns if it made it."""
    for path in reversed(made):
        if os.path.isdir(path):
            os.rmdir(path)
        else:
            os.remove(path)
            os.rmdir(os.path.dirname(path))


# A contender's suffix: run from --baseline-tree.
BASELINE = " @baseline"


def run_contender(hosts, contender, args, model, env_extra=None, tree=ROOT):
    """Starts one process per host (pinned to core h) and returns rank 0's result.
    `tree`: the source tree whose perseus_tf the ranks import. Hosts whose
    `one_host` is true are one machine: both ranks are local ranks of it."""
    from netns_hosts import communicate_all  # on sys.path from main()
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", contender, "--model", model,
           "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.threads:
        cmd.append("--threads")
    if args.ops:
        cmd.append("--ops")
    env = dict(os.environ)
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # What `import perseus_tf` sets, for every contender (the baselines too).
    env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env.update(env_extra or {})
    if contender.startswith("strategy fp32"):
        env["PERSEUS_ALLREDUCE_DTYPE"] = "1"
    if contender.startswith("strategy") and "sharded" in contender:
        env["PERSEUS_SHARD_OPTIMIZER_STATE"] = "1"
    port = 20000 + secrets.randbelow(10000)
    common = dict(env, PERSEUS_MASTER_ADDR=hosts.addrs[0], PERSEUS_MASTER_PORT=str(port),
                  PERSEUS_RENDEZVOUS_SECRET=secrets.token_hex(16),
                  PERSEUS_JOB_ID="e2e-" + secrets.token_hex(4))
    procs = []
    rendezvous = None
    if contender == "horovod":
        rendezvous, hvd_port = horovod_rendezvous(hosts)
    for h in range(2):
        if contender == "compute":
            henv = dict(env)
        elif contender == "lockstep":
            henv = dict(env, STEP_BARRIER=f"{hosts.addrs[0]}:{port}", STEP_BARRIER_RANK=str(h))
        elif contender == "horovod":
            henv = dict(env, HOROVOD_GLOO_RENDEZVOUS_ADDR=hosts.addrs[0],
                        HOROVOD_GLOO_RENDEZVOUS_PORT=str(hvd_port), HOROVOD_CONTROLLER="gloo",
                        HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="eth0",
                        HOROVOD_HOSTNAME=hosts.names[h], HOROVOD_RANK=str(h), HOROVOD_SIZE="2",
                        HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1",
                        HOROVOD_CROSS_RANK=str(h), HOROVOD_CROSS_SIZE="2")
        elif contender == "mwms":
            cluster = {"worker": [f"{a}:{port + 1}" for a in hosts.addrs]}
            henv = dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                                    "task": {"type": "worker", "index": h}}))
        elif getattr(hosts, "one_host", False):
            henv = dict(common, PERSEUS_RANK=str(h), PERSEUS_SIZE="2", PERSEUS_LOCAL_RANK=str(h),
                        PERSEUS_LOCAL_SIZE="2", PERSEUS_CROSS_RANK="0",
                        PERSEUS_CROSS_SIZE="1", PERSEUS_HOST_ADDR=hosts.addrs[h])
        else:
            henv = dict(common, PERSEUS_RANK=str(h), PERSEUS_SIZE="2", PERSEUS_LOCAL_RANK="0",
                        PERSEUS_LOCAL_SIZE="1", PERSEUS_CROSS_RANK=str(h),
                        PERSEUS_CROSS_SIZE="2", PERSEUS_HOST_ADDR=hosts.addrs[h])
        procs.append(hosts.popen(h, ["taskset", "-c", str(h % os.cpu_count())] + cmd,
                                 env=henv, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
    try:
        outputs = communicate_all(procs, args.timeout, f"{contender} ({model})")
    finally:
        if rendezvous:
            rendezvous.kill()
            rendezvous.communicate()
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{contender} ({model}) failed:\n" + "\n".join(o[-2000:] for o in outputs))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mobilenetv2,mlp")
    p.add_argument("--rates", default="1gbit,10gbit", help="tc rates of the link")
    p.add_argument("--contenders", default=",".join(CONTENDERS).replace(", ", "+"),
                   help="comma-separated (write 'strategy, chained' as 'strategy+chained')")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="per-replica batch")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    p.add_argument("--baseline-tree",
                   help="another checkout (its native libraries built or copied in): a "
                        "contender named with the suffix ' @baseline' imports its perseus_tf, "
                        "in the same interleaved rounds")
    p.add_argument("--timeline", action="store_true",
                   help="also run each strategy and shim contender once with PERSEUS_TIMELINE "
                        "and print rank 0's communication spans of the last steps, with rank "
                        "1's starts and the rank that came late to each")
    p.add_argument("--threads", action="store_true",
                   help="also print each contender's CPU time per step by thread (rank 0)")
    p.add_argument("--ops", action="store_true",
                   help="also profile the timed steps (TF profiler) and print rank 0's op "
                        "types by time per step")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    # A SIGTERM (a timeout, a killed run) unwinds through the finally blocks
    # that remove the namespaces, the shaped links and /etc/netns files.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from netns_hosts import NetnsHosts, missing_requirements
    import tensorflow as tf
    why = missing_requirements()
    if why:
        sys.exit(f"step_overlap.py: {why}")
    contenders = [c.replace("+", ", ") for c in args.contenders.split(",")]
    for c in contenders:
        if c.endswith(BASELINE) and not args.baseline_tree:
            sys.exit(f"--contenders: {c!r} needs --baseline-tree")
        if c.replace(", TF order", "").removesuffix(BASELINE) not in CONTENDERS:
            sys.exit(f"--contenders: unknown {c!r}; choose from {', '.join(CONTENDERS)}")
    if tf.__version__ >= "2.16" and "mwms" in contenders:
        contenders.remove("mwms")  # Keras 3's fit fails under MWMS (PerReplica to Tensor)
    if "horovod" in contenders:
        try:
            import horovod.tensorflow  # noqa: F401
        except ImportError:
            contenders.remove("horovod")
            print("# horovod: not importable by this Python (docs/performance.md: .venv-hvd), left out")
    print(f"# TF {tf.__version__}; 2 hosts (network namespaces), 1 rank each pinned to one "
          f"core; per-replica batch {args.batch}; rank 0's median step of {args.steps} after "
          f"{args.warmup} warm-up; median over {args.rounds} interleaved rounds")
    for rate in args.rates.split(","):
        hosts = NetnsHosts(2, subnet=0)
        made = []
        try:
            if "horovod" in contenders:
                made = horovod_hostnames(hosts)
            hosts.shape(rate)
            for model in args.models.split(","):
                rounds = {c: [] for c in contenders}
                cores = {c: [] for c in contenders}
                for r in range(args.rounds):
                    order = contenders if r % 2 == 0 else contenders[::-1]
                    for c in order:
                        result = run_contender(
                            hosts, c.removesuffix(BASELINE), args, model,
                            tree=args.baseline_tree if c.endswith(BASELINE) else ROOT)
                        rounds[c].append(result["ms"])
                        if "core" in result:
                            cores[c].append(result["core"]["busy ms/step"])
                        for key in ("core", "threads", "ops"):
                            if key in result:
                                print(f"# {model} {rate} {c} {key}: "
                                      f"{json.dumps(result[key])}", flush=True)
                _print_table(model, rate, contenders, rounds, cores)
                if args.timeline:
                    for c in contenders:
                        if c.startswith(("strategy", "shim")):
                            _print_timeline(hosts, c, args, model)
        finally:
            remove_horovod_hostnames(made)
            hosts.close()


def _print_timeline(hosts, contender, args, model, spans=12):
    """Rank 0's last `spans` bucket spans beside rank 1's starts."""
    import tempfile
    import rank_timelines  # beside this file
    with tempfile.TemporaryDirectory() as out:
        run_contender(hosts, contender, args, model,
                      {"PERSEUS_TIMELINE": os.path.join(out, "trace.json")})
        traces = []
        for r in range(2):
            path = os.path.join(out, f"trace.rank{r}.json")
            if r == 0 or os.path.exists(path):  # without rank 1's, rank 0's alone
                with open(path) as f:
                    traces.append(rank_timelines.bucket_spans(json.load(f)))
            else:
                traces.append([])
    if not traces[0]:
        print(f"(no bucket spans in the timeline of {contender})")
        return
    rows = rank_timelines.rows(traces[0], traces[1], spans)
    print(f"\n{contender}, {model}: rank 0's last {len(rows)} communication spans "
          f"(PERSEUS_TIMELINE; stream = tid - 1); rank 1's start on rank 0's clock, and "
          f"the rank that came late to the bucket, which the other waited for inside it")
    print("| start ms | end ms | rank 1 start ms | late | stream | op | tensors | MB "
          "| first tensor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    late = rank_timelines.skew(traces[0], traces[1])
    if late:
        print(f"how late the later rank came to each of the run's {late[0]} buckets of 64 KB "
              f"or more: median {late[1]:.1f} ms, 90th percentile {late[2]:.1f} ms")
    sys.stdout.flush()


def _print_table(model, rate, contenders, rounds, cores):
    ms = {c: statistics.median(v) for c, v in rounds.items()}
    n = len(next(iter(rounds.values())))
    lockstep = "lockstep" in rounds
    print(f"\n## {model}, link {rate}")
    print(", ".join(f"{c} {ms[c]:.0f} ms" for c in ("compute", "lockstep", "comm", "comm fp16")
                    if c in ms))
    print("(contenders sending float16 are compared with comm fp16; 'core ms' is rank 0's "
          "core busy per step, softirq included; 'floor' is compute's core ms + comm's core "
          "ms, the step of perfect overlap on a core that does both"
          + ("; lockstep is compute with the hosts waiting for each other every step)"
             if lockstep else ")"))
    print("| contender | step ms | rounds ms | / max(compute, comm) | / (compute + comm) "
          "| core ms | / floor |" + (" / max(lockstep, comm) |" if lockstep else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if lockstep else ""))

    def med(c):
        return f"{statistics.median(cores[c]):.0f}" if len(cores.get(c, [])) == n else ""

    def ratio(c, base, comm, how):
        if not (base in rounds and comm in rounds):
            return ""
        return f"{statistics.median(rounds[c][i] / how(rounds[base][i], rounds[comm][i]) for i in range(n)):.2f}"

    for c in contenders:
        cells = [c, f"{ms[c]:.0f}", " ".join(f"{v:.0f}" for v in rounds[c])]
        if c in ("compute", "lockstep") or c.startswith("comm"):
            cells += ["", "", med(c), ""] + ([""] if lockstep else [])
        else:
            comm = "comm fp16" if c.replace(", TF order", "") in FP16 else "comm"
            floor = ""
            if all(len(cores.get(b, [])) == n for b in ("compute", comm)):
                floor = f"{statistics.median(rounds[c][i] / (cores['compute'][i] + cores[comm][i]) for i in range(n)):.2f}"
            cells += [ratio(c, "compute", comm, max), ratio(c, "compute", comm, lambda x, y: x + y),
                      med(c), floor] + ([ratio(c, "lockstep", comm, max)] if lockstep else [])
        print("| " + " | ".join(cells) + " |")
    _print_speedups(rounds, n)
    sys.stdout.flush()


def _print_speedups(rounds, n):
    """Baseline step / ours, per round then the median. For MWMS also its
    ceiling: MWMS / max(compute, comm), what a step of perfect overlap would
    reach, since no fp32 step is shorter than compute alone or than comm
    alone (the same wire, the same float32 bytes); and with lockstep run,
    MWMS / max(lockstep, comm), since no synchronous step is shorter than
    the slower host's compute."""
    pairs = [("mwms", "strategy"), ("mwms", "strategy fp32"), ("horovod", "shim none"),
             ("horovod", "shim fp16"), ("strategy", "strategy sharded"),
             ("strategy fp32", "strategy fp32 sharded")]
    for base, ours in pairs:
        if base in rounds and ours in rounds:
            r = [rounds[base][i] / rounds[ours][i] for i in range(n)]
            print(f"{base} / {ours}: {statistics.median(r):.2f} "
                  f"(rounds {' '.join(f'{v:.2f}' for v in r)})")
    for floor in ("compute", "lockstep"):
        if "mwms" in rounds and floor in rounds and "comm" in rounds:
            r = [rounds["mwms"][i] / max(rounds[floor][i], rounds["comm"][i]) for i in range(n)]
            print(f"ceiling of mwms / (an fp32 step): mwms / max({floor}, comm) = "
                  f"{statistics.median(r):.2f}")


if __name__ == "__main__":
    main()
