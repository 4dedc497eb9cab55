"""Two ranks' PERSEUS_TIMELINE traces read side by side (step_overlap.py --timeline).

A distributed step waits for its slowest rank: a rank that reaches a bucket
first waits inside the collective until the other arrives, so a long bucket
span on one rank may be the other rank's late backprop, not the wire. These
helpers put rank 1's bucket spans on rank 0's clock and say, per bucket,
which rank came late and by how much.
"""

import math
import statistics


def bucket_spans(trace):
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return sorted((e for e in events if e.get("cat") == "bucket"), key=lambda e: e["ts"])


def rank1_on_rank0_clock(spans0, spans1):
    """Rank 1's spans paired with rank 0's last ones, their times moved onto
    rank 0's clock, or None where the two ranks' last spans differ.

    Each process times its trace from its own start, so the clocks differ by
    an offset. A collective ends on both ranks at about the same moment
    (the last bytes arrive on both), so the median difference of the end
    times is that offset; the starts then show which rank came late to each
    bucket and by how much: the other waited inside the collective."""
    n = min(len(spans0), len(spans1))
    if n == 0:
        return None
    a, b = spans0[-n:], spans1[-n:]
    if any(x["name"] != y["name"] or x.get("args", {}).get("first") !=
           y.get("args", {}).get("first") for x, y in zip(a, b)):
        return None
    offset = statistics.median((x["ts"] + x["dur"]) - (y["ts"] + y["dur"]) for x, y in zip(a, b))
    return [dict(y, ts=y["ts"] + offset) for y in b]


def rows(spans0, spans1, shown=12):
    """Rows of rank 0's last `shown` spans (ms from the first shown) with,
    where rank 1's trace pairs with it, when rank 1 started each one and
    which rank came late to it, by how many ms ("-" under 1 ms)."""
    moved = rank1_on_rank0_clock(spans0, spans1)
    last0 = spans0[-shown:]
    last1 = ([None] * len(last0) + (moved or []))[-len(last0):]  # rank 1's may be fewer
    t0 = last0[0]["ts"]
    rows = []
    for e, f in zip(last0, last1):
        a = e.get("args", {})
        row = [f"{(e['ts'] - t0) / 1e3:.1f}", f"{(e['ts'] + e['dur'] - t0) / 1e3:.1f}"]
        if f is None:
            row += ["", ""]
        else:
            late = (f["ts"] - e["ts"]) / 1e3
            row += [f"{(f['ts'] - t0) / 1e3:.1f}",
                    f"rank {1 if late > 0 else 0} by {abs(late):.1f}" if abs(late) >= 1 else "-"]
        row += [str(e["tid"] - 1), e["name"], str(a.get("tensors", "")),
                f"{a.get('bytes', 0) / 1e6:.2f}", str(a.get("first", ""))]
        rows.append(row)
    return rows


def skew(spans0, spans1, min_bytes=65536):
    """(count, median, 90th percentile) in ms of how late the later rank came
    to each bucket of at least `min_bytes` (a step's gradient buckets, not its
    scalar metric reductions) over the whole run; None if the traces do not pair."""
    moved = rank1_on_rank0_clock(spans0, spans1)
    if not moved:
        return None
    lates = sorted(abs(f["ts"] - e["ts"]) / 1e3 for e, f in zip(spans0[-len(moved):], moved)
                   if e.get("args", {}).get("bytes", 0) >= min_bytes)
    if not lates:
        return None
    return len(lates), statistics.median(lates), lates[math.ceil(0.9 * len(lates)) - 1]
