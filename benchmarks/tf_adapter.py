"""What the TensorFlow adapter costs: the same collectives through the TF ops
and straight through the runtime (`perseus_tf._core`), in one invocation.

Three tables, each timing both paths in the same processes, alternating
call by call so that both see the same machine:

  sizes      one float32 allreduce (sum) of 1 MiB to 256 MiB:
             `_core.submit` with a separate output array, against
             `perseus_tf.allreduce` of a tf.Variable inside tf.function
             (the variable's buffer cannot be reused, so both copy).
             Target: TF path <= 1.2x. For 1 to 16 MiB also "x10 in one
             call": ten dependent allreduces in a tf.range loop inside one
             tf.function against ten `_core` calls in a row, per
             allreduce, which is the op path without TF's cost of calling
             a function from Python (a training step makes many
             collectives per call).
  profiles   a model's gradient set (perseus_tf/profiles) as one grouped,
             plannable sum: `_core.submit_group` against
             `perseus_tf.grouped_allreduce` of variables inside tf.function.
             Target: <= 1.2x.
  small      500 gradients of 1 KiB at --small-np ranks: PerseusStrategy's
             replica all-reduce inside tf.function against `_core`'s
             offline-plan step. Target: <= 2x. Two cases: the gradients
             made and consumed inside the step, as in training, and 500
             eager tensors captured from Python with 500 results returned.
             Then the same again with PERSEUS_OFFLINE_NEG=0: the plan's
             speed-up on each path, and the TF step with the plan against
             TF alone + _core's plan step (target <= 1.2x).

Beside each case, "TF alone": the same tf.function with tf.identity (or
tf.identity_n) in place of the collective, TF's own cost of the call;
"adapter/core" is (TF - TF alone) / _core, what the collective adds to the
function, against the runtime alone.

No compression on either path. Prints median milliseconds per call.

Usage: python benchmarks/tf_adapter.py [--np 2] [--small-np 4] [--iters 10]
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES_MIB = [1, 4, 16, 64, 256]
# Sizes that also run LOOP_CALLS allreduces inside one tf.function.
LOOP_MAX_MIB = 16
LOOP_CALLS = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2, help="ranks for the sizes and profiles tables")
    p.add_argument("--small-np", type=int, default=4, help="ranks for the small-tensor table")
    p.add_argument("--iters", type=int, default=10, help="timed calls per path and case")
    p.add_argument("--profiles", default="resnet50", help="comma-separated profile names")
    p.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)),
                   help="comma-separated MiB for the sizes table")
    p.add_argument("--tables", default="sizes,profiles,small")
    p.add_argument("--worker", choices=["sizes", "profiles", "small"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _alternate(first, second, iters, warmup=3):
    """Median ms of each of two callables, called in turn."""
    for _ in range(warmup):
        first()
        second()
    a, b = [], []
    for _ in range(iters):
        t = time.perf_counter()
        first()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        second()
        b.append(time.perf_counter() - t)
    return _median(a) * 1e3, _median(b) * 1e3


def _worker(args):
    import numpy as np
    import tensorflow as tf

    import perseus_tf as ptf
    from perseus_tf import _gradient_marks, _native

    core = _native._core
    f32 = _native.DTYPE_CODES["float32"]
    rows = []
    if args.worker == "small":
        strategy = ptf.PerseusStrategy()
        count = 500
        captured = [tf.ones([256]) for _ in range(count)]

        def reduce(tensors):
            # Marked as gradients, as a Keras optimizer's apply does: the
            # reduction may run from the offline plan.
            with _gradient_marks.gradient_reduction():
                return tf.distribute.get_replica_context().all_reduce("sum", tensors)

        def made_in_step(collective):
            # As in training: the gradients are made inside the step and what
            # the reduction returns is consumed there (here summed to one
            # tensor, as an optimizer's apply consumes them).
            def replica():
                grads = [tf.fill([256], 1.0) for _ in range(count)]
                return tf.add_n(collective(grads))
            return tf.function(lambda: strategy.run(replica))

        def from_python(collective):
            # 500 eager tensors captured as inputs and 500 results returned
            # to Python each call.
            return tf.function(lambda: strategy.run(lambda: collective(captured)))

        arrays = [np.ones(256, np.float32) for _ in range(count)]
        names = [f"small.{i}" for i in range(count)]

        # PERSEUS_OFFLINE_NEG=0 (the online run of this table): neither path
        # may use a plan; _core's plannable flag is the caller's to give.
        use_plan = os.environ.get("PERSEUS_OFFLINE_NEG") != "0"

        def core_step():
            core.submit_group(arrays, names, f32, reduce_op=0, plannable=use_plan).wait()

        for case, build in (("in the step", made_in_step), ("from Python", from_python)):
            tf_step = build(reduce)
            # The same function with tf.identity_n in place of the
            # collective: what TF costs whatever the adapter does.
            tf_alone = build(tf.identity_n)
            # Enough repetitions for both paths to run from their offline
            # plans. The plan covers what repeats: here one _core call and
            # one TF call together, so a plan step is one call of each.
            before = core.stats()["offline_steps"]
            core_ms, tf_ms = _alternate(core_step, tf_step, args.iters * 4, warmup=30)
            offline = f"{core.stats()['offline_steps'] - before} plan steps for " \
                      f"{args.iters * 4 + 30} calls of each path"
            _, alone_ms = _alternate(core_step, tf_alone, args.iters * 4, warmup=5)
            graph = tf_step.get_concrete_function().graph
            plannable = [op.get_attr("plannable") for op in graph.get_operations()
                         if op.type == "PerseusGroupedAllreduce"]
            rows.append({"case": f"{count} x 1 KiB, {case}", "core": core_ms, "tf": tf_ms,
                         "tf_alone": alone_ms, "offline": offline,
                         "plannable": bool(plannable) and all(plannable)})
    else:
        ptf.init()
        if args.worker == "sizes":
            for mib in map(int, args.sizes.split(",")):
                n = mib << 18
                x, out = np.ones(n, np.float32), np.empty(n, np.float32)
                v = tf.Variable(tf.ones([n]))

                @tf.function
                def tf_call(v=v, mib=mib):
                    return ptf.allreduce(v, op=ptf.Sum, name=f"sizes.tf{mib}")

                # TF's own cost of a call that returns the variable.
                tf_alone = tf.function(lambda v=v: tf.identity(v))

                def core_call(x=x, out=out, mib=mib):
                    core.submit(_native.OP_ALLREDUCE, x, f"sizes.core{mib}", f32, reduce_op=0,
                                output=out).wait()

                iters = args.iters if mib < 256 else max(3, args.iters // 2)
                core_ms, tf_ms = _alternate(core_call, tf_call, iters)
                _, alone_ms = _alternate(core_call, tf_alone, iters)
                rows.append({"case": f"{mib} MiB", "core": core_ms, "tf": tf_ms,
                             "tf_alone": alone_ms})
                if mib <= LOOP_MAX_MIB:
                    rows.append(_in_one_call(ptf, core_call, v, mib, args.iters))
        else:
            for name in args.profiles.split(","):
                with open(os.path.join(ROOT, "perseus_tf", "profiles", f"{name}.json")) as f:
                    profile = json.load(f)
                sizes = [int(t["elements"]) for t in profile["tensors"]]
                arrays = [np.ones(n, np.float32) for n in sizes]
                names = [f"{name}.core.{i}" for i in range(len(sizes))]
                variables = [tf.Variable(tf.ones([n])) for n in sizes]

                @tf.function
                def tf_call(variables=variables, name=name):
                    return ptf.grouped_allreduce(variables, op=ptf.Sum, gradients=True,
                                                 name=f"{name}.tf")

                def core_call(arrays=arrays, names=names):
                    core.submit_group(arrays, names, f32, reduce_op=0, plannable=True).wait()

                tf_alone = tf.function(lambda variables=variables: tf.identity_n(variables))

                core_ms, tf_ms = _alternate(core_call, tf_call, args.iters, warmup=8)
                _, alone_ms = _alternate(core_call, tf_alone, args.iters)
                mib = sum(sizes) * 4 / (1 << 20)
                rows.append({"case": f"{name} ({len(sizes)} tensors, {mib:.0f} MiB)",
                             "core": core_ms, "tf": tf_ms, "tf_alone": alone_ms})
    if _native.topology()["rank"] == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def _in_one_call(ptf, core_call, v, mib, iters):
    """Per allreduce: LOOP_CALLS dependent allreduces of `v` in a tf.range
    loop inside one tf.function, against as many `core_call`s in a row."""
    import tensorflow as tf
    from perseus_tf import _native

    def chain(collective):
        @tf.function
        def run():
            y = tf.zeros_like(v)
            for _ in tf.range(LOOP_CALLS):
                with tf.control_dependencies([y]):  # one after the other
                    y = collective(v)
            return y
        return run

    tf_loop = chain(lambda t: ptf.allreduce(t, op=ptf.Sum, name=f"loop.tf{mib}"))
    tf_alone = chain(tf.identity)

    def core_calls():
        for _ in range(LOOP_CALLS):
            core_call()

    core_ms, tf_ms = _alternate(core_calls, tf_loop, iters)
    _, alone_ms = _alternate(core_calls, tf_alone, iters)
    # The loop's result is every rank's variable summed: a wrong loop (one
    # that skipped the collective) cannot pass for a fast one.
    expected = float(_native.topology()["size"])
    if not bool(tf.reduce_all(tf_loop() == expected)):
        raise SystemExit(f"{mib} MiB x{LOOP_CALLS} in one call: wrong sum")
    return {"case": f"{mib} MiB x{LOOP_CALLS} in one call", "core": core_ms / LOOP_CALLS,
            "tf": tf_ms / LOOP_CALLS, "tf_alone": alone_ms / LOOP_CALLS}


def _launch(args, table, ranks, offline=True):
    cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", str(ranks), "--",
           sys.executable, os.path.abspath(__file__), "--worker", table,
           "--iters", str(args.iters), "--profiles", args.profiles, "--sizes", args.sizes]
    env = dict(os.environ, PERSEUS_ALLREDUCE_DTYPE="1")  # no compression anywhere
    if not offline:
        env["PERSEUS_OFFLINE_NEG"] = "0"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise SystemExit(f"{table} at {ranks} ranks failed (exit {proc.returncode}):\n"
                     f"{proc.stderr[-4000:]}")


TARGETS = {"sizes": 1.2, "profiles": 1.2, "small": 2.0}
WHAT = {"sizes": "perseus_tf.allreduce(tf.Variable) in tf.function vs _core.submit(output=)",
        "profiles": "perseus_tf.grouped_allreduce(variables) in tf.function vs "
                    "_core.submit_group",
        "small": "PerseusStrategy replica all_reduce in tf.function vs _core offline-plan step"}


def _print(rows, target):
    """Each case against _core, and beside it TF's own cost for the same
    function without the collective ("TF alone"): adapter/core is what the
    collective adds to the TF function, (TF - TF alone) / _core, the part the
    adapter and the runtime own."""
    print(f"{'case':<36} {'_core ms':>9} {'TF ms':>9} {'TF alone':>9} {'TF/core':>8} "
          f"{'adapter/core':>13}  target")
    for r in rows:
        ratio = r["tf"] / r["core"]
        added = (r["tf"] - r["tf_alone"]) / r["core"]
        print(f"{r['case']:<36} {r['core']:>9.2f} {r['tf']:>9.2f} {r['tf_alone']:>9.2f} "
              f"{ratio:>7.2f}x {added:>12.2f}x  TF/core <= {target}x: "
              f"{'PASS' if ratio <= target else 'FAIL'}; adapter/core <= {target}x: "
              f"{'PASS' if added <= target else 'FAIL'}")
        if "offline" in r:
            print(f"  (offline plan: {r['offline']}; TF path plannable: {r['plannable']})")


def _print_offline(offline_rows, online_rows):
    """The offline plan through PerseusStrategy against the runtime alone:
    the TF step with the plan against TF alone + _core's plan step (target
    <= 1.2x), and what the plan saves on each path (online / offline)."""
    print(f"{'case':<36} {'TF alone':>9} {'_core off':>10} {'TF off':>8} "
          f"{'TF/(alone+core)':>16} {'_core on':>9} {'TF on':>8} {'plan x _core':>13} "
          f"{'plan x TF':>10}")
    for off, on in zip(offline_rows, online_rows):
        floor = off["tf_alone"] + off["core"]
        ratio = off["tf"] / floor
        print(f"{off['case']:<36} {off['tf_alone']:>9.2f} {off['core']:>10.2f} "
              f"{off['tf']:>8.2f} {ratio:>15.2f}x {on['core']:>9.2f} {on['tf']:>8.2f} "
              f"{on['core'] / off['core']:>12.2f}x {on['tf'] / off['tf']:>9.2f}x  "
              f"<= 1.2x: {'PASS' if ratio <= 1.2 else 'FAIL'}")


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return _worker(args)
    for table in args.tables.split(","):
        ranks = args.small_np if table == "small" else args.np
        rows = _launch(args, table, ranks)
        target = TARGETS[table]
        print(f"\n## {table}, {ranks} ranks: {WHAT[table]}")
        _print(rows, target)
        if table == "small":
            online = _launch(args, table, ranks, offline=False)
            print(f"\n## small, {ranks} ranks, offline plan against online negotiation "
                  "(PERSEUS_OFFLINE_NEG=0)")
            _print_offline(rows, online)
    return 0


if __name__ == "__main__":
    sys.exit(main())
