"""The rendezvous store of a job: where it is, who serves it, its secret, and
the Topology that load_topology() hands the runtime (this rank's place, from
the env contract, plus how to reach the others).

perseusrun serves the store and says where (PERSEUS_RENDEZVOUS_ADDR/PORT,
with a hex PERSEUS_RENDEZVOUS_SECRET). Under any other contract rank 0
serves it at PERSEUS_MASTER_ADDR, else the contract's address (Slurm: the
step's first node; torchrun: MASTER_ADDR; TF_CONFIG: the first address),
else MASTER_ADDR; port PERSEUS_MASTER_PORT, else the contract's (Slurm: from
the job and step ids; torchrun: MASTER_PORT, plus 1 under torchrun itself;
TF_CONFIG: the first address's), else MASTER_PORT, else 6666. Its secret is
PERSEUS_RENDEZVOUS_SECRET (as UTF-8 text) or the contents of
PERSEUS_RENDEZVOUS_SECRET_FILE (mode 600); under Ray (Ray Train's workers)
rank 0 draws one and hands it to the others through Ray's key-value store.
Without one the store may only be on loopback (one machine); a store on the
network with no secret is refused.
"""

import dataclasses
import hashlib
import json
import os
import secrets
import stat
import sys
import time

from perseus_tf.config import elastic_rounds as _elastic
from perseus_tf.config.contracts import find_contract
from perseus_tf.config.netaddr import (
    can_bind, interface_address, is_loopback_ip, resolve, route_address)
from perseus_tf.config.settings import ConfigError, env_int

DEFAULT_MASTER_PORT = 6666


