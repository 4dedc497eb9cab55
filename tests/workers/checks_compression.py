"""Gradient compression and the two-level allreduce against numpy models.

Run through the pybind11 module (no TensorFlow) in several launches, each
with its own PERSEUS_* settings (tests/test_compression.py): every check
reads the settings and predicts, in numpy, exactly what the runtime must
return for them, so the same check covers none, fp16, mixed, top-k and
downsampling.
"""

import os

import numpy as np

from perseus_tf import _native
from perseus_tf._native import DTYPE_CODES, OP_ALLREDUCE, _core

from rank_checks import start_native

R = N = None
TOPO = None
SUM, AVERAGE = 0, 1


def setup():
    global R, N, TOPO
    R, N = start_native()
    TOPO = _native.topology()
    return R


def _env(name, default):
    return type(default)(os.environ.get(name, default))


def _two_level():
    """The job spans several hosts of several ranks each."""
    return TOPO["cross_size"] > 1 and TOPO["local_size"] > 1


def _host_of(rank):
    return rank // TOPO["local_size"]


def _gradient(rank, step, name, n):
    """What `rank` contributes at `step` for tensor `name` (~N(0, 1e-3))."""
    seed = [rank, step, sum(map(ord, name)), n]
    return (np.random.default_rng(seed).normal(size=n) * 1e-3).astype(np.float32)


def _fp16_scaled(x, scale):
    return (x.astype(np.float32) * np.float32(scale)).astype(np.float16)


class Model:
    """numpy model of the runtime's gradient reductions under this launch's settings."""

    def __init__(self):
        self.scale = _env("PERSEUS_ALLREDUCE_GRADIENT_SCALE", 10.0)
        self.dtype_mode = _env("PERSEUS_ALLREDUCE_DTYPE", 0)
        self.topk = _env("PERSEUS_TOPK_ALLREDUCE", 0) == 1
        self.ratio = _env("PERSEUS_TOPK_RATIO", 0.01)
        self.threshold = _env("PERSEUS_TOPK_THRESHOLD", 1048576)
        self.topk_fp16 = _env("PERSEUS_TOPK_FP16", 0) == 1
        self.down = _env("PERSEUS_DOWNSAMPLE_N_ELEMENTS", 1)
        self.momentum = np.float32(_env("PERSEUS_GRADIENT_MOMENTUM", 1.0))
        self.residual = {}  # (rank, name) -> float32 array
        self.steps = {}     # name -> steps run

    def kind(self, n):
        if self.down > 1:
            return "downsample"
        if self.topk and n * 4 >= self.threshold:
            return "topk"
        return {0: "fp16", 1: "none", 2: "mixed"}[self.dtype_mode]

    def reduce(self, name, inputs):
        """inputs[r]: rank r's float32 gradient; returns the averaged result."""
        n = inputs[0].size
        kind = self.kind(n)
        if kind == "none":
            total = inputs[0].copy()
            for x in inputs[1:]:
                total = total + x
        elif kind == "fp16":
            # Summed in float16 (each addition rounds to float16).
            total = _fp16_scaled(inputs[0], self.scale)
            for x in inputs[1:]:
                total = (total.astype(np.float32) + _fp16_scaled(x, self.scale).astype(
                    np.float32)).astype(np.float16)
            total = total.astype(np.float32) * np.float32(1 / self.scale)
        elif kind == "mixed":
            if not _two_level():  # one host: plain float32
                total = inputs[0].copy()
                for x in inputs[1:]:
                    total = total + x
            else:
                hosts = []
                for h in range(TOPO["cross_size"]):
                    members = [x for r, x in enumerate(inputs) if _host_of(r) == h]
                    s = members[0].copy()
                    for x in members[1:]:
                        s = s + x
                    hosts.append(_fp16_scaled(s, self.scale))
                t = hosts[0]
                for h in hosts[1:]:
                    t = (t.astype(np.float32) + h.astype(np.float32)).astype(np.float16)
                total = t.astype(np.float32) * np.float32(1 / self.scale)
        elif kind == "topk":
            k = max(1, min(n, int(np.ceil(self.ratio * n))))
            total = np.zeros(n, np.float32)
            for r, x in enumerate(inputs):
                res = self.residual.setdefault((r, name), np.zeros(n, np.float32))
                acc = x + res
                # Largest magnitude first; ties to the lower index.
                idx = np.sort(np.lexsort((np.arange(n), -np.abs(acc)))[:k])
                sent = acc[idx]
                if self.topk_fp16:
                    sent = _fp16_scaled(sent, self.scale).astype(np.float32) * \
                        np.float32(1 / self.scale)
                new = acc.copy()
                new[idx] = acc[idx] - sent
                self.residual[(r, name)] = new
                total[idx] += sent
        else:  # downsample
            phase = self.steps.get(name, 0) % self.down
            sel = np.arange(phase, n, self.down)
            total = np.zeros(n, np.float32)
            s = None
            for r, x in enumerate(inputs):
                res = self.residual.setdefault((r, name), np.zeros(n, np.float32))
                acc = x + self.momentum * res
                part = acc[sel]
                s = part if s is None else s + part
                new = acc.copy()
                new[sel] = 0
                self.residual[(r, name)] = new
            total[sel] = s
        self.steps[name] = self.steps.get(name, 0) + 1
        return total * np.float32(1.0 / N)


