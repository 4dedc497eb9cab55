"""Across real hosts: network namespaces on this machine, each with its own
address and sshd (tests/netns_hosts.py). perseusrun reaches the second host
over ssh; failures (unreachable host, wrong key, a killed remote rank, a
killed perseusrun) are named, on time, and leave no process on any host.

Needs root; without it the tests skip with the reason.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from harness import ROOT, WORKERS, check_names, collect, rank_env, read_results
from netns_hosts import ALT_SSH_PORT, NetnsHosts, missing_requirements

CHECKS = check_names("checks_multihost")
PERSEUSRUN = [sys.executable, "-m", "perseus_tf.runner"]
# Plain sums, so that distributed training equals one process to 1e-6.
JOB_ENV = {"PERSEUS_ALLREDUCE_DTYPE": "1", "GLOO_TIMEOUT_SECONDS": "30",
           "PERSEUS_STALL_TIMEOUT_SECONDS": "60"}

_why_not = missing_requirements()
pytestmark = pytest.mark.skipif(_why_not is not None, reason=f"cross-host tests: {_why_not}")


@pytest.fixture(scope="module")
def hosts():
    with NetnsHosts(2) as h:
        yield h


def _env(hosts, extra=None):
    env = rank_env(dict(JOB_ENV, **(extra or {})))
    return hosts.ssh_env(env)


def _no_process_left(hosts, within_s):
    deadline = time.monotonic() + within_s
    while True:
        left = {h: hosts.pids(h) for h in range(len(hosts.names))}
        if not any(left.values()):
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError("processes left: " + "; ".join(
                f"host {h}: {hosts.describe(p)}" for h, p in left.items() if p))
        time.sleep(0.2)


def _assert_checks(results, proc_text, np_=4):
    problems = []
    for check in CHECKS:
        for rank in range(np_):
            outcome = results.get(rank, {}).get(check)
            if outcome != "ok":
                problems.append(f"{check} rank {rank}: {outcome}")
    assert not problems, "\n".join(problems) + "\n--- output ---\n" + proc_text[-4000:]


@pytest.fixture(scope="module")
def ssh_job(hosts, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ssh_job"))
    a, b = hosts.addrs
    cmd = PERSEUSRUN + ["-np", "4", "-H", f"{a}:2,{b}:2", "-i", hosts.key,
                        "-x", "EXPECT_SOURCE=perseusrun", "-x", f"EXPECT_SUBNET={hosts.subnet}",
                        "--", sys.executable, os.path.join(WORKERS, "run_checks.py"),
                        "checks_multihost", out]
    start = time.monotonic()
    proc = hosts.exec(0, *cmd, check=False, env=_env(hosts), cwd=ROOT, timeout=300)
    took = time.monotonic() - start
    print(f"perseusrun over ssh, 2 hosts x 2 ranks: {took:.1f} s")
    return proc, read_results(out, 4), took


@pytest.mark.parametrize("check", CHECKS)
def test_perseusrun_over_ssh_two_hosts(ssh_job, check):
    proc, results, _ = ssh_job
    for rank in range(4):
        assert results.get(rank, {}).get(check) == "ok", (
            f"rank {rank}: {results.get(rank, {}).get(check)}\n" + proc.stdout[-3000:]
            + proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_hostfile_ssh_port_prefixed_output_and_secret_on_no_command_line(hosts):
    # A remote rank reports its own command line and its parents' (what `ps`
    # shows on its host) and the secret it got; the secret is in none of them.
    script = ("import os,sys\n"
              "pid=os.getpid(); lines=[]\n"
              "while pid>1:\n"
              "  lines.append(open(f'/proc/{pid}/cmdline','rb').read().replace(b'\\0',b' ').decode().replace(chr(10),' '))\n"
              "  pid=int(open(f'/proc/{pid}/stat').read().split(')')[1].split()[1])\n"
              "print('SECRET', os.environ['PERSEUS_RENDEZVOUS_SECRET'])\n"
              "print('CMDLINES', ' || '.join(lines))\n")
    a, b = hosts.addrs
    # Also: hosts from an Open MPI hostfile, and sshd on another port (-p).
    hostfile = os.path.join(hosts.dir, "hostfile")
    with open(hostfile, "w") as f:
        f.write(f"# the test's hosts\n{a} slots=1\n\n{b} slots=1  # remote\n")
    proc = hosts.exec(0, *PERSEUSRUN, "-np", "2", "--hostfile", hostfile, "-p",
                      str(ALT_SSH_PORT), "-i", hosts.key, "--verbose", "--",
                      sys.executable, "-c", script, check=False, env=_env(hosts), cwd=ROOT,
                      timeout=60)
    assert f"-p {ALT_SSH_PORT}" in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    secrets = {line.split()[2] for line in lines if line.startswith("[1] SECRET")}
    cmdlines = [line for line in lines if line.startswith("[1] CMDLINES")]
    assert len(secrets) == 1 and len(cmdlines) == 1, proc.stdout
    secret = secrets.pop()
    assert len(secret) == 64 and secret not in cmdlines[0], cmdlines[0]
    assert "perseus_tf.runner.remote" in cmdlines[0] and "sshd" in cmdlines[0], cmdlines[0]
    assert any(line.startswith("[0] SECRET") for line in lines), proc.stdout


MODES = {"ssh": [], "mpi": ["--mpi"]}


@pytest.mark.parametrize("mode", MODES)
def test_unreachable_host_and_wrong_key_fail_within_start_timeout(hosts, mode):
    a, b = hosts.addrs
    nobody = a.rsplit(".", 1)[0] + ".200"  # on the subnet, no host answers
    start = time.monotonic()
    proc = hosts.exec(0, *PERSEUSRUN, *MODES[mode], "-np", "3", "-H", f"{a}:1,{b}:1,{nobody}:1",
                      "-i", hosts.other_key, "--start-timeout", "4", "--", "true",
                      check=False, env=_env(hosts), cwd=ROOT, timeout=60)
    took = time.monotonic() - start
    print(f"{mode}: unreachable host + wrong key reported in {took:.1f} s (--start-timeout 4)")
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    # Both bad hosts in one error, each with ssh's own words.
    assert "cannot start ranks on 2 hosts" in err, err
    assert f"{b}: ssh: " in err and "Permission denied" in err, err
    assert f"{nobody}: " in err and ("timed out" in err or "no answer" in err
                                     or "No route" in err), err
    assert took < 4 + 3, took
    _no_process_left(hosts, 5)


@pytest.mark.parametrize("mode", MODES)
def test_killed_remote_rank_ends_the_job_naming_rank_and_host(hosts, mode):
    a, b = hosts.addrs
    script = ("import os,time,signal\n"
              "import perseus_tf as ptf, tensorflow as tf\n"
              "ptf.init()\n"
              "if ptf.rank() == 3:\n"
              "    time.sleep(1); os.kill(os.getpid(), signal.SIGKILL)\n"
              "while True:\n"
              "    ptf.allreduce(tf.ones([4]), name='loop')\n")
    start = time.monotonic()
    proc = hosts.exec(0, *PERSEUSRUN, *MODES[mode], "-np", "4", "-H", f"{a}:2,{b}:2",
                      "-i", hosts.key, "--grace-seconds", "20", "--", sys.executable, "-c", script,
                      check=False, env=_env(hosts, {"GLOO_TIMEOUT_SECONDS": "10"}),
                      cwd=ROOT, timeout=120)
    took = time.monotonic() - start
    print(f"{mode}: remote rank SIGKILLed: job over in {took:.1f} s")
    err = proc.stderr + proc.stdout
    assert proc.returncode != 0, err[-3000:]
    if mode == "ssh":
        assert proc.returncode == 137, err[-3000:]
        assert f"rank 3 on {b}" in err and "killed by signal SIGKILL" in err, err[-3000:]
    else:  # remote.py names rank and host beside mpirun's own report
        assert f"rank 3 on {b} killed by signal SIGKILL" in err, err[-3000:]
        assert "mpirun" in err and "exited with status 137" not in err, err[-3000:]
    # The other ranks name the dead rank too (the runtime's failure report).
    assert "rank 3" in err, err[-3000:]
    _no_process_left(hosts, 15)


SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"


def _sleeping_job(hosts, flags):
    """perseusrun FLAGS over ssh (from host 0) of ranks that print `up` and
    sleep; returns the launcher once every rank is up."""
    np_ = int(flags[flags.index("-np") + 1])
    launcher = hosts.popen(0, PERSEUSRUN + flags + ["-i", hosts.key, "--", sys.executable, "-c",
                                                    SLEEPER],
                           env=_env(hosts), cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    seen = 0
    deadline = time.monotonic() + 60
    while seen < np_ and time.monotonic() < deadline:
        seen += launcher.stdout.readline().endswith("up\n")
    if seen < np_:
        launcher.kill()
        launcher.communicate()
        raise AssertionError("ranks did not start")
    return launcher


@pytest.mark.parametrize("mode,how", [("ssh", "SIGKILL"), ("ssh", "SIGTERM"), ("ssh", "SIGINT"),
                                      ("mpi", "SIGKILL"), ("mpi", "SIGTERM")])
def test_killed_perseusrun_leaves_no_rank_on_any_host(hosts, mode, how):
    a, b = hosts.addrs
    launcher = _sleeping_job(hosts, MODES[mode] + ["-np", "4", "-H", f"{a}:2,{b}:2"])
    try:
        assert len(hosts.pids(1)) >= 2  # the remote ranks run
        # `ip netns exec` execs perseusrun: launcher.pid is perseusrun.
        killed_at = time.monotonic()
        os.kill(launcher.pid, getattr(signal, how))
        launcher.wait(15)
        gone_at = _no_process_left(hosts, 15)
        print(f"{mode}: perseusrun {how}: no process on any host after "
              f"{gone_at - killed_at:.1f} s")
    finally:
        launcher.kill()
        launcher.communicate()


def _no_rank_left(hosts, host, needle, within_s):
    """Waits until no process on host runs a rank (its command line holds
    needle) or remote.py; sshd's own session processes are not ours."""
    deadline = time.monotonic() + within_s
    while True:
        left = [p for p in hosts.pids(host)
                if needle in hosts.describe([p]) or "perseus_tf.runner.remote" in hosts.describe([p])]
        if not left:
            return time.monotonic()
        assert time.monotonic() < deadline, f"still there after {within_s} s: " + hosts.describe(left)
        time.sleep(0.5)


