"""The Horovod-compatible API (perseus_tf.horovod and perseus_tf.horovod.keras):
one perseusrun launch per worker module and rank count. Every check runs at 2
ranks; the checks that 4 ranks test further (each module's AT_4_RANKS) at 4
too. The second pass of `make test` (TF 2.15: Keras 2, tf.estimator) runs the
2-rank launches."""

import importlib.util
import subprocess
import sys

import pytest

from harness import ROOT, cases, rank_env, run_checks_at
from tiers import second_pass

ESTIMATOR_ONLY = {"check_estimator_with_hook"}
HAS_ESTIMATOR = importlib.util.find_spec("tensorflow_estimator") is not None
MODULES = ["checks_horovod", "checks_horovod_keras"]
RANKS = [2] if second_pass() else [2, 4]
CASES = [(m, np_, c) for m in MODULES for np_, c in cases(m, RANKS)]

_launches = {}


def launched(module, np_):
    if (module, np_) not in _launches:
        _launches[(module, np_)] = run_checks_at(module, np_, timeout=900)
    return _launches[(module, np_)]


@pytest.mark.parametrize("module,ranks,check", CASES, ids=[f"{n}-{c}" for _, n, c in CASES])
def test_horovod(module, ranks, check):
    if check in ESTIMATOR_ONLY and not HAS_ESTIMATOR:
        pytest.skip("tf.estimator was removed in TF 2.16")
    launched(module, ranks).assert_ok(check)


@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("module", MODULES)
def test_clean_exit(ranks, module):
    proc = launched(module, ranks).proc
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_queries_before_init_raise_as_in_horovod():
    # Also hvd._executing_eagerly, private but called by Horovod's own tests.
    code = ("import perseus_tf.horovod as hvd\n"
            "for query in (hvd.rank, hvd.size, hvd.local_rank, hvd.cross_size):\n"
            "    try:\n"
            "        query()\n"
            "        raise SystemExit(f'{query.__name__} did not raise before init')\n"
            "    except ValueError as e:\n"
            "        assert 'hvd.init()' in str(e), e\n"
            "hvd.init()\n"
            "assert (hvd.rank(), hvd.size()) == (0, 1)\n"
            "import tensorflow as tf\n"
            "assert hvd._executing_eagerly() is True\n"
            "traced = tf.function(lambda: tf.constant(hvd._executing_eagerly()))()\n"
            "assert not bool(traced), 'inside tf.function it must say False'\n"
            "print('BEFORE INIT OK')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=rank_env(), capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert "BEFORE INIT OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


COMPRESSION_SCRIPT = r"""
import numpy as np, tensorflow as tf
import perseus_tf.horovod as hvd
hvd.init()
r, n = hvd.rank(), hvd.size()
x = np.random.default_rng(r).normal(0, 1e-3, 64).astype(np.float32)
w = tf.Variable(tf.zeros([64]))
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(w * x)
g = hvd.DistributedGradientTape(tape).gradient(loss, [w])[0].numpy()
exact = np.mean([np.random.default_rng(q).normal(0, 1e-3, 64).astype(np.float32)
                 for q in range(n)], 0)
print("EXACT" if np.allclose(g, exact, rtol=1e-6, atol=0) else "CLOSE"
      if np.allclose(g, exact, rtol=0, atol=1e-5) else "WRONG", flush=True)
"""


@pytest.mark.parametrize("setting,expected", [(None, "EXACT"), ("1", "EXACT"), ("0", "CLOSE")])
def test_tape_follows_explicit_perseus_allreduce_dtype_only(setting, expected, tmp_path):
    # Horovod's semantics by default (Compression.none is exact); float16 on
    # the wire only when PERSEUS_ALLREDUCE_DTYPE=0 is set explicitly.
    script = tmp_path / "tape.py"
    script.write_text(COMPRESSION_SCRIPT)
    env = rank_env({"PERSEUS_ALLREDUCE_DTYPE": setting})
    proc = subprocess.run([sys.executable, "-m", "perseus_tf.runner", "-np", "2", "--",
                           sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(expected) == 2, proc.stdout
