"""A real one-node Slurm cluster on this machine, for the length of a test.

`SlurmCluster` writes a key, a slurm.conf and every state directory into one
temporary directory, starts munged, slurmctld and slurmd in the foreground
as children of the test (nothing is written under /etc, /run or /var:
munged gets its socket, key, pid and seed files by option, the daemons and
commands find slurm.conf through SLURM_CONF), waits until the
node is idle, and on exit stops everything it started and removes the
directory, whether the test passed or not.

Slurm runs its daemons and our jobs as root (SlurmUser=root): the cluster
needs root, and `not_root_reason()` says so when we are not.

    with SlurmCluster(cpus=4) as cluster:
        cluster.run(["srun", "-n", "4", "hostname"])
"""

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from harness import apply_env

PACKAGES = "slurm-wlm munge"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "salloc", "sbatch", "sinfo", "squeue", "scancel", "scontrol")


def not_root_reason():
    """Why the cluster cannot start here (only: not root), or None."""
    if os.geteuid() != 0:
        return (f"a local Slurm cluster runs its daemons and jobs as root "
                f"(SlurmUser=root); this runs as uid {os.geteuid()}")
    return None


def free_ports(count):
    """`count` distinct TCP ports that nothing listens on just now."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:  # all bound at once: the kernel hands out distinct ports
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port():
    return free_ports(1)[0]


class SlurmStartError(RuntimeError):
    """The cluster did not come up; the message holds the daemons' logs."""


