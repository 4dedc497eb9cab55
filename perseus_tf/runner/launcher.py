"""The ``perseusrun`` launcher: runs N ranks of a training command.

perseusrun places the ranks on the hosts given with ``-H`` or ``--hostfile``
(inside a Slurm allocation, by default the allocation's nodes), serves the
rendezvous store (store.py) through which the ranks find each other, and
starts one process per rank: directly on this machine, over ssh on other
hosts (remote.py runs there and owns the rank), or all through Open MPI's
``mpirun`` with ``--mpi``. A rank learns its place in the job only from the
PERSEUS_* environment variables set here. While the job runs, perseusrun
prefixes every output line with ``[rank] ``, forwards SIGINT and SIGTERM to
the ranks, and when one rank fails it stops the others.

Remote hosts are assumed to look like this one: the same working directory,
the same Python at the same path with perseus_tf importable, as horovodrun
assumes. The job's secret reaches remote ranks on ssh's standard input,
never on a command line.
"""

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from perseus_tf import _failure_record
from perseus_tf import config as _config
from perseus_tf.runner.scratch import remove_job_scratch
from perseus_tf.runner.store import StoreServer

PROG = "perseusrun"
DEFAULT_GRACE_S = 10.0
DEFAULT_START_TIMEOUT_S = 30.0
# Time between SIGTERM and SIGKILL when stopping ranks that outlived a failure.
KILL_DELAY_S = 5.0
# After the first Ctrl-C (SIGINT, forwarded), ranks still running this long
# later (blocked in a collective, say, where Python cannot see the signal)
# get SIGTERM, then SIGKILL KILL_DELAY_S later. A second Ctrl-C kills at once.
INTERRUPT_GRACE_S = 3.0
POLL_INTERVAL_S = 0.05
# What remote ranks get of perseusrun's environment without -x.
FORWARD_PREFIXES = ("PERSEUS_", "GLOO_", "NCCL_")
FORWARD_NAMES = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV",
                 "TF_CPP_MIN_LOG_LEVEL")
SECRET_VARIABLE = "PERSEUS_RENDEZVOUS_SECRET"


class UsageError(Exception):
    """A bad command line; reported through argparse's usage message."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the job: the name as written, its IPv4 address, its
    slots, and whether it is this machine (ranks start without ssh)."""

    name: str
    addr: str
    slots: int
    local: bool = True


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one rank runs and its coordinates within the job."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: Host


# --------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} -np N [-H HOST:SLOTS,... | --hostfile FILE] [options] [--] "
              "COMMAND [ARGS...]",
        description="Run COMMAND as N data-parallel Perseus-TF ranks, on this "
                    "machine or on several over ssh (or mpirun with --mpi).",
        epilog=(
            "Each rank gets PERSEUS_RANK, PERSEUS_SIZE, PERSEUS_LOCAL_RANK, "
            "PERSEUS_LOCAL_SIZE, PERSEUS_CROSS_RANK, PERSEUS_CROSS_SIZE, "
            "PERSEUS_HOST_ADDR, PERSEUS_JOB_ID and the PERSEUS_RENDEZVOUS_"
            "ADDR/PORT/SECRET of the store served by perseusrun, and the "
            "HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE/"
            "HOSTNAME that horovodrun sets; TF_CPP_MIN_LOG_LEVEL defaults to 2. "
            "Ranks on this machine inherit the whole environment; remote ranks "
            "get PERSEUS_*, GLOO_*, NCCL_*, PYTHONPATH, PATH, LD_LIBRARY_PATH, "
            "VIRTUAL_ENV and what -x names, and run in the same working "
            "directory with the same Python: hosts must share paths. Output "
            "lines (and progress-bar updates ending in a carriage return) are "
            "prefixed with '[RANK] '. SIGINT and SIGTERM are forwarded to every "
            "rank; after a Ctrl-C, ranks still running 3 s later (blocked in a "
            "collective, say) get SIGTERM, and a second Ctrl-C kills them at "
            "once; ranks on every host stop if perseusrun itself dies. "
            "perseusrun exits 0 when every rank exits 0, otherwise with the "
            "status of the first rank that failed (128+N for signal N)."),
    )
    parser.add_argument(
        "-np", "--num-proc", dest="np", type=int, required=True, metavar="N",
        help="number of ranks to start")
    parser.add_argument(
        "-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
        help="comma-separated hosts (names or IPv4 addresses), each with the "
             "number of ranks it may run (SLOTS, default 1); ranks fill the "
             "hosts in the order given. Hosts that are not this machine are "
             "reached over ssh. Default: the nodes of the Slurm allocation "
             "(SLURM_JOB_NODELIST) when inside one, else localhost:N")
    parser.add_argument(
        "--hostfile", default=None, metavar="FILE",
        help="hosts in Open MPI's hostfile format, one per line: 'HOST "
             "slots=N' (or just HOST for one slot); '#' starts a comment")
    parser.add_argument(
        "-p", "--ssh-port", type=int, default=None, metavar="PORT",
        help="port of sshd on the remote hosts (default: ssh's own)")
    parser.add_argument(
        "-i", "--ssh-identity-file", default=None, metavar="FILE",
        help="private key for ssh to the remote hosts")
    parser.add_argument(
        "--network-interface", default=None, metavar="NAME",
        help="the network interface (e.g. eth0) the store and Gloo use on "
             "every host; default: the address of this machine that routes to "
             "the other hosts")
    parser.add_argument(
        "--start-timeout", type=float, default=DEFAULT_START_TIMEOUT_S, metavar="S",
        help="seconds to reach every remote host (checked in parallel before "
             f"any rank starts); default {DEFAULT_START_TIMEOUT_S:g}")
    parser.add_argument(
        "-x", dest="export", action="append", default=[], metavar="NAME[=VALUE]",
        help="also give the ranks NAME from perseusrun's environment, or "
             "NAME=VALUE (repeatable, as mpirun's -x)")
    parser.add_argument(
        "--gloo", action="store_true",
        help="start the ranks with perseusrun's own launcher (ssh for remote "
             "hosts) and rendezvous; the default")
    parser.add_argument(
        "--mpi", action="store_true",
        help="start the ranks through Open MPI's mpirun (same -np, -H, "
             "--hostfile, ssh and -x options); perseusrun still serves the store")
    parser.add_argument(
        "--grace-seconds", type=float, default=DEFAULT_GRACE_S, metavar="S",
        help="after a rank fails, how long the other ranks get to exit on "
             "their own before they are sent SIGTERM (and SIGKILL "
             f"{KILL_DELAY_S:g} s later); default {DEFAULT_GRACE_S:g}")
    parser.add_argument(
        "--tf-logs", action="store_true",
        help="show TensorFlow's own C++ log lines (start-up notes such as "
             "'Could not find cuda drivers' and 'failed call to cuInit' on a "
             "machine without a GPU, and every I/W line). By default perseusrun "
             "drops them from the ranks' output unless TF_CPP_MIN_LOG_LEVEL is "
             "set; PERSEUS_TF_LOGS=1 does the same as this option")
    parser.add_argument(
        "--verbose", action="store_true",
        help="print rank placement, the rendezvous port, the commands run "
             "and each rank's exit")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="COMMAND",
        help="the program to run in every rank, with its arguments; put it "
             "after '--' if it could be mistaken for a perseusrun flag")
    return parser


