"""Operability: PERSEUS_TIMELINE traces and PERSEUS_PERF_CHECK_N_STEPS reports."""

import json
import sys

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
        assert {"negotiate", "allreduce", "fp16 compress", "gloo allreduce (fp16)",
                "fp16 decompress", "gloo allreduce"} <= names, names
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in events if e["ph"] == "X")
        meta = {e["args"]["name"] for e in events if e["ph"] == "M"}
        assert f"rank {rank}" in meta and "negotiation" in meta and "stream 0" in meta, meta
        # The repeated gradient step ran from an offline plan at least once.
        assert any(e["name"] == "allreduce" and e["args"].get("plan") for e in events), events