def _wait_for(path, within_s):
    deadline = time.monotonic() + within_s
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {within_s} s"
        time.sleep(0.1)


@pytest.mark.parametrize("np_,way", [(2, "both"), (2, "in"), (2, "out"), (3, "both"), (3, "unreachable")])
def test_a_partition_is_named_on_both_sides_within_the_timeout(hosts, tmp_path, np_, way):
    """Host 1 is cut off for good (both ways; or only what reaches it, "in";
    or only what leaves it, "out"; or its routes say "unreachable", so its
    connects fail at once with "no route to host") while the ranks run
    allreduces; the last rank is on host 1, the others and perseusrun, which
    serves the store, on host 0. The cut-off rank once waited about 1,000 s
    (the kernel's retries) on a store call with no deadline, and later 2 x
    GLOO_TIMEOUT_SECONDS when a reconnect of its heartbeat met "no route to
    host" (taken for a store that had exited, which ended the heartbeat:
    "unreachable" makes that happen every time; "both" did now and then,
    between ARP's tries). Now, within 1.2 x GLOO_TIMEOUT_SECONDS, it names
    the store and every rank on host 0 names it; at 3 ranks, rank 1 on host
    0 is named by nobody."""
    a, b = hosts.addrs
    timeout = 10
    markers = str(tmp_path)
    cut_off = np_ - 1
    launcher = hosts.popen(0, PERSEUSRUN + ["-np", str(np_), "-H", f"{a}:{np_ - 1},{b}:1", "-i",
                                            hosts.key, "--", sys.executable,
                                            os.path.join(WORKERS, "store_fault_worker.py"),
                                            markers],
                           env=_env(hosts, {"GLOO_TIMEOUT_SECONDS": str(timeout)}), cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for r in range(np_):
            _wait_for(os.path.join(markers, f"running{r}"), 120)
        cut_at = time.time()
        hosts.cut(1, way)
        for r in range(np_):
            _wait_for(os.path.join(markers, f"failed{r}"), 1.2 * timeout + 30)
        launcher.communicate(timeout=60)
        _no_rank_left(hosts, 1, "store_fault_worker", 30)
    finally:
        hosts.mend(1)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    lines = [open(os.path.join(markers, f"failed{r}")).read().split(" ", 2) for r in range(np_)]
    for rank, (_, when, message) in enumerate(lines):
        print(f"{np_} ranks, cut {way}: rank {rank}: {float(when) - cut_at:.1f} s after the cut: "
              f"{message.strip()}")
        assert float(when) - cut_at <= 1.2 * timeout + 1, (rank, float(when) - cut_at, message)
    message = lines[cut_off][2]
    assert "rendezvous store" in message and "stopped answering" in message, message
    assert "served by perseusrun" in message, message
    # Cut one way in, the cut-off rank's closing connections still reach the
    # store. The ranks on host 0 blame it and nobody else.
    for rank in range(cut_off):
        blamed = re.findall(r"ranks? ([\d, ]+?) (?:stopped responding|exited or lost its connection)",
                            lines[rank][2])
        assert blamed and {int(n) for b in blamed for n in b.split(",")} == {cut_off}, \
            lines[rank]


def test_a_remote_rank_cut_off_from_perseusrun_does_not_outlive_it(hosts):
    """A rank that runs no collective (it sleeps) on host 1, cut off: ssh on
    that host never learns that perseusrun is gone, and the rank once lived
    on for as long as its script ran. remote.py now hears perseusrun every
    5 s and stops the rank 30 s after the last word."""
    a, b = hosts.addrs
    launcher = _sleeping_job(hosts, ["-np", "2", "-H", f"{a}:1,{b}:1"])
    try:
        hosts.cut(1)
        cut_at = time.monotonic()
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.wait(60)
        gone_at = _no_rank_left(hosts, 1, "time.sleep(600)", 60 - (time.monotonic() - cut_at))
        print(f"the cut-off rank stopped {gone_at - cut_at:.1f} s after the cut")
    finally:
        hosts.mend(1)
        launcher.kill()
        launcher.communicate()


# ---------------------------------------------------------------------------
# The same checks under other launchers: perseusrun --mpi, a plain mpirun,
# and processes started by hand with what Kubernetes operators set.

def _run_checks_cmd(out):
    return [sys.executable, os.path.join(WORKERS, "run_checks.py"), "checks_multihost", out]


def _by_hand(hosts, envs, out, timeout=300):
    """Starts one process per rank, rank r on host r // 2, with envs[r]."""
    procs = []
    try:
        for rank, extra in enumerate(envs):
            procs.append(hosts.popen(rank // 2, _run_checks_cmd(out), env=_env(hosts, extra),
                                     cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True))
    finally:
        texts = collect(procs, timeout)
    return [p.returncode for p in procs], "\n".join(f"--- rank {r} ---\n{t[-2000:]}"
                                                   for r, t in enumerate(texts))


def _contract_envs(hosts, kind, port):
    a, b = hosts.addrs
    common = {"EXPECT_SUBNET": hosts.subnet, "PERSEUS_RENDEZVOUS_SECRET": "multihost-test-secret"}
    envs = []
    for rank in range(4):
        env = dict(common)
        if kind == "tf_config":
            addrs = [f"{a}:{port}", f"{a}:{port + 1}", f"{b}:{port + 2}", f"{b}:{port + 3}"]
            cluster = {"chief": addrs[:1], "worker": addrs[1:]}
            task = {"type": "chief", "index": 0} if rank == 0 else \
                {"type": "worker", "index": rank - 1}
            env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": task})
        else:  # torchrun-style, as a Kubeflow PyTorchJob sets them
            env.update({"RANK": rank, "WORLD_SIZE": 4, "LOCAL_RANK": rank % 2,
                        "LOCAL_WORLD_SIZE": 2, "MASTER_ADDR": a, "MASTER_PORT": port})
        env["EXPECT_SOURCE"] = kind
        envs.append(env)
    return envs


@pytest.mark.parametrize("kind", ["tf_config", "torchrun"])
def test_kubernetes_contracts_by_hand(hosts, tmp_path, kind):
    port = 21000 + os.getpid() % 1000
    start = time.monotonic()
    codes, text = _by_hand(hosts, _contract_envs(hosts, kind, port), str(tmp_path))
    print(f"{kind} by hand, 2 hosts x 2 ranks: {time.monotonic() - start:.1f} s")
    _assert_checks(read_results(str(tmp_path), 4), text)
    assert codes == [0] * 4, text


def test_perseusrun_mpi_two_hosts(hosts, tmp_path):
    a, b = hosts.addrs
    # --network-interface: Gloo, the store and Open MPI all use eth0.
    cmd = PERSEUSRUN + ["--mpi", "-np", "4", "-H", f"{a}:2,{b}:2", "-i", hosts.key,
                        "--network-interface", "eth0", "--verbose",
                        "-x", "EXPECT_SOURCE=mpirun", "-x", f"EXPECT_SUBNET={hosts.subnet}",
                        "--"] + _run_checks_cmd(str(tmp_path))
    start = time.monotonic()
    proc = hosts.exec(0, *cmd, check=False, env=_env(hosts), cwd=ROOT, timeout=300)
    print(f"perseusrun --mpi, 2 hosts x 2 ranks: {time.monotonic() - start:.1f} s")
    _assert_checks(read_results(str(tmp_path), 4), proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[3] " in proc.stdout + proc.stderr  # remote.py prefixes mpirun's ranks
    assert f"rendezvous store on {a} port" in proc.stderr, proc.stderr[-3000:]
    assert "-mca btl_tcp_if_include eth0" in proc.stderr, proc.stderr[-3000:]


def test_plain_mpirun_two_hosts(hosts, tmp_path):
    a, b = hosts.addrs
    env = _env(hosts, {"EXPECT_SOURCE": "mpirun", "EXPECT_SUBNET": hosts.subnet,
                       "PERSEUS_RENDEZVOUS_SECRET": "multihost-test-secret"})
    cmd = ["mpirun", "--allow-run-as-root", "-np", "4", "-H", f"{a}:2,{b}:2",
           "-mca", "plm_rsh_args", f"-i {hosts.key}", "-x", f"PERSEUS_MASTER_ADDR={a}",
           "-x", "PERSEUS_RENDEZVOUS_SECRET", "-x", "PYTHONPATH", "-x", "EXPECT_SOURCE",
           "-x", "EXPECT_SUBNET"]
    for name in JOB_ENV:
        cmd += ["-x", name]
    start = time.monotonic()
    proc = hosts.exec(0, *cmd, *_run_checks_cmd(str(tmp_path)), check=False, env=env,
                      cwd=ROOT, timeout=300)
    print(f"plain mpirun, 2 hosts x 2 ranks: {time.monotonic() - start:.1f} s")
    _assert_checks(read_results(str(tmp_path), 4), proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
