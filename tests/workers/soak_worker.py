"""A soak of the native runtime: random collectives, every result checked.

Run on every rank by perseusrun (tests/test_soak.py for a short run,
tools/soak.py for a long one):

    soak_worker.py STEPS SEED

Each step every rank submits, in an order of its own:
  - the step's gradients: plannable grouped allreduces (one call per dtype:
    float32, sometimes with fp16 compression, float16, bfloat16, float64,
    int32, int64), plus a few plannable single requests. About 3% of them
    have 100,000-300,000 elements (several shared-memory chunks); some have a
    zero dimension. The set (names, dtypes, shapes) is kept for a random
    number of steps, now and then about a hundred, and then changes, so
    offline plans are entered and left;
  - a random mix of online collectives: allreduce (sum, average, min, max,
    product, pre/postscale), allgather (a different first dimension per rank,
    zero included), broadcast (random root), alltoall (random splits, zero
    rows included), reducescatter, and the same on a process set.
Dtypes and shapes are random, empty tensors included. Half the calls follow
a 2 ms pause (the caller computing), so ranks reach plan buckets at
different moments. The schedule comes from
a generator every rank seeds alike; each rank's data from (seed, step, op,
rank), so every rank knows every rank's input and checks its results against
numpy. Values are small multiples of 1/2 (products: of +-1, 2, 1/2), so every
sum, in any order, is exact: results must match bit for bit, except fp16
compression, whose error must stay within FP16_BOUND of the sum of
magnitudes.

Prints "SOAK-FAIL ..." for each wrong result (the first 20) and, at the end,
"SOAK rank R steps S ops O failures F plans P plan_exits E seconds T in_place I"
(I: results checked of fused tensors of 4 MiB or more, which the runtime
reduces in place).
Exit status 1 when any result was wrong or a collective raised.
"""

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from perseus_tf import _core, _native, _testing  # noqa: E402

_testing.use_test_device()  # PERSEUS_TEST_DEVICE: every array on that device first

DT = _native.DTYPE_CODES
# Relative to the sum of magnitudes: fp16 carries 11 significant bits and
# the sum is divided by the gradient scale after.
FP16_BOUND = 2.0 ** -10
DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8", "int8", "bool"]
# Gradients as users' models make them: mostly float32, every other type that
# a grouped Sum takes, integers included.
GRADIENT_DTYPES = ["float32", "float32", "float32", "float16", "float64", "bfloat16", "int32",
                   "int64"]
# About this share of gradient tensors has 100,000-300,000 elements.
LARGE_SHARE = 0.03
# This share of gradient sets also has one tensor of 4-9.6 MB (float32,
# float64, int32 or int64; fp16 compression reduces it packed).
HUGE_SHARE = 0.25
IN_PLACE_BYTES = 4 << 20  # cc/runtime/executor.cc's kInPlaceBytes
REDUCE = {"sum": 0, "average": 1, "min": 2, "max": 3, "product": 4}


def to_bf16(x):
    """float32 array of bfloat16-exact values -> uint16 bit patterns."""
    x = np.asarray(x, np.float32)
    # Through 1-d arrays: numpy 1.x cannot view a 0-d result as another dtype.
    return (x.reshape(-1).view(np.uint32) >> 16).astype(np.uint16).reshape(x.shape)


def round_bf16(x):
    """float32 array -> the nearest bfloat16 bit patterns (ties to even), as
    the runtime rounds (cc/core/reduce.cc)."""
    x = np.asarray(x, np.float32)
    bits = x.reshape(-1).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.astype(np.uint16).reshape(x.shape)


def from_bf16(bits):
    bits = np.asarray(bits)
    return (bits.reshape(-1).astype(np.uint32) << 16).view(np.float32).reshape(bits.shape)


def values(rng, dtype, shape, op="sum"):
    # 0-d results of numpy arithmetic are scalars: make every value an array.
    return np.array(_values(rng, dtype, shape, op))


def _values(rng, dtype, shape, op):
    """Random exact values of `dtype` (numpy storage: uint16 for bfloat16)."""
    n = int(np.prod(shape))
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    if op == "product":
        pick = [1, -1, 2, 0.5] if dtype in ("float32", "float64", "float16", "bfloat16") else [1, -1, 2]
        if dtype == "uint8":
            pick = [1, 2]
        v = rng.choice(pick, n)
    elif dtype in ("uint8",):
        v = rng.integers(0, 20, n)
    elif dtype in ("int8",):
        v = rng.integers(-20, 20, n)
    elif dtype in ("int32", "int64"):
        v = rng.integers(-1000, 1000, n)
    else:
        v = rng.integers(-16, 16, n) / 2.0
    if dtype == "bfloat16":
        return to_bf16(np.asarray(v, np.float32).reshape(shape))
    return np.asarray(v).astype(dtype).reshape(shape)


