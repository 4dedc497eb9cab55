"""Dead and stuck ranks, bad configuration, world size 1, clean shutdown."""

import importlib.metadata
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from harness import ROOT, WORKERS, collect, launch, rank_env

# TF 2.15 ships Keras 2 (tf.keras); later versions Keras 3.
KERAS_2 = importlib.metadata.version("tensorflow").startswith("2.15")


def _survivor_reports(proc, np_):
    reports = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\[(\d+)\] REPORTED ([\d.]+) (.*)", line)
        if m:
            reports[int(m.group(1))] = (float(m.group(2)), m.group(3))
    return reports


def _assert_last_rank_killed_and_named(proc, np_, victim=None):
    """The launcher names the SIGKILLed rank (default: the last); every
    survivor reported it by name within GLOO_TIMEOUT_SECONDS (20 in these
    tests)."""
    victim = np_ - 1 if victim is None else victim
    assert proc.returncode != 0
    assert f"rank {victim}" in proc.stderr and "signal SIGKILL" in proc.stderr, proc.stderr[-2000:]
    reports = _survivor_reports(proc, np_)
    assert sorted(reports) == [r for r in range(np_) if r != victim], \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, (seconds, message) in reports.items():
        assert f"rank {victim} exited or lost its connection" in message, message
        assert seconds < 20, f"rank {rank} took {seconds}s to notice"


@pytest.mark.parametrize("np_,api", [(4, "core"), (2, "tf"), (2, "tf_function")])
def test_killed_rank_is_named_by_every_survivor(np_, api):
    start = time.time()
    proc = launch(np_, [sys.executable, os.path.join(WORKERS, "failure_worker.py"), "kill", api],
                  env={"GLOO_TIMEOUT_SECONDS": "20"}, timeout=180)
    _assert_last_rank_killed_and_named(proc, np_)
    assert time.time() - start < 120


@pytest.mark.parametrize("victim", [2, 3], ids=["leader", "non-leader"])
def test_killed_rank_during_two_level_allreduce_is_named(victim):
    # 2 hosts x 2 ranks, hierarchical, 12 MB tensors (3 pipelined chunks):
    # host 1's leader (rank 2) or its other rank dies mid-training.
    proc = launch(4, [sys.executable, os.path.join(WORKERS, "failure_worker.py"), "kill", "core"],
                  env={"GLOO_TIMEOUT_SECONDS": "20", "PERSEUS_ALLREDUCE_MODE": "1",
                       "FAILURE_ELEMENTS": "3000000", "FAILURE_VICTIM": str(victim)},
                  hosts="127.0.0.1:2,127.0.0.2:2", timeout=180)
    _assert_last_rank_killed_and_named(proc, 4, victim)


@pytest.mark.parametrize("np_", [2, 4])
def test_rank_that_lost_its_store_connection_is_named_long_before_the_timeout(np_):
    """The last rank's connections to the store close while its process and
    its Gloo sockets stay: Gloo alone would wait GLOO_TIMEOUT_SECONDS (60
    here). The store's count of closed ranks, read with each heartbeat, makes
    every survivor fail at once, naming it."""
    proc = launch(np_, [sys.executable, os.path.join(WORKERS, "failure_worker.py"), "cut", "core"],
                  env={"GLOO_TIMEOUT_SECONDS": "60"}, timeout=180)
    assert proc.returncode != 0
    reports = {r: v for r, v in _survivor_reports(proc, np_).items() if r != np_ - 1}
    assert sorted(reports) == list(range(np_ - 1)), proc.stdout[-3000:] + proc.stderr[-3000:]
    for seconds, message in reports.values():
        assert f"rank {np_ - 1} exited or lost its connection" in message, message
        assert seconds < 15, seconds


@pytest.mark.parametrize("np_", [2, 4])
def test_stuck_rank_is_named_after_the_timeout(np_):
    """A SIGSTOPped rank (its connections stay open) is named by every
    survivor within about 1.2 x GLOO_TIMEOUT_SECONDS: the timeout, then its
    heartbeat in the store seen standing still for 1.5 s."""
    timeout = 10
    proc = launch(np_, [sys.executable, os.path.join(WORKERS, "failure_worker.py"), "stop", "core"],
                  env={"GLOO_TIMEOUT_SECONDS": str(timeout)}, timeout=180)
    assert proc.returncode != 0
    reports = _survivor_reports(proc, np_)
    assert sorted(reports) == list(range(np_ - 1)), proc.stdout[-3000:] + proc.stderr[-3000:]
    for seconds, message in reports.values():
        assert f"rank {np_ - 1} stopped responding" in message, message
        assert timeout - 1 <= seconds <= 1.2 * timeout + 1, seconds
        # What held the survivor: its negotiation thread in the cycle the
        # stopped rank never joined, or a stream in a collective with it.
        held = re.search(r"On this rank, .*had been (waiting|running) [^;]* for ([\d.]+) s",
                         message)
        assert held and float(held.group(2)) >= timeout - 1, message


