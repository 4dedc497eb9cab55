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
"""

import json
import os

from perseus_tf.config.contracts import Contract
from perseus_tf.config.settings import ConfigError

ENV_WORKER = "PERSEUS_ELASTIC_WORKER"  # HOST:SLOT, in messages
ENV_KEY = "PERSEUS_ELASTIC_KEY"        # HOST:SLOT/N: the N-th process started there
ENV_TIMEOUT = "PERSEUS_ELASTIC_TIMEOUT"
SOURCE = "perseusrun (elastic)"

_requests = 0       # this process's requests so far
_hosts_seen = None  # the hosts-updated count of this process's current round


def is_elastic(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return bool(environ.get(ENV_WORKER))


def _client(environ):
    from perseus_tf.runner.store import StoreClient
    return StoreClient(environ["PERSEUS_RENDEZVOUS_ADDR"],
                       int(environ["PERSEUS_RENDEZVOUS_PORT"]),
                       bytes.fromhex(environ["PERSEUS_RENDEZVOUS_SECRET"]))


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
