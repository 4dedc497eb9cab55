"""What step_overlap.py's worker measures beside the step time: the pinned
core's busy time, page faults, CPU time by thread and TF op times, each read
when the timed steps start and when they end."""

import os


def op_times(profile_dir, steps, top=14):
    """TF op types by time per step (ms) in a TF profiler trace: [(op, ms, count)]."""
    import glob
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:
        return []
    path = glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True)
    if not path:
        return []
    space = xplane_pb2.XSpace()
    with open(path[0], "rb") as f:
        space.ParseFromString(f.read())
    ms, count = {}, {}
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for ev in line.events:
                name = plane.event_metadata[ev.metadata_id].name
                if ":" not in name:
                    continue  # executor bookkeeping, not an op
                op = name.rsplit(":", 1)[1]
                ms[op] = ms.get(op, 0.0) + ev.duration_ps / 1e9 / steps
                count[op] = count.get(op, 0) + 1
    rows = sorted(ms.items(), key=lambda kv: -kv[1])
    return [("all ops", round(sum(ms.values()), 1), sum(count.values()) // steps)] + \
        [(op, round(t, 1), count[op] // steps) for op, t in rows[:top]]


def core_times():
    """(busy, softirq) seconds of the one core this process is pinned to, from
    /proc/stat: everything the core did that was not idle, whoever it was for.
    This counts what a thread's own CPU time misses: the network stack's
    softirq work, charged to no thread, or to whichever thread it interrupted.
    None when the process may run on several cores."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) != 1:
        return None
    name = f"cpu{next(iter(cpus))}"
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        for line in f:
            fields = line.split()
            if fields[0] == name:
                # user nice system idle iowait irq softirq steal ...
                v = [int(x) for x in fields[1:9]]
                busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
                return busy / tick, v[6] / tick
    return None


def page_faults():
    """This process's page faults so far (minor and major): fresh memory
    from the system, which a step that reuses its buffers does not need."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def thread_cpu():
    """{tid: (name, user + system CPU seconds)} of this process's threads."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_per_step(before, after, steps, wall):
    """CPU ms per step by thread name (threads of one name summed), busiest first."""
    by_name = {}
    for tid, (name, secs) in after.items():
        used = secs - before.get(tid, (name, 0.0))[1]
        by_name[name] = by_name.get(name, 0.0) + used
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])
    total = sum(by_name.values())
    return {"wall ms/step": round(1000 * wall / steps, 1),
            "cpu ms/step": round(1000 * total / steps, 1),
            "by thread": [(n, round(1000 * s / steps, 1)) for n, s in rows[:8] if s > 0]}