def as_float(a, dtype):
    return from_bf16(a) if dtype == "bfloat16" else a


def reduce_ref(inputs, dtype, op, size, pre=1.0, post=1.0):
    """numpy reference of an allreduce over every rank's input."""
    xs = [as_float(x, dtype) for x in inputs]
    if op == "min":
        out = np.minimum.reduce(xs)
    elif op == "max":
        out = np.maximum.reduce(xs)
    elif op == "product":
        out = xs[0].copy()
        for x in xs[1:]:
            out = (out * x).astype(out.dtype)
    else:
        out = xs[0] * pre
        for x in xs[1:]:
            out = out + x * pre
        out = out.astype(xs[0].dtype)
        # Scaled after the sum by post (times 1/size for an average), as the
        # runtime does (ScaleBuffer): integers in double and truncated,
        # float32 and float64 by the factor in their own type, 16-bit floats
        # through float32 times the factor in double. (Dividing instead
        # rounds differently where 1/size is inexact: 3 ranks.)
        factor = post * (1.0 / size) if op == "average" else post
        if out.dtype.kind != "f":
            out = np.trunc(out.astype(np.float64) * factor).astype(out.dtype)
        elif dtype in ("bfloat16", "float16"):
            out = (out.astype(np.float32).astype(np.float64) * factor).astype(np.float32)
            out = out.astype(xs[0].dtype)
        else:
            out = (out * out.dtype.type(factor)).astype(xs[0].dtype)
    if dtype == "bfloat16":
        return np.array(round_bf16(out))
    return np.array(out.astype(inputs[0].dtype))


