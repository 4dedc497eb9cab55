"""Several hosts on this machine, for the cross-host tests.

`NetnsHosts(n)` makes n network namespaces, each a "host" with one address
10.77.<subnet>.<i+1>/24 on a veth whose other end sits on a bridge inside a
further namespace (the switch), so traffic between hosts never leaves the
namespaces made here. Each host runs its own `sshd` (Debian's
openssh-server) on its address, with a host key and a client key generated
for the test; root may log in with that key only.

Every namespace shares this machine's file system and processes' view of
paths, which is the assumption perseusrun makes of real fleets: the same
paths and virtualenv on every host.

`ssh_env()` gives an environment whose PATH starts with a directory holding
an `ssh` that uses the test's client configuration (no known_hosts file
written, batch mode); perseusrun and mpirun call `ssh` from PATH.

`close()` kills every process left in the namespaces and deletes them; it
runs even when a test fails (use it as a context manager or fixture).
"""

import os
import shutil
import subprocess
import tempfile
import time

SSHD = "/usr/sbin/sshd"
ALT_SSH_PORT = 2222  # every sshd also listens here, for perseusrun -p


def _run(*cmd, check=True, **kw):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


def communicate_all(procs, timeout, what):
    """The outputs of a job's processes, waited for under one deadline of
    `timeout` seconds; on expiry every process is killed and RuntimeError
    names `what`."""
    deadline = time.time() + timeout
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1, deadline - time.time()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{what} timed out after {timeout} s")
    return outputs


