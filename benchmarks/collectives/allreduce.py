"""`python -m benchmarks.collectives allreduce`: one tensor per call through the
runtime against a raw contiguous Gloo allreduce, size by size."""

import sys

from benchmarks.collectives.common import (
    Collectives, MIN_ITERS, TARGET_MIN_BYTES, TARGET_RATIO, bandwidths, choose_iters,
    format_header, format_row, human_bytes, machine_description, size_ladder, summarize,
    timed, write_csv)

# --------------------------------------------------------------------------
# allreduce


ALLREDUCE_COLUMNS = [
    ("size", 7, ""), ("count", 10, ""), ("type", 8, ""),
    ("ours_us", 10, ".1f"), ("ours_min-max_us", 21, ""),
    ("algbw", 7, ".3f"), ("busbw", 7, ".3f"),
    ("raw_us", 10, ".1f"), ("raw_min-max_us", 21, ""),
    ("algbw", 7, ".3f"), ("busbw", 7, ".3f"),
    ("ratio", 6, ".3f"), ("iters", 5, ""),
]
ALLREDUCE_GROUPS = [("", 3), ("ours: submit + wait", 4), ("raw Gloo", 4), ("", 2)]

CSV_FIELDS = ["bytes", "count", "dtype", "ranks", "iters",
              "ours_median_us", "ours_min_us", "ours_max_us", "ours_algbw_gbs", "ours_busbw_gbs",
              "raw_median_us", "raw_min_us", "raw_max_us", "raw_algbw_gbs", "raw_busbw_gbs",
              "ratio_busbw"]


