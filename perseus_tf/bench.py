"""Benchmarks of the Perseus-TF runtime, runnable with one command.

    python -m perseus_tf.bench allreduce [--np N] [--min-bytes 4K] [--max-bytes 256M]
                                         [--iters K] [--warmup W] [--dtype float32]
                                         [--csv PATH]

``allreduce`` compares, for tensor sizes doubling from --min-bytes to
--max-bytes, our path (one tensor submitted to the runtime and waited on:
negotiation, stream dispatch, copy into the output, Gloo allreduce) with a
raw contiguous Gloo allreduce of the same size on a dedicated context (the
ceiling). Rank 0 prints an nccl-tests style table.

Started outside perseusrun (no PERSEUS_RANK in the environment), the
benchmark relaunches itself through perseusrun with -np N ranks. Only the
TensorFlow-free pybind11 module is used, so TensorFlow need not be installed.

New subcommands add a parser in ``build_parser`` and a ``run_<name>`` function;
the helpers for launching, timing and table printing are shared.
"""

import argparse
import csv
import os
import re
import statistics
import sys
import time

PROG = "python -m perseus_tf.bench"
MIB = 1 << 20

# Sizes from this one up are what the throughput target is about.
TARGET_MIN_BYTES = 16 * MIB
TARGET_RATIO = 0.90

# Adaptive iteration count: each size gets about this much time (both paths
# together), never fewer than MIN_ITERS iterations nor more than --iters.
DEFAULT_ITERS = 50
MIN_ITERS = 5
SIZE_BUDGET_S = 8.0


# --------------------------------------------------------------------------
# Command line


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'4K', '256M', '1G', '64KiB', '4096' -> bytes (binary units)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a number with K, M or G (e.g. 4K, 256M)")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be a whole number of bytes >= 1")
    return int(value)


