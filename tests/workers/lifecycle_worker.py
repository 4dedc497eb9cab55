"""20 rounds of the runtime in one job at changing sizes (tests/test_faults.py).

Launched at 4 processes; round k runs at SIZES[k]: processes 0..size-1 take
ranks 0..size-1 (process 0, which serves the store, is always rank 0), the
others wait until the round has started (its roll call is in) and init()
into a later one. In each round the members add a process set, reduce in it
and in the world, and end the round with shutdown(), or with abort() on
every member every fifth round. Each process counts its threads, open file
descriptors, shared-memory mappings and process sets after its first round
and after the last: a round that leaks shows as a difference."""

import os
import sys
import time

import numpy as np

from perseus_tf import _core, _native

P = int(os.environ["PERSEUS_RANK"])
FOLDER = sys.argv[1]
SIZES = [4, 2, 3, 1, 4, 3, 2, 4, 1, 2, 4, 3, 2, 3, 4, 1, 3, 2, 4, 4]
F32 = _native.DTYPE_CODES["float32"]


def say(text):
    print(f"process {P} {text}", flush=True)


def counts():
    with open("/proc/self/maps") as f:
        shm = sum(1 for line in f if "/perseus-" in line)
    return {"threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd")), "shm_maps": shm,
            "process_sets": len(_core.process_set_ids())}


def place(rank, size):
    for prefix in ("PERSEUS_", "HOROVOD_"):
        for key, value in (("RANK", rank), ("SIZE", size), ("LOCAL_RANK", rank),
                           ("LOCAL_SIZE", size), ("CROSS_RANK", 0), ("CROSS_SIZE", 1)):
            os.environ[prefix + key] = str(value)


def started(k):
    return os.path.join(FOLDER, f"round{k}.started")


def sum_of(name, value, process_set=0):
    x = np.full(3, value, np.float32)
    return _core.submit(_native.OP_ALLREDUCE, x, name, F32, process_set=process_set).wait()[0][0]


baseline = None
for k, size in enumerate(SIZES):
    if P < size:
        place(P, size)
        _native.init()
        if P == 0:
            open(started(k), "w").close()
        rnd = _core.stats()["round"]
        total = sum_of(f"world{k}", P + 1.0)
        ok = total == size * (size + 1) / 2
        if size > 1:
            ps = _native.add_process_set([0, 1])
            if P < 2:
                ok &= sum_of(f"set{k}", 10.0 * (P + 1), process_set=ps) == 30.0
        say(f"round {rnd} size {size} {'ok' if ok else f'WRONG {total}'}")
        if k % 5 == 4:
            _native.abort("the round ends")
        else:
            _native.shutdown()
    else:
        deadline = time.monotonic() + 180
        while not os.path.exists(started(k)):
            if time.monotonic() > deadline:
                say(f"round {k} never started")
                sys.exit(3)
            time.sleep(0.02)
    if k == 0:
        baseline = counts()
final = counts()
say(f"counts after the first round {baseline} after the last {final}")
if final != baseline:
    names = []
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            names.append(f.read().strip())
    say(f"threads: {sorted(names)}")
sys.exit(0 if final == baseline else 4)
