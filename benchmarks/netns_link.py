"""Two hosts on one machine, joined by a shaped link: the multi-host benchmark.

Makes two hosts out of network namespaces (tests/netns_hosts.py: each with
its own address 10.77.0.<h+1> and its own sshd, joined through a bridge in a
third namespace), shapes each host's link with `tc` to --rate (default
1 Gbit/s) in each direction, and starts --ranks-per-host ranks of
`python -m benchmarks.collectives gradients` on each host through `perseusrun`
over ssh, as on two machines. It replays one training step's gradients of
--profile under several settings, one job each, in this one invocation.
Ranks on one host talk over its loopback (not shaped); only traffic between
hosts crosses the shaped link.

Prints per setting the time per step (rank 0's median), the payload of one
rank's collectives per step (float16 halves it; for mixed, what crosses
hosts), and the speed-up against the uncompressed flat ring, with the
targets of issue 5:
  fp16 >= 1.7x, hierarchical >= 1.4x, top-k (1%) >= 5x faster than none/flat.
With --also-by-hand every setting also runs with its ranks started by hand
in the namespaces (the env contract, rank 0 serving the store), the way
this benchmark started them before perseusrun could reach other hosts.

Needs root, iproute2, tc and openssh-server (Linux). Usage:
    sudo .venv/bin/python benchmarks/netns_link.py --profile vgg16
"""

import argparse
import csv
import os
import secrets
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from netns_hosts import NetnsHosts, communicate_all, missing_requirements  # noqa: E402

# name -> (PERSEUS_* settings, target speed-up over "flat, none" or None)
SETTINGS = [
    ("flat, none", {"PERSEUS_ALLREDUCE_MODE": "0", "PERSEUS_ALLREDUCE_DTYPE": "1"}, None),
    ("flat, fp16", {"PERSEUS_ALLREDUCE_MODE": "0", "PERSEUS_ALLREDUCE_DTYPE": "0"}, 1.7),
    ("hierarchical, none", {"PERSEUS_ALLREDUCE_MODE": "1", "PERSEUS_ALLREDUCE_DTYPE": "1"}, 1.4),
    # The same with the host phases over TCP instead of shared memory.
    ("hierarchical, none, tcp", {"PERSEUS_ALLREDUCE_MODE": "1", "PERSEUS_ALLREDUCE_DTYPE": "1",
                                 "PERSEUS_SHM_ALLREDUCE": "0"}, None),
    ("flat, top-k 1%", {"PERSEUS_ALLREDUCE_MODE": "0", "PERSEUS_ALLREDUCE_DTYPE": "1",
                        "PERSEUS_TOPK_ALLREDUCE": "1", "PERSEUS_TOPK_RATIO": "0.01"}, 5.0),
    ("hierarchical, mixed", {"PERSEUS_ALLREDUCE_MODE": "1", "PERSEUS_ALLREDUCE_DTYPE": "2"},
     None),
]


def run_job(hosts, profile, per_host, env_extra, iters, timeout, by_hand=False):
    """One job of 2 * per_host ranks; returns rank 0's CSV row."""
    size = 2 * per_host
    with tempfile.TemporaryDirectory() as out:
        path = os.path.join(out, "row.csv")
        bench = [sys.executable, "-m", "benchmarks.collectives", "gradients", "--profile", profile,
                 "--iters", str(iters), "--warmup", "1", "--csv", path]
        env = dict(os.environ)
        env.update(env_extra)  # PERSEUS_* reach the remote ranks by default
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        if by_hand:
            procs = _start_by_hand(hosts, per_host, env, bench)
        else:
            hostlist = ",".join(f"{a}:{per_host}" for a in hosts.addrs)
            procs = [hosts.popen(0, [sys.executable, "-m", "perseus_tf.runner", "-np", str(size),
                                     "-H", hostlist, "-i", hosts.key, "--"] + bench,
                                 env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)]
        outputs = communicate_all(procs, timeout, f"job {env_extra}")
        if any(p.returncode for p in procs) or not os.path.exists(path):
            raise RuntimeError(f"job {env_extra} failed:\n" + outputs[0][-3000:])
        with open(path) as f:
            return next(csv.DictReader(f))


def _start_by_hand(hosts, per_host, env, bench):
    size = 2 * per_host
    port = 20000 + secrets.randbelow(10000)
    common = dict(env, PERSEUS_MASTER_ADDR=hosts.addrs[0], PERSEUS_MASTER_PORT=str(port),
                  PERSEUS_RENDEZVOUS_SECRET=secrets.token_hex(16),
                  PERSEUS_JOB_ID="netns-" + secrets.token_hex(4))
    procs = []
    for rank in range(size):
        host, local = divmod(rank, per_host)
        rank_env = dict(common, PERSEUS_RANK=str(rank), PERSEUS_SIZE=str(size),
                        PERSEUS_LOCAL_RANK=str(local), PERSEUS_LOCAL_SIZE=str(per_host),
                        PERSEUS_CROSS_RANK=str(host), PERSEUS_CROSS_SIZE="2",
                        PERSEUS_HOST_ADDR=hosts.addrs[host])
        procs.append(hosts.popen(host, bench, env=rank_env, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True))
    return procs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="vgg16")
    parser.add_argument("--rate", default="1gbit", help="tc rate of the link (default 1gbit)")
    parser.add_argument("--ranks-per-host", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per job")
    parser.add_argument("--also-by-hand", action="store_true",
                        help="also run every setting with its ranks started by hand")
    parser.add_argument("--only", default=None,
                        help="setting names to run, separated by ';' (the baseline always runs)")
    args = parser.parse_args()
    why = missing_requirements()
    if why:
        sys.exit(f"netns_link.py: {why}")
    chosen = SETTINGS if not args.only else [
        s for s in SETTINGS if s[0] == SETTINGS[0][0] or s[0] in args.only.split(";")]
    hosts = NetnsHosts(2, subnet=0)
    try:
        hosts.shape(args.rate)
        print(f"# {args.profile}: 2 hosts (network namespaces with sshd) x {args.ranks_per_host} "
              f"ranks started by perseusrun over ssh, each host's link shaped to {args.rate} "
              f"each way; one job per setting, {args.iters} timed steps each; ms = rank 0's "
              "median step time")
        by_hand = "  by hand ms   ratio" if args.also_by_hand else ""
        print(f"{'setting':<26} {'ms/step':>10} {'min-max ms':>19} {'payload MB':>13} "
              f"{'speed-up':>9}  {'target':<14}{by_hand}")
        base = None
        for name, env, target in chosen:
            row = run_job(hosts, args.profile, args.ranks_per_host, env, args.iters,
                          args.timeout)
            ms = float(row["ours_median_ms"])
            base = ms if base is None else base
            speedup = base / ms
            verdict = "" if target is None else \
                f">= {target:g}x: {'PASS' if speedup >= target else 'FAIL'}"
            wire = float(row["data_bytes_per_step"]) / 1e6
            spread = f"{float(row['ours_min_ms']):.0f}-{float(row['ours_max_ms']):.0f}"
            line = (f"{name:<26} {ms:>10.1f} {spread:>19} "
                    f"{wire:>13.1f} {speedup:>8.2f}x  {verdict:<14}")
            if args.also_by_hand:
                hand = float(run_job(hosts, args.profile, args.ranks_per_host, env, args.iters,
                                     args.timeout, by_hand=True)["ours_median_ms"])
                line += f"  {hand:>10.1f}  {ms / hand:>5.2f}"
            print(line, flush=True)
    finally:
        hosts.close()


if __name__ == "__main__":
    main()
