"""One host (shared memory): training steps of this tree against an older one.

Runs step_overlap.py's contenders with both ranks on this machine (local ranks
0 and 1 of one host, so the allreduce goes through shared memory), each rank
pinned to its own core, and the same contenders again with the perseus_tf of
--base, an older checkout whose native libraries are built. Contenders are
interleaved over --rounds rounds; the table gives each one's median step and
its ratio to the same contender of --base in the same round (below 1: this
tree is faster).

    git worktree add /tmp/base <rev> && (cd /tmp/base && python tools/build_native.py)
    python benchmarks/one_host_step.py --base /tmp/base --models mobilenetv2,mlp
"""

import argparse
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # netns_hosts

import step_overlap  # noqa: E402

CONTENDERS = ["compute", "strategy fp32", "strategy", "shim none", "shim fp16"]


class LocalHost:
    """The two 'hosts' of step_overlap.run_contender as one machine."""
    one_host = True
    names = ["localhost", "localhost"]
    addrs = ["127.0.0.1", "127.0.0.1"]

    def popen(self, host, cmd, **kw):
        return subprocess.Popen(cmd, **kw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True,
                   help="an older source tree with its native libraries built")
    p.add_argument("--models", default="mobilenetv2")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="per-replica batch")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    p.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args = p.parse_args(argv)
    args.threads = args.ops = False
    base = os.path.abspath(args.base)
    if not os.path.isfile(os.path.join(base, "perseus_tf", "libperseus_core.so")):
        sys.exit(f"--base: {base} has no perseus_tf/libperseus_core.so; run "
                 "tools/build_native.py there first")
    contenders = args.contenders.split(",")
    for c in contenders:
        if c not in CONTENDERS:
            sys.exit(f"--contenders: unknown {c!r}; choose from {', '.join(CONTENDERS)}")
    rev = subprocess.run(["git", "-C", base, "log", "-1", "--format=%h"],
                         capture_output=True, text=True).stdout.strip() or "?"
    here = subprocess.run(["git", "-C", step_overlap.ROOT, "log", "-1", "--format=%h"],
                          capture_output=True, text=True).stdout.strip() or "?"
    import tensorflow as tf
    print(f"# TF {tf.__version__}; one host, 2 ranks (shared memory), each pinned to one "
          f"core; per-replica batch {args.batch}; rank 0's median step of {args.steps} after "
          f"{args.warmup} warm-up; median over {args.rounds} interleaved rounds; "
          f"this tree {here}, base {rev}")
    host = LocalHost()
    for model in args.models.split(","):
        runs = [(c, tree) for c in contenders for tree in (step_overlap.ROOT, base)]
        ms = {run: [] for run in runs}
        for r in range(args.rounds):
            for c, tree in (runs if r % 2 == 0 else runs[::-1]):
                ms[(c, tree)].append(
                    step_overlap.run_contender(host, c, args, model, tree=tree)["ms"])
        print(f"\n## {model}, one host")
        print(f"| contender | step ms ({here}) | rounds | step ms (base {rev}) | rounds "
              "| this / base |")
        print("|---|---|---|---|---|---|")
        for c in contenders:
            now, then = ms[(c, step_overlap.ROOT)], ms[(c, base)]
            ratio = statistics.median(a / b for a, b in zip(now, then))
            print(f"| {c} | {statistics.median(now):.0f} | {' '.join(f'{v:.0f}' for v in now)} "
                  f"| {statistics.median(then):.0f} | {' '.join(f'{v:.0f}' for v in then)} "
                  f"| {ratio:.2f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
