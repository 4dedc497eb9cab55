"""Small allreduces across N hosts: Gloo's ring against recursive doubling.

Makes N hosts out of network namespaces (tests/netns_hosts.py: each its own
address and sshd, joined by a bridge), starts one rank per host through
`perseusrun` over ssh, and times a raw allreduce (one contiguous buffer on a
context of its own, no negotiation: perseus_tf._testing.raw_allreduce) by the
ring and by recursive doubling, alternately, in the same job, size by size.
Both are the transport's: what the runtime picks for a bucket is
PERSEUS_ALLREDUCE_DOUBLING_BYTES (doubling up to it, the ring above).

Beside each measured ratio (ring time / doubling time) it prints what a
latency-only model predicts: a ring waits on 2(N-1) hops in sequence,
doubling on log2(p) exchanges plus 2 for the fold when N is not a power of
two (p: the largest power of two <= N). No link is shaped (netem delay does
not exist here): a hop costs what waking the receiving process costs, which
the 2-host, 4-byte doubling time measures (alpha, printed).

Needs root, iproute2 and openssh-server (Linux). Usage:
    .venv/bin/python benchmarks/hosts_latency.py --hosts 2,4,8
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

SIZES = [4, 64, 1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]


def worker(out, iters, warmup, sizes):
    """One rank: times both algorithms at every size (no sizes: none), then a
    4 KiB allreduce through the runtime (submit + wait, online negotiation)
    at the job's settings; rank 0 writes medians."""
    sys.path.insert(0, ROOT)
    import numpy as np
    from perseus_tf import _native, _testing
    _native.init()
    topo = _native.topology()
    rank, size = topo["rank"], topo["size"]
    f32 = _native.DTYPE_CODES["float32"]
    line_up = np.zeros(1, np.float32)
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        for doubling in (False, True):  # the sum is right either way
            check = np.ones(count, np.float32)
            _testing.raw_allreduce(check, f32, doubling=doubling)
            if not np.all(check == size):
                raise RuntimeError(f"{nbytes} B, doubling={doubling}: wrong sum")
        buf = np.zeros(count, np.float32)  # zeros stay zeros over the iterations
        times = {False: [], True: []}
        for i in range(warmup + iters):
            for doubling in (False, True):
                _testing.raw_allreduce(line_up, f32)  # start together
                start = time.perf_counter()
                _testing.raw_allreduce(buf, f32, doubling=doubling)
                if i >= warmup:
                    times[doubling].append(time.perf_counter() - start)
        rows.append({"bytes": nbytes, "ring_us": 1e6 * statistics.median(times[False]),
                     "doubling_us": 1e6 * statistics.median(times[True])})
    # The negotiation cycle's allgather: a 512-byte slot from every rank.
    slot = bytes(512)
    gathers = {False: [], True: []}
    for i in range(warmup + iters):
        for bruck in (False, True):
            _testing.raw_allreduce(line_up, f32)
            start = time.perf_counter()
            got = _testing.raw_allgather(slot, bruck=bruck)
            if i >= warmup:
                gathers[bruck].append(time.perf_counter() - start)
            if len(got) != 512 * size:
                raise RuntimeError(f"allgather (bruck={bruck}) gave {len(got)} bytes")
    x = np.zeros(1024, np.float32)
    through = []
    for i in range(warmup + iters):
        _testing.raw_allreduce(line_up, f32)
        start = time.perf_counter()
        _native._core.submit(_native.OP_ALLREDUCE, x, "bench.4k", f32, output=x).wait()
        if i >= warmup:
            through.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"size": size, "rows": rows,
                   "allgather_ring_us": 1e6 * statistics.median(gathers[False]),
                   "allgather_bruck_us": 1e6 * statistics.median(gathers[True]),
                       "runtime_4k_us": 1e6 * statistics.median(through)}, f)
    _native.shutdown()


def run(n, iters, warmup, timeout, sizes):
    """Two jobs on n hosts: the raw table and the runtime at the default
    settings, then the runtime alone with PERSEUS_ALLREDUCE_DOUBLING_BYTES=0."""
    from netns_hosts import NetnsHosts
    hosts = NetnsHosts(n, subnet=200 + n)
    try:
        result = job(hosts, n, iters, warmup, timeout, sizes, {})
        ring = job(hosts, n, iters, warmup, timeout, [], {"PERSEUS_ALLREDUCE_DOUBLING_BYTES": "0"})
        result["runtime_4k_ring_us"] = ring["runtime_4k_us"]
        return result
    finally:
        hosts.close()


