"""Launch mistakes, made by hand without perseusrun (as a user writing their
own launcher would): each must fail fast on every rank with an error that
names the rank or the variable and each side's value, and leave nothing in
/dev/shm. The ranks start the runtime only (no TensorFlow), so each case
takes about a second."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import collect
from slurm_cluster import free_port

from perseus_tf.common.store import StoreServer

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import os, sys, time
from perseus_tf import _native
start = time.monotonic()
try:
    _native.init()
    print("INIT OK", flush=True)
except Exception as e:
    print(f"INIT FAILED after {time.monotonic() - start:.1f} s: {type(e).__name__}: {e}",
          flush=True)
    sys.exit(3)
"""
SECRET = b"k" * 32


def _shm():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _mapped_segments():
    """Names in /dev/shm that a live process has mapped."""
    names = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/maps") as f:
                    names.update(line.split("/dev/shm/", 1)[1].split()[0]
                                 for line in f if "/dev/shm/" in line)
            except OSError:  # the process ended meanwhile
                continue
    return names


def _left_behind(before, prefix=""):
    """Segments made since `before` that nobody maps and that stay.

    Other test jobs run beside this one (tools/run_tests.py lanes) and make
    and remove segments of their own at any moment, so a new name is a leak
    only while no live process maps it, and only if it is still there when
    the wait for it to go ends (a job between creating and mapping, or
    between unmapping and removing, passes through that state briefly)."""
    deadline = time.monotonic() + 15
    while True:
        left = {n for n in _shm() - before if n.startswith(prefix)} - _mapped_segments()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _start(envs, store_port=None, pythons=None):
    procs = []
    for i, extra in enumerate(envs):
        env = dict(os.environ, PYTHONPATH=str(REPO), GLOO_TIMEOUT_SECONDS="10",
                   PERSEUS_JOB_ID=f"mistake{os.getpid()}")
        for name in list(env):
            if name.startswith(("PERSEUS_RANK", "PERSEUS_SIZE", "HOROVOD_", "OMPI_")):
                del env[name]
        if store_port is not None:
            env.update(PERSEUS_RENDEZVOUS_ADDR="127.0.0.1",
                       PERSEUS_RENDEZVOUS_PORT=str(store_port),
                       PERSEUS_RENDEZVOUS_SECRET=SECRET.hex())
        env.update(extra)
        python = pythons[i] if pythons else sys.executable
        procs.append(subprocess.Popen([python, "-c", CHILD], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs, collect(procs, 60)


@pytest.fixture()
def store():
    server = StoreServer("127.0.0.1", 0, SECRET)
    port = server.start()
    yield port
    server.stop()


def _seconds(out):
    return float(out.split("INIT FAILED after ")[1].split(" s")[0])


def test_two_processes_claiming_one_rank_fail_at_once(store):
    before = _shm()
    procs, outs = _start([{"PERSEUS_RANK": "0", "PERSEUS_SIZE": "2"}] * 2, store)
    for p, out in zip(procs, outs):
        assert p.returncode == 3, out
        assert "two processes claim rank 0" in out and "PERSEUS_RANK=0 twice" in out, out
        assert _seconds(out) < 8, out  # not the 300 s start wait
    assert _left_behind(before) == set()


def test_second_rank_zero_serving_the_store_gets_a_clear_error():
    port = free_port()   # (a port chosen from the pid was sometimes taken)
    env = {"PERSEUS_RANK": "0", "PERSEUS_SIZE": "2", "PERSEUS_MASTER_ADDR": "127.0.0.1",
           "PERSEUS_MASTER_PORT": str(port)}
    blocker = StoreServer("127.0.0.1", port, SECRET)
    blocker.start()
    try:
        procs, outs = _start([env])
    finally:
        blocker.stop()
    assert procs[0].returncode == 3
    assert "cannot serve the rendezvous store on port" in outs[0], outs[0]
    assert "another process of this job also rank 0" in outs[0], outs[0]


@pytest.mark.parametrize("variable,values", [
    ("PERSEUS_SIZE", ("2", "3")),
    ("PERSEUS_ALLREDUCE_STREAMS", ("2", "3")),
    ("PERSEUS_SHM_ALLREDUCE", ("1", "0")),
    ("PERSEUS_ALLREDUCE_DTYPE", ("1", "0")),
])
def test_settings_that_must_agree_are_compared_at_init(store, variable, values):
    before = _shm()
    envs = []
    for rank, value in enumerate(values):
        env = {"PERSEUS_RANK": str(rank), "PERSEUS_SIZE": "2", variable: value}
        envs.append(env)
    procs, outs = _start(envs, store)
    for rank, (p, out) in enumerate(zip(procs, outs)):
        other = 1 - rank
        assert p.returncode == 3, out
        assert "ranks disagree on settings" in out, out
        assert (f"{variable}: rank {rank} has {values[rank]}, "
                f"rank {other} has {values[other]}") in out, out
        assert _seconds(out) < 8, out
    assert _left_behind(before) == set()


OLD_VENV = REPO / ".venv-tf215" / "bin" / "python"


@pytest.mark.skipif(not OLD_VENV.exists() and not os.environ.get("PERSEUS_TEST_PASS"),
                    reason="make check without the TF 2.15 venv (make test builds it first)")
def test_ranks_with_different_tensorflow_versions_fail_at_init_naming_them(store):
    # Rank 0 in this venv (TF 2.21, Keras 3), rank 1 in the TF 2.15 one
    # (Keras 2): once an eager allreduce worked and fit stalled for 1800 s.
    before = _shm()
    envs = [{"PERSEUS_RANK": str(r), "PERSEUS_SIZE": "2"} for r in range(2)]
    procs, outs = _start(envs, store, pythons=[sys.executable, str(OLD_VENV)])
    import importlib.metadata
    mine = importlib.metadata.version("tensorflow")
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 3, out
        assert "ranks run different software" in out, out
        versions = {0: mine, 1: "2.15."}
        assert f"TensorFlow version: rank {rank} has {versions[rank]}" in out, out
        assert f"rank {1 - rank} has {versions[1 - rank]}" in out, out
        assert "Keras version" in out and "Install the same versions" in out, out
        assert _seconds(out) < 8, out
    assert _left_behind(before) == set()


def test_a_misspelled_variable_is_named_once_and_an_unwritable_timeline_at_init(tmp_path):
    one = {"PERSEUS_RANK": "0", "PERSEUS_SIZE": "1", "PERSEUS_ALLREDUCE_STREAM": "2"}
    procs, outs = _start([one])
    assert procs[0].returncode == 0 and "INIT OK" in outs[0], outs[0]
    assert outs[0].count("PERSEUS_ALLREDUCE_STREAM is not a Perseus-TF variable") == 1, outs[0]
    assert "did you mean PERSEUS_ALLREDUCE_STREAMS?" in outs[0], outs[0]
    # Written at exit, once the whole trace was lost there; now named at init.
    bad = str(tmp_path / "no-such-dir" / "trace.json")
    procs, outs = _start([dict(one, PERSEUS_TIMELINE=bad)])
    assert procs[0].returncode == 3, outs[0]
    assert "PERSEUS_TIMELINE=" in outs[0] and "cannot write its timeline" in outs[0], outs[0]
    assert "No such file or directory" in outs[0], outs[0]


def test_a_missing_rank_is_named_while_waiting(store):
    env = {"PERSEUS_RANK": "0", "PERSEUS_SIZE": "2", "GLOO_TIMEOUT_SECONDS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=dict(os.environ, PYTHONPATH=str(REPO), PERSEUS_JOB_ID="missing",
                 PERSEUS_RENDEZVOUS_ADDR="127.0.0.1", PERSEUS_RENDEZVOUS_PORT=str(store),
                 PERSEUS_RENDEZVOUS_SECRET=SECRET.hex(), **env),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(4)
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert "Perseus rank 0: waiting for rank(s) 1 to start" in err, err


def test_a_rank_with_a_different_secret_is_named_by_the_ranks_waiting_for_it(store):
    """Rank 1's secret differs: the store refuses it and it fails at once;
    rank 0, still waiting for a rank 1, says at once that the store refused a
    process and why, instead of only waiting out its start timeout."""
    common = dict(os.environ, PYTHONPATH=str(REPO), PERSEUS_JOB_ID=f"secret{os.getpid()}",
                  PERSEUS_RENDEZVOUS_ADDR="127.0.0.1", PERSEUS_RENDEZVOUS_PORT=str(store),
                  PERSEUS_SIZE="2", GLOO_TIMEOUT_SECONDS="60")
    waiting = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        env=dict(common, PERSEUS_RANK="0", PERSEUS_RENDEZVOUS_SECRET=SECRET.hex()),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        refused = subprocess.run(
            [sys.executable, "-c", CHILD],
            env=dict(common, PERSEUS_RANK="1", PERSEUS_RENDEZVOUS_SECRET=(b"x" * 32).hex()),
            cwd=REPO, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 3 and "INIT FAILED" in refused.stdout, refused.stdout
        # Rank 0's next note would come after GLOO_TIMEOUT_SECONDS (60 s):
        # the refusal is said at once, within a few seconds of it.
        deadline = time.monotonic() + 20
        text = ""
        while "refused a process" not in text and time.monotonic() < deadline:
            time.sleep(0.5)
            text += _read_available(waiting.stderr)
    finally:
        waiting.kill()
        waiting.communicate()
    assert ("waiting for rank(s) 1 to start; the store refused a process at 127.0.0.1 whose "
            "secret differs from this job's") in text, text


def _read_available(stream):
    """What a pipe holds now, without waiting for more."""
    import fcntl
    fd = stream.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        return os.read(fd, 1 << 16).decode(errors="replace")
    except BlockingIOError:
        return ""
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _stray_connections_during_init(store_server, port):
    """Starts 2 ranks; while they connect, opens and closes a TCP connection
    to every listening address Gloo publishes in the store (as a port scan
    would). Returns (outputs, ports hit)."""
    import socket
    import struct
    values = store_server._server.table._values
    procs = []
    job = f"stray{time.monotonic_ns()}"
    for rank in (0, 1):
        env = dict(os.environ, PYTHONPATH=str(REPO), GLOO_TIMEOUT_SECONDS="10",
                   PERSEUS_JOB_ID=job, PERSEUS_RANK=str(rank),
                   PERSEUS_SIZE="2", PERSEUS_RENDEZVOUS_ADDR="127.0.0.1",
                   PERSEUS_RENDEZVOUS_PORT=str(port), PERSEUS_RENDEZVOUS_SECRET=SECRET.hex())
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    hit, tried = set(), set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        for key, value in list(values.items()):
            # Gloo's address list of a rank: sockaddr_storage + sequence, 136 bytes each
            # Only the first attempt's addresses: the retry must then succeed.
            if key in tried or not key.rsplit(b"/", 1)[-1].isdigit() or len(value) % 136 \
                    or b"/retry" in key:
                continue
            tried.add(key)
            for at in range(0, len(value), 136):
                if struct.unpack_from("<H", value, at)[0] == socket.AF_INET:
                    gloo_port = struct.unpack_from(">H", value, at + 2)[0]
                    try:
                        socket.create_connection(("127.0.0.1", gloo_port), timeout=1).close()
                        hit.add(gloo_port)
                    except OSError:
                        pass
        time.sleep(0.001)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append("TIMED OUT: " + p.communicate()[0])
    return outs, hit


def test_a_stray_connection_during_init_costs_a_retry_not_the_job():
    server = StoreServer("127.0.0.1", 0, SECRET)
    port = server.start()
    try:
        for _ in range(3):
            outs, hit = _stray_connections_during_init(server, port)
            for out in outs:
                assert "INIT OK" in out, out
            if any("connecting again (attempt 2 of 3)" in out for out in outs):
                return  # the stray connection broke a pair, and the ranks recovered
    finally:
        server.stop()
    raise AssertionError(f"no stray connection reached a listening Gloo port in time: {hit}")


def test_failed_init_leaves_no_shared_memory_segments(store):
    """Rank 1 dies after connecting, while local rank 0 has made the shared
    segments and waits for it: rank 0's init fails and removes them."""
    before = _shm()
    env = {"PERSEUS_SIZE": "2", "PERSEUS_TEST_EXIT_BEFORE_SHM": "1"}
    procs, outs = _start([dict(env, PERSEUS_RANK="0"), dict(env, PERSEUS_RANK="1")], store)
    assert procs[1].returncode == 7, outs[1]
    assert procs[0].returncode == 3 and "INIT FAILED" in outs[0], outs[0]
    assert _left_behind(before, "perseus-") == set()