class Soak:
    def __init__(self, steps, seed):
        _native.init()
        topo = _core.topology()
        self.rank, self.size = topo["rank"], topo["size"]
        self.steps, self.seed = steps, seed
        self.shared = np.random.default_rng(seed)          # same on every rank
        self.own = np.random.default_rng(seed * 7919 + self.rank + 1)  # this rank's order
        self.failures, self.ops, self.reported = 0, 0, 0
        self.huge_drawn, self.in_place = False, 0
        self.gradient_set = None
        self.set_left = 0
        # A process set of half the ranks (at least two), added collectively.
        self.members = list(range(0, self.size, 2)) if self.size >= 4 else [0, 1]
        self.pset = _native.add_process_set(self.members)

    def data(self, step, op, rank, dtype, shape, kind="sum"):
        rng = np.random.default_rng([self.seed, step, op, rank])
        return values(rng, dtype, shape, kind)

    def fail(self, step, what, got, want):
        self.failures += 1
        if self.reported < 20:
            self.reported += 1
            print(f"SOAK-FAIL rank {self.rank} step {step}: {what}: got {np.ravel(got)[:8]} "
                  f"want {np.ravel(want)[:8]}", flush=True)

    def check_equal(self, step, what, got, want):
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
            self.fail(step, what + f" ({got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)})",
                      got, want)

    # -- the schedule (identical on every rank) ----------------------------------

    def shape(self, allow_empty=True, min_rank=0):
        r = self.shared
        ndim = int(r.integers(min_rank, 4))
        dims = [int(r.integers(0 if allow_empty and r.random() < 0.1 else 1, 9)) for _ in range(ndim)]
        return tuple(dims)

    def new_gradient_set(self, step):
        r = self.shared
        tensors = []
        for i in range(int(r.integers(1, 31))):
            dtype = str(r.choice(GRADIENT_DTYPES))
            draw = r.random()
            if draw < LARGE_SHARE:  # several shared-memory chunks, fused or alone
                shape = (int(r.integers(100_000, 300_001)),)
            elif draw < 0.12:
                shape = (int(r.integers(100, 20000)),)
            else:
                shape = self.shape(min_rank=1)
            tensors.append((f"grad.s{step}.t{i}", dtype, shape))
        if not self.huge_drawn or r.random() < HUGE_SHARE:
            # The runtime reduces a fused tensor of 4 MiB or more in place,
            # after the packed rest of its bucket: one such tensor, at a
            # random place in the set (the first set always has one).
            dtype = str(r.choice(["float32", "float64", "int32", "int64"]))
            at = int(r.integers(0, len(tensors) + 1))
            tensors.insert(at, (f"grad.s{step}.huge", dtype, (int(r.integers(1_050_000, 1_200_001)),)))
            self.huge_drawn = True
        fp16 = bool(r.random() < 0.3)
        singles = int(r.integers(0, 3))
        # Mostly short-lived sets (plans entered and left often), sometimes
        # one kept for a hundred steps (long runs from one plan).
        self.set_left = int(r.integers(3, 40)) if r.random() < 0.8 else int(r.integers(80, 130))
        return tensors, fp16, singles

    def online_ops(self, step):
        r = self.shared
        ops = []
        for j in range(int(r.integers(0, 6))):
            kind = str(r.choice(["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]))
            dtype = str(r.choice(DTYPES))
            on_set = bool(r.random() < 0.2)
            ops.append((j, kind, dtype, on_set))
        return ops

    # -- one step ------------------------------------------------------------------

    def step(self, step):
        if self.gradient_set is None or self.set_left == 0:
            self.gradient_set = self.new_gradient_set(step)
        self.set_left -= 1
        tensors, fp16, singles = self.gradient_set
        online = self.online_ops(step)
        work = []  # (submit function, check function)
        # Gradients: one grouped call per dtype, the last `singles` tensors alone.
        grouped, alone = tensors[:len(tensors) - singles] or tensors, tensors[len(tensors) - singles:]
        if len(grouped) == len(tensors):
            alone = []
        by_dtype = {}
        for i, (name, dtype, shape) in enumerate(grouped):
            by_dtype.setdefault(dtype, []).append((i, name, shape))
        for dtype, members in by_dtype.items():
            work.append(self.gradient_group(step, dtype, members, fp16 and dtype == "float32"))
        for i, (name, dtype, shape) in enumerate(alone):
            work.append(self.gradient_group(step, dtype, [(100 + i, name, shape)], False, single=True))
        for j, kind, dtype, on_set in online:
            # Every rank draws the op (the schedule stays the same everywhere);
            # only the set's members submit it.
            op = getattr(self, kind)(step, j, dtype, on_set)
            if not on_set or self.rank in self.members:
                work.append(op)
        order = self.own.permutation(len(work))
        handles = []
        for k in order:
            submit, check = work[k]
            if self.own.random() < 0.5:
                # The caller computes between its calls (as a backward pass
                # does between gradients): a plan step learned mid-call then
                # starts and ends mid-call, and ranks reach its buckets at
                # different moments.
                time.sleep(0.002)
            handles.append((submit(), check))
        for handle, check in handles:
            try:
                out = handle.wait()
            except Exception as e:  # noqa: BLE001 - a collective must not raise here
                self.fail(step, f"raised {type(e).__name__}: {e}", np.zeros(0), np.zeros(0))
                continue
            check(out)
            self.ops += 1

    def gradient_group(self, step, dtype, members, fp16, single=False):
        code = _native.COMPRESS_FP16 if fp16 else _native.COMPRESS_NONE
        inputs = {i: [self.data(step, 1000 + i, q, dtype, shape) for q in range(self.size)]
                  for i, _, shape in members}
        arrays = [inputs[i][self.rank].copy() for i, _, _ in members]
        names = [name for _, name, _ in members]

        def submit():
            if single:
                return _core.submit(_native.OP_ALLREDUCE, arrays[0], names[0], DT[dtype],
                                    output=arrays[0], compression=code, plannable=True)
            return _core.submit_group(arrays, names, DT[dtype], compression=code, plannable=True)

        def check(_):
            for (i, name, _), got in zip(members, arrays):
                want = reduce_ref(inputs[i], dtype, "sum", self.size)
                if fp16:
                    exact = np.sum([np.abs(x) for x in inputs[i]], axis=0)
                    if np.any(np.abs(got - want) > FP16_BOUND * exact + 1e-6):
                        self.fail(step, f"fp16 gradient {name}", got, want)
                else:
                    self.check_equal(step, f"gradient {name} {dtype}", got, want)
                    self.in_place += got.nbytes >= IN_PLACE_BYTES
        return submit, check

    def online_name(self, kind, step, j):
        """Half the online collectives reuse a name from earlier steps (with
        another dtype and shape), as a training loop's metrics do."""
        if self.shared.random() < 0.5:
            return f"{kind}.{j}"
        return f"{kind}.{step}.{j}"

    def group_of(self, on_set):
        if not on_set:
            return list(range(self.size)), self.rank
        # A rank outside the set draws the op like the others and drops it.
        return self.members, self.members.index(self.rank) if self.rank in self.members else 0

    def allreduce(self, step, j, dtype, on_set):
        ranks, me = self.group_of(on_set)
        r = self.shared
        kinds = ["min", "max"] if dtype == "bool" else list(REDUCE)
        op = str(r.choice(kinds))
        pre, post = (float(r.choice([1.0, 0.5, 2.0])), float(r.choice([1.0, 0.25, 4.0]))) \
            if op in ("sum", "average") and dtype not in ("bool",) and dtype[0] == "f" else (1.0, 1.0)
        shape = self.shape()
        inputs = [self.data(step, j, q, dtype, shape, op) for q in ranks]
        x = inputs[me].copy()
        name = self.online_name("ar", step, j)

        def submit():
            return _core.submit(_native.OP_ALLREDUCE, x, name, DT[dtype], reduce_op=REDUCE[op],
                                prescale=pre, postscale=post, output=x,
                                process_set=self.pset if on_set else 0)

        def check(_):
            self.check_equal(step, f"allreduce {op} {dtype} pre {pre} post {post}", x,
                             reduce_ref(inputs, dtype, op, len(ranks), pre, post))
        return submit, check

    def allgather(self, step, j, dtype, on_set):
        ranks, me = self.group_of(on_set)
        trailing = self.shape()
        firsts = [int(self.shared.integers(0, 5)) for _ in ranks]
        inputs = [self.data(step, j, q, dtype, (firsts[k],) + trailing)
                  for k, q in enumerate(ranks)]
        name = self.online_name("ag", step, j)

        def submit():
            return _core.submit(_native.OP_ALLGATHER, inputs[me], name, DT[dtype],
                                process_set=self.pset if on_set else 0)

        def check(out):
            self.check_equal(step, f"allgather {dtype}", out[0], np.concatenate(inputs, axis=0))
        return submit, check

    def broadcast(self, step, j, dtype, on_set):
        ranks, me = self.group_of(on_set)
        root = int(self.shared.integers(0, len(ranks)))
        shape = self.shape()
        inputs = [self.data(step, j, q, dtype, shape) for q in ranks]
        x = inputs[me].copy()
        name = self.online_name("bc", step, j)

        def submit():
            return _core.submit(_native.OP_BROADCAST, x, name, DT[dtype], root=root, output=x,
                                process_set=self.pset if on_set else 0)

        def check(_):
            self.check_equal(step, f"broadcast {dtype} root {root}", x, inputs[root])
        return submit, check

    def alltoall(self, step, j, dtype, on_set):
        ranks, me = self.group_of(on_set)
        n = len(ranks)
        trailing = self.shape()
        splits = [[int(self.shared.integers(0, 4)) for _ in range(n)] for _ in range(n)]
        inputs = [self.data(step, j, q, dtype, (sum(splits[k]),) + trailing)
                  for k, q in enumerate(ranks)]
        name = self.online_name("a2a", step, j)

        def submit():
            return _core.submit(_native.OP_ALLTOALL, inputs[me], name, DT[dtype],
                                splits=splits[me], process_set=self.pset if on_set else 0)

        def check(out):
            parts = []
            for k in range(n):
                start = sum(splits[k][:me])
                parts.append(inputs[k][start:start + splits[k][me]])
            self.check_equal(step, f"alltoall {dtype}", out[0], np.concatenate(parts, axis=0))
            if list(out[1]) != [splits[k][me] for k in range(n)]:
                self.fail(step, "alltoall received splits", np.array(out[1]),
                          np.array([splits[k][me] for k in range(n)]))
        return submit, check

    def reducescatter(self, step, j, dtype, on_set):
        ranks, me = self.group_of(on_set)
        n = len(ranks)
        if dtype == "bool":
            dtype = "int32"
        rows = int(self.shared.integers(0, 3 * n + 2))
        shape = (rows,) + self.shape()
        inputs = [self.data(step, j, q, dtype, shape) for q in ranks]
        name = self.online_name("rs", step, j)

        def submit():
            return _core.submit(_native.OP_REDUCESCATTER, inputs[me], name, DT[dtype],
                                process_set=self.pset if on_set else 0)

        def check(out):
            total = reduce_ref(inputs, dtype, "sum", n)
            base, extra = divmod(rows, n)
            start = me * base + min(me, extra)
            mine = base + (1 if me < extra else 0)
            self.check_equal(step, f"reducescatter {dtype}", out[0], total[start:start + mine])
        return submit, check

    def run(self):
        start = time.time()
        for step in range(self.steps):
            self.step(step)
            if self.rank == 0 and step and step % 1000 == 0:
                print(f"SOAK progress step {step} failures {self.failures} "
                      f"{time.time() - start:.0f} s", flush=True)
        st = _core.stats()
        print(f"SOAK rank {self.rank} steps {self.steps} ops {self.ops} failures {self.failures} "
              f"plans {st['plans']} plan_exits {st['plan_exits']} offline_steps "
              f"{st['offline_steps']} seconds {time.time() - start:.1f} in_place {self.in_place}",
              flush=True)
        _native.shutdown()
        return self.failures


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    sys.exit(1 if Soak(steps, seed).run() else 0)
