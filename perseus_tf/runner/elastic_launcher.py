"""perseusrun's elastic mode: a job that goes on when workers die and grows
when hosts come back (``--min-np``, ``--max-np``, ``--host-discovery-script``).

perseusrun starts worker processes on host slots and serves the store; it
does not fix their ranks. A worker takes its place in each round from the
store (config/elastic_rounds.py): perseusrun answers once every live worker has
asked, numbering the ranks host by host in the order the hosts were listed.
What happens when:

- a worker fails (exits non-zero or is killed): its host is blacklisted for
  --blacklist-cooldown seconds, the hosts-updated count goes up, and the
  survivors, whose collectives with it fail (hvd.elastic.run catches that),
  reset and ask again: the next round is made of them;
- the discovery script (rerun every --discovery-interval seconds) lists new
  slots, or a blacklisted host's cooldown ends: new workers start there (up
  to --max-np), the hosts-updated count goes up, and the others reset at
  their next commit (HostsUpdatedInterrupt) to take them in;
- a host leaves the discovery script's list: its workers are stopped;
- fewer than --min-np workers are alive, or a live worker does not ask for
  its place while others wait, for --elastic-timeout seconds: the job fails,
  naming what is missing; waiting workers get that error as their answer;
- more than --reset-limit resets: the job fails;
- a PerseusStrategy worker exits with EXIT_RESTART (its job stops for a
  restart, strategy/keras_preempt.py): a new worker starts on its slot, and
  the free slots fill up to --max-np; a worker that exits with
  EXIT_PREEMPTED (it got SIGTERM) leaves its slot empty for the cooldown;
  the restarted workers resume from the job's backup;
- a worker exits 0: training is over; no more workers start, and perseusrun
  exits 0 once every worker has exited, or with the first failure's status.
"""

import dataclasses
import json
import os
import shlex
import subprocess
import time

from perseus_tf.config.elastic_rounds import EXIT_PREEMPTED, RESTART_CODES
from perseus_tf.runner.cli import UsageError, parse_hosts
from perseus_tf.runner.placement import Host, Placement, resolve_host
from perseus_tf.runner.supervise import describe_status, log

POLL_S = 0.05


@dataclasses.dataclass
class Worker:
    id: str          # "HOST:SLOT"
    key: str         # "HOST:SLOT/N": its store keys (a slot's N-th process)
    host: Host
    slot: int
    child: object    # supervise._Child
    asked: int = -1     # the last request number it wrote
    answered: int = -1  # the last request perseusrun answered
    rank: int = -1      # in the last round it was given a place in


def places(workers: list, host_order: list) -> dict:
    """Each worker's place (rank, size, local and cross) in a round of these
    workers: ranks fill the hosts in host_order, each host's by slot."""
    order = {name: i for i, name in enumerate(host_order)}
    ordered = sorted(workers, key=lambda w: (order.get(w.host.name, len(order)), w.host.name,
                                             w.slot))
    hosts = []
    for w in ordered:
        if w.host.name not in hosts:
            hosts.append(w.host.name)
    out = {}
    for rank, w in enumerate(ordered):
        same = [x for x in ordered if x.host.name == w.host.name]
        out[w.id] = {"rank": rank, "size": len(ordered), "local_rank": same.index(w),
                     "local_size": len(same), "cross_rank": hosts.index(w.host.name),
                     "cross_size": len(hosts)}
    return out


def parse_discovery(text: str, slots_per_host: int) -> list:
    """The discovery script's output: 'HOST[:SLOTS]' lines, blank and '#'
    lines ignored, as (name, slots) pairs."""
    lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    spec = ",".join(line if ":" in line else f"{line}:{slots_per_host}"
                    for line in lines if line)
    return parse_hosts(spec) if spec else []


def run_discovery(args) -> list:
    """Runs the discovery script once: (name, slots) pairs; UsageError
    saying what went wrong."""
    script = args.host_discovery_script
    try:
        out = subprocess.run([script], capture_output=True, text=True,
                             timeout=max(args.discovery_interval, 5.0))
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UsageError(f"host discovery script {script}: {err}") from None
    if out.returncode != 0:
        raise UsageError(f"host discovery script {script} {describe_status(out.returncode)}: "
                         f"{out.stderr.strip()[-300:]}")
    try:
        return parse_discovery(out.stdout, args.slots_per_host)
    except UsageError as err:
        raise UsageError(f"host discovery script {script}: {err}") from None


def discover_once(args) -> list:
    """The hosts to start on: the script's first answer, which must list
    at least --min-np slots."""
    entries = run_discovery(args)
    if sum(slots for _, slots in entries) < args.min_np:
        raise UsageError(f"host discovery script {args.host_discovery_script} lists "
                         f"{sum(s for _, s in entries)} slots, fewer than --min-np "
                         f"{args.min_np}")
    return entries


