"""Quick end-to-end runs of ``python -m benchmarks.collectives`` at 2 ranks.

``allreduce``: the command relaunches itself through perseusrun, exits 0 and
rank 0's table has one row per size with our and raw Gloo columns and a
positive busbw ratio. ``gradients``: a model profile (vgg16) and a synthetic
step (50 tensors of 1 KiB) each give one row with a positive time ratio and
an exact float32 average. No TensorFlow needed: the benchmarks use the
pybind11 module only.
"""

import json
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


def _benchmark(name):
    """A module of benchmarks/ (scripts, not a package), imported by name."""
    import importlib
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_allreduce_bench_quick(tmp_path):
    csv_path = tmp_path / "rows.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.collectives", "allreduce", "--np", "2",
         "--max-bytes", "64K", "--iters", "3", "--warmup", "1", "--csv", str(csv_path)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
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


GRADIENTS_COLUMNS = ["model", "tensors", "MB", "ours_ms", "ours_min-max_ms", "busbw",
                     "raw_ms", "raw_min-max_ms", "busbw", "wire_MB", "ctrl_B", "buckets",
                     "cycles", "ratio", "iters"]


def run_gradients_bench(extra, tmp_path, dtype_mode):
    """Runs the gradients benchmark at 2 ranks with PERSEUS_ALLREDUCE_DTYPE=dtype_mode;
    returns (rank 0's lines, its row, csv lines)."""
    csv_path = tmp_path / "gradients.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.collectives", "gradients", "--np", "2",
         "--iters", "2", "--warmup", "1", "--csv", str(csv_path), *extra],
        cwd=REPO, env=dict(ENV, PERSEUS_ALLREDUCE_DTYPE=dtype_mode), capture_output=True,
        text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [line for line in proc.stdout.splitlines() if line.startswith("[1] ")], proc.stdout
    lines = [line[len("[0] "):] for line in proc.stdout.splitlines() if line.startswith("[0] ")]
    header = next(line for line in lines if line.startswith("#") and "ours_ms" in line)
    assert header.lstrip("#").split() == GRADIENTS_COLUMNS
    rows = [line.split() for line in lines if line and not line.startswith(("#", "target:"))]
    assert len(rows) == 1, proc.stdout
    assert len(rows[0]) == len(GRADIENTS_COLUMNS), rows[0]
    # The duplicated busbw name does not matter here: both are checked positive.
    row = dict(zip(GRADIENTS_COLUMNS, rows[0]))
    for time_col, spread_col in (("ours_ms", "ours_min-max_ms"), ("raw_ms", "raw_min-max_ms")):
        lo, hi = (float(v) for v in row[spread_col].split("-"))
        assert 0 < lo <= float(row[time_col]) <= hi, row
    assert float(rows[0][5]) > 0 and float(rows[0][8]) > 0  # busbw of ours and raw
    assert float(row["ratio"]) > 0, row
    assert int(row["iters"]) == 2
    # Every step runs at least one bucket; control traffic and cycles drop to
    # zero once the step runs from an offline plan.
    assert float(row["ctrl_B"]) >= 0 and float(row["buckets"]) >= 1 and float(row["cycles"]) >= 0
    check = next(line for line in lines if line.startswith("# result check"))
    # 1: float32 end to end; 0 (the default): float16 on the wire.
    assert ("exact: float32" if dtype_mode == "1" else "not exact: compressed") in check, check
    target = [line for line in lines if line.startswith("target: resnet50")]
    assert len(target) == 1 and "N/A" in target[0], target  # resnet50 only
    csv_lines = csv_path.read_text().splitlines()
    assert csv_lines[0].startswith("model,tensors,bytes,ranks,iters,")
    assert len(csv_lines) == 2
    return lines, row, csv_lines


