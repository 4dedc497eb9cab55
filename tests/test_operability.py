"""Operability: PERSEUS_TIMELINE traces and PERSEUS_PERF_CHECK_N_STEPS reports."""

import json
import re
import sys

import pytest

from harness import launch


TIMELINE_SCRIPT = r"""
import numpy as np, tensorflow as tf, perseus_tf as ptf
ptf.init()
for step in range(4):
    ptf.grouped_allreduce([tf.ones([1000]), tf.ones([10])], op=ptf.Average, compression="fp16",
                          gradients=True, name="tl.grads")
ptf.allreduce(tf.ones([3]), name="tl.adhoc")
print("RAN", flush=True)
"""


def test_timeline_written_per_rank_as_chrome_trace(tmp_path):
    script = tmp_path / "tl.py"
    script.write_text(TIMELINE_SCRIPT)
    proc = launch(2, [sys.executable, str(script)],
                  env={"PERSEUS_TIMELINE": str(tmp_path / "trace.json")}, timeout=180)
    assert proc.returncode == 0 and proc.stdout.count("RAN") == 2, proc.stderr[-3000:]
    for rank in range(2):
        trace = json.loads((tmp_path / f"trace.rank{rank}.json").read_text())
        events = trace["traceEvents"]
        names = {e["name"] for e in events if e["ph"] == "X"}
        # One host: the reductions themselves run through shared memory.
        assert {"negotiate", "allreduce", "fp16 compress", "shm allreduce (fp16)",
                "fp16 decompress", "shm allreduce"} <= names, names
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in events if e["ph"] == "X")
        meta = {e["args"]["name"] for e in events if e["ph"] == "M"}
        assert f"rank {rank}" in meta and "negotiation" in meta and "stream 0" in meta, meta
        # The repeated gradient step ran from an offline plan at least once.
        assert any(e["name"] == "allreduce" and e["args"].get("plan") for e in events), events


PERF_SCRIPT = r"""
import time, numpy as np
from perseus_tf import _native
from perseus_tf._native import _core, DTYPE_CODES
_native.init()
t = _native.topology(); R, N = t["rank"], t["size"]
arrays = [np.ones(1000, np.float32) for _ in range(8)]
names = [f"perf.g{i}" for i in range(8)]
for step in range(40):
    if R == N - 1:
        time.sleep(0.03)  # this rank's "forward and backward pass" is slow
    for a in arrays:
        a[:] = 1
    _core.submit_group(arrays, names, DTYPE_CODES["float32"], reduce_op=0, plannable=True).wait()
    assert np.all(arrays[0] == N)
s = _core.stats()
print("STATS", s["perf_reports"], s["slow_ranks"], s["offline_steps"], flush=True)
"""


@pytest.mark.parametrize("np_", [2, 4])
def test_perf_check_names_the_slow_rank(np_, tmp_path):
    script = tmp_path / "perf.py"
    script.write_text(PERF_SCRIPT)
    proc = launch(np_, [sys.executable, str(script)],
                  env={"PERSEUS_PERF_CHECK_N_STEPS": "10"}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = re.findall(r"\[(\d)\] STATS (\d+) \[([\d, ]*)\] (\d+)", proc.stdout)
    assert len(stats) == np_, proc.stdout
    for _, reports, slow, offline in stats:
        assert int(offline) >= 30 and int(reports) >= 2, stats
        assert str(np_ - 1) in slow.split(", "), stats  # every rank knows
    # Rank 0 reports it, naming the rank and its time.
    assert re.search(rf"Perseus perf check \(last 10 steps\): .*rank {np_ - 1} \d", proc.stderr), \
        proc.stderr[-2000:]


HVD_TIMELINE_SCRIPT = r"""
import sys, tensorflow as tf
import perseus_tf.horovod as hvd
hvd.init()
hvd.allreduce(tf.ones([4]), name="before")          # not recorded
hvd.start_timeline(sys.argv[1])
hvd.allreduce(tf.ones([4]), name="during")
hvd.stop_timeline()
hvd.allreduce(tf.ones([4]), name="after")           # not recorded
hvd.start_timeline(sys.argv[2], mark_cycles=True)
hvd.allreduce(tf.ones([4]), name="marked")
hvd.stop_timeline()
print("RAN", flush=True)
"""


def test_horovod_start_and_stop_timeline(tmp_path):
    script = tmp_path / "hvd_tl.py"
    script.write_text(HVD_TIMELINE_SCRIPT)
    proc = launch(2, [sys.executable, str(script), str(tmp_path / "hvd.json"),
                      str(tmp_path / "marked.json")], timeout=180)
    assert proc.returncode == 0 and proc.stdout.count("RAN") == 2, proc.stderr[-3000:]
    for rank in range(2):
        events = json.loads((tmp_path / f"hvd.rank{rank}.json").read_text())["traceEvents"]
        firsts = [e["args"]["first"] for e in events if e["ph"] == "X" and "first" in e["args"]]
        assert firsts == ["during"], firsts
        # Horovod's mark_cycles: cycles are recorded only when asked for.
        assert not any(e["name"] == "negotiate" for e in events), events
        marked = json.loads((tmp_path / f"marked.rank{rank}.json").read_text())["traceEvents"]
        assert any(e["name"] == "negotiate" for e in marked), marked
        assert [e["args"]["first"] for e in marked if e["ph"] == "X" and "first" in e["args"]] \
            == ["marked"]
