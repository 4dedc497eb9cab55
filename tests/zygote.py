"""Ranks of a test launch that start without importing TensorFlow again.

Importing TensorFlow 2.21 (with the Keras it loads) costs each process about
5 CPU-seconds, and the suite starts hundreds of ranks: about half of CI's CPU
went to imports. Here a rank's command `python tests/zygote.py run SCRIPT
ARGS...` (tests/harness.py puts it in front of a worker script) asks a
server that has imported TensorFlow once to fork a process that runs
SCRIPT as __main__, with the rank's arguments, environment, working folder,
stdin, stdout and stderr. The forked process never ran TensorFlow (import
makes no runtime and no thread of TensorFlow's), so it starts as a fresh
rank would, minus the import.

What stays true of the rank as perseusrun sees it: the command it started
(the client) lives as long as the forked rank and exits with its status, or
dies by the same signal; a signal sent to the client reaches the rank; the
rank is the leader of its own process group; if the client dies (perseusrun
killed it, or its process group, with SIGKILL) the rank's group is killed.

Only ranks whose environment matches the server's (apart from the variables
a launcher sets per rank, FROZEN_FREE below) share it: a different Keras on
PYTHONPATH, another TF_USE_LEGACY_KERAS, another interpreter or another
network namespace gets a server of its own, started by the first rank that
needs it. Where anything fails (no server folder, the server does not come
up, the socket refuses), the client execs the script itself: a slower start,
never a different run. Servers stop when the test process that owns the
folder ends (conftest.py), when it is gone, or after IDLE_S without work.
"""

import hashlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

FOLDER_VARIABLE = "PERSEUS_TEST_ZYGOTES"
# Variables that may differ between the server and a rank it forks: what a
# launcher sets per rank and what the runtime reads after import (the
# PERSEUS_/HOROVOD_/GLOO_ settings, the launchers' own variables, the
# stand-in CUDA driver's). Any other difference gets its own server.
FROZEN_FREE = ("PERSEUS_", "HOROVOD_", "GLOO_", "OMPI_", "PMI_", "PMIX_", "SLURM_",
               "FAKE_CUDA_", "TF_CONFIG", "OLDPWD", "PWD", "SHLVL", "_")
IDLE_S = 600.0
START_DEADLINE_S = 120.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)


def _frozen_env(env):
    return {k: v for k, v in env.items()
            if not any(k == p or (p.endswith("_") and k.startswith(p)) for p in FROZEN_FREE)}


def _key(env):
    h = hashlib.sha256()
    h.update(os.path.realpath(sys.executable).encode())
    for ns in ("net", "mnt", "pid", "ipc", "uts", "user"):
        try:
            h.update(os.readlink(f"/proc/self/ns/{ns}").encode())
        except OSError:
            pass
    h.update(str(os.getuid()).encode())
    h.update(json.dumps(sorted(_frozen_env(env).items())).encode())
    return h.hexdigest()[:16]


def _exec_plain(argv):
    os.execv(sys.executable, [sys.executable] + argv)