class ElasticJob:
    """One elastic job: run() starts and supervises its workers and returns
    perseusrun's exit status."""

    def __init__(self, args, client, job_id: str, spawn, fix_host=lambda h: h,
                 interrupted=lambda: False):
        """spawn(worker_id, key, placement) starts one worker process and returns
        its supervise._Child; fix_host(host) gives a host the address the
        others reach it at."""
        self.args = args
        self.client = client
        self.job_id = job_id
        self.spawn = spawn
        self.fix_host = fix_host
        self.interrupted = interrupted  # perseusrun got SIGINT or SIGTERM
        self.workers = {}      # id -> Worker, live ones
        self.slots = {}        # host name -> (Host, slots), what is available
        self.host_order = []   # names, in the order first listed
        self.blacklist = {}    # host name -> monotonic time its cooldown ends
        self.hosts_count = 0   # the hosts-updated count
        self.resets = 0
        self.rounds = 0
        self.finished = False  # a worker exited 0
        self.finisher = None
        self.first_failure = None  # exit status
        self.failed_after_finish = None
        self.short_since = None    # when workers fell below --min-np (or were not all asking)
        self.next_discovery = 0.0
        self.last_round = set()
        self.spawned = {}      # id -> processes started on that slot so far
        # Started since the last round, not yet asked for a place: the others
        # are told to reset (the hosts-updated count) once these have asked,
        # so they train on while a newcomer starts up.
        self.joining = set()
        # PerseusStrategy restarts (strategy/keras_preempt.py): a restart is
        # under way (refill every slot at once, up to --max-np); slots kept
        # for a restarting worker's successor; preempted slots left out.
        self.restart = False
        self.reserved = set()
        self.slot_cooldown = {}
        self.last_preemption = None
        self.resume_round = None   # a reset's round whose resume point is not yet printed

    # ---- hosts -----------------------------------------------------------------
    def discover(self) -> None:
        """Reads the hosts (the script's, else -H); stops the workers of
        slots no longer listed."""
        if not self.args.host_discovery_script:
            entries = self.args.host_slots
        else:
            try:
                entries = run_discovery(self.args)
            except UsageError as err:
                log(str(err))
                return
        fresh = {}
        for name, slots in entries:
            host = self.slots[name][0] if name in self.slots else self._resolve(name)
            if host is not None:
                fresh[name] = (host, slots)
                if name not in self.host_order:
                    self.host_order.append(name)
        self.slots = fresh
        for w in list(self.workers.values()):
            if w.host.name not in fresh or w.slot >= fresh[w.host.name][1]:
                log(f"host {w.host.name} slot {w.slot} left the job's hosts: stopping "
                    f"worker {w.id}")
                self._stop(w)

    def _resolve(self, name):
        try:
            return self.fix_host(resolve_host(name, getattr(self.args, "hosts_source",
                                                            "-H/--hosts")))
        except UsageError as err:
            log(f"host {name}: {err}")
            return None

    def free_slots(self, now: float) -> list:
        """(host, slot) pairs with no live worker, on hosts not blacklisted."""
        taken = {(w.host.name, w.slot) for w in self.workers.values()}
        free = []
        for name in self.host_order:
            if name not in self.slots:
                continue
            host, count = self.slots[name]
            for s in range(count):
                if (name, s) in taken or self.slot_cooldown.get((name, s), 0.0) > now:
                    continue
                # A restarting worker's slot is its successor's, even on a
                # host blacklisted since (for another worker's failure).
                if self.blacklist.get(name, 0.0) <= now or (name, s) in self.reserved:
                    free.append((host, s))
        return free

    def fill(self, target: int, now: float) -> bool:
        """Starts workers on free slots up to target live ones; True if any."""
        started = False
        for host, slot in self.free_slots(now):
            if len(self.workers) >= target or self.finished:
                break
            wid = f"{host.name}:{slot}"
            guess = Placement(rank=len(self.workers), size=target, local_rank=slot,
                              local_size=self.slots[host.name][1], cross_rank=0, cross_size=1,
                              host=host)
            self.spawned[wid] = self.spawned.get(wid, 0) + 1
            key = f"{wid}/{self.spawned[wid]}"
            try:
                child = self.spawn(wid, key, guess)
            except OSError as err:
                log(f"cannot start worker {wid}: {err}; its host {host.name} is blacklisted "
                    f"for {self.args.blacklist_cooldown:g} s")
                self.blacklist[host.name] = now + self.args.blacklist_cooldown
                continue
            self.reserved.discard((host.name, slot))
            self.workers[wid] = Worker(wid, key, host, slot, child)
            self.joining.add(wid)
            started = True
        return started

    def _stop(self, worker):
        try:
            os.killpg(worker.child.proc.pid, 15)
            worker.child.stopped_by_us = True
        except (ProcessLookupError, PermissionError):
            pass

    def bump_hosts(self, removed_only: bool) -> None:
        self.hosts_count += 1
        self.client.set(f"{self.job_id}/elastic/hosts_updated",
                        json.dumps({"count": self.hosts_count,
                                    "removed_only": removed_only}).encode())

    # ---- workers ---------------------------------------------------------------
    def reap(self, now: float) -> bool:
        """Sees exits; True when a worker failed."""
        failed = False
        for w in list(self.workers.values()):
            code = w.child.proc.poll()
            if code is None:
                continue
            w.child.exited_at = time.time()
            del self.workers[w.id]
            if code == 0:
                if not self.finished:
                    self.finisher = w.id
                    if self.args.verbose:
                        log(f"worker {w.id} finished")
                self.finished = True
                continue
            if code in RESTART_CODES and not self.finished:
                self._restarting(w, code, now)
                continue
            failed = True
            if self.finished:
                self.failed_after_finish = self.failed_after_finish or (
                    code if code > 0 else 128 - code)
            if w.child.stopped_by_us:
                continue
            log(f"worker {w.id} (rank {w.rank} of the last round) "
                f"{describe_status(code, w.child.remote)}; its host {w.host.name} is "
                f"blacklisted for {self.args.blacklist_cooldown:g} s")
            self.blacklist[w.host.name] = now + self.args.blacklist_cooldown
            if self.first_failure is None:
                self.first_failure = code if code > 0 else 128 - code
        return failed

    def _restarting(self, worker, code: int, now: float) -> None:
        """A PerseusStrategy worker stopped for the job to restart
        (strategy/keras_preempt.py): its slot gets a new worker at once,
        unless it was the one preempted, whose slot is left out for the
        cooldown."""
        self.restart = True
        if code == EXIT_PREEMPTED:
            self.slot_cooldown[(worker.host.name, worker.slot)] = \
                now + self.args.blacklist_cooldown
            log(f"worker {worker.id} (rank {worker.rank}) was preempted (SIGTERM); its slot is "
                f"left out for {self.args.blacklist_cooldown:g} s and the job restarts")
        else:
            self.reserved.add((worker.host.name, worker.slot))
            if self.args.verbose:
                log(f"worker {worker.id} stopped for the job to restart")

    def resumes_at(self) -> str:
        """Where the last preemption's backup resumes, if one was recorded
        since the previous round."""
        try:
            raw = self.client.get(f"{self.job_id}/preemption", 0)
        except TimeoutError:
            return ""
        saved = json.loads(raw)
        if saved["at"] == self.last_preemption:
            return ""
        self.last_preemption = saved["at"]
        return f"; resuming at epoch {saved['epoch']} step {saved['done']}"

    def report_resume(self) -> None:
        """After a reset: where the new round's rank 0 resumed, once it says."""
        if self.resume_round is None:
            return
        try:
            raw = self.client.get(f"{self.job_id}/elastic/resumed", 0)
        except TimeoutError:
            return
        said = json.loads(raw)
        if said["round"] != self.resume_round:
            return
        self.resume_round = None
        if said["at"]:
            log(f"reset {self.resets}: resumed at "
                + ", ".join(f"{k} {v}" for k, v in said["at"].items()))

    def poll_requests(self) -> None:
        for w in self.workers.values():
            try:
                raw = self.client.get(f"{self.job_id}/elastic/ready/{w.key}", 0)
            except TimeoutError:
                continue
            w.asked = int(raw.decode())

    def answer(self, worker, place: dict) -> None:
        self.client.set(f"{self.job_id}/elastic/assign/{worker.key}/{worker.asked}",
                        json.dumps(place).encode())
        worker.answered = worker.asked

    def maybe_assign(self, now: float):
        """A round, once every live worker has asked and there are enough;
        else None, or an error message when the wait ran out."""
        live = list(self.workers.values())
        waiting = [w for w in live if w.asked > w.answered]
        enough = len(live) >= self.args.min_np
        # A restart with too few slots to start workers on waits (for
        # discovery, a cooldown's end) no longer than --elastic-timeout.
        if not waiting and not (self.restart and not enough):
            self.short_since = None
            return None
        if enough and len(waiting) == len(live):
            self.short_since = None
            self.assign_round(live)
            return None
        if self.short_since is None:
            self.short_since = now
        if now - self.short_since < self.args.elastic_timeout:
            return None
        if not enough:
            return (f"only {len(live)} workers are alive, fewer than --min-np "
                    f"{self.args.min_np}, for {self.args.elastic_timeout:g} s "
                    f"(--elastic-timeout); free slots on hosts not blacklisted: "
                    f"{len(self.free_slots(now))}")
        missing = sorted(w.id for w in live if w.asked <= w.answered)
        return (f"workers {', '.join(missing)} did not ask for a place in the next round "
                f"within {self.args.elastic_timeout:g} s (--elastic-timeout) while "
                f"{len(waiting)} others waited")

    def assign_round(self, live: list) -> None:
        self.joining.clear()
        restarted, self.restart = self.restart, False
        if self.rounds > 0:
            self.resets += 1
        self.rounds += 1
        members = {w.id for w in live}
        left = sorted(self.last_round - members)
        joined = sorted(members - self.last_round)
        table = places(live, self.host_order)
        for w in live:
            place = dict(table[w.id], round=self.rounds - 1, hosts=self.hosts_count)
            w.rank = place["rank"]
            self.answer(w, place)
        if self.rounds > 1 or self.args.verbose:
            log(f"reset {self.resets}: {len(live)} ranks"
                + (f"; left: {', '.join(left)}" if left else "")
                + (f"; joined: {', '.join(joined)}" if joined else "") + self.resumes_at())
        self.last_round = members
        # hvd.elastic's rank 0 says where it resumed; a restarted
        # PerseusStrategy job's resume point is in the line above.
        self.resume_round = self.rounds - 1 if self.rounds > 1 and not restarted else None

    def fail_waiting(self, message: str) -> None:
        for w in self.workers.values():
            if w.asked > w.answered:
                self.client.set(f"{self.job_id}/elastic/assign/{w.key}/{w.asked}",
                                json.dumps({"error": message}).encode())
                w.answered = w.asked

    # ---- the loop --------------------------------------------------------------
    def run(self) -> int:
        now = time.monotonic()
        self.discover()
        self.fill(self.args.np, now)
        self.next_discovery = now + self.args.discovery_interval
        while True:
            now = time.monotonic()
            if self.reap(now) and not self.finished:
                self.bump_hosts(removed_only=True)
            if not self.workers and (self.finished or (self.first_failure is not None
                                                       and not self.restart)):
                break
            if self.interrupted():
                # The signal went to every worker (launcher.py): no new ones.
                self.finished = True
                self.first_failure = self.first_failure or 130
            if self.resets > self.args.reset_limit >= 0:
                log(f"more than --reset-limit {self.args.reset_limit} resets: stopping the job")
                return self._stop_all(1)
            if not self.finished:
                if now >= self.next_discovery:
                    self.next_discovery = now + self.args.discovery_interval
                    # Removed hosts' workers are stopped (and reaped as gone);
                    # new slots, and hosts whose cooldown ended, get workers.
                    self.discover()
                    self.fill(self.args.max_np, now)
                elif self.restart:
                    self.fill(self.args.max_np, now)
                elif len(self.workers) < self.args.min_np:
                    self.fill(self.args.min_np, now)
            self.poll_requests()
            self.report_resume()
            if self.finished:
                # Training is over: a worker asking to go on is told so.
                self.fail_waiting(f"training is over (worker {self.finisher} finished) while "
                                  "this worker asked to go on in a next round: every worker "
                                  "must stop at the same point")
            else:
                self.joining &= set(self.workers)
                if self.joining and all(self.workers[w].asked >= 0 for w in self.joining):
                    self.joining.clear()
                    if self.last_round & set(self.workers):
                        self.bump_hosts(removed_only=False)  # a running round takes them in
                error = self.maybe_assign(now)
                if error:
                    log(f"elastic job failed: {error}")
                    self.fail_waiting(error)  # they exit with it, given the time
                    return self._stop_all(1, self.args.grace_seconds)
            time.sleep(POLL_S)
        if self.finished and not self.interrupted():
            return self.failed_after_finish or 0
        return self.first_failure or 1

    def _stop_all(self, status: int, grace_s: float = 0.0) -> int:
        """Stops every worker (after grace_s for them to exit by themselves)."""
        deadline = time.monotonic() + grace_s
        while self.workers and time.monotonic() < deadline:
            self.reap(time.monotonic())
            time.sleep(POLL_S)
        for w in list(self.workers.values()):
            self._stop(w)
        deadline = time.monotonic() + 10.0
        while self.workers and time.monotonic() < deadline:
            self.reap(time.monotonic())
            time.sleep(POLL_S)
        for w in list(self.workers.values()):
            try:
                os.killpg(w.child.proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        return status


def describe(args) -> str:
    """The elastic settings, for --verbose."""
    parts = [f"-np {args.np}", f"--min-np {args.min_np}", f"--max-np {args.max_np}"]
    if args.host_discovery_script:
        parts.append(f"--host-discovery-script {shlex.quote(args.host_discovery_script)}")
    return "elastic: " + " ".join(parts)