def _add_entry(entries, name, slots, where):
    if not name or slots < 1:
        raise UsageError(f"{where}: {name!r} must be HOST with SLOTS >= 1")
    if any(name == seen for seen, _ in entries):
        raise UsageError(f"{where}: host {name!r} is listed twice")
    entries.append((name, slots))


def parse_hosts(spec: str) -> list:
    """Parses ``host1:n1,host2:n2`` into (name, slots) pairs, in order."""
    entries = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise UsageError(f"-H/--hosts: empty host entry in {spec!r}")
        name, sep, slots_text = item.rpartition(":")
        if not sep:
            name, slots_text = item, "1"
        try:
            slots = int(slots_text)
        except ValueError:
            raise UsageError(
                f"-H/--hosts: slots of {item!r} must be an integer") from None
        if not name or slots < 1:
            raise UsageError(
                f"-H/--hosts: {item!r} must be HOST:SLOTS with SLOTS >= 1")
        _add_entry(entries, name, slots, "-H/--hosts")
    return entries


def parse_hostfile(text: str, path: str = "hostfile") -> list:
    """Parses Open MPI's hostfile format: ``host [slots=N] [max_slots=M]``
    per line, '#' comments and blank lines ignored."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--hostfile {path}, line {number}"
        slots = 1
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if not sep or key not in ("slots", "max_slots", "max-slots"):
                raise UsageError(f"{where}: cannot read {word!r} (expected slots=N)")
            try:
                count = int(value)
            except ValueError:
                raise UsageError(f"{where}: {key} must be an integer, not {value!r}") from None
            if key == "slots":
                slots = count
        _add_entry(entries, words[0], slots, where)
    if not entries:
        raise UsageError(f"--hostfile {path}: lists no host")
    return entries


def slurm_hosts(environ) -> list:
    """The hosts of the Slurm allocation this runs in, with their task
    counts as slots, or [] outside an allocation."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return []
    from perseus_tf.runner import slurm
    try:
        names = slurm.expand_hostlist(nodelist)
        tasks = environ.get("SLURM_TASKS_PER_NODE")
        slots = slurm.expand_tasks_per_node(tasks) if tasks else [1] * len(names)
    except ValueError as err:
        raise UsageError(f"SLURM_JOB_NODELIST: {err}") from None
    if len(slots) != len(names):
        raise UsageError(
            f"SLURM_TASKS_PER_NODE={tasks!r} gives {len(slots)} nodes but "
            f"SLURM_JOB_NODELIST={nodelist!r} lists {len(names)}")
    return list(zip(names, slots))


# --------------------------------------------------------------------------
# Hosts and rank placement