class SlurmCluster:
    """munged + slurmctld + slurmd on this machine, one node of `cpus` CPUs.

    Args:
      cpus: CPUs the node offers. More than the machine has is fine
        (SlurmdParameters=config_overrides): 4 tasks fit on 2 cores.
      start_timeout: seconds to wait for the node to become idle.
    """

    def __init__(self, cpus=4, start_timeout=30.0):
        self.cpus = cpus
        self.start_timeout = start_timeout
        self.dir = None
        self.conf = None
        self.node = socket.gethostname().split(".")[0]
        self.startup_seconds = None
        self._procs = {}

    # -- public -------------------------------------------------------------

    def env(self, extra=None, base=None):
        """An environment for Slurm commands aimed at this cluster.

        SLURM_* variables of an outer job (tests run inside an allocation)
        are dropped: srun would take them for this cluster's job.
        """
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = self.conf
        return apply_env(env, extra)

    def run(self, argv, env=None, timeout=120, **kwargs):
        """Runs a command (srun, salloc, ...) against this cluster."""
        return subprocess.run(argv, env=self.env(base=env), capture_output=True, text=True,
                              timeout=timeout, **kwargs)

    def sbatch(self, argv, env=None, timeout=120, cwd=None):
        """Submits a batch job and waits for it; returns (state, exit code,
        sbatch's CompletedProcess). `sbatch --wait` would do, but it polls
        every 10 s or so; this asks every 0.1 s."""
        submit = self.run(["sbatch", "--parsable"] + list(argv), env=env, timeout=30, cwd=cwd)
        if submit.returncode != 0:
            return "NOT SUBMITTED", submit.returncode, submit
        job_id = submit.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            show = self.run(["scontrol", "-o", "show", "job", job_id], timeout=10)
            fields = dict(f.split("=", 1) for f in show.stdout.split() if "=" in f)
            state = fields.get("JobState", "")
            if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                code, _, sig = fields.get("ExitCode", "-1:0").partition(":")
                return state, int(code) or -int(sig or 0), submit
            time.sleep(0.1)
        self.run(["scancel", job_id], timeout=10)
        return "TIMED OUT (cancelled)", -1, submit

    def logs(self, tail=4000):
        """The daemons' logs, last `tail` characters of each. In the
        foreground they also log to stderr (<name>.out), which holds what
        they said before their log file was open, such as a bad slurm.conf."""
        parts = []
        for name in DAEMONS:
            for suffix in (".out", ".log"):
                path = os.path.join(self.dir or "", "log", name + suffix)
                text = ""
                if os.path.exists(path):
                    with open(path, errors="replace") as f:
                        text = f.read()
                if text.strip():
                    parts.append(f"--- {name} ({name}{suffix}) ---\n{text[-tail:]}")
                    break
        return "\n".join(parts) or "(no daemon logged anything)"

    def start(self):
        missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None
                   and not os.path.exists(os.path.join("/usr/sbin", b))]
        if missing:
            raise SlurmStartError(f"{', '.join(missing)} not found: install {PACKAGES} "
                                  "(Debian 12: apt-get install slurm-wlm munge)")
        began = time.monotonic()
        self.dir = tempfile.mkdtemp(prefix="perseus-slurm-")
        # munged wants every directory above its socket searchable by all,
        # and its key readable by its owner only.
        os.chmod(self.dir, 0o711)
        for sub, mode in (("key", 0o700), ("run", 0o755), ("log", 0o755), ("state", 0o700),
                          ("spool", 0o755)):
            os.mkdir(os.path.join(self.dir, sub), mode)
        self.conf = os.path.join(self.dir, "slurm.conf")
        key = os.path.join(self.dir, "key", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400), "wb") as f:
            f.write(os.urandom(1024))
        socket_path = os.path.join(self.dir, "run", "munge.socket")
        self._write_conf(socket_path)

        self._spawn("munged", [_sbin("munged"), "--foreground", f"--socket={socket_path}",
                               f"--key-file={key}",
                               f"--pid-file={os.path.join(self.dir, 'run', 'munged.pid')}",
                               f"--seed-file={os.path.join(self.dir, 'key', 'munged.seed')}",
                               f"--log-file={os.path.join(self.dir, 'log', 'munged.log')}"])
        self._wait(lambda: os.path.exists(socket_path), "munged to create its socket")
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D"])
        self._spawn("slurmd", [_sbin("slurmd"), "-D", "-N", self.node])
        self._wait(self._node_idle, f"node {self.node} to be idle (sinfo)")
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self):
        """Ends every job, then every process of this cluster; removes the files."""
        if self.conf and self._procs.get("slurmctld") and self._alive("slurmctld"):
            try:
                self.run(["scancel", "--full", "--quiet", "--user", "root"], timeout=10)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    left = self.run(["squeue", "-h", "-o", "%i"], timeout=10)
                    if left.returncode != 0 or not left.stdout.strip():
                        break
                    time.sleep(0.2)
            except subprocess.TimeoutExpired:
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc and proc.poll() is None:
                proc.terminate()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self._procs.get(name)
            if proc:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        # slurmstepd and job tasks are not our children: find them by the
        # SLURM_CONF in their environment (the daemons' path is unique to
        # this cluster, and every task srun starts inherits it).
        if self.conf:
            for pid in self.leftover_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def leftover_pids(self):
        """Processes still running with this cluster's SLURM_CONF."""
        marker = b"SLURM_CONF=" + self.conf.encode()
        me = os.getpid()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                continue
        return pids

    def __enter__(self):
        try:
            return self.start()
        except SlurmStartError as err:
            logs = self.logs()
            self.stop()
            raise SlurmStartError(f"{err}\n{logs}") from None
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
        return False

    # -- private ------------------------------------------------------------

    def _write_conf(self, socket_path):
        d = self.dir
        ctld_port, slurmd_port = free_ports(2)
        # Job ids seed the store port a Slurm job derives; start them at a
        # random place so that two clusters on one machine do not meet.
        first_job = random.randrange(1000, 60000)
        lines = [
            "ClusterName=perseustest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={socket_path}",
            f"StateSaveLocation={d}/state",
            f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd.log",
            f"PlugStackConfig={d}/plugstack.conf",
            # No cgroups, no accounting: processes tracked through /proc.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # Trust the CPUs below even where the machine has fewer.
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            f"FirstJobId={first_job}",
            "MessageTimeout=10",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=2",
            "MinJobAge=10",
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        open(os.path.join(d, "plugstack.conf"), "w").close()  # not /etc/slurm's

    def _spawn(self, name, argv):
        out = open(os.path.join(self.dir, "log", name + ".out"), "wb")
        try:
            self._procs[name] = subprocess.Popen(
                argv, env=self.env(), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, cwd=self.dir)
        finally:
            out.close()

    def _alive(self, name):
        proc = self._procs.get(name)
        return proc is not None and proc.poll() is None

    def _node_idle(self):
        try:  # sinfo retries while slurmctld is not up yet: ask again soon
            state = self.run(["sinfo", "-h", "-N", "-o", "%T"], timeout=2)
        except subprocess.TimeoutExpired:
            return False
        return state.returncode == 0 and state.stdout.strip() == "idle"

    def _wait(self, ready, what):
        deadline = time.monotonic() + self.start_timeout
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmStartError(f"local Slurm cluster: {name} exited with status "
                                          f"{proc.returncode} while waiting for {what}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise SlurmStartError(f"local Slurm cluster: no {what} within "
                                      f"{self.start_timeout:.0f} s")
            time.sleep(0.1)


def _sbin(name):
    return shutil.which(name) or os.path.join("/usr/sbin", name)
