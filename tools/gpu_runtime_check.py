"""The runtime on a GPU, without TensorFlow: collectives of CuPy device arrays
through perseus_tf._testing (submit_device), checked against numpy, and timed.

    python tools/gpu_runtime_check.py nccl            # one process: NCCL at world size 1
    python tools/gpu_runtime_check.py lone            # NCCL communicators nobody joins
    perseusrun -np N -- python tools/gpu_runtime_check.py staged
                                                       # N ranks on one GPU, host-staged
    perseusrun -np N [-H 127.0.0.1:2,127.0.0.2:2] -- python tools/gpu_runtime_check.py nccl
                                                       # N ranks on one GPU through NCCL

`nccl` (PERSEUS_GPU_TRANSPORT=nccl): fused buckets, every NCCL dtype, every
reduction, prescale/postscale, Average, fp16 compression, broadcast, int16
(no NCCL type: staged through the host), the timeline showing NCCL spans;
then NCCL's allreduce at world size 1 against a plain device-to-device copy.
`lone`: a NCCL communicator nobody else joins is aborted at its deadline.

`nccl` at N ranks: NCCL refuses two ranks of one host on one GPU, so each
rank gets an NCCL_HOSTID of its own (NCCL then takes every rank for a host
of its own and connects them through sockets, still all on the one GPU). With
-H 127.0.0.1:2,127.0.0.2:2 the runtime sees two hosts of two ranks: mixed
compression then takes kNcclTwoLevel (NCCL reduces inside each host, the
leaders allreduce float16 times the gradient scale, cast on the GPU, over
Gloo, NCCL broadcasts inside each host), checked bitwise against numpy's
emulation of those steps and in the timeline.

`staged` (PERSEUS_GPU_TRANSPORT=host): the same sums at N ranks, then the
host-staged allreduce's bandwidth against the device <-> pinned host copy
ceiling measured with CuPy.

Prints "ok"/"FAIL" lines and tables; exits non-zero when a check failed.
"""

import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FAILED = []