def resolve_host(name: str) -> Host:
    """The Host for a -H name (slots filled in by the caller): its IPv4
    address, and whether it is this machine."""
    if name == "localhost":
        return Host(name, "127.0.0.1", 1, True)
    try:
        addr = socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except (socket.gaierror, UnicodeError):
        raise UsageError(
            f"-H/--hosts: cannot resolve host {name!r} to an IPv4 address") from None
    local = ipaddress.ip_address(addr).is_loopback or _config.can_bind(addr)
    return Host(name, addr, 1, local)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface name on this machine."""
    try:
        return _config.interface_address(name)
    except _config.ConfigError:
        raise UsageError(f"--network-interface {name}: no IPv4 address on this machine "
                         "(names: " + ", ".join(sorted(n for _, n in socket.if_nameindex()))
                         + ")") from None


def route_address(peer: str) -> str:
    """The address of this machine that packets to peer leave from."""
    try:
        return _config.route_address(peer)
    except _config.ConfigError as err:
        raise UsageError(str(err)) from None


def place_ranks(np: int, hosts: list) -> list:
    """Assigns ranks 0..np-1 to hosts in order, filling each host's slots.

    Hosts left without a rank are not part of the job: they do not count in
    the cross size, and a host's local size is the number of ranks it got.
    """
    per_host = []
    remaining = np
    for host in hosts:
        if remaining == 0:
            break
        count = min(host.slots, remaining)
        per_host.append((host, count))
        remaining -= count
    placements = []
    for cross_rank, (host, count) in enumerate(per_host):
        for local_rank in range(count):
            placements.append(Placement(
                rank=len(placements), size=np,
                local_rank=local_rank, local_size=count,
                cross_rank=cross_rank, cross_size=len(per_host),
                host=host))
    return placements


def rank_contract(placement: Placement, rendezvous_addr: str,
                  rendezvous_port: int, job_id: str) -> dict:
    """The variables that tell one rank its place (the secret aside)."""
    env = {
        "PERSEUS_RANK": str(placement.rank),
        "PERSEUS_SIZE": str(placement.size),
        "PERSEUS_LOCAL_RANK": str(placement.local_rank),
        "PERSEUS_LOCAL_SIZE": str(placement.local_size),
        "PERSEUS_CROSS_RANK": str(placement.cross_rank),
        "PERSEUS_CROSS_SIZE": str(placement.cross_size),
        "PERSEUS_RENDEZVOUS_ADDR": rendezvous_addr,
        "PERSEUS_RENDEZVOUS_PORT": str(rendezvous_port),
        "PERSEUS_JOB_ID": job_id,
        "PERSEUS_HOST_ADDR": placement.host.addr,
        # An uncaught exception leaves a record for perseusrun (_failure_record).
        _failure_record.ENV: "1",
        # Ranks' output goes through pipes; without this Python would hold
        # it back in block buffers and the forwarded lines would lag.
        "PYTHONUNBUFFERED": "1",
    }
    # What horovodrun gives its workers, for scripts (and tests) that read it.
    env.update({
        "HOROVOD_RANK": str(placement.rank),
        "HOROVOD_SIZE": str(placement.size),
        "HOROVOD_LOCAL_RANK": str(placement.local_rank),
        "HOROVOD_LOCAL_SIZE": str(placement.local_size),
        "HOROVOD_CROSS_RANK": str(placement.cross_rank),
        "HOROVOD_CROSS_SIZE": str(placement.cross_size),
        "HOROVOD_HOSTNAME": placement.host.name,
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
    })
    return env


def rank_env(base: dict, placement: Placement, rendezvous_addr: str,
             rendezvous_port: int, secret: bytes, job_id: str) -> dict:
    """The environment of a rank on this machine: base plus the contract."""
    env = dict(base)
    env.update(rank_contract(placement, rendezvous_addr, rendezvous_port, job_id))
    env[SECRET_VARIABLE] = secret.hex()
    # Ranks check that this process is alive (they stop when it is gone).
    env["PERSEUS_LAUNCHER_PID"] = str(os.getpid())
    # TF's C++ start-up lines (and a "failed call to cuInit" on machines
    # without a GPU) times N ranks drown the job's output; the user's own
    # setting wins.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def forwarded_env(base: dict, exports: list) -> dict:
    """What remote ranks get of perseusrun's environment: the default
    names and prefixes, then -x NAME[=VALUE] entries."""
    env = {k: v for k, v in base.items()
           if (k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES) and k != SECRET_VARIABLE}
    env.update(export_values(base, exports))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def export_values(base: dict, exports: list) -> dict:
    values = {}
    for item in exports:
        name, sep, value = item.partition("=")
        if not name or not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise UsageError(f"-x {item!r}: NAME must be an environment variable name")
        if not sep:
            if name not in base:
                raise UsageError(f"-x {name}: {name} is not set in perseusrun's environment")
            value = base[name]
        values[name] = value
    return values


def ssh_base(args, connect_timeout: float) -> list:
    cmd = ["ssh", "-o", "BatchMode=yes",
           "-o", f"ConnectTimeout={max(1, int(connect_timeout))}"]
    if args.ssh_port:
        cmd += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        cmd += ["-i", args.ssh_identity_file]
    return cmd


def remote_command(env: dict, command: list, cwd: str, probe: bool = False) -> str:
    """The shell command ssh runs on a remote host for one rank: remote.py
    reads the secret from its standard input and owns the rank. With probe,
    it only checks that remote.py can start there."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    runner = [sys.executable, "-m", "perseus_tf.runner.remote"]
    runner += ["--probe"] if probe else ["--"] + list(command)
    return (f"cd {shlex.quote(cwd)} && exec env {assignments} "
            + " ".join(shlex.quote(part) for part in runner))