def bench_allreduce_size(coll: Collectives, nbytes: int, dtype: str, warmup: int,
                         max_iters: int, budget_s: float, in_place: bool = False) -> dict:
    """Times both paths at one size on this rank; returns this rank's summary."""
    np = coll.np
    native = coll.native
    code = native.DTYPE_CODES[dtype]
    count = max(1, nbytes // np.dtype(dtype).itemsize)
    nbytes = count * np.dtype(dtype).itemsize  # what is really moved
    x = np.ones(count, dtype=dtype)
    out = x if in_place else np.empty_like(x)
    raw = np.zeros(count, dtype=dtype)  # zeros stay zeros: no overflow over iterations
    name = f"perseus.bench.allreduce.{nbytes}"

    def ours():
        native._core.submit(native.OP_ALLREDUCE, x, name, code, reduce_op=0, output=out).wait()

    def raw_gloo():
        coll.testing.raw_allreduce(raw, code)

    # Warmup (untimed for the results, but it also sizes the iteration count).
    estimate = 0.0
    for i in range(warmup):
        coll.sync()
        t_ours = timed(ours)
        coll.sync()
        t_raw = timed(raw_gloo)
        estimate = t_ours + t_raw
        if i == 0:
            if not np.all(out == coll.size):
                raise RuntimeError(f"allreduce of {nbytes} bytes gave a wrong sum "
                                   f"(expected {coll.size} everywhere)")
            if in_place:
                x[:] = 0  # zeros stay zeros over the in-place iterations
    if warmup == 0:
        coll.sync()
        estimate = timed(ours) + timed(raw_gloo)
        if in_place:
            x[:] = 0
    # Every rank must run the same number of iterations: use rank 0's choice.
    iters = int(coll.from_rank0(choose_iters(estimate, max_iters, budget_s)))

    ours_times, raw_times = [], []
    for i in range(iters):
        # Alternate which path goes first, so drift hits both alike.
        order = ((ours, ours_times), (raw_gloo, raw_times))
        for fn, times in (order if i % 2 == 0 else order[::-1]):
            coll.sync()
            times.append(timed(fn))
    return {"bytes": nbytes, "count": count, "iters": iters,
            "ours": summarize(ours_times), "raw": summarize(raw_times)}


def allreduce_row(result: dict, dtype: str, size: int) -> tuple:
    """(table row, csv row) for one size."""
    o, r = result["ours"], result["raw"]
    o_alg, o_bus = bandwidths(result["bytes"], o["median_us"] / 1e6, size)
    r_alg, r_bus = bandwidths(result["bytes"], r["median_us"] / 1e6, size)
    ratio = r["median_us"] / o["median_us"] if o["median_us"] > 0 else float("nan")
    spread = lambda s: f"{s['min_us']:.1f}-{s['max_us']:.1f}"  # noqa: E731
    table = (human_bytes(result["bytes"]), result["count"], dtype,
             o["median_us"], spread(o), o_alg, o_bus,
             r["median_us"], spread(r), r_alg, r_bus, ratio, result["iters"])
    csv_row = {"bytes": result["bytes"], "count": result["count"], "dtype": dtype,
               "ranks": size, "iters": result["iters"],
               "ours_median_us": round(o["median_us"], 3), "ours_min_us": round(o["min_us"], 3),
               "ours_max_us": round(o["max_us"], 3), "ours_algbw_gbs": round(o_alg, 6),
               "ours_busbw_gbs": round(o_bus, 6),
               "raw_median_us": round(r["median_us"], 3), "raw_min_us": round(r["min_us"], 3),
               "raw_max_us": round(r["max_us"], 3), "raw_algbw_gbs": round(r_alg, 6),
               "raw_busbw_gbs": round(r_bus, 6), "ratio_busbw": round(ratio, 6)}
    return table, csv_row


def target_line(results: list, ratios: list) -> str:
    big = [ratio for res, ratio in zip(results, ratios) if res["bytes"] >= TARGET_MIN_BYTES]
    what = (f"target: busbw at >= {human_bytes(TARGET_MIN_BYTES)}iB >= "
            f"{TARGET_RATIO:.0%} of raw Gloo")
    if not big:
        return f"{what}: N/A (no size >= {human_bytes(TARGET_MIN_BYTES)}iB measured)"
    worst = min(big)
    return f"{what}: {'PASS' if worst >= TARGET_RATIO else 'FAIL'} (min ratio {worst:.3f})"


def check_allreduce(args):
    """An error message for a bad combination of flags, or None."""
    if args.min_bytes > args.max_bytes:
        return f"--min-bytes ({args.min_bytes}) is larger than --max-bytes ({args.max_bytes})"
    if args.size_budget <= 0:
        return "--size-budget must be positive"
    return None


def run_allreduce(args) -> int:
    coll = Collectives()
    lead = coll.rank == 0
    cfg = coll.native.config()
    if lead:
        output = "in place" if args.in_place else "separate output"
        print(f"# Perseus-TF allreduce benchmark: ours = _core.submit(OP_ALLREDUCE, sum, {output}) "
              f"+ wait(), one tensor per call; raw = _testing.raw_allreduce, contiguous in-place "
              f"Gloo allreduce on a dedicated context (no negotiation)")
        print(f"# ranks {coll.size}, dtype {args.dtype}, iterations up to {args.iters} per size "
              f"(at least {min(MIN_ITERS, args.iters)}, ~{args.size_budget:g} s per size), "
              f"warmup {args.warmup}, streams {cfg.streams}, cycle time {cfg.cycle_time_ms:g} ms")
        print(f"# machine: {machine_description()}")
        print("# times are rank 0's: median and min-max over iterations, in microseconds; "
              "GB/s = 1e9 bytes/s; busbw = algbw * 2(n-1)/n; ratio = ours busbw / raw busbw")
        sys.stdout.flush()
    results, csv_rows, ratios = [], [], []
    print_header = True
    for nbytes in size_ladder(args.min_bytes, args.max_bytes):
        res = bench_allreduce_size(coll, nbytes, args.dtype, args.warmup, args.iters,
                                   args.size_budget, args.in_place)
        row, csv_row = allreduce_row(res, args.dtype, coll.size)
        results.append(res)
        csv_rows.append(csv_row)
        ratios.append(res["raw"]["median_us"] / res["ours"]["median_us"])
        if lead:
            # Each row as soon as it is measured, the header before the first.
            if print_header:
                print(format_header(ALLREDUCE_COLUMNS, ALLREDUCE_GROUPS))
                print_header = False
            print(format_row(ALLREDUCE_COLUMNS, row), flush=True)
    if lead:
        print(target_line(results, ratios))
        if args.csv:
            write_csv(args.csv, CSV_FIELDS, csv_rows)
            print(f"# rows written to {args.csv}")
        sys.stdout.flush()
    coll.shutdown()
    return 0
