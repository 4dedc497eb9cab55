"""TF's GPU kernels of the Perseus ops, run on each rank through the C++
harness (tools/tf_gpu_harness.cc): kernel creation and memory types for
DEVICE_GPU, then allreduce (sum, average), grouped allreduce, broadcast,
allgather, alltoall and reducescatter with a slow producer on TF's stream and
outputs handed blocks that a queued write still targets; results against
numpy. No TensorFlow Python: the runtime starts through perseus_tf._core.

    perseusrun -np N -- python tools/tf_gpu_harness.py HARNESS.so [OP_LIBRARY.so]

CUDA is the driver's (a GPU machine) or the stand-in of cc/testing/
fake_cuda.cc named in PERSEUS_CUDA_DRIVER (CI). Prints "ok"/"FAIL" lines,
exits 1 when any check failed.
"""

import ctypes
import glob
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from perseus_tf import _native  # noqa: E402

FLOAT, INT32 = 1, 3
FAILED = []


class HarnessTensor(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("rank", ctypes.c_int32),
                ("dims", ctypes.c_int64 * 4), ("host", ctypes.c_void_p),
                ("capacity", ctypes.c_int64)]


def report(name, ok, detail=""):
    print(f"rank {R}: {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}",
          flush=True)
    if not ok:
        FAILED.append(name)


def tensor_in(a):
    t = HarnessTensor()
    t.dtype = INT32 if a.dtype == np.int32 else FLOAT
    t.rank = a.ndim
    for i, d in enumerate(a.shape):
        t.dims[i] = d
    t.host = a.ctypes.data
    t.capacity = a.nbytes
    return t


def run(op, attrs, inputs, out_capacity):
    """Runs op on the stand-in GPU; returns its outputs as numpy arrays."""
    inputs = [np.ascontiguousarray(a) for a in inputs]
    ins = (HarnessTensor * len(inputs))(*[tensor_in(a) for a in inputs])
    buffers = [np.zeros(cap, np.uint8) for cap, _ in out_capacity]
    outs = (HarnessTensor * len(buffers))()
    for i, b in enumerate(buffers):
        outs[i].host = b.ctypes.data
        outs[i].capacity = b.nbytes
    err = ctypes.create_string_buffer(8192)
    rc = LIB.harness_run(op.encode(), attrs.encode(), len(inputs), ins, len(buffers), outs,
                         2000, 1, ctypes.c_double(120.0), err, ctypes.c_size_t(len(err)))
    if rc != 0:
        raise RuntimeError(err.value.decode())
    result = []
    for i, (b, (_, dtype)) in enumerate(zip(buffers, out_capacity)):
        shape = tuple(outs[i].dims[d] for d in range(outs[i].rank))
        n = int(np.prod(shape)) if shape else 1
        result.append(b.view(dtype)[:n].reshape(shape))
    return result


def data(rank, shape, seed):
    rng = np.random.default_rng(seed + 1000 * rank)
    return rng.integers(-8, 9, size=shape).astype(np.float32)


def check(name, fn):
    try:
        ok, detail = fn()
    except Exception as e:  # noqa: BLE001: reported per check
        ok, detail = False, f"{type(e).__name__}: {e}"
    report(name, ok, detail)


def kernel_info():
    expected = {"PerseusAllreduce": ([FLOAT], "D/D async"),
                "PerseusGroupedAllreduce": ([FLOAT, FLOAT], "DD/DD async"),
                "PerseusBroadcast": ([FLOAT], "D/D async"),
                "PerseusAllgather": ([FLOAT], "D/D async"),
                "PerseusAlltoall": ([FLOAT, INT32], "DH/DH async"),
                "PerseusReducescatter": ([FLOAT], "D/D async")}
    for op, (dtypes, want) in expected.items():
        out = ctypes.create_string_buffer(256)
        err = ctypes.create_string_buffer(4096)
        arr = (ctypes.c_int32 * len(dtypes))(*dtypes)
        rc = LIB.harness_kernel_info(op.encode(), b"", len(dtypes), arr, out,
                                     ctypes.c_size_t(256), err, ctypes.c_size_t(4096))
        got = out.value.decode() if rc == 0 else err.value.decode()
        report(f"{op}: DEVICE_GPU kernel created, memory types", rc == 0 and got == want, got)