def human_bytes(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B" if n < 1024 else f"{n / 1024:.1f}K"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """Flags every subcommand has: how many ranks to start when relaunching."""
    parser.add_argument(
        "--np", type=_positive_int, default=2, metavar="N",
        help="ranks to start through perseusrun when not already running under it "
             "(default 2; ignored under perseusrun, which decides the size)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Benchmarks of the Perseus-TF runtime.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from perseus_tf._native import DTYPE_CODES  # noqa: WPS433 (needs the native build)
    ar = sub.add_parser(
        "allreduce",
        help="our allreduce path against raw Gloo allreduce, over tensor sizes",
        description="Times our allreduce path (submit + wait of one tensor) and a raw "
                    "contiguous Gloo allreduce on a dedicated context, interleaved, "
                    "for sizes doubling from --min-bytes to --max-bytes.")
    add_launch_args(ar)
    ar.add_argument("--min-bytes", type=parse_size, default=parse_size("4K"), metavar="SIZE",
                    help="smallest tensor size (default 4K)")
    ar.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"), metavar="SIZE",
                    help="largest tensor size (default 256M)")
    ar.add_argument("--iters", type=_positive_int, default=DEFAULT_ITERS, metavar="K",
                    help=f"timed iterations per size (default {DEFAULT_ITERS}); large sizes "
                         f"get fewer, down to {MIN_ITERS} (or K if smaller), to keep each "
                         f"size near --size-budget seconds")
    ar.add_argument("--warmup", type=_nonnegative_int, default=2, metavar="W",
                    help="untimed iterations of each path per size (default 2)")
    ar.add_argument("--size-budget", type=float, default=SIZE_BUDGET_S, metavar="S",
                    help=f"seconds each size should take, both paths together, when "
                         f"choosing its iteration count (default {SIZE_BUDGET_S:g})")
    ar.add_argument("--dtype", default="float32",
                    choices=[d for d in DTYPE_CODES if d not in ("bool", "bfloat16")],
                    help="element type (default float32)")
    ar.add_argument("--in-place", action="store_true",
                    help="submit with output = input (what the TF kernel gets when it can "
                         "forward its input buffer), so the runtime skips its input-to-output "
                         "copy; default: a separate output array")
    ar.add_argument("--csv", default=None, metavar="PATH",
                    help="also write the table's rows to PATH (rank 0)")
    ar.set_defaults(run=run_allreduce, check=check_allreduce)
    return parser


# --------------------------------------------------------------------------
# Launching


def under_perseusrun() -> bool:
    return "PERSEUS_RANK" in os.environ


def relaunch(np_: int, argv: list) -> int:
    """Runs this module with argv in np_ ranks through perseusrun."""
    from perseus_tf.runner import launcher
    # The ranks must import this same perseus_tf, wherever it was found.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + paths)
    return launcher.main(["-np", str(np_), "--", sys.executable, "-m", "perseus_tf.bench",
                          *argv])


def machine_description() -> str:
    cpus = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = cpus
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    text = f"{cpus} CPUs" + (f" ({usable} usable)" if usable != cpus else "")
    return text + (f", {model}" if model else "")


# --------------------------------------------------------------------------
# Timing and collective helpers


class Collectives:
    """The few runtime calls the benchmarks need, on numpy arrays."""

    def __init__(self):
        import numpy as np
        from perseus_tf import _native
        self.np = np
        self.native = _native
        _native.init()
        topo = _native.topology()
        self.rank, self.size = topo["rank"], topo["size"]
        self._sync_buf = np.zeros(1, dtype=np.float64)
        self._f64 = _native.DTYPE_CODES["float64"]

    def sync(self) -> None:
        """A tiny raw allreduce: every rank leaves it at about the same time."""
        self._sync_buf[0] = 0.0
        self.native._core.raw_allreduce(self._sync_buf, self._f64)

    def from_rank0(self, value: float) -> float:
        """Rank 0's value on every rank (a sum of it and zeros, so exact)."""
        buf = self.np.array([value if self.rank == 0 else 0.0], dtype=self.np.float64)
        self.native._core.raw_allreduce(buf, self._f64)
        return float(buf[0])

    def shutdown(self) -> None:
        self.native.shutdown()


def timed(fn) -> float:
    """Seconds fn() took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summarize(times: list) -> dict:
    """Median and min/max of a list of seconds, in microseconds."""
    us = [t * 1e6 for t in times]
    return {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us)}


def bandwidths(nbytes: int, seconds: float, size: int) -> tuple:
    """(algbw, busbw) in GB/s (1e9 bytes), as nccl-tests defines them for allreduce."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    return algbw, algbw * 2 * (size - 1) / size


def choose_iters(estimate_s: float, max_iters: int, budget_s: float) -> int:
    """Iterations that fit budget_s at estimate_s each, within [min(5, max), max]."""
    lo = min(MIN_ITERS, max_iters)
    if estimate_s <= 0:
        return max_iters
    return max(lo, min(max_iters, int(budget_s / estimate_s)))


def size_ladder(lo: int, hi: int) -> list:
    sizes = []
    n = lo
    while n <= hi:
        sizes.append(n)
        n *= 2
    return sizes


# --------------------------------------------------------------------------
# Table printing


def format_header(columns: list, groups=None) -> str:
    """The header line(s) of a table; groups: (title, number of columns) spans."""
    widths = [w for _, w, _ in columns]
    lines = []
    if groups:
        cells, i = [], 0
        for title, span in groups:
            width = sum(widths[i:i + span]) + span - 1
            cells.append(f"{title:^{width}}" if title else " " * width)
            i += span
        lines.append(" ".join(cells))
    lines.append(" ".join(f"{h:>{w}}" for h, w, _ in columns))
    return "\n".join("#" + line[1:] for line in lines)


def format_row(columns: list, row: tuple) -> str:
    """columns: (header, width, format spec); row: one value per column."""
    return " ".join(f"{value:>{w}{fmt}}" if fmt else f"{value!s:>{w}}"
                    for (_, w, fmt), value in zip(columns, row))


def write_csv(path: str, fieldnames: list, rows: list) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)


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
        native._core.raw_allreduce(raw, code)

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
              f"+ wait(), one tensor per call; raw = _core.raw_allreduce, contiguous in-place "
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


# --------------------------------------------------------------------------
# Entry point


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    # Checked before relaunching, so that a bad command line fails once, here.
    error = args.check(args) if getattr(args, "check", None) else None
    if error:
        parser.error(f"{args.command}: {error}")
    if not under_perseusrun():
        return relaunch(args.np, argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
