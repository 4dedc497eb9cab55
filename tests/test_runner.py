"""Tests of the perseusrun launcher and the rendezvous store.

The ranks here are small plain-Python programs (no TensorFlow), so that these
tests check only the launcher's contract: environment, output, failures and
signals, and the store's wire protocol.
"""

import hashlib
import hmac
import json
import os
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from perseus_tf.runner import cli, launcher, mpi, output, placement, ssh, supervise
from perseus_tf.common.store import StoreClient, StoreServer

REPO = Path(__file__).resolve().parents[1]
# The ranks import perseus_tf.common.store to talk to the store.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
SECRET = b"s" * 32


def perseusrun_cmd(*args):
    return [sys.executable, "-m", "perseus_tf.runner", *args]


def perseusrun(*args, timeout=60):
    return subprocess.run(perseusrun_cmd(*args), cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def rank_lines(text):
    """Maps rank -> list of that rank's lines in perseusrun's output."""
    lines = {}
    for line in text.splitlines():
        match = re.fullmatch(r"\[(\d+)\] (.*)", line)
        if match:
            lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


def pid_is_gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# A rank that reports its PERSEUS_* environment and proves that the store it
# was pointed at works: every rank publishes a key and reads all the others'.
ENV_REPORTER = r"""
import json, os
from perseus_tf.common.store import StoreClient
env = {k: v for k, v in os.environ.items()
       if k.startswith(("PERSEUS_", "HOROVOD_"))
       or k in ("PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL")}
rank, size = int(env["PERSEUS_RANK"]), int(env["PERSEUS_SIZE"])
with StoreClient(env["PERSEUS_RENDEZVOUS_ADDR"], int(env["PERSEUS_RENDEZVOUS_PORT"]),
                 bytes.fromhex(env["PERSEUS_RENDEZVOUS_SECRET"])) as store:
    store.set(f"hello/{rank}", str(rank).encode())
    env["peers"] = [store.get(f"hello/{r}", 30).decode() for r in range(size)]
    store.add("arrived", 1)
print(json.dumps(env))
"""


def run_env_reporter(*args):
    result = perseusrun(*args, "--", sys.executable, "-c", ENV_REPORTER)
    assert result.returncode == 0, result.stderr
    envs = {rank: json.loads(lines[0])
            for rank, lines in rank_lines(result.stdout).items()}
    return envs


# ---------------------------------------------------------------------------
# Environment contract


def test_env_contract_single_host():
    envs = run_env_reporter("-np", "2")
    assert sorted(envs) == [0, 1]
    for rank, env in envs.items():
        assert env["PERSEUS_RANK"] == str(rank)
        assert env["PERSEUS_SIZE"] == "2"
        assert env["PERSEUS_LOCAL_RANK"] == str(rank)
        assert env["PERSEUS_LOCAL_SIZE"] == "2"
        assert env["PERSEUS_CROSS_RANK"] == "0"
        assert env["PERSEUS_CROSS_SIZE"] == "1"
        assert env["PERSEUS_HOST_ADDR"] == "127.0.0.1"
        assert env["PERSEUS_RENDEZVOUS_ADDR"] == "127.0.0.1"
        assert re.fullmatch(r"[0-9a-f]{64}", env["PERSEUS_RENDEZVOUS_SECRET"])
        assert re.fullmatch(r"[0-9a-f]+", env["PERSEUS_JOB_ID"])
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["TF_CPP_MIN_LOG_LEVEL"] == "2"
        assert env["peers"] == ["0", "1"]
    for name in ("PERSEUS_RENDEZVOUS_PORT", "PERSEUS_RENDEZVOUS_SECRET",
                 "PERSEUS_JOB_ID"):
        assert envs[0][name] == envs[1][name]


def test_env_contract_two_hosts():
    envs = run_env_reporter("-np", "4", "-H", "localhost:2,127.0.0.2:2")
    expected = {  # rank: (local_rank, cross_rank, host_addr)
        0: (0, 0, "127.0.0.1"), 1: (1, 0, "127.0.0.1"),
        2: (0, 1, "127.0.0.2"), 3: (1, 1, "127.0.0.2")}
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, (local_rank, cross_rank, host_addr) in expected.items():
        env = envs[rank]
        assert env["PERSEUS_SIZE"] == "4"
        assert env["PERSEUS_LOCAL_RANK"] == str(local_rank)
        assert env["PERSEUS_LOCAL_SIZE"] == "2"
        assert env["PERSEUS_CROSS_RANK"] == str(cross_rank)
        assert env["PERSEUS_CROSS_SIZE"] == "2"
        assert env["PERSEUS_HOST_ADDR"] == host_addr
        assert env["peers"] == ["0", "1", "2", "3"]
        # horovodrun's variables, which scripts and Horovod's tests read.
        assert {k: v for k, v in env.items() if k.startswith("HOROVOD_")} == {
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "4",
            "HOROVOD_LOCAL_RANK": str(local_rank), "HOROVOD_LOCAL_SIZE": "2",
            "HOROVOD_CROSS_RANK": str(cross_rank), "HOROVOD_CROSS_SIZE": "2",
            "HOROVOD_HOSTNAME": "localhost" if cross_rank == 0 else "127.0.0.2",
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
    # A fresh job id for every launch.
    other = run_env_reporter("-np", "1")
    assert other[0]["PERSEUS_JOB_ID"] != envs[0]["PERSEUS_JOB_ID"]


def _non_loopback_address():
    """An address of this machine outside 127/8, found without sending anything."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("198.51.100.1", 9))
            addr = sock.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_env_contract_non_loopback_local_address():
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    envs = run_env_reporter("-np", "2", "-H", f"{addr}:2")
    for env in envs.values():
        assert env["PERSEUS_HOST_ADDR"] == addr
        assert env["PERSEUS_RENDEZVOUS_ADDR"] == addr
        assert env["peers"] == ["0", "1"]


def test_uneven_hosts_placement():
    hosts = [placement.Host("localhost", "127.0.0.1", 2),
             placement.Host("127.0.0.2", "127.0.0.2", 2),
             placement.Host("127.0.0.3", "127.0.0.3", 4)]
    placements = placement.place_ranks(3, hosts)
    assert [(p.local_rank, p.local_size, p.cross_rank, p.cross_size,
             p.host.addr) for p in placements] == [
        (0, 2, 0, 2, "127.0.0.1"), (1, 2, 0, 2, "127.0.0.1"),
        (0, 1, 1, 2, "127.0.0.2")]


# ---------------------------------------------------------------------------
# Output


def test_output_is_prefixed_by_rank():
    child = ("import os, sys\n"
             "r = os.environ['PERSEUS_RANK']\n"
             "print(f'out one {r}'); print(f'out two {r}')\n"
             "print(f'err {r}', file=sys.stderr)\n"
             "sys.stdout.write(f'no newline {r}')\n")
    result = perseusrun("-np", "2", sys.executable, "-c", child)
    assert result.returncode == 0, result.stderr
    out, err = rank_lines(result.stdout), rank_lines(result.stderr)
    for r in (0, 1):
        assert out[r] == [f"out one {r}", f"out two {r}", f"no newline {r}"]
        assert err[r] == [f"err {r}"]
    assert all(line.startswith("[") for line in result.stdout.splitlines())


def test_users_tf_cpp_min_log_level_wins():
    result = subprocess.run(
        perseusrun_cmd("-np", "1", sys.executable, "-c",
                       "import os; print(os.environ['TF_CPP_MIN_LOG_LEVEL'])"),
        cwd=REPO, env=dict(ENV, TF_CPP_MIN_LOG_LEVEL="0"), capture_output=True,
        text=True, timeout=60)
    assert rank_lines(result.stdout) == {0: ["0"]}, result.stderr


def test_carriage_return_updates_are_forwarded_as_they_come(tmp_path):
    """A progress bar redraws itself with \\r and no \\n: each update must
    reach the terminal at once, prefixed, not as one long line at the end."""
    seen = tmp_path / "seen"
    child = (f"import os, sys, time\n"
             f"sys.stdout.write('1/3 [=>  ]\\r'); sys.stdout.flush()\n"
             f"deadline = time.time() + 20\n"
             f"while not os.path.exists({str(seen)!r}) and time.time() < deadline:\n"
             f"    time.sleep(0.05)\n"
             f"print('waited' if os.path.exists({str(seen)!r}) else 'update held back')\n"
             f"sys.stdout.write('2/3 [==> ]\\r3/3 [===]\\r\\n'); sys.stdout.flush()\n")
    proc = subprocess.Popen(perseusrun_cmd("-np", "1", sys.executable, "-c", child),
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        got = b""
        while b"\r" not in got:
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, (got, proc.stderr.read())
            got += chunk
        seen.write_text("yes")
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert got == b"[0] 1/3 [=>  ]\r", got
    assert rest == b"[0] waited\n[0] 2/3 [==> ]\r[0] 3/3 [===]\r\n", rest
    assert output._segments(b"a\r\nb\rc") == ([b"a\r\n", b"b\r"], [b"c"])
    assert output._segments(b"d\ne", [b"x", b"y"]) == ([b"xyd\n"], [b"e"])
    assert output._segments(b"more", [b"x"]) == ([], [b"x", b"more"])


TF_NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795595146.043765   13913 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "E0000 00:00:1795595149.673293   13913 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "W0000 00:00:1795595149.673293   13913 gpu_device.cc:2344] Cannot dlopen some GPU libraries.",
    "2026-11-25 08:00:00.123456: E external/local_xla/xla/stream_executor/cuda/cuda_dnn.cc:9261] "
    "Unable to register cuDNN factory: Attempting to register factory for plugin cuDNN",
    "2026-11-25 08:00:00.123456: I tensorflow/core/platform/cpu_feature_guard.cc:182] This "
    "TensorFlow binary is optimized to use available CPU instructions",
    # The first float16 op on a CPU without AVX-512 (TF 2.15's format and absl's).
    "2025-03-11 22:30:58.742701: E tensorflow/core/util/util.cc:131] oneDNN supports DT_HALF "
    "only on platforms with AVX-512. Falling back to the default Eigen-based implementation "
    "if present.",
    "E0000 00:00:1795595150.673293   13913 util.cc:131] oneDNN supports DT_HALF only on "
    "platforms with AVX-512. Falling back to the default Eigen-based implementation if present.",
]
TF_REAL_ERROR = ("E0000 00:00:1795595149.673293   13913 some_kernel.cc:52] OOM when allocating "
                 "tensor with shape [1024,1024]")


@pytest.mark.parametrize("how", ["default", "--tf-logs", "PERSEUS_TF_LOGS=1",
                                 "TF_CPP_MIN_LOG_LEVEL=0"])
def test_tensorflow_start_up_lines_stay_off_the_screen(how):
    """TF's C++ start-up notes (and the cuInit error of a machine without a
    GPU) are dropped by default; a real error, and the rank's own lines,
    stay. --tf-logs, PERSEUS_TF_LOGS=1 or the user's own
    TF_CPP_MIN_LOG_LEVEL show them all again."""
    child = ("import sys\n"
             f"lines = {TF_NOISE + [TF_REAL_ERROR]!r}\n"
             "sys.stderr.write('\\n'.join(lines) + '\\n'); sys.stderr.flush()\n"
             "print('user line', flush=True)\n")
    env = dict(ENV)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    options = []
    if how == "--tf-logs":
        options = ["--tf-logs"]
    elif how != "default":
        name, value = how.split("=")
        env[name] = value
    result = subprocess.run(perseusrun_cmd(*options, "-np", "1", sys.executable, "-c", child),
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert rank_lines(result.stdout) == {0: ["user line"]}
    shown = rank_lines(result.stderr).get(0, [])
    if how == "default":
        assert shown == [TF_REAL_ERROR], shown
    else:
        assert shown == TF_NOISE + [TF_REAL_ERROR], shown


def test_a_real_tensorflow_start_is_quiet():
    # What this TensorFlow really prints on import (TF 2.15 and 2.21 differ).
    result = subprocess.run(
        perseusrun_cmd("-np", "1", sys.executable, "-c",
                       "import tensorflow as tf; tf.constant(1.0) + 1; print('ready')"),
        cwd=REPO, env={k: v for k, v in ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"},
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert rank_lines(result.stdout) == {0: ["ready"]}
    assert result.stderr.strip() == "", result.stderr[-3000:]


def test_long_lines_are_forwarded_in_linear_time():
    """An 8 MB line (a dumped array, say) once took 19 s to forward, the rank
    blocked in write() throughout: each 64 KiB read re-scanned everything
    before it. It must arrive whole, and in well under that."""
    child = ("import sys\n"
             "sys.stdout.write('x' * (8 << 20) + '\\n' + 'after\\n'); sys.stdout.flush()\n")
    start = time.monotonic()
    result = subprocess.run(perseusrun_cmd("-np", "1", sys.executable, "-c", child), cwd=REPO,
                            env=ENV, capture_output=True, timeout=120)
    took = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == b"[0] " + b"x" * (8 << 20) + b"\n[0] after\n"
    assert took < 8, f"forwarding an 8 MB line took {took:.1f} s"


# ---------------------------------------------------------------------------
# Failures


def test_failing_rank_is_named_and_others_are_stopped(tmp_path):
    # Rank 0 would sleep for 5 minutes; rank 1 fails once rank 0 is up.
    child = (f"import os, sys, time\n"
             f"pidfile = {str(tmp_path / 'rank0.pid')!r}\n"
             f"if os.environ['PERSEUS_RANK'] == '0':\n"
             f"    open(pidfile + '.tmp', 'w').write(str(os.getpid()))\n"
             f"    os.rename(pidfile + '.tmp', pidfile)\n"
             f"    time.sleep(300)\n"
             f"while not os.path.exists(pidfile): time.sleep(0.02)\n"
             f"sys.exit(3)\n")
    start = time.monotonic()
    result = perseusrun("-np", "2", "--grace-seconds", "1",
                        sys.executable, "-c", child)
    elapsed = time.monotonic() - start
    assert result.returncode == 3
    assert re.search(r"^perseusrun: rank 1 \(pid \d+\) failed with exit status 3$",
                     result.stderr, re.M), result.stderr
    assert "rank 0 (pid" not in result.stderr  # only the first failure is named
    assert elapsed < 15
    assert pid_is_gone(int((tmp_path / "rank0.pid").read_text()))


def test_rank_killed_by_signal_and_sigterm_ignored_escalates_to_sigkill(tmp_path):
    # Rank 0 ignores SIGTERM, so only the SIGKILL that follows stops it.
    child = (f"import os, signal, time\n"
             f"pidfile = {str(tmp_path / 'rank0.pid')!r}\n"
             f"if os.environ['PERSEUS_RANK'] == '0':\n"
             f"    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             f"    open(pidfile + '.tmp', 'w').write(str(os.getpid()))\n"
             f"    os.rename(pidfile + '.tmp', pidfile)\n"
             f"    time.sleep(300)\n"
             f"while not os.path.exists(pidfile): time.sleep(0.02)\n"
             f"os.kill(os.getpid(), signal.SIGKILL)\n")
    start = time.monotonic()
    result = perseusrun("-np", "2", "--grace-seconds", "0.2",
                        sys.executable, "-c", child)
    elapsed = time.monotonic() - start
    assert result.returncode == 128 + signal.SIGKILL
    assert re.search(r"^perseusrun: rank 1 \(pid \d+\) killed by signal SIGKILL$",
                     result.stderr, re.M), result.stderr
    assert supervise.KILL_DELAY_S <= elapsed < supervise.KILL_DELAY_S + 10
    assert pid_is_gone(int((tmp_path / "rank0.pid").read_text()))


def test_other_ranks_may_finish_within_grace():
    child = ("import os, sys, time\n"
             "if os.environ['PERSEUS_RANK'] == '1': sys.exit(3)\n"
             "time.sleep(0.5); print('finished')\n")
    result = perseusrun("-np", "2", "--grace-seconds", "20",
                        sys.executable, "-c", child)
    assert result.returncode == 3
    assert rank_lines(result.stdout)[0] == ["finished"]
    assert "SIGTERM" not in result.stderr


FIRST_FAILURE_SCRIPT = """
import atexit, os, time
rank = int(os.environ["PERSEUS_RANK"])
if rank == 1:
    # Registered before the runtime's own exit handler, so it runs after it:
    # rank 1 leaves the job at once, then takes its time to exit.
    atexit.register(time.sleep, 4)
import tensorflow as tf
import perseus_tf.horovod as hvd
hvd.init()
hvd.allreduce(tf.ones([1]), name="warm")
if rank == 1:
    raise RuntimeError("boom from rank 1")
hvd.allreduce(tf.ones([1]), name="never")
"""


def test_the_rank_that_failed_first_is_named_not_the_first_to_exit():
    # Rank 0 fails because rank 1 left, and exits first; rank 1's exception
    # is the cause. perseusrun names rank 1, its status and its error, and
    # exits with its status; the failure record itself stays off the screen.
    result = perseusrun("-np", "2", "--grace-seconds", "30", sys.executable, "-c",
                        FIRST_FAILURE_SCRIPT, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"^perseusrun: first failure: rank 1 \(pid \d+\) failed with exit status 1; "
                     r"its error: RuntimeError: boom from rank 1$", result.stderr, re.M), \
        result.stderr[-3000:]
    assert "PERSEUS-FAILURE-RECORD" not in result.stderr


class _FakeProc:
    def __init__(self, pid, returncode):
        self.pid, self.returncode = pid, returncode


def _group_of(statuses, records, stopped=()):
    group = supervise.RankGroup()
    for rank, status in enumerate(statuses):
        child = supervise._Child(_FakeProc(100 + rank, status), f"rank {rank}", "", False, rank)
        child.exited_at = 1000.0 + rank
        child.stopped_by_us = rank in stopped
        group.children.append(child)
    for record in records:
        group._add_record(dict({"error": "", "culprits": []}, **record))
    return group


def test_first_failure_follows_the_blame():
    # Rank 0 blames rank 2 (dead: killed by perseusrun's SIGKILL after it
    # stopped responding); rank 1 blames it too: rank 2 is the cause.
    group = _group_of([1, 1, -9], [{"rank": 0, "time": 5.0, "culprits": [2]},
                                   {"rank": 1, "time": 6.0, "culprits": [2]}], stopped={2})
    assert group._report_first_failure(0) == 2
    # No record blames anyone: the earliest failure (record time, else exit).
    group = _group_of([1, 1, 0], [{"rank": 1, "time": 10.0}, {"rank": 0, "time": 20.0}])
    assert group._report_first_failure(0) == 1
    # A rank that blames others is not the cause while one that does not failed.
    group = _group_of([1, 1], [{"rank": 0, "time": 1.0, "culprits": [1]}])
    assert group._report_first_failure(0) == 1
    # Ranks perseusrun stopped after the failure are victims, not causes.
    group = _group_of([3, -15], [], stopped={1})
    assert group._report_first_failure(0) == 0
    # mpirun (one child for every rank): the records name the rank.
    group = supervise.RankGroup()
    group.children.append(supervise._Child(_FakeProc(5, 1), "mpirun", "", False))
    group._add_record({"rank": 3, "time": 2.0, "culprits": [], "error": "E"})
    group._add_record({"rank": 0, "time": 1.0, "culprits": [3], "error": "F"})
    assert group._report_first_failure(0) == 0


def test_failure_records_are_parsed_and_taken_out_of_the_output():
    from perseus_tf import _failure_record
    record = _failure_record.make_record(2, ValueError, ValueError("bad\nsecond line"))
    taken = []
    kept = output._take_records([b"before\n", b"partial " + record, b"after\n"], taken.append)
    assert kept == [b"before\n", b"partial \n", b"after\n"]
    assert taken[0]["rank"] == 2 and taken[0]["error"] == "ValueError: bad"
    assert _failure_record.parse_record(b"ordinary line\n") is None
    assert _failure_record.parse_record(_failure_record.RECORD_PREFIX + b"{not json\n") is None


# ---------------------------------------------------------------------------
# Signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_every_rank(signum):
    child = ("import signal, sys, time\n"
             "def stop(signum, frame):\n"
             "    print(f'got {signum}'); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             "signal.signal(signal.SIGINT, stop)\n"
             "print('ready')\n"
             "time.sleep(300)\n")
    proc = subprocess.Popen(perseusrun_cmd("-np", "2", sys.executable, "-c", child),
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout],
                              daemon=True)
    reader.start()
    try:
        seen = []
        while seen.count("ready") < 2:
            seen.append(lines.get(timeout=30).split("] ", 1)[1].strip())
        proc.send_signal(signum)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    rest = "".join(lines.get() for _ in range(lines.qsize()))
    assert rank_lines(rest) == {0: [f"got {int(signum)}"], 1: [f"got {int(signum)}"]}


BLOCKED_IN_A_COLLECTIVE = """
import numpy as np
from perseus_tf import _native
from perseus_tf._native import DTYPE_CODES, OP_ALLREDUCE, _core
_native.init()
rank = _native.topology()["rank"]
x = np.ones(4, np.float32)
print("ready", flush=True)
# Each rank waits for a collective the other never makes: a wait in C++ that
# Python's SIGINT handler cannot interrupt.
_core.submit(OP_ALLREDUCE, x, f"only-rank-{rank}", DTYPE_CODES["float32"], output=x).wait()
"""


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_ranks_blocked_in_a_collective(presses):
    """Ranks blocked in a collective cannot act on SIGINT. The first Ctrl-C
    once did nothing for up to PERSEUS_STALL_TIMEOUT_SECONDS (1800 s) and a
    second did not escalate; now the first stops them within seconds
    (SIGTERM after INTERRUPT_GRACE_S) and the second kills them at once."""
    proc = subprocess.Popen(perseusrun_cmd("-np", "2", sys.executable, "-c",
                                           BLOCKED_IN_A_COLLECTIVE),
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    try:
        ready = 0
        while ready < 2:
            ready += "ready" in lines.get(timeout=60)
        time.sleep(0.5)  # both are inside the wait
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if presses == 2:
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert status == 130, (status, err[-2000:])  # 128 + SIGINT, as a shell says; it was 143
    assert "Ctrl-C again to kill them now" in err, err[-2000:]
    if presses == 1:
        assert supervise.INTERRUPT_GRACE_S - 0.5 < took < supervise.INTERRUPT_GRACE_S + 10, took
        assert "SIGTERM" in err, err[-2000:]
    else:
        assert took < 5, took
        assert "killing the ranks (SIGKILL)" in err, err[-2000:]


def _wait_for_pids(directory, count, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p.read_text()) for p in Path(directory).glob("*.pid")]
        if len(pids) == count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"ranks did not start: {list(Path(directory).iterdir())}")


def test_ranks_die_with_a_killed_launcher(tmp_path):
    """SIGKILL of perseusrun: a plain rank gets the parent-death SIGTERM; a
    rank that ignores SIGTERM is stopped by the runtime's launcher watch,
    with its children."""
    child = (f"import os, signal, subprocess, sys, time\n"
             f"rank = os.environ['PERSEUS_RANK']\n"
             f"if rank == '1':\n"
             f"    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
             f"    from perseus_tf import _native\n"
             f"    _native.init()\n"
             f"    kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
             f"    open({str(tmp_path)!r} + '/kid.pid', 'w').write(str(kid.pid))\n"
             f"else:\n"
             f"    from perseus_tf import _native\n"
             f"    _native.init()\n"
             f"open({str(tmp_path)!r} + f'/rank{{rank}}.tmp', 'w').write(str(os.getpid()))\n"
             f"os.rename({str(tmp_path)!r} + f'/rank{{rank}}.tmp', {str(tmp_path)!r} + f'/rank{{rank}}.pid')\n"
             f"time.sleep(300)\n")
    proc = subprocess.Popen(perseusrun_cmd("-np", "2", sys.executable, "-c", child),
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        pids = _wait_for_pids(tmp_path, 3)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(pid_is_gone(p) for p in pids):
            time.sleep(0.1)
        assert all(pid_is_gone(p) for p in pids), [p for p in pids if not pid_is_gone(p)]
    finally:
        for p in Path(tmp_path).glob("*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


# ---------------------------------------------------------------------------
# Command line


def test_help_explains_every_flag(capsys):
    assert launcher.main(["-h"]) == 0
    text = capsys.readouterr().out
    for flag in ("-np", "-H", "--hostfile", "-p", "--ssh-port", "-i", "--ssh-identity-file",
                 "--network-interface", "--start-timeout", "-x", "--gloo", "--mpi",
                 "--grace-seconds", "--verbose"):
        assert flag in text


def test_hostfile_in_open_mpi_format(tmp_path):
    text = ("# two hosts\n\nnode-a slots=2\n  node-b slots=3 max_slots=4  # comment\n"
            "node-c\n")
    assert cli.parse_hostfile(text) == [("node-a", 2), ("node-b", 3), ("node-c", 1)]
    for bad, needle in (("node-a slots=x\n", "slots must be an integer"),
                        ("node-a cpus=2\n", "cannot read 'cpus=2'"),
                        ("a\na slots=2\n", "listed twice"),
                        ("# nothing\n", "lists no host")):
        with pytest.raises(cli.UsageError, match=needle):
            cli.parse_hostfile(bad, "hf")
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\n")
    args = launcher._parse_args(cli.build_parser(),
                                ["-np", "2", "--hostfile", str(path), "true"])
    assert [(h.name, h.slots, h.local) for h in args.hosts] == [("localhost", 2, True)]
    # A binary file (a key, an archive) once gave a traceback.
    binary = tmp_path / "binary"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(cli.UsageError, match="is not a text file"):
        launcher._parse_args(cli.build_parser(),
                             ["-np", "2", "--hostfile", str(binary), "true"])


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_scratch_of_a_rank_killed_by_a_signal_is_removed(tmp_path, how):
    """Ranks above 0 keep full checkpoint copies in a scratch directory
    (strategy/keras_files.py) that they remove at exit; killed by a signal
    they could not, and /tmp/perseus-rank<N>-* stayed behind. perseusrun
    removes what its ranks left once they have exited."""
    child = ("import os, signal, sys, time\n"
             "from perseus_tf.common.scratch import rank_scratch\n"
             "rank = int(os.environ['PERSEUS_RANK'])\n"
             "path = rank_scratch(rank)\n"
             "open(os.path.join(path, 'copy.weights.h5'), 'w').write('x')\n"
             f"open(os.path.join({str(tmp_path)!r}, f'rank{{rank}}'), 'w').write(path)\n"
             f"if rank == 1: os.kill(os.getpid(), signal.{how})\n"
             "time.sleep(0.5)\n")
    result = subprocess.run(perseusrun_cmd("-np", "2", sys.executable, "-c", child), cwd=REPO,
                            env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "rank 1" in result.stderr, result.stderr[-2000:]
    made = (tmp_path / "rank1").read_text()
    assert "perseus-" in made and "-rank1-" in made, made
    assert not os.path.exists(made), f"{made} was left behind"
    assert not os.path.exists((tmp_path / "rank0").read_text())


def test_exported_values_travel_on_standard_input_not_the_command_line(tmp_path):
    """-x MY_API_KEY once put the key's value on the local ssh command line,
    readable by any user in /proc/PID/cmdline for the whole job. It goes to
    remote.py's standard input with the secret, and reaches the rank."""
    args = cli.build_parser().parse_args([
        "-np", "1", "-H", "node-a:1", "-x", "MY_API_KEY=sk-do-not-show", "-x", "OTHER=2",
        "python", "t.py"])
    env = {"PERSEUS_RANK": "0", "MY_API_KEY": "sk-do-not-show", "OTHER": "2", "PATH": "/bin"}
    cmd, stdin_data = ssh.remote_invocation(
        args, "node-a", env, {"MY_API_KEY": "sk-do-not-show", "OTHER": "2"}, SECRET)
    assert not any("sk-do-not-show" in part or "OTHER=" in part for part in cmd), cmd
    assert "PERSEUS_RANK=0" in cmd[-1]
    # remote.py, given that standard input, starts the rank with both values
    # (and the secret), the rest of its environment from the command line.
    out = tmp_path / "env.json"
    child = ("import json, os, sys; json.dump({k: os.environ.get(k) for k in "
             "('MY_API_KEY', 'OTHER', 'PERSEUS_RENDEZVOUS_SECRET')}, open(sys.argv[1], 'w'))")
    proc = subprocess.Popen([sys.executable, "-m", "perseus_tf.runner.remote", "--",
                             sys.executable, "-c", child, str(out)], cwd=REPO, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(stdin_data)
    proc.stdin.flush()
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert json.loads(out.read_text()) == {"MY_API_KEY": "sk-do-not-show", "OTHER": "2",
                                           "PERSEUS_RENDEZVOUS_SECRET": SECRET.hex()}


def test_exports_and_forwarded_environment(monkeypatch):
    base = {"PERSEUS_X": "1", "GLOO_TIMEOUT_SECONDS": "5", "NCCL_DEBUG": "INFO",
            "PATH": "/bin", "PYTHONPATH": "/p", "VIRTUAL_ENV": "/v", "LD_LIBRARY_PATH": "/l",
            "HOME": "/root", "SECRET_TOKEN": "s", "PERSEUS_RENDEZVOUS_SECRET": "abc",
            "FOO": "bar"}
    env = placement.forwarded_env(base, ["FOO", "BAZ=1=2"])
    assert env == {"PERSEUS_X": "1", "GLOO_TIMEOUT_SECONDS": "5", "NCCL_DEBUG": "INFO",
                   "PATH": "/bin", "PYTHONPATH": "/p", "VIRTUAL_ENV": "/v",
                   "LD_LIBRARY_PATH": "/l", "FOO": "bar", "BAZ": "1=2",
                   "TF_CPP_MIN_LOG_LEVEL": "2"}
    with pytest.raises(cli.UsageError, match="-x NOPE: NOPE is not set"):
        cli.export_values(base, ["NOPE"])
    with pytest.raises(cli.UsageError, match="NAME must be"):
        cli.export_values(base, ["1BAD=2"])


def test_remote_command_keeps_the_secret_off_the_command_line():
    text = ssh.remote_command({"PERSEUS_RANK": "1", "A": "x y"}, ["python", "t.py", "a b"],
                                   "/work dir")
    assert text.startswith("cd '/work dir' && exec env ")
    assert "'A=x y'" in text and "PERSEUS_RANK=1" in text and "'a b'" in text
    assert "perseus_tf.runner.remote -- python t.py" in text
    assert "SECRET" not in text


def test_mpirun_command_line(monkeypatch):
    args = launcher._parse_args(cli.build_parser(), [
        "--mpi", "-np", "4", "-H", "localhost:4", "-p", "2222", "--network-interface", "lo",
        "-x", "FOO=1", "python", "t.py"])
    cmd = mpi.mpirun_command(args, ["PERSEUS_RENDEZVOUS_SECRET", "FOO"])
    text = " ".join(cmd)
    assert cmd[:3] == ["mpirun", "-np", "4"] and "-H localhost:4" in text
    assert "-mca plm_rsh_args -p 2222" in text and "-mca oob_tcp_if_include lo" in text
    assert "-x PERSEUS_RENDEZVOUS_SECRET -x FOO" in text
    assert text.endswith("perseus_tf.runner.remote --mpi -- python t.py")


def test_unresolvable_host_is_rejected(capsys, tmp_path):
    assert launcher.main(["-np", "2", "-H", "no-such-host.invalid:2", "true"]) == 2
    assert "-H/--hosts: cannot resolve host 'no-such-host.invalid'" in capsys.readouterr().err
    # From a hostfile, the error names the hostfile (it once said -H).
    hostfile = tmp_path / "hosts"
    hostfile.write_text("no-such-host.invalid slots=2\n")
    assert launcher.main(["-np", "2", "--hostfile", str(hostfile), "true"]) == 2
    err = capsys.readouterr().err
    assert "--hostfile: cannot resolve host 'no-such-host.invalid'" in err, err


def test_more_ranks_than_slots_is_rejected(capsys):
    assert launcher.main(["-np", "3", "-H", "localhost:2", "true"]) == 2
    err = capsys.readouterr().err
    assert "-np 3" in err and "-H" in err and "2 slots" in err


def test_missing_command_is_rejected(capsys):
    assert launcher.main(["-np", "2", "--"]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_a_bad_setting_is_one_line_from_perseusrun_before_any_rank_starts(tmp_path, capsys,
                                                                          monkeypatch):
    """A bad PERSEUS_* value once gave a 13-line traceback from every rank."""
    marker = tmp_path / "started"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    monkeypatch.setenv("PERSEUS_ALLREDUCE_STREAMS", "abc")
    assert launcher.main(["-np", "2"] + command) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "perseusrun: PERSEUS_ALLREDUCE_STREAMS='abc' is invalid: it must be an integer from 1 "
        "to 12; no rank was started"], err
    # Given with -x, the same.
    monkeypatch.delenv("PERSEUS_ALLREDUCE_STREAMS")
    assert launcher.main(["-np", "2", "-x", "PERSEUS_ALLREDUCE_DTYPE=7"] + command) == 2
    assert "PERSEUS_ALLREDUCE_DTYPE='7' is invalid" in capsys.readouterr().err
    assert not marker.exists()


def test_a_script_given_as_the_command_is_named_with_the_fix(tmp_path, capsys, monkeypatch):
    """`perseusrun -np 2 train.py` once said "No such file or directory:
    'train.py'" although the file was there. An executable script (with a
    #! line and x bit) is a program and runs as one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    assert launcher.main(["-np", "2", "train.py", "--epochs", "3"]) == 2
    err = capsys.readouterr().err
    assert "train.py is a Python script" in err
    assert "did you mean `perseusrun ... python train.py --epochs 3`?" in err
    runnable = tmp_path / "run.py"
    runnable.write_text("#!/bin/sh\necho ran\n")
    runnable.chmod(0o755)
    args = launcher._parse_args(cli.build_parser(), ["-np", "1", str(runnable)])
    assert args.command == [str(runnable)]


def test_runner_does_not_import_tensorflow():
    result = subprocess.run(
        [sys.executable, "-c",
         "import sys, perseus_tf.runner; print('tensorflow' in sys.modules)"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


# ---------------------------------------------------------------------------
# Store


@pytest.fixture
def store():
    server = StoreServer("127.0.0.1", 0, SECRET, handshake_timeout_s=0.5)
    server.start()
    yield server
    server.stop()


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def mac(secret, *parts):
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def connect_raw(port, secret=SECRET, client_nonce=b"c" * 32):
    """Connects and answers the store's challenge byte by byte, as the C++
    client does; returns the socket and the server's nonce. The verdict is
    left for the caller to read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    hello = recv_exact(sock, 8 + 32)
    assert hello[:8] == b"PERSEUS\x02"
    server_nonce = hello[8:]
    sock.sendall(client_nonce
                 + mac(secret, b"perseus-store client proof", server_nonce, client_nonce))
    return sock, server_nonce


def test_store_rejects_wrong_secret(store):
    with pytest.raises(PermissionError):
        StoreClient("127.0.0.1", store.port, b"x" * 32)
    sock, _ = connect_raw(store.port, b"wrong")
    with sock:
        assert sock.recv(1) == b"\x00"
        assert sock.recv(1) == b""  # closed after the rejection


def test_store_drops_silent_client(store):
    with socket.create_connection(("127.0.0.1", store.port), timeout=10) as sock:
        start = time.monotonic()
        assert len(recv_exact(sock, 8 + 32)) == 40  # the challenge, then nothing
        assert sock.recv(1) == b""
        assert time.monotonic() - start < 5


def test_store_wire_format(store):
    # The exact bytes the C++ client sends and receives.
    client_nonce = bytes(range(32))
    sock, server_nonce = connect_raw(store.port, client_nonce=client_nonce)
    with sock:
        assert recv_exact(sock, 1 + 32) == b"\x01" + mac(
            SECRET, b"perseus-store server proof", client_nonce, server_nonce)
        sock.sendall(b"\x01" + struct.pack("<I", 1) + b"k"
                     + struct.pack("<Q", 3) + b"abc")
        assert recv_exact(sock, 1) == b"\x00"
        sock.sendall(b"\x02" + struct.pack("<I", 1) + b"k" + struct.pack("<I", 0))
        assert recv_exact(sock, 1 + 8 + 3) == b"\x00" + struct.pack("<Q", 3) + b"abc"
        sock.sendall(b"\x02" + struct.pack("<I", 1) + b"m" + struct.pack("<I", 50))
        assert recv_exact(sock, 1) == b"\x01"
        sock.sendall(b"\x03" + struct.pack("<I", 1) + b"n" + struct.pack("<q", -5))
        assert recv_exact(sock, 8) == struct.pack("<q", -5)
        sock.sendall(b"\x09")  # unknown command: connection closed
        assert sock.recv(1) == b""


def test_store_set_get_overwrite(store):
    with StoreClient("127.0.0.1", store.port, SECRET) as client:
        client.set("a", b"1")
        assert client.get("a", 1) == b"1"
        client.set("a", b"")
        assert client.get("a", 1) == b""
        big = os.urandom(3 << 20)
        client.set("big", big)
        assert client.get("big", 1) == big


def test_store_get_times_out(store):
    with StoreClient("127.0.0.1", store.port, SECRET) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.get("missing", 0.3)
        assert 0.25 <= time.monotonic() - start < 3


def test_store_get_waits_for_set(store):
    def set_later():
        time.sleep(0.3)
        with StoreClient("127.0.0.1", store.port, SECRET) as other:
            other.set("late", b"here")

    setter = threading.Thread(target=set_later)
    setter.start()
    with StoreClient("127.0.0.1", store.port, SECRET) as client:
        assert client.get("late", 10) == b"here"
    setter.join()


def test_store_add_is_atomic_across_threads(store):
    def add_many():
        with StoreClient("127.0.0.1", store.port, SECRET) as client:
            for _ in range(50):
                client.add("counter", 1)

    threads = [threading.Thread(target=add_many) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with StoreClient("127.0.0.1", store.port, SECRET) as client:
        assert client.add("counter", -400) == 0
        assert client.add("counter", 400) == 400
        assert client.get("counter", 1) == struct.pack("<q", 400)


def test_store_stop_wakes_waiting_get():
    server = StoreServer("127.0.0.1", 0, SECRET)
    server.start()
    client = StoreClient("127.0.0.1", server.port, SECRET)
    outcome = []

    def wait_forever():
        try:
            client.get("never", 60)
        except (ConnectionError, TimeoutError) as err:
            outcome.append(err)

    waiter = threading.Thread(target=wait_forever)
    waiter.start()
    time.sleep(0.2)
    server.stop()
    waiter.join(5)
    client.close()
    assert not waiter.is_alive() and outcome


def test_perseusruns_own_lines_start_lines_of_their_own():
    # A rank's progress bar ends its updates in \r; perseusrun's message
    # about that rank's exit once went on the same line ("[0] 3/10\rperseusrun:
    # rank 0 ..."), the terminal showing it over the bar.
    child = ("import sys\n"
             "sys.stderr.write('3/10 [===>      ]\\r'); sys.stderr.flush()\n"
             "sys.exit(3)\n")
    proc = subprocess.run(perseusrun_cmd("-np", "1", sys.executable, "-c", child), cwd=REPO,
                          env=ENV, capture_output=True, timeout=60)
    err = proc.stderr.decode()  # bytes: text mode would turn the \r into \n
    assert proc.returncode == 3, err
    assert "[0] 3/10 [===>      ]\r" in err, repr(err)
    ours = [line for line in err.split("\n") if "perseusrun:" in line]
    assert ours and all(line.startswith("perseusrun: ") for line in ours), repr(err)