def _failures(outputs):
    """{rank: (wall-clock time, message)} from store_fault_worker's lines."""
    found = {}
    for rank, out in enumerate(outputs):
        m = re.search(r"^FAILED ([\d.]+) (.*)$", out, re.M)
        if m:
            found[rank] = (float(m.group(1)), m.group(2))
    return found


def _wait_for_markers(markers, names, procs, within_s):
    deadline = time.monotonic() + within_s
    while not all(os.path.exists(os.path.join(markers, n)) for n in names):
        assert all(p.poll() is None for p in procs), "a rank exited before it ran"
        assert time.monotonic() < deadline, f"the ranks did not start within {within_s} s"
        time.sleep(0.1)


@pytest.mark.parametrize("np_", [2, 3])
def test_a_stopped_store_is_named_by_every_rank_within_the_timeout(np_, tmp_path):
    """Ranks started by hand (torchrun's variables): rank 0 serves the store.
    SIGSTOP rank 0: once every other rank was silent for the whole stop and
    then blamed the others. Now each names the store (and rank 0 serving
    it) within 1.2 x GLOO_TIMEOUT_SECONDS; rank 0, let go on, says it was
    the one that did not run."""
    timeout = 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: None for k in os.environ if k.startswith(("PERSEUS_", "HOROVOD_", "OMPI_"))}
    base.update(GLOO_TIMEOUT_SECONDS=str(timeout), WORLD_SIZE=str(np_), LOCAL_WORLD_SIZE=str(np_),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                PERSEUS_RENDEZVOUS_SECRET="store-fault-test")
    worker = os.path.join(WORKERS, "store_fault_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(tmp_path)],
                              env=rank_env(dict(base, RANK=str(r), LOCAL_RANK=str(r))), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(np_)]
    try:
        _wait_for_markers(str(tmp_path), [f"running{r}" for r in range(np_)], procs, 120)
        stopped_at = time.time()
        os.kill(procs[0].pid, signal.SIGSTOP)
        deadline = time.monotonic() + 1.2 * timeout + 30
        while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(procs[0].pid, signal.SIGCONT)
        outputs = collect(procs, 60)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    failures = _failures(outputs)
    assert sorted(failures) == list(range(np_)), "\n---\n".join(o[-2000:] for o in outputs)
    for rank in range(1, np_):
        when, message = failures[rank]
        print(f"rank {rank}: {when - stopped_at:.1f} s after the stop: {message}")
        assert "rendezvous store" in message and "served by rank 0" in message, message
        assert "stopped answering" in message, message
        assert when - stopped_at <= 1.2 * timeout + 1, (rank, when - stopped_at, message)
    assert "this process did not run for" in failures[0][1], failures[0][1]


def test_a_stalled_launcher_then_a_stopped_rank_names_that_rank_only(tmp_path):
    """perseusrun, which serves the store, is stopped for 5 s (once the
    first stall over 3 s ended every rank's heartbeat for good, and a later
    failure named every rank whose count stood still); then rank 2 stops.
    Ranks 0 and 1 name rank 2, and only it."""
    proc = launch(3, [sys.executable, os.path.join(WORKERS, "store_fault_worker.py"),
                      str(tmp_path), "stall_then_stop", "2", "5"],
                  env={"GLOO_TIMEOUT_SECONDS": "10"}, timeout=180)
    failures = _failures([("\n".join(line[4:] for line in proc.stdout.splitlines()
                                      if line.startswith(f"[{r}] "))) for r in range(3)])
    assert os.path.exists(os.path.join(str(tmp_path), "stalled")), proc.stderr[-3000:]
    assert sorted(failures) == [0, 1], proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, (_, message) in failures.items():
        print(f"rank {rank}: {message}")
        assert "rank 2 stopped responding" in message, message
        assert "ranks" not in message.split("stopped responding")[0], message


