"""What perseusrun runs on a remote host (over ssh) or, with --mpi, under
mpirun: it starts one rank and owns it.

Over ssh (``python -m perseus_tf.runner.remote -- COMMAND...``):
- The first line of standard input is the job's secret (hex). It becomes
  the rank's PERSEUS_RENDEZVOUS_SECRET; it is never on a command line. The
  second line is a hex-encoded JSON object of the variables perseusrun's -x
  names (API keys, say): they join the rank's environment, also never on a
  command line.
- The rest of standard input stays open while perseusrun lives, and
  perseusrun writes a byte to it every KEEPALIVE_S seconds. When it closes
  (perseusrun exited, was killed, or the ssh connection broke), or nothing
  has come for KEEPALIVE_LOST_S (the network to perseusrun's host is cut,
  and ssh on this side may not notice for many minutes), the rank's process
  group gets SIGTERM, then SIGKILL after a few seconds: no rank outlives its
  launcher on any host.
- SIGINT, SIGTERM and SIGHUP are passed to the rank's process group.
- The exit status is the rank's (128+N when signal N killed it), which ssh
  hands back to perseusrun.

Under mpirun (``--mpi``): the rank's place comes from Open MPI's variables;
this adds horovodrun's HOROVOD_* variables from them and prefixes the rank's
output lines with ``[rank] `` as perseusrun does. When mpirun (or its orted
daemon) is gone, this gets SIGTERM from the kernel and stops the rank.

``--probe`` only exits 0: perseusrun's check that this Python and
perseus_tf are there before it starts anything.

Only the standard library is imported here (no TensorFlow): it must start
fast and stay small beside the rank.
"""

import os
import select
import signal
import subprocess
import sys
import threading
import time

SECRET_WAIT_S = 30.0
KILL_DELAY_S = 3.0
# perseusrun's keep-alive (supervise.RankGroup): one byte this often, and
# how long without one means perseusrun is cut off.
KEEPALIVE_S = 5.0
KEEPALIVE_LOST_S = 30.0


def _usage() -> int:
    print("usage: python -m perseus_tf.runner.remote [--mpi] -- COMMAND [ARGS...]\n"
          "       (started by perseusrun; see perseus_tf/runner/remote.py)", file=sys.stderr)
    return 2


def _read_line(what: str, deadline: float) -> str:
    """One line of standard input, read without Python's buffering so that
    the rest of the stream stays for the end-of-input watch; it must be hex."""
    fd = sys.stdin.fileno()
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise SystemExit(f"perseus remote: no {what} on standard input within "
                             f"{SECRET_WAIT_S:g} s (this is started by perseusrun)")
        chunk = os.read(fd, 1)
        if not chunk:
            raise SystemExit(f"perseus remote: standard input closed before the {what}")
        data += chunk
    text = data.decode().strip()
    if any(c not in "0123456789abcdef" for c in text):
        raise SystemExit(f"perseus remote: the {what} on standard input is not hex")
    return text


def _read_secret_and_private_env():
    """The job secret (hex) and the -x variables perseusrun sends."""
    import json

    deadline = time.monotonic() + SECRET_WAIT_S
    secret = _read_line("job secret", deadline)
    if not secret:
        raise SystemExit("perseus remote: the job secret on standard input is empty")
    encoded = _read_line("forwarded variables", deadline)
    private = json.loads(bytes.fromhex(encoded).decode()) if encoded else {}
    return secret, {str(k): str(v) for k, v in private.items()}


