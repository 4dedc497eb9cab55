"""2 hosts x 2 ranks, each host a network namespace (tests/netns_hosts.py),
started by perseusrun over ssh, by mpirun, or by hand with TF_CONFIG or the
torchrun variables (tests/test_multihost.py).

The launch sets EXPECT_SOURCE (which env contract the ranks must report)
and EXPECT_SUBNET (host h has address 10.77.<subnet>.<h+1>). Every rank also
trains the same model alone on the same global batches: the distributed
weights must equal that single-process result.
"""

import os

import numpy as np
import tensorflow as tf

import perseus_tf as ptf
from perseus_tf import _native

from rank_checks import same_on_all_ranks

try:
    import keras
except ImportError:  # pragma: no cover
    keras = tf.keras

R = N = STRATEGY = None
GLOBAL_BATCH = 16
rng = np.random.default_rng(7)
X = rng.normal(size=(96, 6)).astype(np.float32)
Y = (X @ rng.normal(size=(6, 1)) + 0.1).astype(np.float32)


def setup():
    global R, N, STRATEGY
    STRATEGY = ptf.PerseusStrategy()
    R, N = ptf.rank(), ptf.size()
    return R


def check_a_topology_spans_two_hosts():
    t = _native.topology()
    assert (t["size"], t["local_size"], t["cross_size"]) == (4, 2, 2), t
    assert t["cross_rank"] == R // 2 and t["local_rank"] == R % 2, t
    subnet = os.environ["EXPECT_SUBNET"]
    assert _native.host_addr() == f"10.77.{subnet}.{R // 2 + 1}", _native.host_addr()
    assert _native._topology.source == os.environ["EXPECT_SOURCE"], _native._topology.source
    # Every rank's address, as MultiWorkerMirroredStrategy users read it.
    spec = STRATEGY.cluster_resolver.cluster_spec().as_dict()
    assert spec["worker"] == [f"10.77.{subnet}.{r // 2 + 1}" for r in range(4)], spec


def _model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(1)])


def check_b_strategy_fit_equals_one_process():
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH)
    with STRATEGY.scope():
        model = _model(seed=R)  # other initial weights per rank: rank 0's win
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    start = [w.numpy() for w in model.weights]
    model.fit(data, epochs=3, verbose=0, shuffle=False)
    ref = _model(seed=0)
    ref.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    for v, s in zip(ref.weights, start):
        v.assign(s)
    ref.fit(data, epochs=3, verbose=0, shuffle=False)
    same_on_all_ranks([w.numpy() for w in model.weights])  # first: the same calls on every rank
    for a, b in zip(model.weights, ref.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)


def check_c_hierarchical_allreduce_is_used():
    # 1 MiB: two levels or flat, as the cost model says; the sum either way.
    x = tf.fill([1 << 18], float(R + 1))
    y = ptf.allreduce(x, op=ptf.Sum, name="multihost.big").numpy()
    np.testing.assert_array_equal(y, np.full(1 << 18, N * (N + 1) / 2, np.float32))
    stats = _native.stats()
    assert stats["hierarchical"] is True, stats


def check_d_horovod_distributed_optimizer_keeps_ranks_identical():
    import perseus_tf.horovod as hvd
    hvd.init()
    keras.utils.set_random_seed(100 + R)  # different starting weights per rank
    w = tf.Variable(tf.random.normal([6, 1]))
    b = tf.Variable(tf.zeros([1]))
    opt = keras.optimizers.SGD(0.1)
    hvd.broadcast_variables([w, b], root_rank=0)
    per_rank = GLOBAL_BATCH // N
    for step in range(6):
        lo = step * GLOBAL_BATCH + R * per_rank
        xs, ys = X[lo:lo + per_rank], Y[lo:lo + per_rank]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.matmul(xs, w) + b - ys) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, [w, b])
        opt.apply_gradients(zip(grads, [w, b]))
    same_on_all_ranks([w.numpy(), b.numpy()])
