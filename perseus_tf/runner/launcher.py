"""The ``perseusrun`` launcher: runs N ranks of a training command.

perseusrun places the ranks on the hosts given with ``-H``, serves the
rendezvous store (store.py) through which the ranks find each other, and
starts one child process per rank. A child learns its place in the job only
from the PERSEUS_* environment variables set here. While the job runs,
perseusrun prefixes every output line with ``[rank] ``, forwards SIGINT and
SIGTERM to the ranks, and when one rank fails it stops the others.

Only hosts that are this machine are supported for now; starting ranks on
other machines over ssh, or through mpirun, will come later.
"""

import argparse
import dataclasses
import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from perseus_tf.runner.store import StoreServer

PROG = "perseusrun"
DEFAULT_GRACE_S = 10.0
# Time between SIGTERM and SIGKILL when stopping ranks that outlived a failure.
KILL_DELAY_S = 5.0
POLL_INTERVAL_S = 0.05


class UsageError(Exception):
    """A bad command line; reported through argparse's usage message."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One ``-H`` entry: the name as written, its IPv4 address and its slots."""

    name: str
    addr: str
    slots: int


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
        usage=f"{PROG} -np N [-H HOST:SLOTS,...] [options] [--] COMMAND [ARGS...]",
        description="Run COMMAND as N data-parallel Perseus-TF ranks.",
        epilog=(
            "Each rank gets PERSEUS_RANK, PERSEUS_SIZE, PERSEUS_LOCAL_RANK, "
            "PERSEUS_LOCAL_SIZE, PERSEUS_CROSS_RANK, PERSEUS_CROSS_SIZE, "
            "PERSEUS_HOST_ADDR, PERSEUS_JOB_ID and the PERSEUS_RENDEZVOUS_"
            "ADDR/PORT/SECRET of the store served by perseusrun, and the "
            "HOROVOD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE/CROSS_RANK/CROSS_SIZE/"
            "HOSTNAME that horovodrun sets; TF_CPP_MIN_LOG_LEVEL defaults to 2; "
            "the rest of the environment is inherited. Output lines (and "
            "progress-bar updates ending in a carriage return) are prefixed "
            "with '[RANK] '. SIGINT and SIGTERM are forwarded to every rank; "
            "ranks get SIGTERM if perseusrun itself dies. "
            "perseusrun exits 0 when every rank exits 0, otherwise with the "
            "status of the first rank that failed (128+N for signal N)."),
    )
    parser.add_argument(
        "-np", "--num-proc", dest="np", type=int, required=True, metavar="N",
        help="number of ranks to start")
    parser.add_argument(
        "-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
        help="comma-separated hosts, each with the number of ranks it may run "
             "(SLOTS, default 1); ranks fill the hosts in the order given. "
             "Default: localhost:N. Only this machine is supported for now: "
             "localhost, 127.x.y.z, or a name or address of this machine")
    parser.add_argument(
        "--gloo", action="store_true",
        help="start the ranks with perseusrun's own launcher and rendezvous "
             "(the default; the flag exists for symmetry with --mpi)")
    parser.add_argument(
        "--mpi", action="store_true",
        help="start the ranks through mpirun (not supported yet)")
    parser.add_argument(
        "--grace-seconds", type=float, default=DEFAULT_GRACE_S, metavar="S",
        help="after a rank fails, how long the other ranks get to exit on "
             "their own before they are sent SIGTERM (and SIGKILL "
             f"{KILL_DELAY_S:g} s later); default {DEFAULT_GRACE_S:g}")
    parser.add_argument(
        "--verbose", action="store_true",
        help="print rank placement, the rendezvous port and each rank's exit")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="COMMAND",
        help="the program to run in every rank, with its arguments; put it "
             "after '--' if it could be mistaken for a perseusrun flag")
    return parser


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
        if any(name == seen for seen, _ in entries):
            raise UsageError(f"-H/--hosts: host {name!r} is listed twice")
        entries.append((name, slots))
    return entries


# --------------------------------------------------------------------------
# Hosts and rank placement