def remote_invocation(args, host: str, env: dict, private: dict, secret: bytes):
    """The ssh command for one remote rank and what goes to its standard
    input. What -x names (`private`: API keys, tokens) travels with the
    secret on standard input, never on a command line, where any local user
    could read it in /proc/PID/cmdline for the whole job. Standard input:
    the secret in hex, a line; then a hex-encoded JSON object of the private
    variables, a line (remote.py reads both)."""
    public = {k: v for k, v in env.items() if k not in private}
    cmd = ssh_base(args, args.start_timeout) + [host, remote_command(public, args.command,
                                                                     os.getcwd())]
    values = json.dumps(private, sort_keys=True).encode().hex().encode()
    return cmd, secret.hex().encode() + b"\n" + values + b"\n"


def check_hosts(args, hosts: list) -> None:
    """Reaches every remote host over ssh, all at once, within
    --start-timeout, and checks that perseus_tf's runner imports there with
    this Python; raises UsageError naming every host that failed."""
    env = forwarded_env(os.environ, [])
    probe = remote_command({k: env[k] for k in ("PYTHONPATH", "PATH") if k in env},
                           [], os.getcwd(), probe=True)
    checks = []
    for host in hosts:
        cmd = ssh_base(args, args.start_timeout) + [host.name, probe]
        checks.append((host, subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)))
    deadline = time.monotonic() + args.start_timeout
    failures = []
    for host, proc in checks:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            failures.append(f"  {host.name}: no answer within --start-timeout "
                            f"{args.start_timeout:g} s")
            continue
        if proc.returncode == 255:
            failures.append(f"  {host.name}: ssh: {(err or out).strip() or 'exit status 255'}")
        elif proc.returncode != 0:
            failures.append(
                f"  {host.name}: {sys.executable} cannot import perseus_tf there "
                f"(hosts must share paths and the virtualenv): {(err or out).strip()[-300:]}")
    if failures:
        raise UsageError("cannot start ranks on " + str(len(failures)) + " host"
                         + ("s" if len(failures) > 1 else "") + ":\n" + "\n".join(failures))


# --------------------------------------------------------------------------
# Running the ranks


def _log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def describe_status(returncode: int, remote: bool = False) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by signal {name}"
    if remote and returncode == 255:
        return "lost: ssh failed or the connection broke (exit status 255)"
    if remote and 128 < returncode < 128 + 65:
        try:
            return f"killed by signal {signal.Signals(returncode - 128).name}"
        except ValueError:
            pass
    return f"failed with exit status {returncode}"


# TensorFlow's C++ log lines: absl's format (TF >= 2.16, "I0000
# 00:00:1795595146.043765 1234 file.cc:31] ...", seconds since the epoch
# before absl is initialised) and TF 2.15's ("2026-11-25 08:00:00.123: I
# tensorflow/...cc:182] ..."), and absl's note that it logs to stderr.
_TF_LOG_LINE = re.compile(
    rb"^(?:([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] "
    rb"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: ([IWEF]) \S+:\d+\] )")
_ABSL_NOTE = b"WARNING: All log messages before absl::InitializeLog() is called"
# Errors TensorFlow logs at every start on a machine without a GPU (or with
# a CUDA build beside another): noise, not the user's problem.
_TF_BENIGN_ERRORS = (b"failed call to cuInit", b"Unable to register cuDNN factory",
                     b"Unable to register cuFFT factory", b"Unable to register cuBLAS factory")


def tf_log_noise(segment: bytes) -> bool:
    """True for a line perseusrun keeps off the screen by default: TF's C++
    info and warning lines, the start-up errors of a machine without a GPU,
    and absl's note about logging before InitializeLog. Real errors (E/F
    lines about anything else) and everything else the rank prints stay."""
    if segment.startswith(_ABSL_NOTE):
        return True
    m = _TF_LOG_LINE.match(segment)
    if not m:
        return False
    severity = m.group(1) or m.group(2)
    if severity in (b"I", b"W"):
        return True
    return severity == b"E" and any(text in segment for text in _TF_BENIGN_ERRORS)


# A segment ends at \n, or at a \r not followed by \n (a \r\n pair stays
# together; a \r that ends a read ends its segment).
_SEGMENT_END = re.compile(rb"\n|\r(?!\n)")


