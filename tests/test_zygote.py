"""tests/zygote.py, the fork server that starts test ranks without a second
TensorFlow import: a forked rank gets its own arguments, environment,
folder and stdio, its status and signals reach whoever started it, and its
death or its starter's death ends the other. One server per environment."""

import os
import signal
import subprocess
import sys
import time

import pytest

import zygote

SCRIPT = """
import json, os, signal, subprocess, sys, time
before = 'tensorflow' in sys.modules
mode = sys.argv[1]
if mode == 'term':  # before the line below tells the test it may signal
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
out = {'argv': sys.argv, 'cwd': os.getcwd(), 'x': os.environ.get('PERSEUS_X'),
       'preimported': before, 'stdin': sys.stdin.read() if mode == 'echo' else '',
       'pid': os.getpid(), 'group_leader': os.getpgrp() == os.getpid(),
       'path0': sys.path[0]}
print(json.dumps(out), flush=True)
print('to stderr', file=sys.stderr, flush=True)
if mode == 'term':
    time.sleep(60)
if mode == 'hang':
    child = subprocess.Popen(['sleep', '60'])
    print(child.pid, flush=True)
    time.sleep(60)
if mode == 'die':
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(3 if mode == 'three' else 0)
"""


@pytest.fixture
def folder(tmp_path, monkeypatch):
    script = tmp_path / "work" / "rank.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    path = zygote.make_folder(str(tmp_path))
    monkeypatch.setenv(zygote.FOLDER_VARIABLE, path)
    yield path, str(script)
    zygote.stop_servers(path)


def start(script, mode, env=None, **kwargs):
    return subprocess.Popen([sys.executable, zygote.__file__, "run", script, mode],
                            env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def first_line(proc):
    import json
    return json.loads(proc.stdout.readline())


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def wait_gone(pid, seconds=30):
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_a_forked_rank_is_the_process_it_stands_for(folder, tmp_path):
    path, script = folder
    runs = []
    for x in ("a", "b"):
        proc = start(script, "echo", env={"PERSEUS_X": x}, stdin=subprocess.PIPE,
                     cwd=str(tmp_path))
        out, err = proc.communicate(f"input {x}", timeout=120)
        runs.append((proc, out, err))
    import json
    for (proc, out, err), x in zip(runs, ("a", "b")):
        seen = json.loads(out.splitlines()[0])
        assert proc.returncode == 0, err
        assert seen["preimported"], "the rank imported TensorFlow itself: no server served it"
        assert seen["argv"] == [script, "echo"] and seen["path0"] == os.path.dirname(script)
        assert seen["cwd"] == str(tmp_path) and seen["x"] == x and seen["stdin"] == f"input {x}"
        assert seen["pid"] != proc.pid and seen["group_leader"]
        assert "to stderr" in err
    # PERSEUS_* differs per rank: one server served both.
    assert len([n for n in os.listdir(path) if n.endswith(".sock")]) == 1
    proc = start(script, "three", env={"OTHER_SETTING": "1"})
    proc.communicate(timeout=120)
    assert proc.returncode == 3
    assert len([n for n in os.listdir(path) if n.endswith(".sock")]) == 2
    # Stopped, the servers report the CPU they and their ranks used (two
    # TensorFlow imports at least), which the test job's figure adds.
    assert zygote.stop_servers(path) > 2.0
    assert not [n for n in os.listdir(path) if n.endswith(".sock")]


def _process_state(pid):
    """What /proc says of a process: its state, where it sleeps, its signal
    masks and threads (for a wait that ran out: which side kept the signal)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = [x.strip() for x in f
                     if x.split(":")[0] in ("State", "PPid", "Threads", "SigPnd", "ShdPnd",
                                            "SigBlk", "SigIgn", "SigCgt")]
        with open(f"/proc/{pid}/wchan") as f:
            lines.append("wchan: " + f.read())
        return f"pid {pid}: " + ", ".join(lines)
    except OSError:
        return f"pid {pid}: gone"


def wait_status(proc, rank, path, timeout=60):
    """The starter's status, or a failure that says what the starter, the
    rank and the server were doing when the wait ran out."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        logs = ""
        for name in sorted(os.listdir(path)):
            if name.endswith(".log"):
                with open(os.path.join(path, name), errors="replace") as f:
                    logs += f"{name}: {f.read()[-2000:]}\n"
        proc.kill()
        pytest.fail(f"the starter did not end in {timeout} s\n{_process_state(proc.pid)}\n"
                    f"rank {_process_state(rank)}\n{logs}")


def test_signals_and_deaths_cross_between_starter_and_rank(folder):
    path, script = folder
    proc = start(script, "term")
    rank = first_line(proc)["pid"]
    proc.send_signal(signal.SIGTERM)
    assert wait_status(proc, rank, path) == 7  # the rank's handler ran and chose the status

    # The rank runs (and prints) before its starter has its pid: a signal
    # then waits in the starter and reaches the rank once the pid is there.
    proc = start(script, "term", env={"PERSEUS_TEST_ZYGOTE_REPLY_DELAY_S": "2"})
    rank = first_line(proc)["pid"]
    proc.send_signal(signal.SIGTERM)
    assert wait_status(proc, rank, path) == 7

    proc = start(script, "die")
    assert proc.wait(timeout=120) == -signal.SIGKILL

    # The starter killed as perseusrun's killpg(..., SIGKILL) of a rank kills
    # it: once it knows the rank's pid, and before (on a loaded host the
    # server's reply can come after the rank has printed and been killed).
    for env in ({}, {"PERSEUS_TEST_ZYGOTE_REPLY_DELAY_S": "2"}):
        proc = start(script, "hang", env=env)
        rank = first_line(proc)["pid"]
        child = int(proc.stdout.readline())
        proc.kill()
        proc.wait()
        assert wait_gone(rank) and wait_gone(child), f"the rank's group outlived its starter {env}"


def test_a_pid_reply_past_its_deadline_fails_the_start_and_ends_the_rank(folder):
    path, script = folder
    proc = start(script, "term", env={"PERSEUS_TEST_ZYGOTE_REPLY_DELAY_S": "4",
                                      "PERSEUS_TEST_ZYGOTE_REPLY_TIMEOUT_S": "1"})
    rank = first_line(proc)["pid"]
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 124, (proc.returncode, err)
    assert "sent no pid within 1 s" in err, err
    assert wait_gone(rank), "the rank outlived its starter's failed start"


def test_without_a_server_folder_a_rank_starts_plainly(folder, monkeypatch):
    path, script = folder
    monkeypatch.delenv(zygote.FOLDER_VARIABLE)
    proc = start(script, "three")
    out, _ = proc.communicate(timeout=120)
    import json
    assert proc.returncode == 3 and not json.loads(out.splitlines()[0])["preimported"]
    assert not [n for n in os.listdir(path) if n.endswith(".sock")]


def test_a_server_ends_with_its_owner(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        path = str(tmp_path / "zygotes")
        os.makedirs(path)
        with open(os.path.join(path, "owner"), "w") as f:
            f.write(str(owner.pid))
        sock = os.path.join(path, "k.sock")
        server = subprocess.Popen([sys.executable, zygote.__file__, "serve", sock])
        deadline = time.monotonic() + 120
        while not os.path.exists(sock) and time.monotonic() < deadline:
            assert server.poll() is None
            time.sleep(0.1)
        assert os.path.exists(sock)
    finally:
        owner.communicate(b"")
    assert server.wait(timeout=30) == 0 and not os.path.exists(sock)
