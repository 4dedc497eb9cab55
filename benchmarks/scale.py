"""How the runtime's costs grow with the job: one rank on each of N hosts.

Makes N hosts out of network namespaces (tests/netns_hosts.py: each its own
address and sshd, joined by a bridge), shapes each host's link with tc's
token bucket (--rate; netem's delay does not exist on this kernel, so a
hop's latency is what waking the receiving process costs), and starts one
`_core` rank per host through `perseusrun` over ssh. For each N it measures:

  start-up   the first collective done on every rank, after the last rank's
             process started (ssh excluded) and after the first; init's parts
             (joining through the store; connecting transports)
  buckets    one allreduce of 4 KiB, 64 KiB, 1 MiB and 16 MiB, negotiated
             online every step and run from an offline plan
  profiles   a training step's gradients (perseus_tf/profiles: resnet50 by
             default, bert with --profiles resnet50,bert), from a plan
  control    negotiation bytes sent and cycles per step, online and offline
  failure    a rank SIGKILLed mid-step: seconds until every other rank's wait
             has failed naming it; a rank frozen (SIGSTOP) mid-step: the same,
             against GLOO_TIMEOUT_SECONDS (--freeze-timeout)
  elastic    an elastic job (perseusrun --min-np N-1 --max-np N and a host
             discovery script): a rank SIGKILLed mid-step, and the seconds
             until the N-1 survivors have re-formed (their first collective
             of the new round done); then a slot discovered, and the seconds
             until the N ranks have re-formed with the newcomer, with the
             parts (spawn, the newcomer's import and request, the others'
             reset, the new round's init)
  resources  per rank after the steps: open files, threads, resident memory

Beside each time it prints the bound of an alpha-beta model: the fastest of
a ring (2(N-1) hops, 2(N-1)/N of the bytes), recursive doubling (log2 N
exchanges of the whole buffer, 2 more when N is not a power of two) and
halving-doubling (2 log2 N hops, the ring's bytes), with alpha and beta
measured in the same run on 2 hosts over the same shaped links (a raw
4-byte exchange; a raw 16 MiB ring), and the ratio measured / bound. The
`cpu` column is how busy the machine's cores were while the bucket ran
(/proc/stat): near 100% the figure measures the cores, not the links.

Needs root, iproute2, tc and openssh-server (Linux). Usage:
    .venv/bin/python benchmarks/scale.py --hosts 2,4,8,16,32 [--rate 400mbit]
        [--json out.json] [--svg docs/scale.svg]
"""

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

_STARTED = time.time()  # the process's start, before any import of ours

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

BUCKETS = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
CALIBRATE_BYTES = 16 << 20


# ---------------------------------------------------------------------------
# the ranks


def _cpu_ticks():
    """(busy, total) jiffies of the whole machine (/proc/stat's cpu line)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def _resources():
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    return {"open_files": len(os.listdir("/proc/self/fd")),
            "threads": int(status["Threads"]),
            "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
            "peak_rss_mb": int(status["VmHWM"].split()[0]) / 1024}


class Rank:
    """One rank's runtime and the helpers the measurements share."""

    def __init__(self):
        import numpy as np
        from perseus_tf import _native, _testing
        self.np, self.native, self.testing = np, _native, _testing
        self.imported = time.time()
        _native.init()
        self.initialized = time.time()
        topo = _native.topology()
        self.rank, self.size = topo["rank"], topo["size"]
        self.core = _native._core
        self.f32 = _native.DTYPE_CODES["float32"]
        self.f64 = _native.DTYPE_CODES["float64"]
        self.sum = _native.REDUCE_CODES["sum"]
        self._line = np.zeros(1, np.float32)

    def line_up(self):
        """Every rank leaves this together (as near as one exchange allows)."""
        self.testing.raw_allreduce(self._line, self.f32)

    def agree_mean(self, value):
        """The mean of every rank's value, the same on every rank."""
        x = self.np.array([value], self.np.float64)
        self.testing.raw_allreduce(x, self.f64)
        return float(x[0]) / self.size

    def agree_count(self, seconds_per_call, budget, least=3, most=50):
        """How many timed calls fit the budget: the same count on every rank."""
        per_call = self.agree_mean(seconds_per_call)
        return int(min(most, max(least, budget / max(per_call, 1e-6))))

    def timed(self, fn, calls):
        times = []
        busy0, total0 = _cpu_ticks()
        for _ in range(calls):
            self.line_up()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        busy1, total1 = _cpu_ticks()
        cpu = (busy1 - busy0) / max(1, total1 - total0)
        return times, cpu

    def stats_delta(self, fn):
        before = self.core.stats()
        fn()
        after = self.core.stats()
        return {k: after[k] - before[k] for k in ("control_bytes_sent", "cycles",
                                                   "offline_steps")}