def main():
    global LIB, R
    harness = sys.argv[1]
    ops = sys.argv[2] if len(sys.argv) > 2 else sorted(
        glob.glob(os.path.join(ROOT, "perseus_tf", "_perseus_ops_tf*.so")))[-1]
    _native.init()
    topo = _native.topology()
    R, N = topo["rank"], topo["size"]
    # "local": the rank's local rank (a GPU per rank, as on a machine of several).
    which = os.environ.get("PERSEUS_TEST_HARNESS_GPU", "0")
    gpu = topo["local_rank"] if which == "local" else int(which)
    LIB = ctypes.CDLL(harness)
    LIB.harness_reused_blocks.restype = ctypes.c_int
    err = ctypes.create_string_buffer(4096)
    rc = LIB.harness_init(ops.encode(), os.path.join(ROOT, "perseus_tf", "libperseus_cuda.so")
                          .encode(), gpu, err, ctypes.c_size_t(4096))
    if rc != 0:
        print(f"rank {R}: FAIL harness_init: {err.value.decode()}", flush=True)
        return 1
    kernel_info()
    n = 3000

    def allreduce(op, name):
        x = data(R, (n,), 1)
        (y,) = run("PerseusAllreduce", f"tensor_name=s:{name};reduce_op=i:{op}", [x],
                   [(x.nbytes, np.float32)])
        total = sum(data(r, (n,), 1) for r in range(N))
        want = total / N if op == 1 else total
        return np.array_equal(y, want.astype(np.float32)), ""

    check("allreduce sum", lambda: allreduce(0, "h.sum"))
    check("allreduce average", lambda: allreduce(1, "h.avg"))

    def grouped():
        shapes = [(7,), (500, 3), (1,)]
        xs = [data(R, s, 10 + i) for i, s in enumerate(shapes)]
        ys = run("PerseusGroupedAllreduce", "tensor_name=s:h.group", xs,
                 [(x.nbytes, np.float32) for x in xs])
        ok = all(np.array_equal(y, sum(data(r, s, 10 + i) for r in range(N)))
                 for i, (y, s) in enumerate(zip(ys, shapes)))
        return ok, ""

    check("grouped allreduce", grouped)

    def broadcast():
        root = N - 1
        x = data(R, (40, 5), 3)
        (y,) = run("PerseusBroadcast", f"tensor_name=s:h.bcast;root_rank=i:{root}", [x],
                   [(x.nbytes, np.float32)])
        return np.array_equal(y, data(root, (40, 5), 3)), ""

    check("broadcast from the last rank", broadcast)

    def allgather():
        x = data(R, (R + 1, 3), 4)  # a different first dimension on each rank
        total_rows = sum(r + 1 for r in range(N))
        (y,) = run("PerseusAllgather", "tensor_name=s:h.gather", [x],
                   [(total_rows * 3 * 4, np.float32)])
        want = np.concatenate([data(r, (r + 1, 3), 4) for r in range(N)])
        return y.shape == want.shape and np.array_equal(y, want), str(y.shape)

    check("allgather of different sizes", allgather)

    def alltoall():
        # Rank r sends (r + i) % 3 + 1 rows to rank i.
        sends = [(R + i) % 3 + 1 for i in range(N)]
        x = data(R, (sum(sends), 2), 5)
        splits = np.array(sends, np.int32)
        gets = [(r + R) % 3 + 1 for r in range(N)]
        y, received = run("PerseusAlltoall", "tensor_name=s:h.a2a;has_splits=b:true",
                          [x, splits], [(sum(gets) * 2 * 4, np.float32), (N * 4, np.int32)])
        pieces = []
        for r in range(N):
            theirs = [(r + i) % 3 + 1 for i in range(N)]
            start = sum(theirs[:R])
            pieces.append(data(r, (sum(theirs), 2), 5)[start:start + theirs[R]])
        want = np.concatenate(pieces)
        return (np.array_equal(y, want) and list(received) == gets), f"{y.shape} {list(received)}"

    check("alltoall with splits (host memory)", alltoall)

    def reducescatter():
        x = data(R, (2 * N, 3), 6)
        (y,) = run("PerseusReducescatter", "tensor_name=s:h.rs", [x], [(2 * 3 * 4, np.float32)])
        total = sum(data(r, (2 * N, 3), 6) for r in range(N))
        return np.array_equal(y, total[2 * R:2 * R + 2]), str(y.shape)

    check("reducescatter", reducescatter)
    report("outputs were handed freed blocks still being written",
           LIB.harness_reused_blocks() > 0, f"{LIB.harness_reused_blocks()} reused")
    _native.shutdown()
    print(f"rank {R}: {len(FAILED)} failed" + (": " + ", ".join(FAILED) if FAILED else ""),
          flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
