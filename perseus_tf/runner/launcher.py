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

This module is the entry point (main); the parts it joins:
  cli.py        the command line and its host lists
  placement.py  hosts, ranks on their slots, each rank's environment
  ssh.py        starting remote.py on other hosts, checking them first
  supervise.py  RankGroup: the running ranks, their signals and failures
  output.py     forwarding the ranks' output lines
  mpi.py        --mpi: starting the ranks through mpirun
  store.py      the rendezvous store served to the ranks
"""

import dataclasses
import json
import os
import secrets
import shlex
import signal
import socket
import sys

from perseus_tf.config.elastic_rounds import EXIT_RESTART
from perseus_tf.runner import cli
from perseus_tf.runner.cli import UsageError, build_parser, export_values
from perseus_tf.runner.mpi import run_mpi
from perseus_tf.runner.placement import (
    addresses, forwarded_env, interface_address, place_ranks, rank_contract, rank_env,
    resolve_hosts)
from perseus_tf.common.scratch import remove_job_scratch
from perseus_tf.runner.ssh import check_hosts, remote_invocation
from perseus_tf.common.store import StoreClient, StoreServer
from perseus_tf.runner.supervise import PROG, RankGroup, log


def _parse_args(parser, argv: list):
    """The command line, checked (cli.parse_args), with its hosts resolved
    (args.hosts: Host objects) and --network-interface found on this machine."""
    args = cli.parse_args(parser, argv)
    if args.host_discovery_script:
        from perseus_tf.runner.elastic_launcher import discover_once
        args.host_slots = discover_once(args)  # the hosts to start on
        args.hosts_source = f"--host-discovery-script {args.host_discovery_script}"
    args.hosts = resolve_hosts(args.host_slots, args.hosts_source)
    if args.network_interface:
        interface_address(args.network_interface)  # exists here
    return args


def resume_point(addr, port, secret, job_id) -> str:
    """Where the job's preemption backup resumes, as rank 0 recorded it."""
    try:
        with StoreClient(addr, port, secret, connect_timeout_s=5.0) as client:
            saved = json.loads(client.get(f"{job_id}/preemption", 0))
    except (OSError, TimeoutError, ValueError):
        return ""
    return f"; its backup resumes at epoch {saved['epoch']} step {saved['done']}"


def run_elastic(args, group, start, rendezvous_addr, port, secret, job_id, placements,
                interrupted):
    """--min-np/--max-np/--host-discovery-script: runner/elastic_launcher.py's job."""
    from perseus_tf.config import elastic_rounds as elastic_env
    from perseus_tf.runner import elastic_launcher as elastic
    if args.verbose:
        log(elastic.describe(args))
    initial = {p.host.name: p.host for p in placements}
    anywhere = any(not p.host.local for p in placements) or args.network_interface

    def fix_host(host):
        # A host listed at the start keeps the address addresses() gave it;
        # this machine, when others take part, is reached at the store's.
        if host.name in initial:
            return initial[host.name]
        if host.local and anywhere:
            return dataclasses.replace(host, addr=rendezvous_addr)
        return host

    def spawn(worker_id, key, placement):
        extra = {elastic_env.ENV_WORKER: worker_id, elastic_env.ENV_KEY: key,
                 elastic_env.ENV_TIMEOUT: f"{args.elastic_timeout:g}"}
        return start(placement, extra, tag=f"[{worker_id}] ")

    with StoreClient(rendezvous_addr, port, secret) as client:
        job = elastic.ElasticJob(args, client, job_id, spawn, fix_host, interrupted)
        status = job.run()
    group._drain_output()
    return status


def _bad_setting(args):
    """The ranks' PERSEUS_* settings (this environment and -x), read as each
    rank reads them at init: a bad one is one line here, before any rank
    starts, instead of a traceback from every rank. None when all are good."""
    from perseus_tf.config.settings import ConfigError, load_config
    environ = dict(os.environ)
    environ.update(export_values(os.environ, args.export))
    try:
        load_config(environ=environ)
    except ConfigError as err:
        return str(err)
    return None


def main(argv=None) -> int:
    """Runs perseusrun with argv (default sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    try:
        args = _parse_args(parser, sys.argv[1:] if argv is None else list(argv))
        placements = place_ranks(args.np, args.hosts)
        rendezvous_addr, placements = addresses(args, placements)
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
    bad = _bad_setting(args)
    if bad:
        print(f"{PROG}: {bad}; no rank was started", file=sys.stderr)
        return 2

    secret = secrets.token_bytes(32)
    job_id = secrets.token_hex(8)
    # The ranks connect from their hosts' addresses (local ones from the
    # rendezvous address itself or loopback): those connections are served
    # first when strangers hold the store's handshake slots.
    job_hosts = {p.host.addr for p in placements} | {rendezvous_addr, "127.0.0.1"}
    store = StoreServer(rendezvous_addr, 0, secret, job_hosts=job_hosts,
                        served_by=f"perseusrun on {socket.gethostname()}")
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
            log(f"job {job_id}, rendezvous store on {rendezvous_addr} port {port}")
        if args.mpi:
            return run_mpi(args, group, rendezvous_addr, port, secret, job_id)
        forward_base = forwarded_env(os.environ, args.export)
        local_extra = export_values(os.environ, args.export)
        if args.network_interface:
            forward_base.setdefault("PERSEUS_GLOO_NETWORK_INTERFACE", args.network_interface)
            local_extra.setdefault("PERSEUS_GLOO_NETWORK_INTERFACE", args.network_interface)

        def start(p, extra=None, tag=None):
            if p.host.local:
                env = rank_env({**os.environ, **local_extra, **(extra or {})}, p,
                               rendezvous_addr, port, secret, job_id)
                return group.spawn(p.rank, args.command, env, tag=tag,
                                   host=p.host.name if remote_hosts else "")
            env = dict(forward_base, **(extra or {}))
            env.update(rank_contract(p, rendezvous_addr, port, job_id))
            cmd, stdin_data = remote_invocation(args, p.host.name, env, local_extra, secret)
            if args.verbose:
                log(f"rank {p.rank}: {' '.join(shlex.quote(c) for c in cmd)}")
            return group.spawn(p.rank, cmd, dict(os.environ), host=p.host.name, tag=tag,
                               remote=True, stdin_data=stdin_data)

        if args.elastic:
            status = run_elastic(args, group, start, rendezvous_addr, port, secret, job_id,
                                 placements, lambda: bool(received))
            remove_job_scratch(job_id)
            return status
        for p in placements:
            if received:
                break  # interrupted while starting: do not start more ranks
            if args.verbose:
                log(f"rank {p.rank} on {p.host.name} ({p.host.addr}): local "
                     f"{p.local_rank}/{p.local_size}, cross "
                     f"{p.cross_rank}/{p.cross_size}")
            try:
                start(p)
            except OSError as err:
                log(f"cannot start rank {p.rank}: {err}")
                group.supervise(args.grace_seconds, stop_now=True)
                return 127
        status = group.supervise(args.grace_seconds)
        if status == EXIT_RESTART:
            log("every rank stopped for a restart (a rank got SIGTERM)"
                + resume_point(rendezvous_addr, port, secret, job_id)
                + ": run the same command again to resume from the backup (or use "
                  "--min-np/--max-np, which restart the job by themselves)")
        # Ranks killed by a signal leave their scratch directories here (those
        # on other hosts are removed there by remote.py).
        remove_job_scratch(job_id)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.stop()