def test_gradients_bench_vgg16_profile(tmp_path):
    lines, row, csv_lines = run_gradients_bench(["--profile", "vgg16"], tmp_path, "1")
    assert row["model"] == "vgg16" and row["tensors"] == "32"
    # 138,357,544 float32 elements; a ring allreduce at 2 ranks sends all of them once.
    assert row["MB"] == "553.430" and row["wire_MB"] == "553.430"
    assert csv_lines[1].startswith("vgg16,32,553430176,2,2,")


def test_gradients_bench_synthetic(tmp_path):
    lines, row, csv_lines = run_gradients_bench(
        # Two warmup steps: the plan exists from the first timed step on.
        ["--tensors", "50", "--tensor-bytes", "1K", "--online", "--warmup", "2"], tmp_path, "0")
    assert row["model"] == "synthetic" and row["tensors"] == "50" and row["MB"] == "0.051"
    runtime = next(line for line in lines if line.startswith("# runtime per step"))
    # float16 on the wire: half of the 51200 float32 bytes.
    assert "50.0 requests" in runtime and "25600 data bytes" in runtime, runtime
    assert "0.00 plan checks" in runtime, runtime  # PERSEUS_OFFLINE_NEG_CHECK_N_STEPS unset
    assert row["wire_MB"] == "0.026", row
    # --online: the same step negotiated every step, beside the plan.
    neg = next(line for line in lines if line.startswith("# negotiation, per step"))
    m = re.search(r"offline plan ([\d.]+) ms \((\d+) control bytes.*online ([\d.]+) ms "
                  r"\([\d.-]+; (\d+) control bytes.*offline is ([\d.]+)x faster", neg)
    assert m, neg
    offline_ms, offline_ctrl, online_ms, online_ctrl, speedup = m.groups()
    assert int(offline_ctrl) == 0 and int(online_ctrl) > 0, neg
    assert abs(float(online_ms) / float(offline_ms) - float(speedup)) < 0.05 * float(speedup)
    target = [line for line in lines if line.startswith("target: 500 tensors")]
    assert len(target) == 1 and "N/A (this run: 50 tensors of 1KiB, 2 ranks)" in target[0], target


def test_gradients_bench_names_a_missing_profile(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.collectives", "gradients", "--profile", "resnet51",
         "--profile-dir", str(tmp_path)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert str(tmp_path / "resnet51.json") in proc.stderr, proc.stderr


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


def test_horovod_compare_perseus_side_runs_and_checks_results():
    # Horovod itself is not installed here (benchmark only); the Perseus side
    # of the comparison, the same worker code through the shim, must run and
    # report right results for both kinds of workload.
    for workload in ("small", "keras"):
        proc = subprocess.run(
            [sys.executable, "-m", "perseus_tf.runner", "-np", "2", "--", sys.executable,
             str(REPO / "benchmarks" / "horovod_compare.py"), "--worker", "perseus",
             "--workload", workload, "--steps", "2", "--warmup", "1", "--width", "32",
             "--global-batch", "8"],
            cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
        assert result["ok"] and len(result["ms"]) == 2 and min(result["ms"]) > 0, result


def test_horovod_compare_rejects_an_unknown_workload():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "horovod_compare.py"), "--workloads",
         "gradients:resnet51"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "unknown workload 'gradients:resnet51'" in proc.stderr


def test_tf_adapter_benchmark_small_step_runs_from_the_plan():
    # The TF-op path against _core: the 500 x 1 KiB step (PerseusStrategy's
    # gradient all-reduce), a model's gradient set and 1 MiB per call and
    # ten in one tf.function (which checks its sum), 2 ranks, few calls.
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tf_adapter.py"), "--tables",
         "small,profiles,sizes", "--small-np", "2", "--np", "2", "--iters", "2",
         "--profiles", "resnet50", "--sizes", "1"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    figures = r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+x\s+-?[\d.]+x"
    for case in ("in the step", "from Python"):
        small = re.search(rf"^500 x 1 KiB, {case}{figures}", proc.stdout, re.M)
        assert small and all(float(v) > 0 for v in small.groups()), proc.stdout
    planned = re.findall(r"offline plan: (\d+) plan steps for (\d+) calls of each path; "
                         r"TF path plannable: True", proc.stdout)
    assert len(planned) == 2 and all(int(p[0]) > 0 for p in planned), proc.stdout
    assert re.search(rf"^resnet50 \(161 tensors, \d+ MiB\){figures}", proc.stdout,
                     re.M), proc.stdout
    for case in (r"1 MiB", r"1 MiB x10 in one call"):
        row = re.search(rf"^{case}{figures}", proc.stdout, re.M)
        assert row and all(float(v) > 0 for v in row.groups()), proc.stdout


def test_one_host_step_benchmark_compares_two_trees():
    # This tree as its own --base: both columns run, the table has the
    # contender's row with a ratio, and a tree without built libraries is
    # refused by name.
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "one_host_step.py"), "--base", str(REPO),
         "--models", "mlp", "--contenders", "strategy", "--rounds", "1", "--steps", "2",
         "--warmup", "2", "--batch", "4"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    row = re.search(r"^\| strategy \| ([\d.]+) \| [\d. ]+ \| ([\d.]+) \| [\d. ]+ \| ([\d.]+) \|$",
                    proc.stdout, re.M)
    assert row and all(float(v) > 0 for v in row.groups()), proc.stdout
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "one_host_step.py"), "--base",
         str(REPO / "tests")], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "has no perseus_tf/libperseus_core.so" in proc.stderr


