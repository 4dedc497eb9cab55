"""Helpers shared by the per-rank check modules (tests/workers/checks_*.py).

None of these names starts with `check_`, so run_checks.py never runs one as
a check when a module imports it. Helpers that make collective calls make the
same calls on every rank whatever their outcome. TensorFlow is imported only
inside the helpers that need it: the checks that drive the pybind11 module
directly stay free of it.
"""

import time

import numpy as np

import perseus_tf as ptf
from perseus_tf import _native


def start_native(**options):
    """Starts the runtime through the pybind11 module (no TensorFlow).

    Args:
      **options: passed to `_native.init`.

    Returns (rank, size).
    """
    _native.init(**options)
    t = _native.topology()
    return t["rank"], t["size"]


def data(rank, shape, dtype=np.float32, seed=0, low=1, high=4):
    """What `rank` contributes: small integers in [low, high), exact in every
    dtype so that sums and products compare exactly. Any rank can compute any
    other rank's data, so each check builds the numpy answer locally."""
    rng = np.random.default_rng(1000 * rank + seed)
    return rng.integers(low, high, size=shape).astype(dtype)


def gathered(a):
    """Every rank's `a` as float64, one flattened row per rank (an allgather)."""
    import tensorflow as tf
    everyone = ptf.allgather(tf.constant(np.asarray(a, np.float64).reshape(1, -1))).numpy()
    assert len(everyone) == ptf.size(), f"gathered {len(everyone)} rows from {ptf.size()} ranks"
    return everyone


def same_on_all_ranks(arrays, tol=0.0):
    """Every rank holds the same arrays: bit for bit, or within an absolute `tol`.

    NaN never counts as equal, so weights that went NaN everywhere fail.
    """
    for a in arrays:
        everyone = gathered(a)
        np.testing.assert_allclose(everyone, np.repeat(everyone[:1], len(everyone), 0),
                                   rtol=0, atol=tol, equal_nan=False)


def shared_tempdir(prefix):
    """A directory named by rank 0 (every rank gets the same path)."""
    import tempfile

    import tensorflow as tf
    mine = tempfile.mkdtemp(prefix=prefix) if ptf.rank() == 0 else ""
    raw = list(mine.encode()) + [0] * (200 - len(mine))
    name = ptf.broadcast(tf.constant(raw, tf.uint8), root_rank=0).numpy()
    return bytes(name).rstrip(b"\0").decode()


def interrupting_callback(keras, epoch=1):
    """A Keras callback that raises RuntimeError("interrupted") as `epoch`
    begins: a job stopped there, for BackupAndRestore to resume."""
    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, at, logs=None):
            if at == epoch:
                raise RuntimeError("interrupted")
    return Interrupt()


def expect(error, fn, *needles):
    """fn() raises `error` (or a subclass) with every needle in its message."""
    try:
        fn()
    except error as e:
        for needle in needles:
            assert needle in str(e), f"{needle!r} not in {type(e).__name__}: {e}"
        return
    raise AssertionError(f"expected {error.__name__}")


def assert_barrier_waits(barrier, delay=0.2):
    """`barrier()` lets no rank leave before every rank has entered it.

    Each rank in turn enters `delay` seconds late (every rank in turn, so that
    a barrier that waits only for some ranks is caught too). Every rank notes
    when it entered and left; no rank may have left before the last one
    entered. That needs one clock for all ranks: these tests run every rank on
    one machine, where time.monotonic() is the same clock in every process.
    A barrier that returns at once fails in the first round that the ranks
    start together (the collectives before it, at the latest this helper's
    allgather, line them up): the others have left before the late rank enters.
    """
    for late in range(ptf.size()):
        if ptf.rank() == late:
            time.sleep(delay)
        entered = time.monotonic()
        barrier()
        left = time.monotonic()
        times = gathered([entered, left])
        first_out, last_in = times[:, 1].argmin(), times[:, 0].argmax()
        early = times[last_in, 0] - times[first_out, 1]
        assert early <= 0, (f"rank {first_out} left the barrier {early:.3f} s before rank "
                            f"{last_in} entered it (rank {late} entered {delay} s late)")