def _can_bind(addr: str) -> bool:
    """True if addr is assigned to this machine: only those can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
            return True
        except OSError:
            return False


def resolve_local_host(name: str) -> str:
    """Returns the IPv4 address of a host that is this machine.

    Raises UsageError for a host that cannot be resolved or that is another
    machine, since ranks cannot be started remotely yet.
    """
    if name == "localhost":
        return "127.0.0.1"
    try:
        addr = socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except (socket.gaierror, UnicodeError):
        raise UsageError(
            f"-H/--hosts: cannot resolve host {name!r} to an IPv4 address") from None
    if ipaddress.ip_address(addr).is_loopback or _can_bind(addr):
        return addr
    raise UsageError(
        f"-H/--hosts: host {name!r} ({addr}) is not this machine; starting "
        f"ranks on remote hosts over ssh is not supported yet (use localhost "
        f"or this machine's names and addresses)")


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


def rank_env(base: dict, placement: Placement, rendezvous_addr: str,
             rendezvous_port: int, secret: bytes, job_id: str) -> dict:
    """The environment of one rank: base plus the PERSEUS_* contract."""
    env = dict(base)
    env.update({
        "PERSEUS_RANK": str(placement.rank),
        "PERSEUS_SIZE": str(placement.size),
        "PERSEUS_LOCAL_RANK": str(placement.local_rank),
        "PERSEUS_LOCAL_SIZE": str(placement.local_size),
        "PERSEUS_CROSS_RANK": str(placement.cross_rank),
        "PERSEUS_CROSS_SIZE": str(placement.cross_size),
        "PERSEUS_RENDEZVOUS_ADDR": rendezvous_addr,
        "PERSEUS_RENDEZVOUS_PORT": str(rendezvous_port),
        "PERSEUS_RENDEZVOUS_SECRET": secret.hex(),
        "PERSEUS_JOB_ID": job_id,
        "PERSEUS_HOST_ADDR": placement.host.addr,
        # Ranks check that this process is alive (they stop when it is gone).
        "PERSEUS_LAUNCHER_PID": str(os.getpid()),
        # Ranks' output goes through pipes; without this Python would hold
        # it back in block buffers and the forwarded lines would lag.
        "PYTHONUNBUFFERED": "1",
    })
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
    # TF's C++ start-up lines (and a "failed call to cuInit" on machines
    # without a GPU) times N ranks drown the job's output; the user's own
    # setting wins.
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


# --------------------------------------------------------------------------
# Running the ranks


def _log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def describe_status(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by signal {name}"
    return f"failed with exit status {returncode}"


def _segments(buffer: bytes):
    """Splits buffer into complete segments, each ending in \\n or \\r (a
    \\r\\n pair stays together); returns (segments, the unfinished rest)."""
    segments, start = [], 0
    for i, byte in enumerate(buffer):
        if byte == 0x0A or (byte == 0x0D and buffer[i + 1:i + 2] != b"\n"):
            segments.append(buffer[start:i + 1])
            start = i + 1
    return segments, buffer[start:]


def _forward_lines(pipe, stream, prefix: bytes, lock: threading.Lock) -> None:
    """Copies pipe to stream, each line or \\r-ended update (a progress bar
    redrawing itself) as soon as it is complete, each starting with prefix."""
    # Write bytes when the stream allows it, so that output that is not
    # valid in our locale's encoding passes through untouched.
    raw = getattr(stream, "buffer", None)
    broken = False
    pending = b""
    after_cr = False  # the last segment sent ended in \\r
    fd = pipe.fileno()
    with pipe:
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if chunk:
                segments, pending = _segments(pending + chunk)
            else:
                segments, pending = ([pending + b"\n"] if pending else []), b""
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


class RankGroup:
    """The child processes of one job and the threads forwarding their output."""

    def __init__(self, verbose: bool = False):
        self.procs = []
        self._readers = []
        self._verbose = verbose
        self._stdout_lock = threading.Lock()
        self._stderr_lock = threading.Lock()

    def spawn(self, rank: int, command: list, env: dict) -> None:
        # Each rank gets its own process group, so that a Ctrl-C typed in the
        # terminal reaches perseusrun alone and perseusrun decides what the
        # ranks receive; signalling the group also reaches a rank's children.
        launcher_pid = os.getpid()
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _die_with_launcher(launcher_pid))
        self.procs.append(proc)
        prefix = f"[{rank}] ".encode()
        for pipe, stream, lock in ((proc.stdout, sys.stdout, self._stdout_lock),
                                   (proc.stderr, sys.stderr, self._stderr_lock)):
            reader = threading.Thread(
                target=_forward_lines, args=(pipe, stream, prefix, lock),
                name=f"perseusrun-rank{rank}-output", daemon=True)
            reader.start()
            self._readers.append(reader)

    def signal_running(self, signum: int) -> None:
        """Sends signum to the process group of every rank not yet reaped."""
        for proc in self.procs:
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def supervise(self, grace_s: float, stop_now: bool = False) -> int:
        """Waits for every rank to exit and returns perseusrun's exit status.

        After the first failure the others get grace_s seconds, then SIGTERM,
        then SIGKILL. stop_now starts that sequence at once (without grace).
        """
        exited = set()
        failed_rank = None
        term_at = time.monotonic() if stop_now else None
        kill_at = None
        while len(exited) < len(self.procs):
            now = time.monotonic()
            for rank, proc in enumerate(self.procs):
                if rank in exited or proc.poll() is None:
                    continue
                exited.add(rank)
                if self._verbose:
                    _log(f"rank {rank} (pid {proc.pid}) exited with "
                         f"status {proc.returncode}")
                if proc.returncode != 0 and failed_rank is None:
                    failed_rank = rank
                    _log(f"rank {rank} (pid {proc.pid}) "
                         f"{describe_status(proc.returncode)}")
                    if term_at is None:
                        term_at = now + grace_s
            if len(exited) == len(self.procs):
                break
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
        if failed_rank is None:
            return 0
        status = self.procs[failed_rank].returncode
        return status if status > 0 else 128 - status

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
    if args.mpi:
        raise UsageError("--mpi: starting ranks through mpirun is not supported "
                         "yet; use the default Gloo launcher (--gloo or no flag)")
    if not args.command:
        raise UsageError("no COMMAND given to run in the ranks")
    if args.np < 1:
        raise UsageError("-np must be at least 1")
    if args.grace_seconds < 0:
        raise UsageError("--grace-seconds must not be negative")
    entries = parse_hosts(args.hosts) if args.hosts else [("localhost", args.np)]
    total_slots = sum(slots for _, slots in entries)
    if total_slots < args.np:
        raise UsageError(f"-np {args.np} is more than the {total_slots} slots "
                         f"given by -H/--hosts")
    args.hosts = [Host(name, resolve_local_host(name), slots)
                  for name, slots in entries]
    return args


def main(argv=None) -> int:
    """Runs perseusrun with argv (default sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        args = _parse_args(parser, sys.argv[1:] if argv is None else list(argv))
    except UsageError as err:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:
        # argparse exits for -h and for malformed flags; main reports a status.
        return exit_.code if isinstance(exit_.code, int) else 2

    placements = place_ranks(args.np, args.hosts)
    all_loopback = all(ipaddress.ip_address(p.host.addr).is_loopback
                       for p in placements)
    secret = secrets.token_bytes(32)
    job_id = secrets.token_hex(8)
    store = StoreServer("127.0.0.1" if all_loopback else "0.0.0.0", 0, secret)
    port = store.start()
    group = RankGroup(verbose=args.verbose)
    received = []

    def forward(signum, _frame):
        received.append(signum)
        group.signal_running(signum)

    # Install the handlers before the first rank starts, so that no signal can
    # kill perseusrun and orphan ranks that were already running.
    previous = {sig: signal.signal(sig, forward)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if args.verbose:
            _log(f"job {job_id}, rendezvous store on port {port}")
        for p in placements:
            if received:
                break  # interrupted while starting: do not start more ranks
            # The rank runs on this machine, so its host's address reaches the
            # store when that listens on 0.0.0.0; when it listens on 127.0.0.1
            # only, 127.0.0.2 would not. Remote ranks will need the launcher's
            # routable address instead.
            rendezvous_addr = "127.0.0.1" if all_loopback else p.host.addr
            if args.verbose:
                _log(f"rank {p.rank} on {p.host.name} ({p.host.addr}): local "
                     f"{p.local_rank}/{p.local_size}, cross "
                     f"{p.cross_rank}/{p.cross_size}")
            env = rank_env(os.environ, p, rendezvous_addr, port, secret, job_id)
            try:
                group.spawn(p.rank, args.command, env)
            except OSError as err:
                _log(f"cannot start {args.command[0]!r}: {err}")
                group.supervise(args.grace_seconds, stop_now=True)
                return 127
        return group.supervise(args.grace_seconds)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.stop()
