"""PerseusStrategy in ranks that Slurm started: 4 tasks of one `srun`, no launcher.

tests/test_slurm.py runs this through run_checks.py under `srun -n 4` with
EXPECT_SOURCE=slurm (the ranks read their place from SLURM_* variables).
Each rank also trains the same model alone on the same global batches: the
distributed weights must equal that single-process result.
"""

import os

import numpy as np
import tensorflow as tf

import perseus_tf as ptf
from perseus_tf import _native

from checks_strategy import dataset, make_model
from rank_checks import same_on_all_ranks

try:
    import keras
except ImportError:  # pragma: no cover
    keras = tf.keras

R = N = STRATEGY = None


def setup():
    global R, N, STRATEGY
    STRATEGY = ptf.PerseusStrategy()
    R, N = ptf.rank(), ptf.size()
    return R


def check_a_topology_comes_from_slurm():
    t = _native.topology()
    env = os.environ
    assert _native._topology.source == "slurm", _native._topology.source
    assert t["rank"] == int(env["SLURM_PROCID"]), (t, env["SLURM_PROCID"])
    assert t["size"] == int(env["SLURM_STEP_NUM_TASKS"]) == 4, t
    assert t["local_rank"] == int(env["SLURM_LOCALID"]) and t["local_size"] == 4, t
    assert t["cross_rank"] == int(env["SLURM_NODEID"]) == 0 and t["cross_size"] == 1, t
    assert STRATEGY.num_replicas_in_sync == 4


def check_b_fit_equals_one_process():
    with STRATEGY.scope():
        model = make_model(seed=R)  # other initial weights per rank: rank 0's win
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    start = [w.numpy() for w in model.weights]
    model.fit(dataset(), epochs=2, verbose=0, shuffle=False)
    ref = make_model(seed=0)
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for v, s in zip(ref.weights, start):
        v.assign(s)
    ref.fit(dataset(), epochs=2, verbose=0, shuffle=False)
    same_on_all_ranks([w.numpy() for w in model.weights])  # first: the same calls on every rank
    for a, b in zip(model.weights, ref.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