def report(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    if mode == "lone":
        return lone()
    os.environ["PERSEUS_GPU_TRANSPORT"] = "nccl" if mode == "nccl" else "host"
    # One GPU for all ranks: a host id per rank keeps NCCL from refusing them.
    os.environ.setdefault("NCCL_HOSTID", "perseus-check-" + os.environ.get("PERSEUS_RANK", "0"))
    timeline = os.path.join(tempfile.mkdtemp(), "timeline.json")
    if mode == "nccl":
        os.environ["PERSEUS_TIMELINE"] = timeline
    import cupy as cp
    from perseus_tf import _core, _native, _testing
    _native.init()
    topo = _native.topology()
    rank, size = topo["rank"], topo["size"]
    codes = _native.DTYPE_CODES
    stream = cp.cuda.Stream(non_blocking=True)
    stream.use()  # every CuPy copy and kernel below runs on it: the events cover them

    def submit(x, name, out=None, op=_native.OP_ALLREDUCE, **kw):
        """Queues x's collective after the producer's work on `stream`."""
        out = cp.empty_like(x) if out is None else out
        event = cp.cuda.Event(disable_timing=True)
        event.record(stream)
        h = _testing.submit_device(op, x.data.ptr, out.data.ptr, list(x.shape), name,
                                codes[x.dtype.name], device=x.device.id, stream=stream.ptr,
                                ready=event.ptr, **kw)
        return h, out, event

    # The first collective's cost (communicators, buffers and kernels are
    # made then) against the same collective warm; the device's free memory
    # before and after it (every rank of this GPU together).
    free0 = cp.cuda.runtime.memGetInfo()[0]
    first_x = cp.ones(1 << 18, cp.float32)
    t0 = time.perf_counter()
    h, _, _event = submit(first_x, "first")  # the event lives until the collective is done
    h.wait()
    first = time.perf_counter() - t0
    free1 = cp.cuda.runtime.memGetInfo()[0]

    def again():
        h, _, _event = submit(first_x, "first")
        h.wait()
    warm = _time(again, 5)
    if rank == 0:
        print(f"first collective: {first * 1e3:.1f} ms, warm {warm * 1e3:.2f} ms; the GPU's "
              f"free memory fell {(free0 - free1) / 2**20:.0f} MiB meanwhile", flush=True)

    def data(r, shape, dtype, seed):
        rng = np.random.default_rng(1000 * r + seed)
        return rng.integers(1, 4, size=shape).astype(dtype)

    # Sums of many tensors at once (fused into buckets), each dtype.
    dtypes = ["float32", "float64", "float16", "int32", "int64", "uint8", "int8", "int16"]
    shapes = [(0,), (1,), (17,), (1000, 3), (257, 129), (1 << 20,)]
    pending = []
    for i, dt in enumerate(dtypes):
        for j, shape in enumerate(shapes):
            x = cp.asarray(data(rank, shape, dt, 10 * i + j))
            # The input and the producer's event live until the handle completes.
            pending.append((dt, shape, 10 * i + j) + submit(x, f"sum.{dt}.{j}") + (x,))
    bad = []
    for dt, shape, seed, h, out, _event, _x in pending:
        h.wait()
        want = sum(data(r, shape, dt, seed).astype(np.float64) for r in range(size)).astype(dt)
        if not np.array_equal(cp.asnumpy(out), want):
            bad.append(f"{dt}{shape}")
    report(f"sums of {len(pending)} tensors, {len(dtypes)} dtypes, {size} rank(s)", not bad,
           ", ".join(bad[:8]))

    # Reductions, scaling, Average, in place.
    x = cp.asarray(data(rank, (5000,), "float32", 99))
    allx = [data(r, (5000,), "float32", 99) for r in range(size)]
    for red, name, fn in ((_native.REDUCE_CODES["min"], "min", np.minimum.reduce),
                          (_native.REDUCE_CODES["max"], "max", np.maximum.reduce),
                          (_native.REDUCE_CODES["product"], "product", np.multiply.reduce)):
        h, out, _ = submit(x, f"red.{name}", reduce_op=red)
        h.wait()
        report(f"{name}", np.array_equal(cp.asnumpy(out), fn(allx)))
    h, out, _ = submit(x, "avg", reduce_op=_native.REDUCE_CODES["average"], prescale=2.0,
                       postscale=0.5)
    h.wait()
    report("average with prescale 2, postscale 0.5",
           np.allclose(cp.asnumpy(out), sum(allx) / size, rtol=1e-6))
    y = x.copy()
    h, out, _ = submit(y, "inplace", out=y)
    h.wait()
    report("in place", np.array_equal(cp.asnumpy(y), sum(allx)))
    h, out, _ = submit(x, "fp16", compression=_core.COMPRESSION["fp16"])
    h.wait()
    report("fp16 compression", np.allclose(cp.asnumpy(out), sum(allx), rtol=2e-3))
    b = cp.asarray(np.full(1001, rank + 7, np.float64))
    h, out, _ = submit(b, "bcast", op=_native.OP_BROADCAST, root=size - 1)
    h.wait()
    report("broadcast from the last rank", np.array_equal(cp.asnumpy(out), np.full(1001, size + 6.0)))

    # Mixed compression: float16 times the gradient scale between hosts only.
    shape = (3001,)

    def grad(r):
        return np.random.default_rng(7000 + r).standard_normal(shape).astype(np.float32)

    g = cp.asarray(grad(rank))
    h, out, _ = submit(g, "mixed", compression=_core.COMPRESSION["mixed"])
    h.wait()
    got = cp.asnumpy(out)
    local, cross = topo["local_size"], topo["cross_size"]
    two_level = mode == "nccl" and cross > 1 and local > 1
    if two_level:
        # What kNcclTwoLevel does: a float32 sum inside each host (ranks
        # c*local .. c*local+local-1), float16(sum * scale) summed across the
        # hosts in float16, then times 1/scale in float32.
        scale = np.float32(10.0)  # PERSEUS_ALLREDUCE_GRADIENT_SCALE's default
        halves = []
        for c in range(cross):
            s = grad(c * local)
            for r in range(c * local + 1, (c + 1) * local):
                s = s + grad(r)
            halves.append((s * scale).astype(np.float16))
        across = halves[0]
        for x in halves[1:]:
            across = (across.astype(np.float32) + x.astype(np.float32)).astype(np.float16)
        want = across.astype(np.float32) * (np.float32(1) / scale)
        report(f"mixed compression in two levels ({cross} hosts x {local}), bitwise numpy's "
               "emulation", np.array_equal(got, want),
               f"max |diff| {float(np.max(np.abs(got - want))):.3g}")
    else:
        want = sum(grad(r) for r in range(size))
        report("mixed compression", np.allclose(got, want, rtol=2e-3, atol=2e-3),
               f"max |diff| {float(np.max(np.abs(got - want))):.3g}")

    if mode == "nccl" and size == 1:
        bandwidth_nccl(cp, submit, stream)
    elif mode == "nccl":
        versus_nccl(cp, submit, stream, rank, size)
    elif mode != "nccl":
        bandwidth_staged(cp, submit, stream, rank, size)
    _native.shutdown()  # writes the timeline
    if mode == "nccl":
        import glob  # the runtime names it timeline.rank<N>.json
        text = "".join(open(p).read() for p in glob.glob(timeline[:-len(".json")] + "*.json"))
        report(f"rank {rank}: the timeline shows NCCL allreduces", '"nccl allreduce"' in text,
               f"{text.count('nccl allreduce')} spans")
        if two_level:
            spans = ['"nccl host reduce"', '"nccl host broadcast"']
            if topo["local_rank"] == 0:
                spans.append('"cross-host allreduce (fp16)"')
            report(f"rank {rank}: the timeline shows the two levels",
                   all(s in text for s in spans), ", ".join(f"{s} x{text.count(s)}" for s in spans))
    if rank == 0:
        print(f"{len(FAILED)} failed" + (": " + ", ".join(FAILED) if FAILED else ""), flush=True)
    return 1 if FAILED else 0


def lone():
    """NCCL communicators made with the real library outside the runtime:
    one of two ranks that nobody else joins (aborted at the deadline), and
    one of one rank."""
    from perseus_tf import _core, _native, _testing
    dirs = list(_native._nccl_wheel_dirs())
    t0 = time.monotonic()
    message = _testing.nccl_lone_communicator(dirs, 2, 3000)
    took = time.monotonic() - t0
    report("a communicator nobody joins is aborted at its deadline",
           "aborted" in message and took < 30, f"{took:.1f} s: {message}")
    one = _testing.nccl_lone_communicator(dirs, 1, 10000)
    report("a communicator of one rank comes up", one.startswith("created"), one)
    return 1 if FAILED else 0


def _time(fn, reps):
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def bandwidth_nccl(cp, submit, stream):
    print("\nNCCL allreduce at world size 1 (through the runtime) against a device copy")
    print("| MB | runtime allreduce ms | device copy ms | GB/s allreduce | GB/s copy |")
    print("|---|---|---|---|---|")
    for mb in (1, 16, 64, 256):
        x = cp.ones(mb * (1 << 20) // 4, cp.float32)
        out = cp.empty_like(x)

        def run():
            h, _, event = submit(x, f"bw{mb}", out=out)
            h.wait()  # the event lives until the collective is done

        def copy():
            cp.copyto(out, x)
            cp.cuda.Device().synchronize()

        a, c = _time(run, 10), _time(copy, 10)
        gb = mb / 1024
        print(f"| {mb} | {a * 1e3:.3f} | {c * 1e3:.3f} | {gb / a:.1f} | {gb / c:.1f} |", flush=True)


def versus_nccl(cp, submit, stream, rank, size):
    """Perseus's allreduce against NCCL called directly (CuPy's binding, a
    communicator of its own) on the same buffers, 1 to 256 MiB of float32."""
    from perseus_tf import _core, _native, _testing
    try:
        from cupy.cuda import nccl
    except Exception as e:  # a CuPy built without NCCL
        print(f"no direct NCCL through CuPy ({type(e).__name__}: {e}): no comparison")
        return
    made = nccl.get_unique_id()  # bytes (newer CuPy) or a tuple of signed chars
    uid = np.zeros(128, np.int64)
    if rank == 0:
        uid[:] = (np.frombuffer(made, np.int8) if isinstance(made, bytes) else np.array(made))
    uid = _core.submit(_native.OP_ALLREDUCE, uid, "nccl.uid",
                       _native.DTYPE_CODES["int64"]).wait()[0]  # rank 0's, everywhere
    uid = (uid.astype(np.int8).tobytes() if isinstance(made, bytes)
           else tuple(int(v) for v in uid))
    comm = nccl.NcclCommunicator(size, uid, rank)
    rows = []
    for mb in (1, 16, 64, 256):
        x = cp.ones(mb * (1 << 20) // 4, cp.float32)
        out = cp.empty_like(x)

        def perseus():
            h, _, _event = submit(x, f"vs{mb}", out=out)
            h.wait()

        def direct():
            comm.allReduce(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                           stream.ptr)
            stream.synchronize()

        reps = 3 if mb == 256 else 5
        a, d = _time(perseus, reps), _time(direct, reps)
        a2 = _time(perseus, reps)  # after the direct runs too: the better of the two
        rows.append((mb, min(a, a2), d))
    comm.destroy()
    if rank == 0:
        print(f"\nAllreduce through Perseus against NCCL called directly, {size} ranks on one "
              "GPU (a host id each: NCCL's sockets over loopback)")
        print("| MiB | Perseus ms | NCCL direct ms | Perseus / NCCL |")
        print("|---|---|---|---|")
        for mb, a, d in rows:
            print(f"| {mb} | {a * 1e3:.2f} | {d * 1e3:.2f} | {a / d:.2f} |", flush=True)


def bandwidth_staged(cp, submit, stream, rank, size):
    rows = []
    for mb in (1, 16, 64):
        n = mb * (1 << 20) // 4
        x = cp.ones(n, cp.float32)
        out = cp.empty_like(x)
        pinned = cp.cuda.alloc_pinned_memory(n * 4)
        host = np.frombuffer(pinned, np.float32, n)

        def run():
            h, _, event = submit(x, f"bw{mb}", out=out)
            h.wait()  # the event lives until the collective is done

        def ceiling():
            cp.cuda.runtime.memcpy(host.ctypes.data, x.data.ptr, n * 4, 2)  # device to host
            cp.cuda.runtime.memcpy(out.data.ptr, host.ctypes.data, n * 4, 1)  # host to device

        a = _time(run, 5)
        c = _time(ceiling, 5)
        rows.append((mb, a, c))
    if rank == 0:
        print(f"\nHost-staged allreduce, {size} ranks on one GPU, rank 0's view")
        print("| MB | allreduce ms | D2H + H2D copy ms (pinned) | allreduce / copy |")
        print("|---|---|---|---|")
        for mb, a, c in rows:
            print(f"| {mb} | {a * 1e3:.2f} | {c * 1e3:.2f} | {a / c:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
