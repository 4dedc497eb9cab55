"""Where the ranks run and what tells each one its place: hosts (their
addresses, and which is this machine), ranks placed on their slots, the
rendezvous address every host reaches, and each rank's environment (the
PERSEUS_* contract, and horovodrun's HOROVOD_* variables).
"""

import dataclasses
import ipaddress
import os
import socket

from perseus_tf import _failure_record
from perseus_tf.config import ConfigError, netaddr
from perseus_tf.runner.cli import UsageError, export_values

# What remote ranks get of perseusrun's environment without -x.
FORWARD_PREFIXES = ("PERSEUS_", "GLOO_", "NCCL_")
FORWARD_NAMES = ("PYTHONPATH", "PATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV",
                 "TF_CPP_MIN_LOG_LEVEL")
SECRET_VARIABLE = "PERSEUS_RENDEZVOUS_SECRET"


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


def resolve_host(name: str, source: str = "-H/--hosts") -> Host:
    """The Host for a name of -H, --hostfile or another source (named in
    the error; slots filled in by the caller): its IPv4 address, and whether
    it is this machine."""
    if name == "localhost":
        return Host(name, "127.0.0.1", 1, True)
    try:
        addr = socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0]
    except (socket.gaierror, UnicodeError):
        raise UsageError(
            f"{source}: cannot resolve host {name!r} to an IPv4 address") from None
    local = ipaddress.ip_address(addr).is_loopback or netaddr.can_bind(addr)
    return Host(name, addr, 1, local)


def resolve_hosts(host_slots: list, source: str = "-H/--hosts") -> list:
    """The Hosts of the command line's (name, slots) pairs, in order; source
    says where they came from (-H, --hostfile, the Slurm allocation)."""
    return [dataclasses.replace(resolve_host(name, source), slots=slots)
            for name, slots in host_slots]


def interface_address(name: str) -> str:
    """The IPv4 address of network interface name on this machine."""
    try:
        return netaddr.interface_address(name)
    except ConfigError:
        raise UsageError(f"--network-interface {name}: no IPv4 address on this machine "
                         "(names: " + ", ".join(sorted(n for _, n in socket.if_nameindex()))
                         + ")") from None


def route_address(peer: str) -> str:
    """The address of this machine that packets to peer leave from."""
    try:
        return netaddr.route_address(peer)
    except ConfigError as err:
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


def addresses(args, placements):
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