def test_step_overlap_prints_speedups_and_the_mwms_ceiling(capsys):
    step_overlap = _benchmark("step_overlap")
    rounds = {"compute": [400, 420, 410], "comm": [100, 500, 95], "comm fp16": [70, 70, 70],
              "strategy fp32": [450, 520, 470], "mwms": [600, 610, 590],
              "horovod": [640, 700, 650], "shim none": [480, 530, 500]}
    step_overlap._print_table("m", "1gbit", list(rounds), rounds, {})
    out = capsys.readouterr().out
    assert "mwms / strategy fp32: 1.26 (rounds 1.33 1.17 1.26)" in out, out
    assert "horovod / shim none: 1.32 (rounds 1.33 1.32 1.30)" in out, out
    # per round: 600/400, 610/500, 590/410
    assert "mwms / max(compute, comm) = 1.44" in out, out



def test_step_overlap_compares_with_the_lockstep_floor(capsys):
    # With lockstep rounds the table gains a column: each step over
    # max(lockstep, comm) of its own round, fp16 contenders against comm fp16.
    step_overlap = _benchmark("step_overlap")
    rounds = {"compute": [400, 420, 410], "lockstep": [440, 500, 430], "comm": [100, 450, 95],
              "comm fp16": [70, 520, 70], "strategy fp32": [462, 540, 473],
              "strategy": [484, 560, 440], "mwms": [660, 700, 645]}
    step_overlap._print_table("m", "1gbit", list(rounds), rounds, {})
    out = capsys.readouterr().out
    assert "| lockstep | 440 | 440 500 430 |  |  |  |  |  |" in out, out
    # lockstep: 462/440, 540/500, 473/430; compute: 462/400, 540/450, 473/410
    assert "| strategy fp32 | 473 | 462 540 473 | 1.16 | 0.92 |  |  | 1.08 |" in out, out
    # fp16, lockstep: 484/440, 560/520, 440/430; compute: 484/400, 560/520, 440/410
    assert "| strategy | 484 | 484 560 440 | 1.08 | 0.92 |  |  | 1.08 |" in out, out
    assert "/ max(lockstep, comm) |" in out
    # MWMS's ceilings: 660/400, 700/450, 645/410 and 660/440, 700/500, 645/430
    assert "mwms / max(compute, comm) = 1.57" in out, out
    assert "mwms / max(lockstep, comm) = 1.50" in out, out