def _submit_gradient(x, name):
    code = _native.gradient_compression()
    return _core.submit(OP_ALLREDUCE, x, name, DTYPE_CODES["float32"], reduce_op=AVERAGE,
                        output=np.empty_like(x), compression=code, plannable=True)


def check_gradient_steps_match_the_numpy_model():
    """Five steps of a small gradient set (some tensors above the top-k
    threshold, some under) through the runtime, against the model."""
    model = Model()
    sizes = {"g.small": 1000, "g.mid": 12_345, "g.big": 50_000}
    for step in range(5):
        handles = {name: _submit_gradient(_gradient(R, step, name, n), name)
                   for name, n in sizes.items()}
        for name, n in sizes.items():
            got = handles[name].wait()[0]
            want = model.reduce(name, [_gradient(r, step, name, n) for r in range(N)])
            kind = model.kind(n)
            if kind == "fp16" and N > 2:
                # Ring order decides how float16 partial sums round.
                rtol, atol = 2e-3, 2e-6
            else:
                # The same operations as the model, in the same order (two
                # ranks, or two hosts, add commutatively); float32 sums of
                # more ranks differ by rounding only.
                rtol, atol = 2e-6, 1e-9
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                       err_msg=f"{name} ({kind}) at step {step}")


def check_compression_is_what_the_settings_say():
    model = Model()
    code = _native.gradient_compression()
    want = {"none": 0, "fp16": 1, "mixed": 2, "topk": 3, "downsample": 4}[model.kind(10**9)]
    assert code == want, (code, want)
    # Wire bytes reported for one 100k-element gradient.
    before = sum(s["bytes"] for s in _native.stats()["streams"])
    _submit_gradient(np.ones(100_000, np.float32), "g.bytes").wait()
    sent = sum(s["bytes"] for s in _native.stats()["streams"]) - before
    per_kind = {"none": 400_000, "fp16": 200_000,
                "mixed": 200_000 if _two_level() else 400_000,
                "topk": int(np.ceil(model.ratio * 100_000)) * (6 if model.topk_fp16 else 8),
                "downsample": 4 * -(-100_000 // model.down)}
    assert sent == per_kind[model.kind(100_000)], (sent, model.kind(100_000))


def check_topk_residuals_deliver_everything_eventually():
    """Error feedback: with a constant gradient, what top-k has delivered
    after many steps approaches what plain averaging would have."""
    model = Model()
    if model.kind(50_000) != "topk":
        # Not a top-k launch: gradients must not be sparse at all.
        x = _gradient(R, 0, "g.dense", 50_000)
        got = _submit_gradient(x, "g.dense").wait()[0]
        assert np.count_nonzero(got) > 0.2 * got.size, np.count_nonzero(got)
        return
    n = 50_000
    x = _gradient(R, 0, "g.const", n)
    delivered = np.zeros(n, np.float32)
    steps = 3 * int(np.ceil(1 / model.ratio))
    for _ in range(steps):
        delivered += _submit_gradient(x, "g.const").wait()[0]
    exact = sum(_gradient(r, 0, "g.const", n) for r in range(N)) / N * steps
    # What is still held back is one residual per rank, small against the
    # total (about 0.14 in L2 for this data; one step of top-k alone would
    # leave 1 - ratio of it undelivered), and most elements have travelled.
    err = np.linalg.norm(delivered - exact) / np.linalg.norm(exact)
    assert err < 0.25, err
    assert np.count_nonzero(delivered) > 0.9 * n, np.count_nonzero(delivered)


def check_two_level_allreduce_equals_flat():
    """Every reduction (not only gradients) over the two-level path when the
    topology has hosts: integers exactly, floats to float32 rounding."""
    st = _native.stats()
    mode = os.environ.get("PERSEUS_ALLREDUCE_MODE")
    assert st["hierarchical"] == (_two_level() and mode != "0"), (st["hierarchical"], TOPO)
    # The ranks of a host meet in shared memory (every launch here has
    # several ranks per host) unless it is turned off.
    assert st["shm"] is (os.environ.get("PERSEUS_SHM_ALLREDUCE") != "0"), st["shm"]
    n = 300_000  # 1.2 MB
    xi = np.arange(n, dtype=np.int64) * (R + 1)
    got = _core.submit(OP_ALLREDUCE, xi, "h.int", DTYPE_CODES["int64"], reduce_op=SUM,
                       output=np.empty_like(xi)).wait()[0]
    np.testing.assert_array_equal(got, np.arange(n, dtype=np.int64) * (N * (N + 1) // 2))
    xf = _gradient(R, 9, "h.float", n)
    got = _core.submit(OP_ALLREDUCE, xf, "h.float", DTYPE_CODES["float32"], reduce_op=SUM,
                       output=np.empty_like(xf)).wait()[0]
    want = sum(_gradient(r, 9, "h.float", n).astype(np.float64) for r in range(N))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-9)
    for op, fn in ((2, np.minimum), (3, np.maximum)):  # min, max
        got = _core.submit(OP_ALLREDUCE, xf, f"h.op{op}", DTYPE_CODES["float32"], reduce_op=op,
                           output=np.empty_like(xf)).wait()[0]
        want = _gradient(0, 9, "h.float", n)
        for r in range(1, N):
            want = fn(want, _gradient(r, 9, "h.float", n))
        np.testing.assert_array_equal(got, want)


def _ring_s(n, nbytes, alpha, beta, gamma):
    share = (n - 1) / n
    return 2 * (n - 1) * alpha + 2 * share * nbytes / beta + share * nbytes * gamma


def _doubling_s(n, nbytes, alpha, beta, gamma):
    p = 1 << (n.bit_length() - 1)
    steps = p.bit_length() - 1 + (0 if p == n else 2)
    return steps * (alpha + nbytes / beta + nbytes * gamma)


def _flat_s(n, nbytes, cost, line):
    doubles = 0 < line and nbytes <= line and nbytes >= 4 * n
    return (_doubling_s if doubles else _ring_s)(n, nbytes, *cost)


def _two_level_and_flat_s(st, nbytes):
    """cost_model.h's two times for a bucket, written again from the inputs
    stats() reports: the host phases plus the leaders' doubling or ring
    among the hosts, and the flat allreduce among all ranks."""
    gamma = 1e-6 / st["reduce_mbytes"]
    flat = (st["link_latency_us"] * 1e-6, st["link_bandwidth_mbytes"] * 1e6, gamma)
    cross = (st["cross_latency_us"] * 1e-6, st["cross_bandwidth_mbytes"] * 1e6, gamma)
    per_byte = 1e-6 / st["host_phase_mbytes"] if st["host_phase_mbytes"] > 0 else 0.0
    two = st["host_phase_us"] * 1e-6 + nbytes * per_byte + \
        _flat_s(TOPO["cross_size"], nbytes, cross, st["leaders_doubling_bytes"])
    return two, _flat_s(N, nbytes, flat, st["allreduce_doubling_bytes"])


def check_two_levels_where_the_cost_model_says():
    """With two levels and PERSEUS_ALLREDUCE_MODE unset, each bucket takes
    them or the flat allreduce by costs measured at init on the groups that
    carry them (the host phases; doubling among the hosts' leaders; the flat
    group), the same on every rank. The timeline names what each bucket took
    (the leaders double up to their line), and it is what the model says."""
    import json
    import tempfile
    st = _native.stats()
    keys = ("host_phase_us", "host_phase_mbytes", "cross_latency_us", "cross_bandwidth_mbytes",
            "leaders_doubling_bytes", "allreduce_doubling_bytes", "link_latency_us",
            "link_bandwidth_mbytes", "reduce_mbytes")
    mine = np.array([float(st[k]) for k in keys], np.float64)
    every = _core.submit(_native.OP_ALLGATHER, mine.copy(), "two.level.model",
                         DTYPE_CODES["float64"]).wait()[0].reshape(N, -1)
    assert (every == every[0]).all(), f"the ranks measured different costs: {every}"
    if not st["hierarchical"] or os.environ.get("PERSEUS_ALLREDUCE_MODE") is not None:
        assert st["cross_latency_us"] == 0 and st["host_phase_us"] == 0, st
        return
    assert st["cross_latency_us"] > 0 and st["cross_bandwidth_mbytes"] > 0, st
    assert st["host_phase_us"] > 0 and st["link_bandwidth_mbytes"] > 0, st
    sizes = [64, 4096, 64 << 10, 1 << 20, 3 << 20]
    want = []
    for nbytes in sizes:
        two, flat = _two_level_and_flat_s(st, nbytes)
        # None: too near to call from stats' rounded units.
        want.append(None if abs(two - flat) < 1e-3 * max(two, flat) else two < flat)
    path = os.path.join(tempfile.mkdtemp(), f"twolevel.rank{R}.json")
    _core.start_timeline(path, False)
    for nbytes in sizes:
        n = nbytes // 4  # int32: no compression applies
        x = np.arange(n, dtype=np.int32) % 1000 * (R + 1)
        got = _core.submit(OP_ALLREDUCE, x, f"two.level.{nbytes}", DTYPE_CODES["int32"],
                           reduce_op=SUM, output=np.empty_like(x)).wait()[0]
        np.testing.assert_array_equal(got, np.arange(n, dtype=np.int32) % 1000 * (N * (N + 1) // 2))
    _core.stop_timeline()
    with open(path) as f:
        spans = sorted((e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"),
                       key=lambda e: e["ts"])
    names = [e["name"] for e in spans]
    taken = [n == "host reduce" for n in names
             if n == "host reduce" or n.startswith("gloo allreduce")]
    assert len(taken) == len(sizes), names
    for nbytes, w, got in zip(sizes, want, taken):
        assert w is None or w == got, (nbytes, w, got, _two_level_and_flat_s(st, nbytes), st)
    if TOPO["local_rank"] == 0:  # a leader: each crossing by the leaders' line
        line = st["leaders_doubling_bytes"]
        crossed = [n for n in names if n.startswith("cross-host allreduce")]
        assert crossed == ["cross-host allreduce, doubling"
                           if 4 * TOPO["cross_size"] <= b <= line else "cross-host allreduce"
                           for b, two in zip(sizes, taken) if two], (crossed, line)


def check_large_buffers_in_pipelined_chunks():
    """Buffers of several 4 MiB chunks (the two-level path pipelines them):
    an exact int64 sum, and one gradient step against the model."""
    n = 1_700_000  # 13.6 MB of int64: 4 chunks, the last partial
    xi = (np.arange(n, dtype=np.int64) % 1000) * (R + 1)
    got = _core.submit(OP_ALLREDUCE, xi, "big.int", DTYPE_CODES["int64"], reduce_op=SUM,
                       output=np.empty_like(xi)).wait()[0]
    np.testing.assert_array_equal(got, (np.arange(n, dtype=np.int64) % 1000) * (N * (N + 1) // 2))
    n = 2_200_000  # 8.8 MB of float32: 3 chunks
    model = Model()
    got = _submit_gradient(_gradient(R, 0, "big.grad", n), "big.grad").wait()[0]
    want = model.reduce("big.grad", [_gradient(r, 0, "big.grad", n) for r in range(N)])
    kind = model.kind(n)
    rtol, atol = (2e-3, 2e-6) if kind == "fp16" and N > 2 else (2e-6, 1e-9)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=kind)


def check_plan_checks_run_only_when_enabled():
    """Runs after the gradient steps (checks run in name order).
    PERSEUS_OFFLINE_NEG_CHECK_N_STEPS=K: the ranks' plans were compared (they
    agree, so every check passed) before each plan's first step and once
    per K plan steps; unset, never."""
    st = _native.stats()
    every = int(os.environ.get("PERSEUS_OFFLINE_NEG_CHECK_N_STEPS", "0"))
    if every:
        # Each plan is checked before its first step (here the gradient steps'
        # plan is left again by the next check's different requests).
        assert st["plans"] > 0, st
        assert st["plan_checks"] >= max(st["plans"], st["offline_steps"] // every), st
    else:
        assert st["plan_checks"] == 0, st