def measure_steps(r, name, arrays, budget, warmup):
    """Online (never plannable) and offline (from a plan) step times of one
    grouped allreduce; control traffic per step of each."""
    names = [f"{name}.{i}" for i in range(len(arrays))]
    online_names = [f"online.{n}" for n in names]
    core, f32, total = r.core, r.f32, r.sum

    def offline():
        core.submit_group(arrays, names, f32, reduce_op=total, plannable=True).wait()

    def online():
        core.submit_group(arrays, online_names, f32, reduce_op=total, plannable=False).wait()

    out = {}
    for mode, fn in (("online", online), ("offline", offline)):
        start = time.perf_counter()
        for _ in range(warmup):
            r.line_up()
            fn()
        calls = r.agree_count((time.perf_counter() - start) / warmup, budget)
        counted = r.stats_delta(lambda: r.timed(fn, 1))
        times, cpu = r.timed(fn, calls)
        out[mode] = {"ms": 1e3 * statistics.median(times), "calls": calls, "cpu": cpu,
                     "control_bytes": counted["control_bytes_sent"],
                     "cycles": counted["cycles"], "offline_steps": counted["offline_steps"]}
    return out


def worker_steps(out_dir, buckets, profiles, budget, calibrate):
    r = Rank()
    np = r.np
    first = np.ones(1, np.float32)
    r.core.submit(r.native.OP_ALLREDUCE, first, "scale.first", r.f32, output=first).wait()
    first_done = time.time()
    st = r.core.stats()
    result = {"rank": r.rank, "size": r.size, "started": _STARTED, "imported": r.imported,
              "initialized": r.initialized, "first_done": first_done,
              "store_s": st["startup_store_seconds"], "connect_s": st["startup_connect_seconds"],
              "line": st["allreduce_doubling_bytes"], "model_alpha_us": st["link_latency_us"],
              "model_beta_mb": st["link_bandwidth_mbytes"], "model_reduce_mb": st["reduce_mbytes"],
              "host_phase_us": st["host_phase_us"], "host_phase_mb": st["host_phase_mbytes"],
              "cross_alpha_us": st["cross_latency_us"], "cross_beta_mb": st["cross_bandwidth_mbytes"],
              "leaders_line": st["leaders_doubling_bytes"],
              "buckets": {}, "profiles": {}}
    if calibrate:
        # alpha: one exchange of 4 bytes (recursive doubling at 2 ranks is one
        # exchange); beta: a ring of CALIBRATE_BYTES, which at 2 ranks sends
        # every byte once: t = bytes / beta + 2 alpha.
        tiny = np.zeros(1, np.float32)
        big = np.zeros(CALIBRATE_BYTES // 4, np.float32)
        a, _ = r.timed(lambda: r.testing.raw_allreduce(tiny, r.f32, doubling=True), 30)
        b, _ = r.timed(lambda: r.testing.raw_allreduce(big, r.f32), 5)
        result["alpha_s"] = statistics.median(a)
        result["ring_16m_s"] = statistics.median(b)
    for nbytes in buckets:
        x = [np.zeros(nbytes // 4, np.float32)]  # zeros stay zeros
        result["buckets"][str(nbytes)] = measure_steps(r, f"bucket{nbytes}", x, budget, 3)
    from benchmarks.collectives.gradients import load_profile
    for name in profiles:
        tensors = load_profile(name)["tensors"]
        arrays = [np.zeros(n, np.float32) for _, n in tensors][::-1]  # backprop's order
        row = measure_steps(r, f"{name}", arrays, budget, 3)  # a plan from the third
        row["bytes"] = 4 * sum(n for _, n in tensors)
        row["tensors"] = len(tensors)
        result["profiles"][name] = row
    result.update(_resources())
    with open(os.path.join(out_dir, f"rank{r.rank}.json"), "w") as f:
        json.dump(result, f)
    r.native.shutdown()


def worker_failure(out_dir, how):
    """The last rank dies (kill) or stops (freeze) as the others wait on an
    allreduce with it; each other rank records when its wait failed and
    whether the error named the rank."""
    r = Rank()
    np = r.np
    x = np.ones(1024, np.float32)
    for i in range(5):
        r.core.submit(r.native.OP_ALLREDUCE, x, f"warm{i}", r.f32, output=x).wait()
    victim = r.size - 1
    r.line_up()
    if r.rank == victim:
        with open(os.path.join(out_dir, "victim.json"), "w") as f:
            json.dump({"at": time.time()}, f)
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(3600)  # frozen: the launcher ends this process
    try:
        r.core.submit(r.native.OP_ALLREDUCE, x, "mid_step", r.f32, output=x).wait()
        error = None
    except Exception as e:  # what the wait raised is what is measured
        error = str(e)
    with open(os.path.join(out_dir, f"rank{r.rank}.json"), "w") as f:
        json.dump({"at": time.time(), "error": error,
                   "named": error is not None and f"rank {victim}" in error}, f)
    os._exit(1)


def worker_elastic(out_dir, discovery):
    """A worker of the elastic job: every step is one allreduce whose sum also
    carries rank 0's "hosts were updated" flag, so the ranks reset together.
    Round 0 (N ranks): the last rank dies at step 5. At N-1 ranks,
    rank 0 rewrites the discovery file with one more slot on its host. Back
    at N ranks, every rank records its lives and exits."""
    import numpy as np
    from perseus_tf import _native
    from perseus_tf.config import elastic_rounds
    me = os.environ["PERSEUS_ELASTIC_WORKER"]
    with open(discovery) as f:
        full = len(f.read().split())  # one line a host, before and after growing
    f32, total = _native.DTYPE_CODES["float32"], _native.REDUCE_CODES["sum"]
    record = {"worker": me, "started": _STARTED, "imported": time.time(), "lives": []}
    step_count = 5
    while True:
        life = {"init_start": time.time()}
        record["lives"].append(life)
        _native.init()
        topo = _native.topology()
        st = _native._core.stats()
        life.update(initialized=time.time(), rank=topo["rank"], size=topo["size"],
                    round=elastic_rounds._round[0], store_s=st["startup_store_seconds"],
                    connect_s=st["startup_connect_seconds"])
        rank, size = topo["rank"], topo["size"]
        grown = size == full and life["round"] > 0
        step = 0
        try:
            while True:
                if size == full and not grown and rank == size - 1 and step == step_count:
                    with open(os.path.join(out_dir, "victim.json"), "w") as f:
                        json.dump({"at": time.time()}, f)
                    os.kill(os.getpid(), signal.SIGKILL)
                if size == full - 1 and rank == 0 and step == step_count:
                    life["grow_at"] = time.time()
                    os.rename(discovery + ".grown", discovery)  # see elastic_times
                flag = np.zeros(1, np.float32)
                if rank == 0 and step and elastic_rounds.hosts_updated() is not None:
                    flag[0] = 1.0
                _native._core.submit(_native.OP_ALLREDUCE, flag, f"elastic{step}", f32,
                                     reduce_op=total, output=flag).wait()
                if step == 0:
                    life["first_done"] = time.time()
                step += 1
                if grown and step > step_count:
                    _native.shutdown()
                    with open(os.path.join(out_dir, me.replace(":", "_") + ".json"), "w") as f:
                        json.dump(record, f)
                    return
                if flag[0] > 0:
                    life["reset"] = "hosts updated"
                    break
        except Exception as e:  # a collective failed: the round is over
            life.update(failed_at=time.time(), reset=str(e)[:300])
            if len(record["lives"]) > 4:
                raise
        _native.shutdown()


# ---------------------------------------------------------------------------
# the jobs


def job(hosts, n, args, worker_args, settings, expect_failure=False, per_host=1, placing=None):
    """One job of `per_host` ranks on each of n hosts (or perseusrun's
    `placing` flags instead of -np and -H); every JSON its ranks wrote."""
    from netns_hosts import communicate_all
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   **settings)
        placing = placing or ["-np", str(n * per_host),
                              "-H", ",".join(f"{a}:{per_host}" for a in hosts.addrs[:n])]
        cmd = [sys.executable, "-m", "perseus_tf.runner"] + placing + ["-i", hosts.key,
               "--grace-seconds", "30", "--",
               sys.executable, os.path.abspath(__file__), "--worker", out] + worker_args
        proc = hosts.popen(0, cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        output = communicate_all([proc], args.timeout, f"{n} hosts {worker_args}")[0]
        results = {}
        for name in os.listdir(out):
            if not name.endswith(".json"):
                continue
            with open(os.path.join(out, name)) as f:
                results[name[:-len(".json")]] = json.load(f)
        if (proc.returncode and not expect_failure) or not results:
            raise RuntimeError(f"{n} hosts {worker_args} failed:\n{output[-3000:]}")
        return results


def failure_times(hosts, n, args, how, settings):
    res = job(hosts, n, args, ["--failure", how], settings, expect_failure=True)
    victim = res.pop("victim")
    late = max(v["at"] for v in res.values()) - victim["at"]
    named = sum(v["named"] for v in res.values())
    return {"seconds": late, "named": named, "survivors": n - 1,
            "error": next(iter(res.values()))["error"]}


def elastic_times(hosts, n, args):
    """Shrink N -> N-1 (a rank killed) and grow back to N (a slot discovered:
    a second on host 0, as the killed rank's host is blacklisted)."""
    with tempfile.TemporaryDirectory() as files:
        os.chmod(files, 0o755)
        listing = os.path.join(files, "hosts")
        with open(listing, "w") as f:
            f.write("".join(f"{a}:1\n" for a in hosts.addrs[:n]))
        with open(listing + ".grown", "w") as f:
            f.write("".join(f"{a}:{2 if i == 0 else 1}\n" for i, a in enumerate(hosts.addrs[:n])))
        script = os.path.join(files, "discover.sh")
        with open(script, "w") as f:
            f.write(f"#!/bin/sh\ncat {listing}\n")
        os.chmod(script, 0o755)
        res = job(hosts, n, args, ["--elastic", listing], {},
                  placing=["-np", str(n), "--min-np", str(n - 1), "--max-np", str(n),
                           "--host-discovery-script", script, "--discovery-interval", "0.2",
                           "--blacklist-cooldown", "600"])
    victim = res.pop("victim", None)
    if victim is None or len(res) != n:
        raise RuntimeError(f"{n} hosts elastic: {sorted(res)} finished, victim {victim}")
    killed = victim["at"]
    shrunk = [next(l for l in w["lives"] if l["size"] == n - 1)
              for w in res.values() if len(w["lives"]) > 1]
    grown = [w["lives"][-1] for w in res.values()]
    grow_at = next(l["grow_at"] for l in shrunk if "grow_at" in l)
    newcomer = next(w for w in res.values() if len(w["lives"]) == 1)
    olds = [w for w in res.values() if w is not newcomer]
    asked = [next(l for l in w["lives"] if l["size"] == n - 1) for w in olds]
    return {
        "shrink_s": max(l["first_done"] for l in shrunk) - killed,
        "shrink_failed_s": max(w["lives"][0]["failed_at"] for w in olds) - killed,
        "shrink_init_s": max(l["initialized"] - l["init_start"] for l in asked),
        "grow_s": max(l["first_done"] for l in grown) - grow_at,
        "grow_spawn_s": newcomer["started"] - grow_at,
        "grow_newcomer_ready_s": newcomer["lives"][0]["init_start"] - grow_at,
        "grow_reset_s": max(l["init_start"] for l in grown) - grow_at,
        "grow_init_s": max(l["initialized"] - l["init_start"] for l in grown),
        "grow_store_s": max(l["store_s"] for l in grown),
        "grow_connect_s": max(l["connect_s"] for l in grown),
    }


def two_level_times(n, args):
    """n hosts of 2 ranks: each bucket's offline time as the cost model
    chooses (PERSEUS_ALLREDUCE_MODE unset), flat (0) and in two levels (1)."""
    from netns_hosts import NetnsHosts
    hosts = NetnsHosts(n, subnet=200 + n % 50)
    try:
        if args.rate:
            hosts.shape(args.rate)
        buckets = [int(b) for b in args.buckets.split(",")]
        out = {}
        for mode in ("auto", "0", "1"):
            settings = {} if mode == "auto" else {"PERSEUS_ALLREDUCE_MODE": mode}
            res = job(hosts, n, args, ["--budget", str(args.budget), "--buckets",
                                       ",".join(map(str, buckets)), "--profiles", ""],
                      settings, per_host=2)
            out[mode] = res["rank0"]
        return out
    finally:
        hosts.close()


def print_two_level(rows):
    print("\n## two link classes: hosts of 2 ranks each; each bucket's offline time (rank "
          "0's median, ms) as the cost model chooses (PERSEUS_ALLREDUCE_MODE unset), flat (=0) "
          "and in two levels (=1); the model's inputs at init (rank 0, the run with it)")
    print(f"{'hosts':>5} {'bucket':>10} {'auto ms':>9} {'flat ms':>8} {'two ms':>7} "
          f"{'auto/best':>10}")
    for n, out in rows:
        st = out["auto"]
        for b in st["buckets"]:
            model, flat, two = (out[m]["buckets"][b]["offline"]["ms"] for m in ("auto", "0", "1"))
            print(f"{n:>5} {human(int(b)):>10} {model:>9.2f} {flat:>8.2f} {two:>7.2f} "
                  f"{model / min(flat, two):>10.2f}")
        print(f"# {n} hosts: flat alpha {st['model_alpha_us']:.0f} us, beta "
              f"{st['model_beta_mb']:.1f} MB/s, line {human(st['line'])}; host phases "
              f"{st['host_phase_us']:.0f} us + {st['host_phase_mb']:.0f} MB/s; leaders alpha "
              f"{st['cross_alpha_us']:.0f} us, beta {st['cross_beta_mb']:.1f} MB/s, line "
              f"{human(st['leaders_line'])}")


def run_hosts(n, args):
    from netns_hosts import NetnsHosts
    hosts = NetnsHosts(n, subnet=150 + n % 100)
    try:
        if args.rate:
            hosts.shape(args.rate)
        buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else []
        profiles = [p for p in args.profiles.split(",") if p]
        steps = job(hosts, n, args,
                    ["--budget", str(args.budget), "--buckets", ",".join(map(str, buckets)),
                     "--profiles", ",".join(profiles)] + (["--calibrate"] if n == 2 else []),
                    {})
        result = {"n": n, "ranks": [steps[f"rank{i}"] for i in range(n)]}
        if not args.no_failures:
            result["kill"] = failure_times(hosts, n, args, "kill", {})
            result["freeze"] = failure_times(
                hosts, n, args, "freeze", {"GLOO_TIMEOUT_SECONDS": str(args.freeze_timeout)})
        if not args.no_elastic:
            result["elastic"] = elastic_times(hosts, n, args)
        return result
    finally:
        hosts.close()


# ---------------------------------------------------------------------------
# the model and the tables


def bounds(n, nbytes, alpha, beta):
    """Alpha-beta times (seconds) of the three algorithms."""
    p = 1 << int(math.log2(n))
    fold = 0 if p == n else 2
    ring = 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta
    doubling = (int(math.log2(p)) + fold) * (alpha + nbytes / beta)
    halving = (2 * int(math.log2(p)) + fold) * alpha + 2 * (p - 1) / p * nbytes / beta \
        + (fold * nbytes / beta)
    return {"ring": ring, "doubling": doubling, "halving-doubling": halving}


def best(n, nbytes, alpha, beta):
    b = bounds(n, nbytes, alpha, beta)
    name = min(b, key=b.get)
    return name, b[name]


def human(nbytes):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes} B"


def print_tables(results, alpha, beta, args):
    print(f"# alpha (2 hosts, one 4-byte exchange): {1e6 * alpha:.0f} us; beta (2 hosts, "
          f"16 MiB ring): {beta / 1e6:.1f} MB/s; links shaped to {args.rate or 'nothing'}")
    print("\n## start-up (seconds): how far apart ssh started the ranks' processes; the "
          "slowest rank's import, store (joining: the roll call waits for the last rank) and "
          "connect (Gloo's contexts, the cost model); the first collective done on every "
          "rank, after the last process started and after the first")
    print(f"{'hosts':>5} {'spread':>7} {'import':>7} {'store':>7} {'connect':>8} "
          f"{'after last':>11} {'after first':>12}")
    for res in results:
        ranks = res["ranks"]
        first, last = min(x["started"] for x in ranks), max(x["started"] for x in ranks)
        done = max(x["first_done"] for x in ranks)
        print(f"{res['n']:>5} {last - first:>7.2f} "
              f"{max(x['imported'] - x['started'] for x in ranks):>7.2f} "
              f"{max(x['store_s'] for x in ranks):>7.2f} "
              f"{max(x['connect_s'] for x in ranks):>8.2f} "
              f"{done - last:>11.2f} {done - first:>12.2f}")
    print("\n## the cost model at init (rank 0): a hop's latency, a link's bandwidth, the "
          "float32 sum's speed, and the line up to which buckets double")
    print(f"{'hosts':>5} {'alpha us':>9} {'beta MB/s':>10} {'sum MB/s':>9} {'line':>10}")
    for res in results:
        r0 = res["ranks"][0]
        print(f"{res['n']:>5} {r0['model_alpha_us']:>9.0f} {r0['model_beta_mb']:>10.1f} "
              f"{r0['model_reduce_mb']:>9.0f} {human(r0['line']):>10}")
    print("\n## allreduce step time (rank 0's median, ms) against the alpha-beta bound of "
          "the best algorithm; control traffic per step (bytes, cycles) of rank 0")
    print("# ratio N: against the bound with alpha as the cost model measured it at init at "
          "that N (the same links, and the cores shared by N ranks)")
    print(f"{'hosts':>5} {'what':>10} {'mode':>8} {'ms':>9} {'bound ms':>9} {'best':>16} "
          f"{'ratio':>6} {'ratio N':>7} {'ctrl B':>7} {'cycles':>6} {'cpu':>5}")
    for res in results:
        n, r0 = res["n"], res["ranks"][0]
        alpha_n = r0["model_alpha_us"] * 1e-6 or alpha
        rows = [(human(int(b)), int(b), m) for b, m in r0["buckets"].items()]
        rows += [(name, m["bytes"], m) for name, m in r0["profiles"].items()]
        for what, nbytes, modes in rows:
            name, bound = best(n, nbytes, alpha, beta)
            bound_n = best(n, nbytes, alpha_n, beta)[1]
            for mode in ("online", "offline"):
                m = modes[mode]
                print(f"{n:>5} {what:>10} {mode:>8} {m['ms']:>9.2f} {1e3 * bound:>9.2f} "
                      f"{name:>16} {m['ms'] / (1e3 * bound):>6.2f} "
                      f"{m['ms'] / (1e3 * bound_n):>7.2f} {m['control_bytes']:>7} "
                      f"{m['cycles']:>6} {100 * m['cpu']:>4.0f}%")
    print("\n## a failed rank: seconds from its failure until every other rank's wait "
          f"failed, and how many named it (frozen: GLOO_TIMEOUT_SECONDS={args.freeze_timeout})")
    print(f"{'hosts':>5} {'killed s':>9} {'named':>7} {'frozen s':>9} {'named':>7} "
          f"{'/timeout':>9}")
    for res in results:
        if "kill" not in res:
            continue
        k, f = res["kill"], res["freeze"]
        print(f"{res['n']:>5} {k['seconds']:>9.2f} {k['named']:>3}/{k['survivors']:<3} "
              f"{f['seconds']:>9.2f} {f['named']:>3}/{f['survivors']:<3} "
              f"{f['seconds'] / args.freeze_timeout:>9.2f}")
    print("\n## an elastic job: a rank killed (N -> N-1), then a slot discovered (N-1 -> N): "
          "seconds until every rank of the new round has done its first collective; the "
          "parts: the survivors' waits failed, the slowest init (the place from perseusrun, "
          "the store, connections and the cost model); the newcomer's process started and "
          "asked for its place, every rank reset, the slowest init and its store and "
          "connect phases")
    print(f"{'hosts':>5} {'shrink s':>9} {'failed':>7} {'init':>6} {'grow s':>7} "
          f"{'spawned':>8} {'asked':>6} {'reset':>6} {'init':>6} {'store':>6} {'connect':>8}")
    for res in results:
        if "elastic" not in res:
            continue
        e = res["elastic"]
        print(f"{res['n']:>5} {e['shrink_s']:>9.2f} {e['shrink_failed_s']:>7.2f} "
              f"{e['shrink_init_s']:>6.2f} {e['grow_s']:>7.2f} {e['grow_spawn_s']:>8.2f} "
              f"{e['grow_newcomer_ready_s']:>6.2f} {e['grow_reset_s']:>6.2f} "
              f"{e['grow_init_s']:>6.2f} {e['grow_store_s']:>6.2f} "
              f"{e['grow_connect_s']:>8.2f}")
    print("\n## per rank after the steps (the largest over ranks)")
    print(f"{'hosts':>5} {'files':>6} {'threads':>8} {'RSS MB':>7} {'peak MB':>8}")
    for res in results:
        ranks = res["ranks"]
        print(f"{res['n']:>5} {max(x['open_files'] for x in ranks):>6} "
              f"{max(x['threads'] for x in ranks):>8} {max(x['rss_mb'] for x in ranks):>7.0f} "
              f"{max(x['peak_rss_mb'] for x in ranks):>8.0f}")


def write_svg(path, results, alpha, beta):
    """Log-log curves of step time against hosts: each bucket's offline time
    and its bound (dashed). Plain SVG: no plotting library is a dependency."""
    width, height, pad = 640, 420, 60
    series = {}
    for res in results:
        n, r0 = res["n"], res["ranks"][0]
        for b, modes in r0["buckets"].items():
            series.setdefault(human(int(b)), []).append(
                (n, modes["offline"]["ms"], 1e3 * best(n, int(b), alpha, beta)[1]))
    values = [v for pts in series.values() for p in pts for v in p[1:]]
    hosts = [res["n"] for res in results]
    lo_y, hi_y = math.log10(min(values)), math.log10(max(values))
    lo_x, hi_x = math.log2(min(hosts)), math.log2(max(hosts))

    def xy(n, ms):
        x = pad + (width - 2 * pad) * (math.log2(n) - lo_x) / max(hi_x - lo_x, 1e-9)
        y = height - pad - (height - 2 * pad) * (math.log10(ms) - lo_y) / max(hi_y - lo_y, 1e-9)
        return x, y

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{width / 2}" y="20" text-anchor="middle">Allreduce step time '
             '(offline plan, ms, log) against hosts (log); dashed: alpha-beta bound</text>']
    for n in hosts:
        x, _ = xy(n, 10 ** lo_y)
        parts.append(f'<text x="{x:.0f}" y="{height - pad + 18}" text-anchor="middle">{n}</text>')
    for e in range(math.floor(lo_y), math.ceil(hi_y) + 1):
        if lo_y <= e <= hi_y:
            _, y = xy(min(hosts), 10 ** e)
            parts.append(f'<text x="{pad - 6}" y="{y:.0f}" text-anchor="end">{10 ** e:g}</text>')
            parts.append(f'<line x1="{pad}" x2="{width - pad}" y1="{y:.0f}" y2="{y:.0f}" '
                         'stroke="#ddd"/>')
    for i, (label, pts) in enumerate(series.items()):
        color = colors[i % len(colors)]
        for k, dash in ((1, ""), (2, ' stroke-dasharray="5,4"')):
            line = " ".join("%.1f,%.1f" % xy(p[0], p[k]) for p in pts)
            parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" '
                         f'stroke-width="2"{dash}/>')
        x, y = xy(pts[-1][0], pts[-1][1])
        parts.append(f'<text x="{x + 6:.0f}" y="{y:.0f}" fill="{color}">{label}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,4,8,16,32", help="host counts, comma-separated")
    parser.add_argument("--rate", default="400mbit",
                        help="tc rate of each host's link ('' for none; default 400mbit)")
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                        help="bucket sizes in bytes, comma-separated")
    parser.add_argument("--profiles", default="resnet50",
                        help="gradient profiles, comma-separated ('' for none)")
    parser.add_argument("--budget", type=float, default=2.0,
                        help="seconds of timed calls per bucket and mode (3 to 50 calls)")
    parser.add_argument("--freeze-timeout", type=float, default=5.0,
                        help="GLOO_TIMEOUT_SECONDS of the frozen-rank job")
    parser.add_argument("--no-failures", action="store_true", help="skip the failure jobs")
    parser.add_argument("--no-elastic", action="store_true", help="skip the elastic job")
    parser.add_argument("--two-level-hosts", default="",
                        help="host counts (comma-separated) of 2 ranks each at which to time "
                             "the cost model's choice against flat and two levels")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per job")
    parser.add_argument("--json", help="also write every rank's figures here")
    parser.add_argument("--svg", help="also write the step-time curves here")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--failure", choices=("kill", "freeze"), help=argparse.SUPPRESS)
    parser.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--elastic", metavar="HOSTS_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, ROOT)
        if args.elastic:
            return worker_elastic(args.worker, args.elastic)
        if args.failure:
            return worker_failure(args.worker, args.failure)
        return worker_steps(args.worker, [int(b) for b in args.buckets.split(",") if b],
                            [p for p in args.profiles.split(",") if p], args.budget,
                            args.calibrate)
    from netns_hosts import missing_requirements
    why = missing_requirements()
    if why:
        sys.exit(f"scale.py: {why}")
    two_level = [(n, two_level_times(n, args))
                 for n in sorted({int(x) for x in args.two_level_hosts.split(",") if x})]
    if two_level and not args.hosts:
        return print_two_level(two_level)
    counts = sorted({int(x) for x in args.hosts.split(",")} | {2})
    results = []
    for n in counts:
        started = time.time()
        results.append(run_hosts(n, args))
        print(f"# {n} hosts measured in {time.time() - started:.0f} s", file=sys.stderr,
              flush=True)
        if args.json:  # what is measured so far survives a later failure
            with open(args.json, "w") as f:
                json.dump({"rate": args.rate, "results": results}, f, indent=1)
    cal = results[0]["ranks"][0]
    alpha = cal["alpha_s"]
    beta = CALIBRATE_BYTES / max(cal["ring_16m_s"] - 2 * alpha, 1e-9)
    print_tables(results, alpha, beta, args)
    if two_level:
        print_two_level(two_level)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"alpha_s": alpha, "beta_bytes_s": beta, "rate": args.rate,
                       "results": results}, f, indent=1)
    if args.svg:
        write_svg(args.svg, results, alpha, beta)


if __name__ == "__main__":
    main()
