"""Checks on a machine with an NVIDIA GPU (no TensorFlow needed): the CUDA
kernels of cc/cuda against numpy, through ctypes and CuPy device arrays, and
NCCL as the runtime loads it.

    python tools/gpu_check.py [--lib perseus_tf/libperseus_cuda.so]

Prints one line per check ("ok"/"FAIL" and what was compared) and exits
non-zero when any failed. Needs numpy, CuPy, the built libperseus_cuda.so
(tools/build_native.py, or pip install) and NVRTC (PERSEUS_NVRTC_LIBRARY,
or found as the library looks for it): the kernels are compiled for this
GPU at the first launch. Without a GPU it says so and exits 2.
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAILED = []


def report(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def load(path):
    lib = ctypes.CDLL(path)
    p, sz, f32, f64, i32 = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_float, ctypes.c_double,
                            ctypes.c_int)
    sig = {
        "perseus_cuda_to_half": [p, p, sz, f32, p],
        "perseus_cuda_from_half": [p, p, sz, f32, p],
        "perseus_cuda_scale": [p, i32, sz, f64, p],
        "perseus_cuda_sum_chunks": [p, i32, p, sz, p],
        "perseus_cuda_nonfinite": [p, i32, sz, p, p],
        "perseus_cuda_batched_copy": [p, i32, p],
        "perseus_cuda_topk": [p, p, sz, sz, f32, p, p, p, p],
        "perseus_cuda_exclusive_sum": [p, p, sz, p, p],
    }
    for name, args in sig.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = i32
    lib.perseus_cuda_topk_scratch_bytes.argtypes = [sz]
    lib.perseus_cuda_topk_scratch_bytes.restype = sz
    lib.perseus_cuda_scan_scratch_bytes.argtypes = [sz]
    lib.perseus_cuda_scan_scratch_bytes.restype = sz
    lib.perseus_cuda_error_string.argtypes = [i32]
    lib.perseus_cuda_error_string.restype = ctypes.c_char_p
    return lib


def check_kernels(lib, cp, emulated=False):
    rng = np.random.default_rng(7)
    stream = cp.cuda.Stream(non_blocking=True)
    stream.use()  # CuPy's own copies and fills too, so each kernel comes after them
    s = stream.ptr
    ptr = lambda a: ctypes.c_void_p(a.data.ptr)  # noqa: E731
    # The first launch compiles the kernels for this GPU with NVRTC (or reads the cache).
    one = cp.zeros(1, cp.float32)
    half = cp.zeros(1, cp.uint16)
    rc = lib.perseus_cuda_to_half(ptr(one), ptr(half), 1, 1.0, ctypes.c_void_p(s))
    stream.synchronize()
    report("kernels compiled by NVRTC and loaded for this GPU", rc == 0,
           "" if rc == 0 else lib.perseus_cuda_error_string(rc).decode())

    for n in (0, 1, 1000, 3_000_001):
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        dx = cp.asarray(x)
        dh = cp.empty(n, cp.uint16)
        rc = lib.perseus_cuda_to_half(ptr(dx), ptr(dh), n, 10.0, ctypes.c_void_p(s))
        stream.synchronize()
        want = (x * np.float32(10)).astype(np.float16).view(np.uint16)
        report(f"to_half n={n}", rc == 0 and np.array_equal(cp.asnumpy(dh), want))
        dy = cp.empty(n, cp.float32)
        rc = lib.perseus_cuda_from_half(ptr(dh), ptr(dy), n, 0.1, ctypes.c_void_p(s))
        stream.synchronize()
        want_y = want.view(np.float16).astype(np.float32) * np.float32(0.1)
        report(f"from_half n={n}", rc == 0 and np.array_equal(cp.asnumpy(dy), want_y))

    # Arrays that start off a 16-byte boundary take the one-element path.
    x = (rng.standard_normal(1003) * 3).astype(np.float32)
    dx = cp.asarray(np.concatenate([[0], x]).astype(np.float32))[1:]
    dh = cp.zeros(1004, cp.uint16)[1:]
    rc = lib.perseus_cuda_to_half(ptr(dx), ptr(dh), 1003, 10.0, ctypes.c_void_p(s))
    stream.synchronize()
    want = (x * np.float32(10)).astype(np.float16).view(np.uint16)
    report("to_half misaligned", rc == 0 and np.array_equal(cp.asnumpy(dh), want))
    rc = lib.perseus_cuda_scale(ptr(dx), 2, 1003, 0.3, ctypes.c_void_p(s))
    stream.synchronize()
    report("scale float32 misaligned",
           rc == 0 and np.array_equal(cp.asnumpy(dx), x * np.float32(0.3)))

    for dtype, code in ((np.float32, 2), (np.float64, 3), (np.int32, 4), (np.int64, 5)):
        x = (rng.standard_normal(1001) * 100).astype(dtype)
        dx = cp.asarray(x)
        rc = lib.perseus_cuda_scale(ptr(dx), code, x.size, 0.3, ctypes.c_void_p(s))
        stream.synchronize()
        if np.issubdtype(dtype, np.integer):
            want = np.trunc(x.astype(np.float64) * 0.3).astype(dtype)
            ok = np.array_equal(cp.asnumpy(dx), want)
        else:
            ok = np.allclose(cp.asnumpy(dx), x * 0.3, rtol=1e-6)
        report(f"scale {np.dtype(dtype).name}", rc == 0 and ok)

    # The 16-bit floats and the small integers, as the host scales them: a
    # double product, rounded to float, then to the 16-bit type (nearest even).
    for name, code in (("float16", 0), ("bfloat16", 1), ("uint8", 6), ("int8", 7),
                       ("uint16", 9), ("int16", 10)):
        if name == "bfloat16":
            x = (rng.standard_normal(1001) * 100).astype(np.float32)
            bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # truncated: exact bf16 values
            vals = (bits.astype(np.uint32) << 16).view(np.float32)
            want = _to_bfloat16((vals.astype(np.float64) * 0.3).astype(np.float32))
            dx = cp.asarray(bits)
        elif name == "float16":
            x = (rng.standard_normal(1001) * 100).astype(np.float16)
            want = (x.astype(np.float64) * 0.3).astype(np.float32).astype(np.float16).view(
                np.uint16)
            dx = cp.asarray(x.view(np.uint16))
        else:
            info = np.iinfo(name)
            x = rng.integers(info.min, info.max, 1001, endpoint=True).astype(name)
            want = np.trunc(x.astype(np.float64) * 0.3).astype(name)
            dx = cp.asarray(x)
        rc = lib.perseus_cuda_scale(ptr(dx), code, 1001, 0.3, ctypes.c_void_p(s))
        stream.synchronize()
        got = cp.asnumpy(dx)
        report(f"scale {name}", rc == 0 and np.array_equal(got.view(want.dtype), want),
               "" if rc == 0 else lib.perseus_cuda_error_string(rc).decode())

    chunks = [cp.asarray(rng.standard_normal(5000).astype(np.float32)) for _ in range(4)]
    table = cp.asarray(np.array([c.data.ptr for c in chunks], np.uint64))
    out = cp.empty(5000, cp.float32)
    rc = lib.perseus_cuda_sum_chunks(ptr(table), 4, ptr(out), 5000, ctypes.c_void_p(s))
    stream.synchronize()
    host = [cp.asnumpy(c) for c in chunks]
    want = ((host[0] + host[1]) + host[2]) + host[3]
    report("sum_chunks (chunk order)", rc == 0 and np.array_equal(cp.asnumpy(out), want))

    for dtype, kind in ((np.float32, 0), (np.float16, 1), (np.float64, 2)):
        for bad in (None, np.nan, np.inf):
            x = np.ones(70001, dtype)
            if bad is not None:
                x[69999] = bad
            flag = cp.zeros(1, cp.int32)
            dx = cp.asarray(x)  # held until the kernel ran
            rc = lib.perseus_cuda_nonfinite(ptr(dx), kind, x.size, ptr(flag),
                                            ctypes.c_void_p(s))
            stream.synchronize()
            report(f"nonfinite {np.dtype(dtype).name} {bad}",
                   rc == 0 and int(flag.get()[0]) == (0 if bad is None else 1))

    sizes = [0, 1, 15, 16, 17, 4096, 1 << 20, 333]
    srcs = [cp.asarray(rng.integers(0, 255, n, dtype=np.uint8)) for n in sizes]
    dst = cp.zeros(sum(sizes) + 3, cp.uint8)
    spans, at = [], 3  # a misaligned start
    for src, n in zip(srcs, sizes):
        spans += [src.data.ptr, dst.data.ptr + at, n]
        at += n
    dspans = cp.asarray(np.array(spans, np.uint64))
    rc = lib.perseus_cuda_batched_copy(ptr(dspans), len(sizes), ctypes.c_void_p(s))
    stream.synchronize()
    want = np.concatenate([np.zeros(3, np.uint8)] + [cp.asnumpy(x) for x in srcs])
    report("batched_copy (8 spans, unaligned)", rc == 0 and np.array_equal(cp.asnumpy(dst), want))
    # One large aligned span with a ragged end (shared among the blocks), and
    # more spans than blocks (whole spans per block); then ends at offsets
    # (source, destination) that allow 16-byte words after a head, 8, 4, 2
    # or 1-byte words.
    cases = [([(5 << 20) + 7], 0, 0), ([3] * 1500, 0, 0)]
    cases += [([100_003, 17, 4096], so, do) for so, do in
              ((3, 3), (8, 0), (0, 4), (4, 8), (2, 6), (1, 0))]
    for sizes, so, do in cases:
        srcs = [cp.asarray(rng.integers(0, 255, n + 16, dtype=np.uint8)) for n in sizes]
        dsts = [cp.zeros(n + 16, cp.uint8) for n in sizes]
        table = cp.asarray(np.array([v for a, b, n in zip(srcs, dsts, sizes)
                                     for v in (a.data.ptr + so, b.data.ptr + do, n)], np.uint64))
        rc = lib.perseus_cuda_batched_copy(ptr(table), len(sizes), ctypes.c_void_p(s))
        stream.synchronize()
        ok = rc == 0
        for a, b, n in zip(srcs, dsts, sizes):
            want = np.zeros(n + 16, np.uint8)
            want[do:do + n] = cp.asnumpy(a)[so:so + n]
            ok = ok and np.array_equal(cp.asnumpy(b), want)
        report(f"batched_copy ({len(sizes)} span(s) of {sizes[0]} bytes, offsets {so}/{do})", ok)

    # One tile, one block, many of each (the CPU emulation runs each thread of
    # the scan's blocks as an OS thread: the largest takes minutes there).
    for n in (1, 255, 1025, 70_001) + (() if emulated else (3_000_001,)):
        flags = (rng.random(n) < 0.3).astype(np.uint32)
        dflags, dout = cp.asarray(flags), cp.empty(n, cp.uint32)
        scratch = cp.empty(lib.perseus_cuda_scan_scratch_bytes(n), cp.uint8)
        rc = lib.perseus_cuda_exclusive_sum(ptr(dflags), ptr(dout), n, ptr(scratch),
                                            ctypes.c_void_p(s))
        stream.synchronize()
        want = np.concatenate([[0], np.cumsum(flags)[:-1]]).astype(np.uint32)
        report(f"exclusive_sum n={n}", rc == 0 and np.array_equal(cp.asnumpy(dout), want),
               "" if rc == 0 else lib.perseus_cuda_error_string(rc).decode())

    # prescale 0.1 is not a power of two: a fused multiply-add would round
    # grad * prescale + residual once, the host rounds twice.
    for n, k, prescale in ((10, 3, 2.0), (100_000, 5_000, 2.0), (1000, 1000, 2.0),
                           (100_000, 5_000, 0.1)):
        g = rng.standard_normal(n).astype(np.float32)
        g[:4] = 0.5  # ties
        res = rng.standard_normal(n).astype(np.float32) * 0.1
        dg, dres = cp.asarray(g), cp.asarray(res)
        idx = cp.empty(k, cp.int32)
        val = cp.empty(k, cp.float32)
        scratch = cp.empty(lib.perseus_cuda_topk_scratch_bytes(n), cp.uint8)
        rc = lib.perseus_cuda_topk(ptr(dg), ptr(dres), n, k, prescale, ptr(idx), ptr(val),
                                   ptr(scratch), ctypes.c_void_p(s))
        stream.synchronize()
        acc = g * np.float32(prescale) + res
        order = np.lexsort((np.arange(n), -np.abs(acc)))  # |acc| descending, ties by index
        chosen = np.sort(order[:k])
        want_res = acc.copy()
        want_res[chosen] = 0
        ok = (rc == 0 and np.array_equal(cp.asnumpy(idx), chosen) and
              np.array_equal(cp.asnumpy(val), acc[chosen]) and
              np.array_equal(cp.asnumpy(dres), want_res))
        report(f"topk n={n} k={k} prescale {prescale}", ok)


def _to_bfloat16(x):
    """float32 to bfloat16 bits, nearest even (ml_dtypes where it is installed)."""
    try:
        import ml_dtypes
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)
    except ImportError:
        b = x.view(np.uint32).astype(np.uint64)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def bench_kernels(lib, cp):
    """The kernels' bandwidth against the device's own copy (bytes read and
    written per second), 256 MiB of float32."""
    n = 64 << 20
    stream = cp.cuda.Stream(non_blocking=True)
    stream.use()
    s = ctypes.c_void_p(stream.ptr)
    ptr = lambda a: ctypes.c_void_p(a.data.ptr)  # noqa: E731
    x, y = cp.ones(n, cp.float32), cp.empty(n, cp.float32)
    h = cp.empty(n, cp.uint16)
    spans = cp.asarray(np.array([x.data.ptr, y.data.ptr, 4 * n], np.uint64))

    def timed(fn, repeat=20):
        fn()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(repeat):
            fn()
        end.record(stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / repeat

    copy_ms = timed(lambda: y.__setitem__(Ellipsis, x))
    rows = [("device copy (CuPy)", copy_ms, 8 * n)]
    rows.append(("to_half", timed(lambda: lib.perseus_cuda_to_half(ptr(x), ptr(h), n, 1.0, s)),
                 6 * n))
    rows.append(("from_half",
                 timed(lambda: lib.perseus_cuda_from_half(ptr(h), ptr(y), n, 1.0, s)), 6 * n))
    rows.append(("scale float32", timed(lambda: lib.perseus_cuda_scale(ptr(y), 2, n, 0.5, s)),
                 8 * n))
    rows.append(("batched_copy (1 span)",
                 timed(lambda: lib.perseus_cuda_batched_copy(ptr(spans), 1, s)), 8 * n))
    # A float32 tensor packed after an odd count of others: 4-byte aligned.
    spans4 = cp.asarray(np.array([x.data.ptr, y.data.ptr + 4, 4 * n - 16], np.uint64))
    rows.append(("batched_copy (destination 4 bytes off)",
                 timed(lambda: lib.perseus_cuda_batched_copy(ptr(spans4), 1, s)), 8 * n))
    flag = cp.zeros(1, cp.int32)
    rows.append(("nonfinite float32",
                 timed(lambda: lib.perseus_cuda_nonfinite(ptr(x), 0, n, ptr(flag), s)), 4 * n))
    copy_gbs = 8 * n / copy_ms / 1e6
    print("\nKernels against the device copy, 256 MiB of float32 (bytes read + written)")
    print("| kernel | ms | GB/s | / device copy |")
    print("|---|---|---|---|")
    for name, ms, moved in rows:
        gbs = moved / ms / 1e6
        print(f"| {name} | {ms:.3f} | {gbs:.0f} | {gbs / copy_gbs:.2f} |")


def check_nccl():
    code = ("import json; from perseus_tf import _native; "
            "print(json.dumps(_native.nccl_library()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode != 0:
        report("nccl_library", False, proc.stderr.strip().splitlines()[-1:][0]
               if proc.stderr.strip() else "failed")
        return
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    report("nccl_library", info["available"], json.dumps(info))


class _HostArray(np.ndarray):
    """A numpy array that answers `.data.ptr` as CuPy's do (--emulated)."""

    @property
    def data(self):
        class Ptr:
            ptr = self.ctypes.data
        return Ptr()

    def get(self):
        return np.array(self).view(np.ndarray)