def _parent_death_signal():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _stop(proc, why: str = "") -> None:
    """SIGTERM to the rank's process group, SIGKILL if it is still there
    KILL_DELAY_S later."""
    if proc.poll() is not None:
        return
    if why:
        try:
            print(f"perseus remote: {why}; stopping rank (pid {proc.pid})",
                  file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + KILL_DELAY_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return
            time.sleep(0.05)


def _watch_input(proc, lost_s: float = KEEPALIVE_LOST_S) -> None:
    fd = sys.stdin.fileno()
    while True:
        try:
            ready = select.select([fd], [], [], lost_s)[0]
            chunk = os.read(fd, 4096) if ready else None
        except OSError:
            chunk = b""
        if chunk is None:
            _stop(proc, f"no word from perseusrun for {lost_s:g} s (the network to its host "
                        f"is cut, or it is stopped)")
            return
        if not chunk:
            break
    _stop(proc, "perseusrun is gone (its connection closed)")


def _status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _horovod_from_ompi(env: dict) -> None:
    rank = env.get("OMPI_COMM_WORLD_RANK")
    if rank is None:
        return
    size = int(env.get("OMPI_COMM_WORLD_SIZE", "1"))
    local_size = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    env.setdefault("HOROVOD_RANK", rank)
    env.setdefault("HOROVOD_SIZE", str(size))
    env.setdefault("HOROVOD_LOCAL_RANK", env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))
    env.setdefault("HOROVOD_LOCAL_SIZE", str(local_size))
    env.setdefault("HOROVOD_CROSS_RANK", str(int(rank) // max(1, local_size)))
    env.setdefault("HOROVOD_CROSS_SIZE", str(max(1, size // max(1, local_size))))
    env.setdefault("HOROVOD_CONTROLLER", "gloo")
    env.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--probe"]:
        return 0
    mpi = argv[:1] == ["--mpi"]
    if mpi:
        argv = argv[1:]
    if argv[:1] != ["--"] or len(argv) < 2:
        return _usage()
    command = argv[1:]
    env = dict(os.environ)
    if mpi:
        # The parent is mpirun or its orted: when it is gone, so is the job.
        parent = os.getppid()
        _parent_death_signal()
        if os.getppid() != parent:
            return 1
        _horovod_from_ompi(env)
        store = env.get("PERSEUS_RENDEZVOUS_ADDR")
        if store and not env.get("PERSEUS_HOST_ADDR"):
            # This host's address as the others reach it: the one that
            # routes to the store.
            from perseus_tf.config.netaddr import route_address
            env["PERSEUS_HOST_ADDR"] = route_address(store)
    else:
        env["PERSEUS_RENDEZVOUS_SECRET"], private = _read_secret_and_private_env()
        env.update(private)
    env["PERSEUS_LAUNCHER_PID"] = str(os.getpid())
    env.setdefault("PYTHONUNBUFFERED", "1")

    pipes = subprocess.PIPE if mpi else None
    try:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                stdout=pipes, stderr=pipes, start_new_session=True,
                                preexec_fn=_parent_death_signal)
    except OSError as err:
        print(f"perseus remote: cannot start {command[0]!r}: {err}", file=sys.stderr)
        return 127

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    readers = []
    if mpi:
        from perseus_tf.runner.output import forward_lines
        prefix = f"[{env.get('OMPI_COMM_WORLD_RANK', '?')}] ".encode()
        lock = threading.Lock()
        for pipe, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=forward_lines, args=(pipe, stream, prefix, lock),
                                 daemon=True)
            t.start()
            readers.append(t)
    else:
        threading.Thread(target=_watch_input, args=(proc,), daemon=True).start()
    while True:
        try:
            proc.wait()
            break
        except InterruptedError:
            continue
    for t in readers:
        t.join(2.0)
    # A rank killed by a signal left its scratch directory (common/scratch.py).
    rank = env.get("PERSEUS_RANK") or env.get("OMPI_COMM_WORLD_RANK")
    if env.get("PERSEUS_JOB_ID") and rank is not None:
        from perseus_tf.common.scratch import remove_job_scratch
        remove_job_scratch(env["PERSEUS_JOB_ID"], rank)
    if mpi and proc.returncode != 0:
        # mpirun names the rank but not where it ran: say it, as perseusrun does.
        from perseus_tf.runner.supervise import describe_status
        where = env.get("PERSEUS_HOST_ADDR") or os.uname().nodename
        print(f"perseus: rank {env.get('OMPI_COMM_WORLD_RANK', '?')} on {where} "
              f"{describe_status(proc.returncode)}", file=sys.stderr, flush=True)
    return _status(proc.returncode)


if __name__ == "__main__":
    sys.exit(main())