@dataclasses.dataclass
class Topology:
    """This rank's place in the job and how to reach the others: what
    load_topology() hands the native runtime."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    store_addr: str = ""
    store_port: int = 0
    secret: bytes = b""
    job_id: str = "local"
    host_addr: str = "127.0.0.1"
    host_store: bool = False  # this rank must start the rendezvous store itself
    source: str = "none"      # which env contract was found


# ---- the store's address ----------------------------------------------------------

def _store_is_loopback(addr, cross_size):
    """True when the store is on loopback: one machine, the store private to it.

    A loopback address (127.x.y.z, "localhost") is. A host name is only when
    the job is on one host: a name can resolve to 127.0.1.1 on its own host
    (Debian's /etc/hosts) while the other hosts reach it over the network.
    """
    ip = resolve(addr, "the rendezvous address")
    if not is_loopback_ip(ip):
        return False
    return addr in (ip, "localhost") or cross_size == 1


def store_bind_address(topology, gloo_iface=""):
    """Where rank 0 serves the rendezvous store under a foreign launcher: the
    store address itself when it is loopback (one machine) or assigned to
    this machine; else the address of PERSEUS_GLOO_NETWORK_INTERFACE if set;
    else every interface (0.0.0.0), e.g. behind a Kubernetes service whose
    address belongs to no pod. Clients must hold the secret either way."""
    ip = resolve(topology.store_addr, "the rendezvous address")
    if _store_is_loopback(topology.store_addr, topology.cross_size):
        return ip
    if not is_loopback_ip(ip) and can_bind(ip):
        return ip
    if gloo_iface:
        return interface_address(gloo_iface)
    return "0.0.0.0"


# ---- secret -----------------------------------------------------------------------

NO_SECRET_HELP = (
    "export PERSEUS_RENDEZVOUS_SECRET=... (the same in every rank, e.g. "
    "`export PERSEUS_RENDEZVOUS_SECRET=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')` "
    "in the sbatch script, or `-x PERSEUS_RENDEZVOUS_SECRET` for mpirun) or "
    "PERSEUS_RENDEZVOUS_SECRET_FILE")


def _foreign_secret(environ):
    """The secret given to ranks of a foreign launcher, as bytes (b"": none)."""
    text = environ.get("PERSEUS_RENDEZVOUS_SECRET", "")
    path = environ.get("PERSEUS_RENDEZVOUS_SECRET_FILE", "")
    if text and path:
        raise ConfigError("both PERSEUS_RENDEZVOUS_SECRET and PERSEUS_RENDEZVOUS_SECRET_FILE "
                          f"({path!r}) are set: set only one")
    if text:
        return text.encode("utf-8")
    if not path:
        return b""
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ConfigError(f"PERSEUS_RENDEZVOUS_SECRET_FILE={path!r} cannot be read: "
                          f"{e.strerror}; it must name a file that holds the job's secret") \
            from None
    if mode & 0o077:
        raise ConfigError(
            f"PERSEUS_RENDEZVOUS_SECRET_FILE={path!r} has mode {stat.S_IMODE(mode):04o}: "
            f"group or others may read it; it must be private to its owner (`chmod 600 "
            f"{path}`; for a Kubernetes secret volume, defaultMode: 0400)")
    if not secret:
        raise ConfigError(f"PERSEUS_RENDEZVOUS_SECRET_FILE={path!r} is empty: it must hold "
                          "the job's secret")
    return secret


RAY_SECRET_WAIT_S = 120.0


def _ray_secret(environ, c, t):
    """The job's secret under Ray (Ray Train's TensorflowTrainer starts the
    workers and sets TF_CONFIG), with no step of the user's: rank 0 draws one
    and keeps it in Ray's own key-value store (the GCS), which only the Ray
    cluster's processes reach (and they can run code on every node anyway);
    the other ranks read it there. b"" when this process is not a Ray
    worker. Ray is never imported here: only a process that runs Ray has it."""
    ray = sys.modules.get("ray")
    if ray is None or not getattr(ray, "is_initialized", lambda: False)():
        return b""
    try:
        from ray.experimental import internal_kv
    except ImportError:  # pragma: no cover - another Ray
        return b""
    if not internal_kv._internal_kv_initialized():
        return b""
    try:
        job = ray.get_runtime_context().get_job_id()
    except Exception:  # noqa: BLE001 - a Ray without it: the contract alone names the run
        job = ""
    # TF_CONFIG's cluster (not its task, this worker's own): its addresses
    # and ports are drawn afresh for each run.
    try:
        cluster = json.dumps(json.loads(environ.get("TF_CONFIG") or "{}").get("cluster"),
                             sort_keys=True)
    except (ValueError, AttributeError):
        cluster = ""
    run = "|".join([job, c.source, cluster, f"{t.store_addr}:{t.store_port}"])
    key = "rendezvous-secret-" + hashlib.sha256(run.encode()).hexdigest()[:32]
    if t.rank == 0:
        # The first value put wins (a retried rank 0 keeps the one the others read).
        internal_kv._internal_kv_put(key, secrets.token_hex(16), overwrite=False,
                                     namespace="perseus")
    deadline = time.monotonic() + RAY_SECRET_WAIT_S
    while True:
        value = internal_kv._internal_kv_get(key, namespace="perseus")
        if value:
            return bytes(value)
        if time.monotonic() > deadline:
            raise ConfigError(
                f"rank {t.rank} (a Ray worker, {c.names}): rank 0 did not put the job's "
                f"rendezvous secret in Ray's key-value store within {RAY_SECRET_WAIT_S:.0f} s; "
                f"is rank 0 running? Or give every worker the same PERSEUS_RENDEZVOUS_SECRET "
                f"(Ray's runtime_env env_vars)")
        time.sleep(0.05)


def load_topology(environ=None, cluster=None) -> Topology:
    """Finds this process's place in the job and how to reach the others.

    Args:
      environ: the environment to read (default os.environ).
      cluster: a TF_CONFIG-shaped dict from a cluster resolver
        (cluster_from_resolver); it wins over the environment.

    With no contract at all this is a single process (world size 1).
    """
    environ = os.environ if environ is None else environ
    t = Topology()
    if cluster is None and _elastic.is_elastic(environ):
        c = _elastic.request_place(environ)  # perseusrun --min-np/--max-np
    else:
        c = find_contract(environ, cluster)
    if c is None:
        return t
    t.source = c.source
    t.rank, t.size = c.rank, c.size
    t.local_rank, t.local_size = c.local_rank, c.local_size
    t.cross_rank, t.cross_size = c.cross_rank, c.cross_size
    if t.size == 1:
        return t

    if environ.get("PERSEUS_RENDEZVOUS_ADDR"):
        # perseusrun serves the store (also for ranks it starts through mpirun).
        t.store_addr = environ["PERSEUS_RENDEZVOUS_ADDR"]
        t.store_port = env_int(environ, "PERSEUS_RENDEZVOUS_PORT", 1, 65535)
        try:
            t.secret = bytes.fromhex(environ.get("PERSEUS_RENDEZVOUS_SECRET", ""))
        except ValueError:
            t.secret = b""
        if not t.secret:
            raise ConfigError("PERSEUS_RENDEZVOUS_SECRET must be the job's hex secret: start "
                              "the job with perseusrun, which sets it")
    else:
        # A foreign launcher: rank 0 serves the store itself.
        _foreign_store(environ, c, t)
        t.secret = _foreign_secret(environ) or _ray_secret(environ, c, t)
        if not t.secret and not _store_is_loopback(t.store_addr, t.cross_size):
            raise ConfigError(
                f"rank 0 would serve the rendezvous store to the network "
                f"({t.store_addr}:{t.store_port}) with no secret: {NO_SECRET_HELP}")
        t.host_store = t.rank == 0
    t.job_id = environ.get("PERSEUS_JOB_ID") or c.job_id or _derived_job_id(t)
    if not t.secret:
        # One machine, and rank 0 serves the store on loopback only: a
        # secret derived from the job id keeps other jobs' ranks out.
        t.secret = ("perseus:" + t.job_id).encode()
    t.host_addr = environ.get("PERSEUS_HOST_ADDR") or _host_address(environ, t)
    return t


def _host_address(environ, t):
    """The address this rank's Gloo pairs listen on, when PERSEUS_HOST_ADDR is
    not set: 127.0.0.1 on one machine, else the one that routes to the store."""
    if _store_is_loopback(t.store_addr, t.cross_size):
        return "127.0.0.1"
    addr = route_address(t.store_addr, t.store_port)
    if not is_loopback_ip(addr):
        return addr
    iface = environ.get("PERSEUS_GLOO_NETWORK_INTERFACE")
    if iface:
        return interface_address(iface)
    raise ConfigError(
        f"the rendezvous address {t.store_addr!r} is a loopback address on this host but "
        f"the job spans {t.cross_size} hosts: set PERSEUS_MASTER_ADDR to an address the "
        f"other hosts reach, or PERSEUS_HOST_ADDR (or PERSEUS_GLOO_NETWORK_INTERFACE) to "
        f"this host's address on their network")


def _foreign_store(environ, contract, t):
    """Store address and port under a foreign launcher: PERSEUS_MASTER_ADDR /
    PERSEUS_MASTER_PORT win; then what the contract says; then MASTER_ADDR /
    MASTER_PORT; the port defaults to 6666."""
    addr = environ.get("PERSEUS_MASTER_ADDR") or contract.store_addr \
        or environ.get("MASTER_ADDR")
    if not addr:
        raise ConfigError(
            f"this process is rank {t.rank} of {t.size} (from {contract.names}) but there is "
            "no rendezvous address: start it with perseusrun, or set PERSEUS_MASTER_ADDR "
            "(and PERSEUS_MASTER_PORT, default 6666) to rank 0's address")
    t.store_addr = addr
    if "PERSEUS_MASTER_PORT" in environ:
        t.store_port = env_int(environ, "PERSEUS_MASTER_PORT", 1, 65535)
    elif contract.store_port is not None:
        t.store_port = contract.store_port
    elif contract.store_addr is None and "MASTER_PORT" in environ:
        t.store_port = env_int(environ, "MASTER_PORT", 1, 65535)
    else:
        t.store_port = DEFAULT_MASTER_PORT


def _derived_job_id(t):
    """A job id from the store address and port: two jobs running at once on
    one host cannot share a store port, so it is unique among them. Hashed
    with the secret, when there is one, so it does not tell the port's
    previous job from this one."""
    h = hashlib.sha256(f"{t.store_addr}:{t.store_port}\0".encode() + t.secret)
    return "store-" + h.hexdigest()[:16]
