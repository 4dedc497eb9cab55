"""One rank dies (SIGKILL), hangs (SIGSTOP) or loses its store connections
while its process and its Gloo sockets stay (cut); the others must raise,
naming it.

Usage: failure_worker.py {kill|stop|cut} {core|tf|tf_function}. FAILURE_VICTIM picks the
rank (default: the last), FAILURE_ELEMENTS the tensor size (core). Survivors print
`REPORTED <seconds> <message>` once their collective fails.
"""

import os
import signal
import socket
import sys
import time

import numpy as np

mode, api = sys.argv[1], sys.argv[2]

if api == "tf":
    import tensorflow as tf

    import perseus_tf as ptf

    ptf.init()
    rank, size = ptf.rank(), ptf.size()

    def collective(i):
        ptf.allreduce(tf.ones([16]), name=f"step{i}")

    expected_error = tf.errors.UnavailableError
elif api == "tf_function":
    import tensorflow as tf

    import perseus_tf as ptf

    ptf.init()
    rank, size = ptf.rank(), ptf.size()

    @tf.function
    def step(x):
        return ptf.allreduce(x) * 2.0

    def collective(i):
        step(tf.ones([16]))

    # Inside a tf.function, TF's executor turns UnavailableError from any op
    # that is not one of its own Send/Recv/collective ops into InternalError
    # (same message); docs/ say so.
    expected_error = tf.errors.InternalError
else:
    from perseus_tf._native import _core
    from rank_checks import start_native

    rank, size = start_native()

    # FAILURE_ELEMENTS: a larger tensor takes the chunked two-level path
    # when the job has hosts.
    elements = int(os.environ.get("FAILURE_ELEMENTS", "16"))

    def collective(i):
        x = np.ones(elements, np.float32)
        _core.submit(0, x, f"step{i}", 2, output=np.empty_like(x)).wait()

    expected_error = _core.CommunicationError

victim = int(os.environ.get("FAILURE_VICTIM", size - 1))
collective(0)  # everyone is connected and working


def cut_store_connections():
    """Shuts down this process's TCP connections to the rendezvous store."""
    port = int(os.environ["PERSEUS_RENDEZVOUS_PORT"])
    cut = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.getpeername()[1] == port:
                s.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:
            pass
        finally:
            s.close()
    assert cut >= 1, "no connection to the store found"


if rank == victim:
    if mode == "cut":
        cut_store_connections()
    else:
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    time.sleep(600)
time.sleep(0.5)
start = time.time()
try:
    for i in range(1, 10**6):
        collective(i)
except expected_error as e:
    print(f"REPORTED {time.time() - start:.1f} {' '.join(str(e).split())}", flush=True)
    sys.exit(1)
print("NOT REPORTED", flush=True)