def test_lockstep_barrier_holds_each_host_until_the_other_comes():
    # Rank 1 comes 0.4 s late to the second barrier: rank 0 waits for it there.
    import threading
    import time
    step_overlap = _benchmark("step_overlap")
    LocalHost = _benchmark("one_host_step").LocalHost
    import socket
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"

    def rank1():
        wait = step_overlap._barrier(addr, 1, 60)
        wait()
        time.sleep(0.4)
        wait()

    other = threading.Thread(target=rank1)
    other.start()
    wait = step_overlap._barrier(addr, 0, 60)
    wait()
    start = time.monotonic()
    wait()
    waited = time.monotonic() - start
    other.join(60)
    assert not other.is_alive() and waited >= 0.35, waited

    # The real contender: both ranks train and meet at every step's end.
    import argparse
    args = argparse.Namespace(batch=4, steps=3, warmup=2, threads=False, ops=False, timeout=300)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = ENV["PYTHONPATH"]
    try:
        result = step_overlap.run_contender(LocalHost(), "lockstep", args, "mlp")
    finally:
        os.environ.pop("PYTHONPATH")
        if old is not None:
            os.environ["PYTHONPATH"] = old
    assert result["ms"] > 0 and result["max"] >= result["ms"], result

def test_rank_timelines_put_rank_1_on_rank_0s_clock_and_name_the_late_rank():
    rank_timelines = _benchmark("rank_timelines")

    def span(ts, dur, first, nbytes=1 << 20):
        return {"cat": "bucket", "name": "allreduce", "tid": 1, "ts": ts, "dur": dur,
                "args": {"first": first, "bytes": nbytes, "tensors": 2}}

    # Rank 1's clock runs 5 s behind rank 0's. Rank 1 comes 30 ms late to
    # the first bucket (rank 0 waits inside it), rank 0 40 ms late to the
    # second; both end each bucket together. The scalar span is left out of
    # the skew figures.
    rank0 = [span(100_000, 40_000, "g.0"), span(200_000, 10_000, "g.1"),
             span(215_000, 500, "loss", nbytes=4)]
    rank1 = [span(-4_870_000, 10_000, "g.0"), span(-4_840_000, 50_000, "g.1"),
             span(-4_785_000, 500, "loss", nbytes=4)]
    trace1 = {"traceEvents": [{"cat": "negotiation", "ts": 0, "dur": 1}] + rank1[::-1]}
    spans1 = rank_timelines.bucket_spans(trace1)
    assert [s["args"]["first"] for s in spans1] == ["g.0", "g.1", "loss"]
    rows = rank_timelines.rows(rank0, spans1)
    assert [r[:4] for r in rows] == [["0.0", "40.0", "30.0", "rank 1 by 30.0"],
                                     ["100.0", "110.0", "60.0", "rank 0 by 40.0"],
                                     ["115.0", "115.5", "115.0", "-"]], rows
    assert rank_timelines.skew(rank0, spans1) == (2, 35.0, 40.0)
    # Traces that do not pair (another bucket last) show rank 0 alone.
    other = rank1[:2] + [span(-4_785_000, 500, "other", nbytes=4)]
    assert [r[2:4] for r in rank_timelines.rows(rank0, other)] == [["", ""]] * 3
    assert rank_timelines.skew(rank0, other) is None
    # Rank 1's trace kept only its last span: the rows before it stay rank 0's alone.
    assert [r[2:4] for r in rank_timelines.rows(rank0, rank1[2:])] == \
        [["", ""], ["", ""], ["115.0", "-"]]


def test_shard_benchmark_shim_keeps_half_the_state_at_2_ranks(tmp_path):
    # The Horovod shim's sharded path (--api shim), ResNet-50's gradients at
    # 2 ranks: every rank's Adam state is half the unsharded one's.
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "shard.py"), "--api", "shim",
         "--profiles", "resnet50", "--np", "2", "--steps", "1", "--warmup", "1",
         "--json", str(out)],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert row["api"] == "shim" and row["ranks"] == 2, row
    assert row["state_sharded"] <= row["state_unsharded"] / 2 * 1.01, row
    assert row["step_sharded"] > 0 and row["step_unsharded"] > 0, row
    assert "| resnet50 | 2 |" in proc.stdout, proc.stdout