def _segments(buffer: bytes, pending=None):
    """Splits buffer into complete segments, each ending in \n or \r (a
    \r\n pair stays together); returns (segments, the unfinished rest).

    pending: a list of earlier unfinished pieces, joined to the first
    segment only once it completes, so a long line costs time linear in its
    length however many reads bring it."""
    pending = pending or []
    ends = [m.end() for m in _SEGMENT_END.finditer(buffer)]
    if not ends:
        return [], pending + [buffer] if buffer else pending
    segments = [b"".join(pending) + buffer[:ends[0]]]
    segments += [buffer[a:b] for a, b in zip(ends, ends[1:])]
    rest = buffer[ends[-1]:]
    return segments, [rest] if rest else []


def _take_records(segments: list, on_record) -> list:
    """The segments with ranks' failure records (_failure_record) taken
    out and handed to on_record."""
    kept = []
    for segment in segments:
        record = _failure_record.parse_record(segment)
        if record is None:
            kept.append(segment)
            continue
        on_record(record)
        before = segment[:segment.find(_failure_record.RECORD_PREFIX)]
        if before:
            kept.append(before + b"\n")
    return kept


def _forward_lines(pipe, stream, prefix: bytes, lock: threading.Lock,
                   quiet: bool = False, on_record=None) -> None:
    """Copies pipe to stream, each line or \\r-ended update (a progress bar
    redrawing itself) as soon as it is complete, each starting with prefix.
    quiet: drop TensorFlow's C++ log noise (tf_log_noise). on_record: takes
    the ranks' failure records, which are not shown."""
    # Write bytes when the stream allows it, so that output that is not
    # valid in our locale's encoding passes through untouched.
    raw = getattr(stream, "buffer", None)
    broken = False
    pending = []  # unfinished pieces of the current segment
    after_cr = False  # the last segment sent ended in \\r
    fd = pipe.fileno()
    with pipe:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if chunk:
                segments, pending = _segments(chunk, pending)
            else:
                segments, pending = ([b"".join(pending) + b"\n"] if pending else []), []
            if on_record is not None:
                segments = _take_records(segments, on_record)
            if quiet:
                segments = [seg for seg in segments if not tf_log_noise(seg)]
            parts = []
            for segment in segments:
                # A \\r\\n split across two reads: the \\n ends the line
                # already shown, it needs no prefix of its own.
                parts.append(segment if after_cr and segment == b"\n" else prefix + segment)
                after_cr = segment.endswith(b"\r")
            if parts and not broken:
                data = b"".join(parts)
                with lock:
                    try:
                        if raw is not None:
                            raw.write(data)
                            raw.flush()
                        else:
                            stream.write(data.decode("utf-8", "replace"))
                            stream.flush()
                    except (BrokenPipeError, ValueError):
                        # Our reader went away (e.g. `perseusrun ... | head`);
                        # keep draining, or the rank would block on a full pipe.
                        broken = True
            if not chunk:
                return


def _first_record(records: list, _unused) -> dict:
    """Of failure records, the cause: a rank others blame that blames
    nobody, else the earliest that blames nobody, else the earliest."""
    blamed = {r for record in records for r in record["culprits"]}
    own = [r for r in records if not r["culprits"]]
    pool = [r for r in own if r["rank"] in blamed] or own or records
    return min(pool, key=lambda r: r["time"])