def _short(path):
    """A name for the socket at `path` that fits AF_UNIX's 107 bytes however
    deep the folder is: through a descriptor of the folder."""
    fd = os.open(os.path.dirname(path), os.O_PATH)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _connect(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name, fd = _short(path)
    try:
        sock.connect(name)
        return sock
    except OSError:
        sock.close()
        return None
    finally:
        os.close(fd)


def _server_for(folder, key):
    """A connected socket to the server of `key`, starting it if nobody has;
    None if it does not come up in time."""
    path = os.path.join(folder, key + ".sock")
    sock = _connect(path)
    if sock:
        return sock
    lock = os.path.join(folder, key + ".lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        fd = None
    if fd is not None:
        with open(os.path.join(folder, key + ".log"), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "serve", path],
                env=_frozen_env(os.environ) | {FOLDER_VARIABLE: folder},
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, close_fds=True)
        os.write(fd, str(proc.pid).encode())
        os.close(fd)
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        sock = _connect(path)
        if sock:
            return sock
        try:
            with open(lock) as f:
                owner = int(f.read() or 0)
        except (OSError, ValueError):
            owner = 0
        if (fd is not None and proc.poll() is not None) or (owner and not _alive(owner)):
            return None  # the server died starting: its log says why
        time.sleep(0.05)
    return None


def _recv_line(sock):
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            return None
        data += chunk
    return data.decode()


def client(argv):
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder or not os.path.isdir(folder):
        _exec_plain(argv)
    try:
        with open(os.path.join(folder, "netns")) as f:
            same_net = f.read() == os.readlink("/proc/self/ns/net")
    except OSError:
        same_net = False
    sock = _server_for(folder, _key(os.environ)) if same_net else None
    if sock is None:
        _exec_plain(argv)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    # A signal that comes once the rank runs but before this process knows
    # its pid (the rank may print before the reply arrives) waits, blocked,
    # and is forwarded as soon as the handlers are in.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    # The pid comes at once from a working server: a deadline, so that a
    # stuck one fails the rank's start rather than hang it (the server kills
    # the rank it forked once it finds this process gone).
    deadline_s = float(os.environ.get("PERSEUS_TEST_ZYGOTE_REPLY_TIMEOUT_S", "120"))
    try:
        socket.send_fds(sock, [struct.pack("!I", len(request)) + request], [0, 1, 2])
        sock.settimeout(deadline_s)
        line = _recv_line(sock)
        sock.settimeout(None)
    except socket.timeout:
        sys.stderr.write(f"zygote: the fork server sent no pid within {deadline_s:g} s "
                         "(PERSEUS_TEST_ZYGOTE_REPLY_TIMEOUT_S); giving up on this rank\n")
        sys.stderr.flush()
        os._exit(124)
    except OSError:
        line = None
    if line is None:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        _exec_plain(argv)  # the server went away before it forked: nothing ran
    pid = int(line)

    def forward(signum, _frame):
        try:  # the rank leads its process group, as a rank perseusrun starts does
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass
    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    line = _recv_line(sock)
    if line is None:
        os._exit(255)
    kind, value = line.split()
    if kind == "exit":
        os._exit(int(value))
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    if int(value) in FORWARDED:
        signal.signal(int(value), signal.SIG_DFL)
    os.kill(os.getpid(), int(value))
    os._exit(128 + int(value))


def _recv_request(conn):
    head, fds, _flags, _addr = socket.recv_fds(conn, 4, 3)
    if len(head) < 4:
        raise ConnectionError("no request")
    need = struct.unpack("!I", head[:4])[0]
    body = head[4:]
    while len(body) < need:
        chunk = conn.recv(need - len(body))
        if not chunk:
            raise ConnectionError("request cut short")
        body += chunk
    return json.loads(body), fds


def _become_rank(request, fds):
    """In the forked process: the rank's stdio, folder, environment and
    arguments; returns the script to run."""
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for signum in FORWARDED + (signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter starts
    signal.signal(signal.SIGINT, signal.default_int_handler)
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script] + request["argv"][1:]
    sys.path[0] = os.path.dirname(script)
    return script


def _wait_for_rank(conn, pid, env):
    """In the per-rank waiter: reports the rank's end to the client; kills
    the rank's group when the client is gone. (PERSEUS_TEST_ZYGOTE_REPLY_DELAY_S
    in the rank's environment delays the pid's reply: test_zygote signals the
    client while the rank runs and its pid is still unknown there.)"""
    def kill_group():
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(float(env.get("PERSEUS_TEST_ZYGOTE_REPLY_DELAY_S", 0)))
    try:
        conn.sendall(f"{pid}\n".encode())
    except OSError:  # the client died before it heard the pid (a loaded host)
        kill_group()
        os.waitpid(pid, 0)
        return
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                message = f"signal {os.WTERMSIG(status)}\n"
            else:
                message = f"exit {os.waitstatus_to_exitcode(status)}\n"
            try:
                conn.sendall(message.encode())
            except OSError:
                pass
            return
        try:
            gone = not conn.recv(1)
        except OSError:
            gone = True
        if gone:  # the client is gone
            kill_group()


def serve(path):
    """Imports what every rank imports, then forks a rank per request. Returns
    the script to run in a forked rank; never returns in the server."""
    import numpy  # noqa: F401
    import tensorflow  # noqa: F401
    folder = os.path.dirname(path)
    with open(os.path.join(folder, "owner")) as f:
        owner = int(f.read())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = f"{path}.{os.getpid()}"
    name, fd = _short(partial)
    listener.bind(name)
    os.close(fd)
    listener.listen(64)
    os.rename(partial, path)
    waiters = set()

    def stop(_signum, _frame):
        # What this server and the ranks it forked used, for the job's CPU
        # figure (a forked rank is no child of the test process that waits).
        while True:
            try:
                if not os.waitpid(-1, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
        t = os.times()
        with open(path[:-len(".sock")] + ".cpu", "w") as f:
            f.write(f"{t.user + t.system + t.children_user + t.children_system:.2f}\n")
        try:
            os.unlink(path)
        finally:
            os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    idle_since = time.monotonic()
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        while waiters:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                waiters.clear()
                break
            if not pid:
                break
            waiters.discard(pid)
        if waiters:
            idle_since = time.monotonic()
        gone = not _alive(owner) or not os.path.exists(path)
        if gone or time.monotonic() - idle_since > IDLE_S:
            try:
                if os.path.exists(path):
                    os.unlink(path)
            finally:
                os._exit(0)
        ready, _, _ = select.select([listener], [], [], 1.0)
        if not ready:
            continue
        conn, _ = listener.accept()
        try:
            request, fds = _recv_request(conn)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            continue
        waiter = os.fork()
        if waiter:
            waiters.add(waiter)
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        # The waiter: forks the rank, then waits for it.
        listener.close()
        rank = os.fork()
        if rank == 0:
            conn.close()
            return _become_rank(request, fds)
        for fd in fds:
            os.close(fd)
        try:
            _wait_for_rank(conn, rank, request["env"])
        finally:
            os._exit(0)


def make_folder(parent):
    """The folder a test process's servers live in (conftest.py): owned by
    this process, valid for ranks in this network namespace."""
    folder = os.path.join(parent, "zygotes")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "owner"), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(folder, "netns"), "w") as f:
        f.write(os.readlink("/proc/self/ns/net"))
    return folder


def stop_servers(folder, deadline_s=10.0):
    """Stops the folder's servers (and nothing they forked: ranks are their
    tests' to end); returns the CPU seconds the servers and their ranks
    used."""
    pids = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.endswith(".lock"):
            try:
                with open(os.path.join(folder, name)) as f:
                    pid = int(f.read())
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + deadline_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    total = 0.0
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.endswith(".cpu"):
            with open(os.path.join(folder, name)) as f:
                total += float(f.read() or 0)
    return total


def main():
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        client(sys.argv[2:])
    elif len(sys.argv) == 3 and sys.argv[1] == "serve":
        script = serve(sys.argv[2])
        import runpy
        runpy.run_path(script, run_name="__main__")
    else:
        raise SystemExit("usage: zygote.py run SCRIPT [ARGS...] | zygote.py serve SOCKET")


if __name__ == "__main__":
    main()
