"""Supervising the ranks of a job: RankGroup starts them, forwards their
output and signals, stops the others when one fails, and names the rank
whose failure came first. Also perseusrun's own messages (log) and how an
exit status reads (describe_status).
"""

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

from perseus_tf.config.elastic_rounds import EXIT_RESTART, RESTART_CODES
from perseus_tf.runner.output import forward_lines, stream_lock, write_line
# How often remote.py hears from perseusrun (a byte on its standard input).
from perseus_tf.runner.remote import KEEPALIVE_S

# The name on the command line, and at the start of perseusrun's own messages.
PROG = "perseusrun"
# Time between SIGTERM and SIGKILL when stopping ranks that outlived a failure.
KILL_DELAY_S = 5.0
# After the first Ctrl-C (SIGINT, forwarded), ranks still running this long
# later (blocked in a collective, say, where Python cannot see the signal)
# get SIGTERM, then SIGKILL KILL_DELAY_S later. A second Ctrl-C kills at once.
INTERRUPT_GRACE_S = 3.0
POLL_INTERVAL_S = 0.05


def log(message: str) -> None:
    """One of perseusrun's own messages, on stderr, after "perseusrun: ", on
    a line of its own (output.write_line)."""
    write_line(sys.stderr, f"{PROG}: {message}")


def describe_status(returncode: int, remote: bool = False) -> str:
    """How a child's exit reads in a message ("killed by signal SIGKILL");
    remote: the child was ssh, whose 255 means the connection was lost."""
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
        self._stdout_lock = stream_lock(sys.stdout)
        self._stderr_lock = stream_lock(sys.stderr)
        self._keepalive = None  # the thread of _keep_alive, once a rank reads input
        # Ranks' failure records (perseus_tf/_failure_record.py) by rank.
        self.records = {}
        self._records_lock = threading.Lock()

    @property
    def procs(self):
        return [c.proc for c in self.children]

    def spawn(self, rank: int, command: list, env: dict, *, host: str = "",
              remote: bool = False, stdin_data: bytes = None, label: str = None,
              prefix: bool = True, tag: str = None):
        """Starts one child; returns its _Child. tag: the output lines'
        prefix (default '[RANK] ')."""
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
        child = _Child(proc, label or f"rank {rank}", f" on {host}" if host else "", remote, rank)
        self.children.append(child)
        if stdin_data is not None and self._keepalive is None:
            self._keepalive = threading.Thread(target=self._keep_alive, daemon=True,
                                               name="perseusrun-keepalive")
            self._keepalive.start()
        tag = (f"[{rank}] " if tag is None else tag).encode() if prefix else b""
        for pipe, stream, lock in ((proc.stdout, sys.stdout, self._stdout_lock),
                                   (proc.stderr, sys.stderr, self._stderr_lock)):
            reader = threading.Thread(
                target=forward_lines,
                args=(pipe, stream, tag, lock, self._quiet, self._add_record),
                name=f"perseusrun-rank{rank}-output", daemon=True)
            reader.start()
            self._readers.append(reader)
        return child

    def _keep_alive(self) -> None:
        """A byte to every running child that reads perseusrun's input (a
        remote rank's remote.py, through ssh) every KEEPALIVE_S."""
        while True:
            time.sleep(KEEPALIVE_S)
            for child in list(self.children):
                stdin = child.proc.stdin
                if stdin is None or stdin.closed or child.proc.returncode is not None:
                    continue
                try:
                    os.set_blocking(stdin.fileno(), False)
                    os.write(stdin.fileno(), b"\n")
                except (OSError, ValueError):
                    pass  # ssh is gone or stuck: its exit tells the rest

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
            log("interrupted: stopping the ranks (Ctrl-C again to kill them now)")
            self._stop_by = time.monotonic() + INTERRUPT_GRACE_S
            self.signal_running(signal.SIGINT)
        else:
            log("interrupted again: killing the ranks (SIGKILL)")
            self.signal_running(signal.SIGKILL)

    def supervise(self, grace_s: float, stop_now: bool = False) -> int:
        """Waits for every rank to exit and returns perseusrun's exit status.

        After the first failure the others get grace_s seconds, then SIGTERM,
        then SIGKILL. stop_now starts that sequence at once (without grace).
        """
        exited = set()
        failed = None
        restarting = False
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
                    log(f"{child.label}{child.where} (pid {proc.pid}) exited with "
                         f"status {proc.returncode}")
                if proc.returncode in RESTART_CODES:
                    # Stopped for a restart (strategy/keras_preempt.py): every
                    # rank does so after the same batch; not a failure.
                    restarting = True
                elif proc.returncode != 0 and failed is None:
                    failed = index
                    log(f"{child.label}{child.where} (pid {proc.pid}) "
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
                log("stopping the remaining ranks (SIGTERM)")
                self.signal_running(signal.SIGTERM)
                term_at, kill_at = None, now + KILL_DELAY_S
            elif kill_at is not None and now >= kill_at:
                log(f"ranks still running {KILL_DELAY_S:g} s after "
                     f"SIGTERM, sending SIGKILL")
                self.signal_running(signal.SIGKILL)
                kill_at = None
            time.sleep(POLL_INTERVAL_S)
        self._drain_output()
        if failed is None:
            return EXIT_RESTART if restarting else 0
        failed = self._report_first_failure(failed)
        if self._interrupts:
            # Stopped by Ctrl-C: the shell's convention (128 + SIGINT), not
            # the SIGTERM or SIGKILL that stopped the ranks after it.
            return 128 + int(signal.SIGINT)
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
                log(f"first failure: rank {record['rank']}: {record['error']}")
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
            log(f"first failure: {child.label}{child.where} (pid {child.proc.pid}) "
                 f"{describe_status(child.proc.returncode, child.remote)}{error}")
        return root

    def _drain_output(self) -> None:
        # Normally the pipes close when the ranks exit. A rank may have left
        # children behind that hold them open; do not wait for those forever.
        deadline = time.monotonic() + 2.0
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
