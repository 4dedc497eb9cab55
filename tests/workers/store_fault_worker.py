"""Ranks that run allreduces until one fails, for tests/test_store_faults.py
(through _core: no TensorFlow).

    store_fault_worker.py MARKERS [stall_then_stop VICTIM SECONDS]

Every rank runs a 16-element allreduce every 20 ms. After its first, it
creates MARKERS/running<R>. When one fails it prints
`FAILED <wall-clock time> <message>`, writes that line to MARKERS/failed<R>
too (a rank cut off from perseusrun cannot print), and exits 1.

stall_then_stop: rank 0 stops its parent (perseusrun, which serves the
store) for SECONDS with SIGSTOP and creates MARKERS/stalled once it let it
go on; then rank VICTIM stops itself (SIGSTOP). The others must name
VICTIM alone.
"""

import os
import signal
import subprocess
import sys
import time

import numpy as np

from perseus_tf._native import _core
from rank_checks import start_native

markers = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "loop"
rank, size = start_native()


def allreduce(i):
    x = np.ones(16, np.float32)
    _core.submit(0, x, f"step{i}", 2, output=np.empty_like(x)).wait()


allreduce(0)
open(os.path.join(markers, f"running{rank}"), "w").close()
stalled = os.path.join(markers, "stalled")
if mode == "stall_then_stop" and rank == 0:
    seconds = float(sys.argv[4])
    subprocess.Popen(["sh", "-c", f"kill -STOP {os.getppid()}; sleep {seconds}; "
                                  f"kill -CONT {os.getppid()}; touch {stalled}"])
try:
    for i in range(1, 10**7):
        allreduce(i)
        time.sleep(0.02)
        if (mode == "stall_then_stop" and rank == int(sys.argv[3])
                and os.path.exists(stalled)):
            time.sleep(1.0)  # the others' heartbeats are back on the store
            os.kill(os.getpid(), signal.SIGSTOP)
except _core.CommunicationError as e:
    line = f"FAILED {time.time():.2f} {' '.join(str(e).split())}"
    print(line, flush=True)
    with open(os.path.join(markers, f"failed{rank}"), "w") as f:
        f.write(line + "\n")
    sys.exit(1)
