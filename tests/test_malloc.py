"""PerseusStrategy undoes TF 2.21's frozen malloc thresholds (perseus_tf/_malloc.py).

On TF 2.21 a distributed dataset's iterator makes TensorFlow call
mallopt(M_TRIM_THRESHOLD, 128 KiB), after which every malloc of 128 KiB or
more is a fresh mmap (TF's convolutions then fault in new pages each step).
With PERSEUS_MALLOC_MMAP_THRESHOLD=0 that is what the worker sees; by
default a 1 MiB block comes from the heap again. On TF 2.15, which makes no
such call, glibc's own dynamic rule is left alone either way.
"""

import json
import os
import subprocess
import sys

import pytest

from harness import ROOT, WORKERS, rank_env


def _run(threshold):
    env = rank_env({"PERSEUS_MALLOC_MMAP_THRESHOLD": threshold})
    out = subprocess.run([sys.executable, os.path.join(WORKERS, "malloc_worker.py")],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"malloc_worker failed (rc {out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


@pytest.fixture(scope="module")
def results():
    return {"default": _run(None), "off": _run("0")}


def test_large_blocks_come_from_the_heap_again_under_the_strategy(results):
    r = results["default"]
    assert r["batches"] == [1, 5, 9, 13]
    assert r["maps_1mib"] == 0, r
    # Above the 32 MiB threshold blocks are still mapped, and returned on free.
    assert r["maps_64mib"] == 1, r


def test_threshold_zero_keeps_what_tensorflow_set(results):
    import tensorflow as tf
    r = results["off"]
    assert r["batches"] == [1, 5, 9, 13]
    version = tuple(int(x) for x in tf.__version__.split(".")[:2])
    # Which TF builds make the call: 2.21 does, 2.15 does not.
    assert r["tf_freezes_malloc"] == (version >= (2, 21)), (tf.__version__, r)
    # Frozen by TF: a 1 MiB block is mapped. Not frozen: glibc's rule,
    # having seen a 1 MiB block freed, serves it from the heap.
    assert r["maps_1mib"] == (1 if r["tf_freezes_malloc"] else 0), r


def test_strategy_with_eager_execution_off_still_starts():
    # No eager op can run then: the strategy leaves glibc as it is, and
    # must not fail because the one-device iterator cannot be built.
    script = ("import perseus_tf, tensorflow as tf\n"
              "from perseus_tf import _malloc\n"
              "tf.compat.v1.disable_eager_execution()\n"
              "strategy = perseus_tf.PerseusStrategy()\n"
              "print('RESULT', strategy.num_replicas_in_sync, _malloc._done)\n"
              "perseus_tf.shutdown()\n")
    out = subprocess.run([sys.executable, "-c", script], env=rank_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert "RESULT 1 False" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
