"""A rank of an elastic job: its place in each round comes from perseusrun.

Under ``perseusrun --min-np A --max-np B`` a worker process does not have a
fixed rank. Each time its runtime starts (the first init(), and init() after
a reset), it tells perseusrun's store that it is ready and waits for its
place in the next round: perseusrun hands out places once every live worker
is ready, so a round's members are exactly the workers that are alive and
waiting. The keys, under the job id:

  elastic/ready/<key>            the worker's request number (0, 1, ...)
  elastic/assign/<key>/<n>       its answer to request n: a JSON object with
                                 rank, size, local_rank, local_size,
                                 cross_rank, cross_size, round and hosts
                                 (the hosts-updated count it starts from), or
                                 {"error": message} when the job cannot go on
  elastic/hosts_updated          JSON {"count": n, "removed_only": bool}:
                                 hosts came or went since count n-1
  elastic/resumed                JSON {"round": r, "at": {...}}: where rank 0's
                                 state resumed after the reset into round r
                                 (its epoch, batch and step attributes)
  preemption                     JSON {"epoch": e, "done": k, "at": time}: a
                                 PerseusStrategy job stopped for a restart
                                 after k batches of epoch e (any launch by
                                 perseusrun, elastic or not)

Exit statuses of a rank that stops for a restart (strategy/keras_preempt.py):
EXIT_RESTART, started again at the job's next size; EXIT_PREEMPTED, the rank
that got SIGTERM, whose slot is left out.
"""

import json
import os
import time

from perseus_tf.config.contracts import Contract
from perseus_tf.config.settings import ConfigError

ENV_WORKER = "PERSEUS_ELASTIC_WORKER"  # HOST:SLOT, in messages
ENV_KEY = "PERSEUS_ELASTIC_KEY"        # HOST:SLOT/N: the N-th process started there
ENV_TIMEOUT = "PERSEUS_ELASTIC_TIMEOUT"
SOURCE = "perseusrun (elastic)"
EXIT_RESTART = 75     # EX_TEMPFAIL: run me again
EXIT_PREEMPTED = 76   # got SIGTERM: my slot is going away
RESTART_CODES = (EXIT_RESTART, EXIT_PREEMPTED)

_requests = 0       # this process's requests so far
_hosts_seen = None  # the hosts-updated count of this process's current round
_round = [-1]       # this process's current round


def is_elastic(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return bool(environ.get(ENV_WORKER))


def _client(environ, **kwargs):
    from perseus_tf.common.store import StoreClient
    return StoreClient(environ["PERSEUS_RENDEZVOUS_ADDR"],
                       int(environ["PERSEUS_RENDEZVOUS_PORT"]),
                       bytes.fromhex(environ["PERSEUS_RENDEZVOUS_SECRET"]), **kwargs)


def request_place(environ=None) -> Contract:
    """Waits for this worker's place in the job's next round (see above)."""
    global _requests, _hosts_seen
    environ = os.environ if environ is None else environ
    worker, job = environ[ENV_WORKER], environ["PERSEUS_JOB_ID"]
    key = environ.get(ENV_KEY, worker)
    # perseusrun answers within its --elastic-timeout or fails the job;
    # the margin covers a round that it assembled just before that.
    timeout_s = float(environ.get(ENV_TIMEOUT, "600")) + 30.0
    number = _requests
    _requests += 1
    with _client(environ) as client:
        client.set(f"{job}/elastic/ready/{key}", str(number).encode())
        try:
            raw = client.get(f"{job}/elastic/assign/{key}/{number}", timeout_s)
        except TimeoutError:
            raise ConfigError(
                f"elastic worker {worker}: perseusrun gave it no place in the job's next "
                f"round within {timeout_s:g} s (--elastic-timeout plus 30 s): is perseusrun "
                "still running?") from None
    place = json.loads(raw)
    if "error" in place:
        raise ConfigError(f"elastic worker {worker}: {place['error']}")
    _hosts_seen = int(place["hosts"])
    _round[0] = int(place["round"])
    if environ is os.environ:
        # For what reads them after init (failure records, scripts reading
        # HOROVOD_RANK): this round's place.
        for prefix in ("PERSEUS_", "HOROVOD_"):
            for key in ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size"):
                os.environ[prefix + key.upper()] = str(place[key])
    return Contract(SOURCE, "perseusrun's elastic places", rank=int(place["rank"]),
                    size=int(place["size"]), local_rank=int(place["local_rank"]),
                    local_size=int(place["local_size"]), cross_rank=int(place["cross_rank"]),
                    cross_size=int(place["cross_size"]), job_id=job)


def hosts_updated(environ=None):
    """None when the job's hosts are those of this worker's round; else
    (the update's count, whether hosts only went away: Horovod's skip_sync)."""
    environ = os.environ if environ is None else environ
    if not is_elastic(environ) or _hosts_seen is None:
        return None
    with _client(environ) as client:
        try:
            raw = client.get(f"{environ['PERSEUS_JOB_ID']}/elastic/hosts_updated", 0)
        except TimeoutError:
            return None
    update = json.loads(raw)
    if int(update["count"]) <= _hosts_seen:
        return None
    return int(update["count"]), bool(update["removed_only"])


def _tell_perseusrun(environ, key: str, payload: dict) -> None:
    """Writes payload (JSON) under the job's key; a failure only costs
    perseusrun's log a line."""
    try:
        with _client(environ, connect_timeout_s=5.0) as client:
            client.set(f"{environ['PERSEUS_JOB_ID']}/{key}", json.dumps(payload).encode())
    except (OSError, TimeoutError, ValueError):
        pass


def record_preemption(epoch: int, done: int, environ=None) -> None:
    """Tells perseusrun (when it launched this job) where a restarted job
    resumes, for its log; nothing when no perseusrun serves the store."""
    environ = os.environ if environ is None else environ
    if environ.get("PERSEUS_JOB_ID") and environ.get("PERSEUS_RENDEZVOUS_SECRET"):
        _tell_perseusrun(environ, "preemption",
                         {"epoch": int(epoch), "done": int(done), "at": time.time()})


def record_resume(state, environ=None) -> None:
    """Rank 0 of an elastic job, after a reset: tells perseusrun where the
    state resumed (its epoch, batch or step attributes), for its log."""
    environ = os.environ if environ is None else environ
    if not is_elastic(environ) or _round[0] < 0:
        return
    at = {}
    for name in ("epoch", "batch", "step"):
        value = getattr(state, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            at[name] = value
    _tell_perseusrun(environ, "elastic/resumed", {"round": _round[0], "at": at})