FORK = r"""
import os, sys, time
import numpy as np
from perseus_tf import _native
from perseus_tf._native import _core
_native.init()

def allreduce(name):
    x = np.ones(4, np.float32)
    out = np.empty_like(x)
    _core.submit(0, x, name, 2, output=out).wait()
    return out

allreduce("before")
pid = os.fork()
if pid == 0:
    start = time.time()
    for attempt in (_native.ensure_initialized, lambda: allreduce("in-child")):
        try:
            attempt()
            print("CHILD RAN", flush=True)
        except Exception as e:
            print("CHILD REFUSED", round(time.time() - start, 1), " ".join(str(e).split()),
                  flush=True)
    sys.exit(0)  # atexit's shutdown runs here: once it crashed (SIGSEGV)
_, status = os.waitpid(pid, 0)
print("CHILD STATUS", status, flush=True)
print("AFTER", allreduce("after").tolist(), flush=True)
"""


def test_a_process_forked_after_init_is_told_to_init_and_exits_cleanly():
    """os.fork() after init(): the child's collective once hung for ever and
    its exit crashed in atexit's shutdown. Now the child is refused at once,
    told that a forked process must call init() itself, and exits 0; the
    parents go on with their job."""
    proc = launch(2, [sys.executable, "-c", FORK], env={"GLOO_TIMEOUT_SECONDS": "20"},
                  timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for rank in range(2):
        refused = re.findall(rf"^\[{rank}\] CHILD REFUSED ([\d.]+) (.*)$", proc.stdout, re.M)
        assert len(refused) == 2, out[-3000:]
        for seconds, message in refused:
            assert float(seconds) < 5, (seconds, message)
            assert f"fork (made after init()) of rank {rank}" in message, message
            assert "must call" in message and "init() itself" in message, message
        assert f"[{rank}] CHILD STATUS 0" in proc.stdout, out[-3000:]
        assert f"[{rank}] AFTER [2.0, 2.0, 2.0, 2.0]" in proc.stdout, out[-3000:]
    assert "CHILD RAN" not in proc.stdout


def _python(code, env=None, timeout=120):
    return subprocess.run([sys.executable, "-c", code], env=rank_env(env), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("variable,value,needle", [
    ("PERSEUS_ALLREDUCE_STREAMS", "0", "an integer from 1 to 12"),
    ("PERSEUS_ALLREDUCE_DTYPE", "7", "one of 0, 1, 2"),
    ("GLOO_TIMEOUT_SECONDS", "soon", "a number in [1, 86400]"),
    ("PERSEUS_RANK", "5", "PERSEUS_RANK=5 is out of range"),
])
def test_bad_variable_fails_at_start_naming_it(variable, value, needle):
    env = {variable: value}
    if variable == "PERSEUS_RANK":
        env["PERSEUS_SIZE"] = "2"
    proc = _python("import perseus_tf._native as n; n.init()", env=env)
    assert proc.returncode != 0
    assert variable in proc.stderr and needle in proc.stderr, proc.stderr[-2000:]


def test_bad_variable_under_perseusrun_fails_the_job():
    proc = launch(2, [sys.executable, "-c", "import perseus_tf._native as n; n.init()"],
                  env={"PERSEUS_ALLREDUCE_STREAMS": "13"}, timeout=60)
    assert proc.returncode != 0
    assert "PERSEUS_ALLREDUCE_STREAMS='13'" in proc.stderr


SINGLE = r"""
import numpy as np, tensorflow as tf, perseus_tf as ptf
assert (ptf.rank(), ptf.size(), ptf.local_size()) == (0, 1, 1)
x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
np.testing.assert_array_equal(ptf.allreduce(x, op=ptf.Average), x)
np.testing.assert_array_equal(ptf.allreduce(x, op=ptf.Sum, postscale_factor=2.0), 2 * x)
np.testing.assert_array_equal(ptf.allgather(x), x)
np.testing.assert_array_equal(ptf.broadcast(x, 0), x)
out, splits = ptf.alltoall(x)
np.testing.assert_array_equal(out, x); np.testing.assert_array_equal(splits, [2])
np.testing.assert_array_equal(ptf.reducescatter(x), x)
ptf.barrier()
print("SINGLE OK")
"""


def test_world_size_one_without_launcher():
    env = {k: None for k in os.environ if k.startswith(("PERSEUS_", "OMPI_", "HOROVOD_"))}
    proc = _python(SINGLE, env=env)
    assert proc.returncode == 0 and "SINGLE OK" in proc.stdout, proc.stderr[-3000:]


SHUTDOWN = r"""
import sys, time, numpy as np
from perseus_tf import _native
from perseus_tf._native import _core
_native.init()
rank = _native.topology()["rank"]
x = np.ones(4, np.float32)
_core.submit(0, x, "before", 2, output=np.empty_like(x)).wait()
if rank == 1:
    time.sleep(2)  # ranks reach the end at different times
if sys.argv[1] == "explicit":
    _native.shutdown()
    try:
        _core.submit(0, x, "after", 2, output=np.empty_like(x)).wait()
        print("NO ERROR")
    except _core.CommunicationError as e:
        print("AFTER SHUTDOWN:", e)
print("END", flush=True)
"""


@pytest.mark.parametrize("mode", ["atexit", "explicit"])
def test_clean_shutdown(mode, tmp_path):
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN)
    start = time.time()
    proc = launch(2, [sys.executable, str(script), mode], timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.count("END") == 2
    assert time.time() - start < 20
    if mode == "explicit":
        assert proc.stdout.count("AFTER SHUTDOWN:") == 2 and "shut down" in proc.stdout


def test_mpirun_style_environment_without_perseusrun(tmp_path):
    # What mpirun sets, plus the master address: rank 0 hosts the store itself.
    code = ("import numpy as np; from perseus_tf import _native; from perseus_tf._native import _core;"
            "_native.init(); x=np.ones(3,np.float32)*(_native.topology()['rank']+1);"
            "print('SUM', _core.submit(0,x,'m',2,output=np.empty_like(x)).wait()[0][0])")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = rank_env({"OMPI_COMM_WORLD_RANK": rank, "OMPI_COMM_WORLD_SIZE": 2,
                        "OMPI_COMM_WORLD_LOCAL_RANK": rank, "OMPI_COMM_WORLD_LOCAL_SIZE": 2,
                        "PERSEUS_MASTER_ADDR": "127.0.0.1", "PERSEUS_MASTER_PORT": port})
        for k in list(env):
            if k.startswith("PERSEUS_") and k not in ("PERSEUS_MASTER_ADDR", "PERSEUS_MASTER_PORT"):
                del env[k]
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "SUM 3.0" in out, err[-2000:]


@pytest.mark.parametrize("np_", [2, 4])
def test_rank_dying_during_fit_fails_every_survivor(np_):
    proc = launch(np_, [sys.executable, os.path.join(WORKERS, "fit_failure_worker.py")],
                  env={"GLOO_TIMEOUT_SECONDS": "20"}, timeout=240)
    _assert_last_rank_killed_and_named(proc, np_)


@pytest.mark.parametrize("np_", [2, 4])
def test_rank_leaving_cleanly_during_fit_is_named_at_once(np_):
    # sys.exit(0) in a callback on the last rank, mid-epoch, while the
    # offline plan runs: it shuts down between two plan steps. The others
    # once waited in a negotiation cycle for GLOO_TIMEOUT_SECONDS and then
    # named nobody; now each says at once that this rank left.
    proc = launch(np_, [sys.executable, os.path.join(WORKERS, "fit_failure_worker.py"), "exit"],
                  env={"GLOO_TIMEOUT_SECONDS": "20"}, timeout=240)
    victim = np_ - 1
    reports = _survivor_reports(proc, np_)
    assert sorted(reports) == list(range(victim)), proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank, (seconds, message) in reports.items():
        assert f"rank {victim} has called shutdown and left the job" in message, message
        assert seconds < 5, f"rank {rank} took {seconds}s to notice"



SHM_FALLBACK = r"""
import numpy as np
from perseus_tf import _native
from perseus_tf._native import DTYPE_CODES, OP_ALLREDUCE, _core
_native.init()
r, n = _native.topology()["rank"], _native.topology()["size"]
assert _native.stats()["shm"] is False, _native.stats()
x = np.full(300_000, r + 1.0, np.float32)
got = _core.submit(OP_ALLREDUCE, x, "fallback", DTYPE_CODES["float32"], output=np.empty_like(x))
np.testing.assert_array_equal(got.wait()[0], np.full(300_000, n * (n + 1) / 2))
print("FALLBACK OK", flush=True)
"""


def test_shared_memory_unavailable_falls_back_to_tcp(tmp_path):
    # A private mount namespace whose /dev/shm holds 1 MiB: rank 0 cannot
    # reserve the segments, so every rank keeps Gloo over TCP, and rank 0
    # says why.
    probe = subprocess.run(["unshare", "-m", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("needs root and unshare(1) to give the job a small /dev/shm")
    script = tmp_path / "fallback.py"
    script.write_text(SHM_FALLBACK)
    inner = (f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -m "
             f"perseus_tf.runner -np 2 -- {sys.executable} {script}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", inner], env=rank_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.count("FALLBACK OK") == 2, \
        proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "allreduce uses Gloo over TCP, not shared memory: reserving" in proc.stderr, \
        proc.stderr[-3000:]
    assert "PERSEUS_SHM_ALLREDUCE=0" in proc.stderr


@pytest.fixture
def full_directory(tmp_path):
    """A 1 MiB tmpfs: a few checkpoints fill it."""
    target = tmp_path / "full"
    target.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)], check=True)
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.mark.skipif(KERAS_2, reason="Keras 2 writes the other ranks' copies beside the "
                    "target (the strategy's checkpoint task id), not in a scratch directory")
def test_full_scratch_directory_is_named_with_what_where_and_how_much(full_directory,
                                                                      tmp_path):
    # Rank 1 writes its scratch copy of each checkpoint under TMPDIR, here a
    # full disk, while rank 0 writes the real one into a roomy directory.
    # Once rank 1 failed with a bare "No space left on device".
    target = tmp_path / "checkpoints"
    target.mkdir()
    proc = launch(2, [sys.executable, os.path.join(WORKERS, "full_disk_worker.py"),
                      str(target)], env={"GLOO_TIMEOUT_SECONDS": "20",
                                         "TMPDIR": str(full_directory)}, timeout=240)
    assert proc.returncode != 0
    reports = _survivor_reports(proc, 2)
    assert 1 in reports, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = reports[1][1]
    assert "Perseus-TF rank 1: no space left in its scratch directory" in said, reports
    assert str(full_directory) in said and "checkpoint m" in said and "MiB" in said, said
    assert "set TMPDIR" in said, said
    assert os.listdir(target), "rank 0 wrote no checkpoint"


def test_full_checkpoint_directory_is_named_on_every_rank(full_directory):
    # Rank 0's ModelCheckpoint gets ENOSPC. The others fail at once naming
    # rank 0 (not a timeout naming nobody), and perseusrun names rank 0 and
    # its error as the first failure, whichever rank exits first.
    proc = launch(2, [sys.executable, os.path.join(WORKERS, "full_disk_worker.py"),
                      str(full_directory)], env={"GLOO_TIMEOUT_SECONDS": "20"}, timeout=240)
    assert proc.returncode != 0
    reports = _survivor_reports(proc, 2)
    assert sorted(reports) == [1], proc.stdout[-3000:] + proc.stderr[-3000:]
    if KERAS_2:
        # Keras 2's ModelCheckpoint writes the other ranks' copies into a
        # temporary directory beside the target, on the same full disk: rank
        # 1 may then hit ENOSPC itself first (in h5py, HDF5 words it as a
        # cache it could not flush, or as a file write that failed with the
        # errno on a later line).
        full = r"No space left on device|Errno 28|Can't destroy cache|file write failed"
        assert ("rank 0 has called shutdown and left the job" in reports[1][1]
                or re.search(full, reports[1][1])), reports
        # HDF5 may also crash at ENOSPC (SIGSEGV) rather than raise; its error
        # text, recorded before, then spans lines.
        assert re.search(r"^perseusrun: first failure: rank [01] \(pid \d+\) (failed with exit "
                         rf"status 1|killed by signal SIG[A-Z]+); its error: (.|\n)*?({full})",
                         proc.stderr, re.M), proc.stderr[-3000:]
        return
    assert "rank 0 has called shutdown and left the job" in reports[1][1], reports
    assert reports[1][0] < 60, reports
    assert re.search(r"^perseusrun: first failure: rank 0 \(pid \d+\) failed with exit status 1; "
                     r"its error: OSError: \[Errno 28\] No space left on device",
                     proc.stderr, re.M), proc.stderr[-3000:]
