"""A quick end-to-end run of ``python -m perseus_tf.bench allreduce`` at 2 ranks.

It checks the command relaunches itself through perseusrun, exits 0 and that
rank 0's table has one row per size with our and raw Gloo columns and a
positive busbw ratio. No TensorFlow needed: the benchmark uses the pybind11
module only.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
# Not under perseusrun: the benchmark must start its own ranks.
for _var in [v for v in ENV if v.startswith("PERSEUS_")]:
    del ENV[_var]

SIZES = ["4K", "8K", "16K", "32K", "64K"]


def test_allreduce_bench_quick(tmp_path):
    csv_path = tmp_path / "rows.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "perseus_tf.bench", "allreduce", "--np", "2",
         "--max-bytes", "64K", "--iters", "3", "--warmup", "1", "--csv", str(csv_path)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    lines = [line[len("[0] "):] for line in proc.stdout.splitlines() if line.startswith("[0] ")]
    # Only rank 0 prints.
    assert not [line for line in proc.stdout.splitlines() if line.startswith("[1] ")], proc.stdout

    header = next(line for line in lines if line.startswith("#") and "ours_us" in line)
    columns = header.lstrip("#").split()
    assert columns == ["size", "count", "type", "ours_us", "ours_min-max_us", "algbw", "busbw",
                       "raw_us", "raw_min-max_us", "algbw", "busbw", "ratio", "iters"]
    rows = [line.split() for line in lines if line and not line.startswith(("#", "target:"))]
    assert [row[0] for row in rows] == SIZES, proc.stdout
    for row in rows:
        assert len(row) == len(columns), row
        values = dict(zip(columns, row))
        assert values["type"] == "float32"
        assert int(values["count"]) * 4 == int(values["size"][:-1]) * 1024
        assert int(values["iters"]) == 3
        # Our and raw columns: a median time and bandwidths, all positive.
        for time_col, spread_col, first_bw in (("ours_us", "ours_min-max_us", 4),
                                               ("raw_us", "raw_min-max_us", 8)):
            assert float(values[time_col]) > 0
            lo, hi = (float(v) for v in values[spread_col].split("-"))
            assert 0 < lo <= float(values[time_col]) <= hi
            assert float(row[first_bw + 1]) > 0 and float(row[first_bw + 2]) > 0
        ratio = float(values["ratio"])
        assert ratio > 0 and re.fullmatch(r"\d+\.\d+", values["ratio"])

    target = [line for line in lines if line.startswith("target:")]
    assert len(target) == 1 and "N/A" in target[0], target  # no size >= 16 MiB here

    csv_lines = csv_path.read_text().splitlines()
    assert csv_lines[0].startswith("bytes,count,dtype,ranks,iters,ours_median_us")
    assert len(csv_lines) == 1 + len(SIZES)


def test_keras_throughput_benchmark_runs_all_three_modes():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "keras_throughput.py"), "--np", "2",
         "--width", "32", "--global-batch", "8", "--steps", "2", "--warmup", "1"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(single|perseus|mwms)\s+([\d.]+)\s", proc.stdout, re.M)}
    assert sorted(rows) == ["mwms", "perseus", "single"], proc.stdout
    assert all(v > 0 for v in rows.values()), rows
    assert re.search(r"^target: .*(PASS|FAIL) \([\d.]+x\)$", proc.stdout, re.M), proc.stdout