def job(hosts, n, iters, warmup, timeout, sizes, settings):
    """One job of one rank per host; rank 0's medians."""
    from netns_hosts import communicate_all
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **settings)
        cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", str(n),
               "-H", ",".join(f"{a}:1" for a in hosts.addrs), "-i", hosts.key, "--",
               sys.executable, os.path.abspath(__file__), "--worker", out,
               "--iters", str(iters), "--warmup", str(warmup),
               "--sizes", ",".join(map(str, sizes)) or "none"]
        proc = hosts.popen(0, cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        output = communicate_all([proc], timeout, f"{n} hosts")[0]
        if proc.returncode or not os.path.exists(out):
            raise RuntimeError(f"{n} hosts failed:\n{output[-3000:]}")
        with open(out) as f:
            return json.load(f)


def model_ratio(n):
    """Ring hops over doubling exchanges, latency only."""
    p = 1 << int(math.log2(n))
    return 2 * (n - 1) / (int(math.log2(p)) + (2 if p != n else 0))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4,8", help="host counts, comma-separated")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per job")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="buffer sizes in bytes, comma-separated")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [] if args.sizes == "none" else [int(x) for x in args.sizes.split(",")]
    if args.worker:
        return worker(args.worker, args.iters, args.warmup, sizes)
    from netns_hosts import missing_requirements
    why = missing_requirements()
    if why:
        sys.exit(f"hosts_latency.py: {why}")
    counts = [int(x) for x in args.hosts.split(",")]
    print(f"# raw allreduce of float32 zeros, one rank per host (network namespaces, "
          f"perseusrun over ssh); median of {args.iters} alternating calls per algorithm; "
          "ratio = ring / doubling (> 1: doubling faster); model = the same ratio "
          "counting only waits on the network")
    print(f"{'hosts':>5} {'bytes':>8} {'ring us':>10} {'doubling us':>12} {'ratio':>7} "
          f"{'model':>7}")
    alpha = None
    through, gathers = [], []
    for n in counts:
        result = run(n, args.iters, args.warmup, args.timeout, sizes)
        through.append((n, result["runtime_4k_ring_us"], result["runtime_4k_us"]))
        gathers.append((n, result["allgather_ring_us"], result["allgather_bruck_us"]))
        for row in result["rows"]:
            ratio = row["ring_us"] / row["doubling_us"]
            if n == 2 and row["bytes"] == 4:
                alpha = row["doubling_us"]
            print(f"{n:>5} {row['bytes']:>8} {row['ring_us']:>10.1f} "
                  f"{row['doubling_us']:>12.1f} {ratio:>7.2f} {model_ratio(n):>7.2f}", flush=True)
    if alpha is not None:
        print(f"# alpha (2 hosts, 4 bytes, one exchange): {alpha:.1f} us")
    print("# a 4 KiB allreduce through the runtime (submit + wait, online negotiation): "
          "PERSEUS_ALLREDUCE_DOUBLING_BYTES=0 (ring) against the default (doubling)")
    print(f"{'hosts':>5} {'ring us':>10} {'doubling us':>12} {'ratio':>7}")
    for n, ring, doubling in through:
        print(f"{n:>5} {ring:>10.1f} {doubling:>12.1f} {ring / doubling:>7.2f}")
    print("# the negotiation cycle's allgather, 512 bytes a rank (raw): Gloo's ring against "
          "Bruck's rounds (what the runtime runs); model = (N-1) / ceil(log2 N)")
    print(f"{'hosts':>5} {'ring us':>10} {'bruck us':>12} {'ratio':>7} {'model':>7}")
    for n, ring, bruck in gathers:
        print(f"{n:>5} {ring:>10.1f} {bruck:>12.1f} {ring / bruck:>7.2f} "
              f"{(n - 1) / math.ceil(math.log2(n)):>7.2f}")


if __name__ == "__main__":
    main()
