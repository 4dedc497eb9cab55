"""perseusrun's command line: the parser, the host lists of -H, --hostfile
and a Slurm allocation, and -x NAME[=VALUE] exports, checked before anything
starts. A bad command line is a UsageError, reported with the usage line.
"""

import argparse
import os
import shutil

from perseus_tf.runner.supervise import KILL_DELAY_S, PROG

DEFAULT_GRACE_S = 10.0
DEFAULT_START_TIMEOUT_S = 30.0


class UsageError(Exception):
    """A bad command line; reported through argparse's usage message."""


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
    elastic = parser.add_argument_group(
        "elastic training",
        "Any of --min-np, --max-np or --host-discovery-script makes the job "
        "elastic: workers that fail are left out and the others go on in the "
        "next round (hvd.elastic.run resets them), and new workers start on "
        "free slots up to --max-np; -np is the number started with.")
    elastic.add_argument(
        "--min-np", type=int, default=None, metavar="A",
        help="the fewest workers the job goes on with (default: -np)")
    elastic.add_argument(
        "--max-np", type=int, default=None, metavar="B",
        help="the most workers the job grows to (default: -np)")
    elastic.add_argument(
        "--host-discovery-script", default=None, metavar="PATH",
        help="an executable printing the hosts available now, one 'HOST[:SLOTS]' "
             "a line; rerun every --discovery-interval seconds (instead of -H)")
    elastic.add_argument(
        "--slots-per-host", type=int, default=1, metavar="N",
        help="slots of a discovered host that prints no ':SLOTS' (default 1)")
    elastic.add_argument(
        "--discovery-interval", type=float, default=1.0, metavar="S",
        help="seconds between runs of the discovery script (default 1)")
    elastic.add_argument(
        "--elastic-timeout", type=float, default=600.0, metavar="S",
        help="how long the job may have fewer than --min-np workers, or wait "
             "for a worker that does not come to the next round, before it "
             "fails (default 600)")
    elastic.add_argument(
        "--reset-limit", type=int, default=-1, metavar="N",
        help="fail the job after more than N resets (default: no limit)")
    elastic.add_argument(
        "--blacklist-cooldown", type=float, default=60.0, metavar="S",
        help="seconds a host whose worker failed gets no new workers (default 60)")
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
    from perseus_tf.common import slurm
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


def export_values(base: dict, exports: list) -> dict:
    """The -x entries as NAME -> value: NAME=VALUE as given, a bare NAME
    from base (perseusrun's environment)."""
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


def parse_args(parser: argparse.ArgumentParser, argv: list):
    """The command line, checked; args.host_slots holds the (name, slots)
    pairs the ranks go to (-H, --hostfile, the Slurm allocation, else
    localhost). Host names are not resolved here (placement.resolve_host)."""
    args = parser.parse_args(argv)
    # REMAINDER keeps the '--' that separates perseusrun's flags from COMMAND.
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.mpi and args.gloo:
        raise UsageError("--mpi and --gloo exclude each other")
    if not args.command:
        raise UsageError("no COMMAND given to run in the ranks")
    script = args.command[0]
    if script.endswith(".py") and shutil.which(script) is None:
        # `perseusrun -np 2 train.py`: the OS cannot run a script that is
        # not executable, and says only "No such file or directory".
        raise UsageError(f"{script} is a Python script, not a program the ranks can run: did you "
                         f"mean `perseusrun ... python {' '.join(args.command)}`?")
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
    args.elastic = (args.min_np is not None or args.max_np is not None
                    or args.host_discovery_script is not None)
    if args.elastic:
        _check_elastic(args)
    total_slots = sum(slots for _, slots in entries)
    if total_slots < args.np and not args.host_discovery_script:
        raise UsageError(f"-np {args.np} is more than the {total_slots} slots "
                         f"given by {flag}")
    args.host_slots = entries
    args.hosts_source = flag
    return args


def _check_elastic(args) -> None:
    args.min_np = args.np if args.min_np is None else args.min_np
    args.max_np = args.np if args.max_np is None else args.max_np
    if not 1 <= args.min_np <= args.np <= args.max_np:
        raise UsageError(f"elastic sizes must satisfy 1 <= --min-np ({args.min_np}) <= -np "
                         f"({args.np}) <= --max-np ({args.max_np})")
    if args.mpi:
        raise UsageError("--mpi starts a fixed set of ranks: it cannot run an elastic job")
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise UsageError("give -H/--hostfile or --host-discovery-script, not both")
    script = args.host_discovery_script
    if script and not (os.path.isfile(script) and os.access(script, os.X_OK)):
        raise UsageError(f"--host-discovery-script {script}: not an executable file")
    for name, value, low in (("--slots-per-host", args.slots_per_host, 1),
                             ("--discovery-interval", args.discovery_interval, 0.01),
                             ("--elastic-timeout", args.elastic_timeout, 0.01),
                             ("--blacklist-cooldown", args.blacklist_cooldown, 0.0)):
        if value < low:
            raise UsageError(f"{name} {value}: must be at least {low:g}")