def missing_requirements():
    """Why the cross-host tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, sshd)"
    for tool in ("ip", SSHD, "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} is not installed (make test installs openssh-server and iproute2)"
    return None


class NetnsHosts:
    def __init__(self, n, subnet=None):
        tag = f"pt{os.getpid() % 100000}"
        self.subnet = subnet if subnet is not None else 100 + os.getpid() % 100
        self.names = [f"{tag}-h{i}" for i in range(n)]
        self.switch = f"{tag}-sw"
        self.addrs = [f"10.77.{self.subnet}.{i + 1}" for i in range(n)]
        self.dir = tempfile.mkdtemp(prefix="perseus-netns-")
        self.key = os.path.join(self.dir, "id_test")
        self.other_key = os.path.join(self.dir, "id_other")  # not authorized
        self._sshd = []
        try:
            self._make_network()
            self._start_sshd()
        except BaseException:
            self.close()
            raise

    # ---- set-up ----------------------------------------------------------

    def _make_network(self):
        self.close_namespaces()
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs)):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Both ends are created inside our namespaces, never in the root one.
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth",
                 "peer", "name", f"port{i}", "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", f"port{i}", "up")
            _run("ip", "-n", ns, "addr", "add", addr + "/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")

    def _start_sshd(self):
        for key in (self.key, self.other_key):
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
        shutil.copy(self.key + ".pub", os.path.join(self.dir, "authorized_keys"))
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs)):
            host_key = os.path.join(self.dir, f"host_key{i}")
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key)
            config = os.path.join(self.dir, f"sshd_config{i}")
            with open(config, "w") as f:
                f.write(f"Port 22\nPort {ALT_SSH_PORT}\nListenAddress {addr}\nHostKey {host_key}\n"
                        f"PidFile {self.dir}/sshd{i}.pid\n"
                        f"AuthorizedKeysFile {self.dir}/authorized_keys\n"
                        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                        "PrintMotd no\nMaxStartups 100\nMaxSessions 100\n")
            self._sshd.append(self._spawn_sshd(i))
        bindir = os.path.join(self.dir, "bin")
        os.makedirs(bindir)
        with open(os.path.join(self.dir, "ssh_config"), "w") as f:
            f.write("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                    "  LogLevel ERROR\n  BatchMode yes\n  IdentitiesOnly yes\n")
        wrapper = os.path.join(bindir, "ssh")
        with open(wrapper, "w") as f:
            f.write(f"#!/bin/sh\nexec /usr/bin/ssh -F {self.dir}/ssh_config \"$@\"\n")
        os.chmod(wrapper, 0o755)
        self.bindir = bindir
        # Wait until every sshd accepts our key.
        deadline = time.monotonic() + 20
        for i, addr in enumerate(self.addrs):
            while True:
                r = self.exec(0, "ssh", "-i", self.key, addr, "true", check=False)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    with open(os.path.join(self.dir, f"sshd{i}.log")) as f:
                        log = f.read()
                    raise RuntimeError(f"sshd on {addr} did not come up: {r.stderr}\n{log}")
                time.sleep(0.2)

    def _spawn_sshd(self, i):
        config = os.path.join(self.dir, f"sshd_config{i}")
        return subprocess.Popen(
            ["ip", "netns", "exec", self.names[i], SSHD, "-D", "-e", "-f", config],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, f"sshd{i}.log"), "a"))

    # ---- use -------------------------------------------------------------

    def kill_host(self, host):
        """SIGKILLs every process of host's namespace, its sshd included: the
        host is gone until restart_sshd(host)."""
        out = _run("ip", "netns", "pids", self.names[host], check=False).stdout.split()
        for pid in out:
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        self._sshd[host].wait()

    def restart_sshd(self, host):
        """Brings a killed host's sshd back; returns once it accepts our key."""
        self._sshd[host] = self._spawn_sshd(host)
        deadline = time.monotonic() + 20
        while self.exec(0, "ssh", "-i", self.key, self.addrs[host], "true",
                        check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {self.addrs[host]} did not come back")
            time.sleep(0.2)

    def cut(self, host, way="both"):
        """Cuts host off the network: its packets are dropped, nobody gets a
        reset. way="both": its switch port goes down; "in": nothing reaches
        it, what it sends still goes out; "out": the reverse. A one-way cut
        is a token bucket too small for any packet (`tc` tbf; this kernel
        has no netem or netfilter), on the switch port toward the host or on
        the host's own interface. way="unreachable": the host's routes to
        the others say "unreachable", so its connects fail at once with "no
        route to host" (what a router's ICMP answer gives), every time, and
        its packets to them are dropped. mend(host) undoes any of them."""
        if way == "both":
            _run("ip", "-n", self.switch, "link", "set", f"port{host}", "down")
            return
        if way == "unreachable":
            for i, addr in enumerate(self.addrs):
                if i != host:
                    _run("ip", "-n", self.names[host], "route", "add", "unreachable",
                         f"{addr}/32")
            return
        ns, dev = (self.switch, f"port{host}") if way == "in" else (self.names[host], "eth0")
        _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", "8kbit",
             "burst", "20", "limit", "20")

    def mend(self, host):
        _run("ip", "-n", self.switch, "link", "set", f"port{host}", "up")
        for i, addr in enumerate(self.addrs):
            if i != host:
                _run("ip", "-n", self.names[host], "route", "del", "unreachable", f"{addr}/32",
                     check=False)
        for ns, dev in ((self.switch, f"port{host}"), (self.names[host], "eth0")):
            _run("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)

    def shape(self, rate):
        """Shapes every host's link with tc's token bucket: `rate` leaves each
        host, so each direction is shaped (256 KB bursts pass at full speed)."""
        for ns in self.names:
            _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                 "burst", "256kb", "latency", "200ms")

    def ssh_env(self, base=None):
        env = dict(os.environ if base is None else base)
        env["PATH"] = self.bindir + os.pathsep + env.get("PATH", "")
        return env

    def exec(self, host, *cmd, check=True, env=None, **kw):
        """Runs cmd in host's namespace and waits for it."""
        return subprocess.run(["ip", "netns", "exec", self.names[host], *cmd],
                              check=check, capture_output=True, text=True,
                              env=self.ssh_env(env), **kw)

    def popen(self, host, cmd, env=None, **kw):
        return subprocess.Popen(["ip", "netns", "exec", self.names[host], *cmd],
                                env=self.ssh_env(env), **kw)

    def pids(self, host):
        """Processes in host's namespace other than its sshd listener."""
        out = _run("ip", "netns", "pids", self.names[host], check=False).stdout.split()
        sshd_pid = self._sshd_pid(host)
        return [int(p) for p in out if int(p) != sshd_pid]

    def describe(self, pids):
        lines = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    lines.append(f"{pid}: " + f.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
        return "\n".join(lines)

    def _sshd_pid(self, host):
        try:
            with open(os.path.join(self.dir, f"sshd{host}.pid")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return -1

    # ---- tear-down -------------------------------------------------------

    def close_namespaces(self):
        for ns in self.names + [self.switch]:
            out = _run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in out:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", ns, check=False)

    def close(self):
        for p in self._sshd:
            p.kill()
            p.wait()
        self.close_namespaces()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