class _HostStream:
    ptr = 0

    def __init__(self, non_blocking=False):
        pass

    def use(self):
        pass

    def synchronize(self):
        pass


class _EmulatedCupy:
    """What check_kernels uses of CuPy, over host memory: with the stand-in
    driver (cc/testing/fake_cuda.cc, PERSEUS_CUDA_DRIVER) the kernels run on
    the CPU and read and write these arrays directly."""
    float16, float32, float64 = np.float16, np.float32, np.float64
    int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
    uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64

    class cuda:
        Stream = _HostStream

    @staticmethod
    def asarray(a, dtype=None):
        return np.array(a, dtype=dtype, copy=True).view(_HostArray)

    @staticmethod
    def empty(shape, dtype=np.float32):
        return np.empty(shape, dtype).view(_HostArray)

    @staticmethod
    def zeros(shape, dtype=np.float32):
        return np.zeros(shape, dtype).view(_HostArray)

    @staticmethod
    def asnumpy(a):
        return np.array(a).view(np.ndarray)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", default=os.path.join(ROOT, "perseus_tf", "libperseus_cuda.so"))
    parser.add_argument("--emulated", action="store_true",
                        help="the kernels on the CPU, through the stand-in CUDA driver named "
                             "in PERSEUS_CUDA_DRIVER (tests/test_cuda.py): no GPU, no CuPy")
    args = parser.parse_args()
    if args.emulated:
        # The kernels run in the calling thread's current context, which
        # CuPy makes current on a GPU: here the stand-in driver's device 0.
        driver = ctypes.CDLL(os.environ["PERSEUS_CUDA_DRIVER"])
        ctx = ctypes.c_void_p()
        assert driver.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert driver.cuCtxSetCurrent(ctx) == 0
        check_kernels(load(args.lib), _EmulatedCupy, emulated=True)
        print(f"{len(FAILED)} failed" + (": " + ", ".join(FAILED) if FAILED else ""))
        return 1 if FAILED else 0
    try:
        import cupy as cp
        devices = cp.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver, no device
        print(f"no GPU here ({type(e).__name__}: {e})")
        return 2
    if devices < 1:
        print("no GPU here (CUDA reports 0 devices)")
        return 2
    print(f"GPU: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {devices} device(s)")
    lib = load(args.lib)
    check_kernels(lib, cp)
    check_nccl()
    bench_kernels(lib, cp)
    print(f"{len(FAILED)} failed" + (": " + ", ".join(FAILED) if FAILED else ""))
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