def _die_with_launcher(launcher_pid: int):
    """Runs in the child before exec: the kernel sends it SIGTERM when
    perseusrun dies, even by SIGKILL. If perseusrun died before this ran,
    the child exits at once."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != launcher_pid:
        os._exit(1)


@dataclasses.dataclass
class _Child:
    proc: subprocess.Popen
    label: str        # "rank 3" or "mpirun"
    where: str        # "" on this machine, else " on HOST"
    remote: bool
    rank: int = -1    # -1: not one rank (mpirun)
    exited_at: float = 0.0       # time.time() when its exit was seen
    stopped_by_us: bool = False  # still running when perseusrun sent SIGTERM/SIGKILL


class RankGroup:
    """The child processes of one job and the threads forwarding their output."""

    def __init__(self, verbose: bool = False, quiet: bool = False):
        self.children = []
        # When the ranks must be gone by (SIGTERM then), set by interrupt().
        self._stop_by = None
        self._interrupts = 0
        self._readers = []
        self._verbose = verbose
        self._quiet = quiet  # drop TF's C++ log noise from the output
        self._stdout_lock = threading.Lock()
        self._stderr_lock = threading.Lock()
        # Ranks' failure records (perseus_tf/_failure_record.py) by rank.
        self.records = {}
        self._records_lock = threading.Lock()

    @property
    def procs(self):
        return [c.proc for c in self.children]

    def spawn(self, rank: int, command: list, env: dict, *, host: str = "",
              remote: bool = False, stdin_data: bytes = None, label: str = None,
              prefix: bool = True) -> None:
        # Each rank gets its own process group, so that a Ctrl-C typed in the
        # terminal reaches perseusrun alone and perseusrun decides what the
        # ranks receive; signalling the group also reaches a rank's children.
        # This must run on the main thread: the parent-death signal follows
        # the thread that made the child.
        launcher_pid = os.getpid()
        proc = subprocess.Popen(
            command, env=env,
            stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _die_with_launcher(launcher_pid))
        if stdin_data is not None:
            # The secret goes to remote.py; the pipe then stays open, and its
            # end (perseusrun gone) tells remote.py to stop the rank.
            try:
                proc.stdin.write(stdin_data)
                proc.stdin.flush()
            except BrokenPipeError:
                pass
        self.children.append(_Child(proc, label or f"rank {rank}",
                                    f" on {host}" if host else "", remote, rank))
        tag = f"[{rank}] ".encode() if prefix else b""
        for pipe, stream, lock in ((proc.stdout, sys.stdout, self._stdout_lock),
                                   (proc.stderr, sys.stderr, self._stderr_lock)):
            reader = threading.Thread(
                target=_forward_lines,
                args=(pipe, stream, tag, lock, self._quiet, self._add_record),
                name=f"perseusrun-rank{rank}-output", daemon=True)
            reader.start()
            self._readers.append(reader)

    def _add_record(self, record: dict) -> None:
        with self._records_lock:
            self.records.setdefault(record["rank"], record)

    def signal_running(self, signum: int) -> None:
        """Sends signum to the process group of every child not yet reaped.
        For a remote rank that child is ssh: ssh ends, and remote.py stops
        the rank on its host when its input closes."""
        for child in self.children:
            if child.proc.returncode is None:
                if signum in (signal.SIGTERM, signal.SIGKILL):
                    child.stopped_by_us = True
                try:
                    os.killpg(child.proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def interrupt(self) -> None:
        """Ctrl-C: the first is forwarded (SIGINT) and the ranks get
        INTERRUPT_GRACE_S to stop before SIGTERM; the second kills them."""
        self._interrupts += 1
        if self._interrupts == 1:
            _log(f"interrupted: stopping the ranks (Ctrl-C again to kill them now)")
            self._stop_by = time.monotonic() + INTERRUPT_GRACE_S
            self.signal_running(signal.SIGINT)
        else:
            _log("interrupted again: killing the ranks (SIGKILL)")
            self.signal_running(signal.SIGKILL)

    def supervise(self, grace_s: float, stop_now: bool = False) -> int:
        """Waits for every rank to exit and returns perseusrun's exit status.

        After the first failure the others get grace_s seconds, then SIGTERM,
        then SIGKILL. stop_now starts that sequence at once (without grace).
        """
        exited = set()
        failed = None
        term_at = time.monotonic() if stop_now else None
        kill_at = None
        while len(exited) < len(self.children):
            now = time.monotonic()
            for index, child in enumerate(self.children):
                proc = child.proc
                if index in exited or proc.poll() is None:
                    continue
                exited.add(index)
                child.exited_at = time.time()
                if proc.stdin:
                    try:
                        proc.stdin.close()
                    except OSError:
                        pass
                if self._verbose:
                    _log(f"{child.label}{child.where} (pid {proc.pid}) exited with "
                         f"status {proc.returncode}")
                if proc.returncode != 0 and failed is None:
                    failed = index
                    _log(f"{child.label}{child.where} (pid {proc.pid}) "
                         f"{describe_status(proc.returncode, child.remote)}")
                    if term_at is None:
                        term_at = now + grace_s
            if len(exited) == len(self.children):
                break
            if self._stop_by is not None and kill_at is None:
                # Interrupted: SIGTERM by then, whatever the grace after a failure.
                term_at = self._stop_by if term_at is None else min(term_at, self._stop_by)
                self._stop_by = None
            if term_at is not None and now >= term_at:
                _log("stopping the remaining ranks (SIGTERM)")
                self.signal_running(signal.SIGTERM)
                term_at, kill_at = None, now + KILL_DELAY_S
            elif kill_at is not None and now >= kill_at:
                _log(f"ranks still running {KILL_DELAY_S:g} s after "
                     f"SIGTERM, sending SIGKILL")
                self.signal_running(signal.SIGKILL)
                kill_at = None
            time.sleep(POLL_INTERVAL_S)
        self._drain_output()
        if failed is None:
            return 0
        failed = self._report_first_failure(failed)
        status = self.children[failed].proc.returncode
        return status if status > 0 else 128 - status

    def _report_first_failure(self, first_exit: int) -> int:
        """The child whose failure came first, not merely the first to exit:
        ranks whose runtime failed because of other ranks name them in their
        failure records, so a rank they blame that failed by itself is the
        cause; otherwise the earliest failure. Logs it (with its error) when
        that says more than the exit already logged."""
        with self._records_lock:
            records = dict(self.records)
        first = self.children[first_exit]
        if first.rank < 0:
            # mpirun: one child for all ranks; the records alone tell them apart.
            if records:
                record = _first_record(list(records.values()), {})
                _log(f"first failure: rank {record['rank']}: {record['error']}")
            return first_exit
        blamed = {r for record in records.values() for r in record["culprits"]}
        failed = [i for i, c in enumerate(self.children)
                  if c.proc.returncode not in (0, None)
                  and (not c.stopped_by_us or c.rank in blamed)]
        if not failed:
            return first_exit

        def blames_others(i):
            record = records.get(self.children[i].rank)
            return bool(record and record["culprits"])

        def when(i):
            record = records.get(self.children[i].rank)
            return record["time"] if record else self.children[i].exited_at

        own = [i for i in failed if not blames_others(i)]
        pool = [i for i in own if self.children[i].rank in blamed] or own or failed
        root = min(pool, key=when)
        child = self.children[root]
        record = records.get(child.rank)
        if root != first_exit or record:
            error = f"; its error: {record['error']}" if record else ""
            _log(f"first failure: {child.label}{child.where} (pid {child.proc.pid}) "
                 f"{describe_status(child.proc.returncode, child.remote)}{error}")
        return root

    def _drain_output(self) -> None:
        # Normally the pipes close when the ranks exit. A rank may have left
        # children behind that hold them open; do not wait for those forever.
        deadline = time.monotonic() + 2.0
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))


# --------------------------------------------------------------------------
# Entry point


def _parse_args(parser: argparse.ArgumentParser, argv: list):
    args = parser.parse_args(argv)
    # REMAINDER keeps the '--' that separates perseusrun's flags from COMMAND.
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.mpi and args.gloo:
        raise UsageError("--mpi and --gloo exclude each other")
    if not args.command:
        raise UsageError("no COMMAND given to run in the ranks")
    if args.np < 1:
        raise UsageError("-np must be at least 1")
    if args.grace_seconds < 0:
        raise UsageError("--grace-seconds must not be negative")
    if args.start_timeout <= 0:
        raise UsageError("--start-timeout must be positive")
    if args.ssh_port is not None and not 1 <= args.ssh_port <= 65535:
        raise UsageError(f"-p/--ssh-port {args.ssh_port}: must be from 1 to 65535")
    if args.ssh_identity_file and not os.path.isfile(args.ssh_identity_file):
        raise UsageError(f"-i/--ssh-identity-file {args.ssh_identity_file}: no such file")
    export_values(os.environ, args.export)  # reject bad -x entries early
    if args.hosts and args.hostfile:
        raise UsageError("give -H/--hosts or --hostfile, not both")
    if args.hostfile:
        try:
            with open(args.hostfile, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise UsageError(f"--hostfile {args.hostfile}: {err.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--hostfile {args.hostfile} is not a text file: it must list "
                             "one host a line ('HOST slots=N' or just HOST)") from None
        entries = parse_hostfile(text, args.hostfile)
        flag = "--hostfile"
    elif args.hosts:
        entries, flag = parse_hosts(args.hosts), "-H/--hosts"
    else:
        entries, flag = slurm_hosts(os.environ), "the Slurm allocation (SLURM_JOB_NODELIST)"
        if not entries:
            entries, flag = [("localhost", args.np)], "-H"
    total_slots = sum(slots for _, slots in entries)
    if total_slots < args.np:
        raise UsageError(f"-np {args.np} is more than the {total_slots} slots "
                         f"given by {flag}")
    args.hosts = [dataclasses.replace(resolve_host(name), slots=slots)
                  for name, slots in entries]
    if args.network_interface:
        interface_address(args.network_interface)  # exists here
    return args


def _addresses(args, placements):
    """(the store's address, which it binds and every rank connects to;
    placements with each host's address as the other hosts reach it)."""
    hosts = []
    for p in placements:
        if p.host not in hosts:
            hosts.append(p.host)
    remote = [h for h in hosts if not h.local]
    if args.network_interface:
        mine = interface_address(args.network_interface)
    elif remote:
        mine = route_address(remote[0].addr)
    elif all(ipaddress.ip_address(h.addr).is_loopback for h in hosts):
        mine = "127.0.0.1"
    else:
        mine = next(h.addr for h in hosts if not ipaddress.ip_address(h.addr).is_loopback)
    if not (remote or args.network_interface or args.mpi):
        # One machine: the store listens where every local rank reaches it.
        return mine, placements
    # Ranks on other hosts cannot reach a loopback address of this one.
    fixed = {h: (dataclasses.replace(h, addr=mine)
                 if h.local and (ipaddress.ip_address(h.addr).is_loopback
                                 or args.network_interface) else h) for h in hosts}
    return mine, [dataclasses.replace(p, host=fixed[p.host]) for p in placements]


def mpirun_command(args, names) -> list:
    """The mpirun command of --mpi: values travel in mpirun's environment
    (-x NAME), so the secret is never on a command line."""
    cmd = ["mpirun", "-np", str(args.np), "--bind-to", "none", "--map-by", "slot",
           "-wdir", os.getcwd()]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["-H", ",".join(f"{h.name}:{h.slots}" for h in args.hosts)]
    rsh = []
    if args.ssh_port:
        rsh += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        rsh += ["-i", args.ssh_identity_file]
    if rsh:
        cmd += ["-mca", "plm_rsh_args", " ".join(shlex.quote(a) for a in rsh)]
    if args.network_interface:
        cmd += ["-mca", "oob_tcp_if_include", args.network_interface,
                "-mca", "btl_tcp_if_include", args.network_interface]
    for name in names:
        cmd += ["-x", name]
    cmd += [sys.executable, "-m", "perseus_tf.runner.remote", "--mpi", "--"] + args.command
    return cmd


def main(argv=None) -> int:
    """Runs perseusrun with argv (default sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        args = _parse_args(parser, sys.argv[1:] if argv is None else list(argv))
        placements = place_ranks(args.np, args.hosts)
        rendezvous_addr, placements = _addresses(args, placements)
        remote_hosts = []
        for p in placements:
            if not p.host.local and p.host not in remote_hosts:
                remote_hosts.append(p.host)
        if remote_hosts:
            check_hosts(args, remote_hosts)
    except UsageError as err:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        # argparse exits for -h and for malformed flags; main reports a status.
        return exit_.code if isinstance(exit_.code, int) else 2

    secret = secrets.token_bytes(32)
    job_id = secrets.token_hex(8)
    # The ranks connect from their hosts' addresses (local ones from the
    # rendezvous address itself or loopback): those connections are served
    # first when strangers hold the store's handshake slots.
    job_hosts = {p.host.addr for p in placements} | {rendezvous_addr, "127.0.0.1"}
    store = StoreServer(rendezvous_addr, 0, secret, job_hosts=job_hosts)
    port = store.start()
    show_tf_logs = (args.tf_logs or os.environ.get("PERSEUS_TF_LOGS") == "1"
                    or "TF_CPP_MIN_LOG_LEVEL" in os.environ)
    group = RankGroup(verbose=args.verbose, quiet=not show_tf_logs)
    received = []

    def forward(signum, _frame):
        received.append(signum)
        if signum == signal.SIGINT:
            group.interrupt()
        else:
            group.signal_running(signum)

    # Install the handlers before the first rank starts, so that no signal can
    # kill perseusrun and orphan ranks that were already running.
    previous = {sig: signal.signal(sig, forward)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.verbose:
            _log(f"job {job_id}, rendezvous store on {rendezvous_addr} port {port}")
        if args.mpi:
            return _run_mpi(args, group, rendezvous_addr, port, secret, job_id)
        forward_base = forwarded_env(os.environ, args.export)
        local_extra = export_values(os.environ, args.export)
        if args.network_interface:
            forward_base.setdefault("PERSEUS_GLOO_NETWORK_INTERFACE", args.network_interface)
            local_extra.setdefault("PERSEUS_GLOO_NETWORK_INTERFACE", args.network_interface)
        for p in placements:
            if received:
                break  # interrupted while starting: do not start more ranks
            if args.verbose:
                _log(f"rank {p.rank} on {p.host.name} ({p.host.addr}): local "
                     f"{p.local_rank}/{p.local_size}, cross "
                     f"{p.cross_rank}/{p.cross_size}")
            try:
                if p.host.local:
                    env = rank_env(dict(os.environ, **local_extra), p, rendezvous_addr,
                                   port, secret, job_id)
                    group.spawn(p.rank, args.command, env,
                                host=p.host.name if remote_hosts else "")
                else:
                    env = dict(forward_base)
                    env.update(rank_contract(p, rendezvous_addr, port, job_id))
                    cmd, stdin_data = remote_invocation(args, p.host.name, env, local_extra,
                                                        secret)
                    if args.verbose:
                        _log(f"rank {p.rank}: {' '.join(shlex.quote(c) for c in cmd)}")
                    group.spawn(p.rank, cmd, dict(os.environ), host=p.host.name,
                                remote=True, stdin_data=stdin_data)
            except OSError as err:
                _log(f"cannot start rank {p.rank}: {err}")
                group.supervise(args.grace_seconds, stop_now=True)
                return 127
        status = group.supervise(args.grace_seconds)
        # Ranks killed by a signal leave their scratch directories here (those
        # on other hosts are removed there by remote.py).
        remove_job_scratch(job_id)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.stop()


def _run_mpi(args, group, rendezvous_addr, port, secret, job_id) -> int:
    env = dict(os.environ)
    env.update(export_values(os.environ, args.export))
    env.update({
        "PERSEUS_RENDEZVOUS_ADDR": rendezvous_addr,
        "PERSEUS_RENDEZVOUS_PORT": str(port),
        SECRET_VARIABLE: secret.hex(),
        "PERSEUS_JOB_ID": job_id,
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.network_interface:
        env.setdefault("PERSEUS_GLOO_NETWORK_INTERFACE", args.network_interface)
    names = sorted({k for k in env if k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES}
                   | {item.partition("=")[0] for item in args.export})
    cmd = mpirun_command(args, names)
    if args.verbose:
        _log("mpirun: " + " ".join(shlex.quote(c) for c in cmd))
    try:
        # remote.py --mpi prefixes each rank's lines itself.
        group.spawn(0, cmd, env, label="mpirun", prefix=False)
    except OSError as err:
        _log(f"cannot start mpirun (is Open MPI installed? Debian: openmpi-bin): {err}")
        return 127
    return group.supervise(args.grace_seconds)
