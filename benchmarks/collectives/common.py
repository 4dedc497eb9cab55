"""What every benchmark shares: sizes on the command line, launching
through perseusrun, the native collectives, timing, table printing."""

import argparse
import csv
import os
import re
import statistics
import sys
import time

PROG = "python -m benchmarks.collectives"
MIB = 1 << 20

# Sizes from this one up are what the throughput target is about.
TARGET_MIN_BYTES = 16 * MIB
TARGET_RATIO = 0.90

# Adaptive iteration count: each size gets about this much time (both paths
# together), never fewer than MIN_ITERS iterations nor more than --iters.
DEFAULT_ITERS = 50
MIN_ITERS = 5
SIZE_BUDGET_S = 8.0
GRADIENTS_ITERS = 20


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


def binary_bytes(n: int) -> str:
    """human_bytes with the binary unit spelled out: '64MiB', '1KiB', '100B'."""
    text = human_bytes(n)
    return text if text.endswith("B") else text + "iB"


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


# --------------------------------------------------------------------------
# Launching


def under_perseusrun() -> bool:
    return "PERSEUS_RANK" in os.environ


def relaunch(np_: int, argv: list) -> int:
    """Runs this module with argv in np_ ranks through perseusrun."""
    from perseus_tf.runner import launcher
    # The ranks must import this same perseus_tf and these benchmarks: the
    # checkout they are in goes first on their path.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + paths)
    return launcher.main(["-np", str(np_), "--", sys.executable, "-m", "benchmarks.collectives",
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
        from perseus_tf import _native, _testing
        self.np = np
        self.native = _native
        self.testing = _testing  # raw_allreduce: the baseline with no negotiation
        _native.init()
        topo = _native.topology()
        self.rank, self.size = topo["rank"], topo["size"]
        self._sync_buf = np.zeros(1, dtype=np.float64)
        self._f64 = _native.DTYPE_CODES["float64"]

    def sync(self) -> None:
        """A tiny raw allreduce: every rank leaves it at about the same time."""
        self._sync_buf[0] = 0.0
        self.testing.raw_allreduce(self._sync_buf, self._f64)

    def from_rank0(self, value: float) -> float:
        """Rank 0's value on every rank (a sum of it and zeros, so exact)."""
        buf = self.np.array([value if self.rank == 0 else 0.0], dtype=self.np.float64)
        self.testing.raw_allreduce(buf, self._f64)
        return float(buf[0])

    def gather(self, value: float) -> list:
        """Every rank's value, on every rank (a sum of one-hot vectors, so exact)."""
        buf = self.np.zeros(self.size, dtype=self.np.float64)
        buf[self.rank] = value
        self.testing.raw_allreduce(buf, self._f64)
        return buf.tolist()

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
