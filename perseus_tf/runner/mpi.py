"""``perseusrun --mpi``: the ranks start through Open MPI's mpirun (remote.py
--mpi in each), while perseusrun still serves the store and supervises."""

import os
import shlex
import sys

from perseus_tf.runner.cli import export_values
from perseus_tf.runner.placement import FORWARD_NAMES, FORWARD_PREFIXES, SECRET_VARIABLE
from perseus_tf.runner.supervise import log


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


def run_mpi(args, group, rendezvous_addr, port, secret, job_id) -> int:
    """Starts mpirun in group (a supervise.RankGroup), every rank's contract
    in its environment, and returns perseusrun's exit status."""
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
        log("mpirun: " + " ".join(shlex.quote(c) for c in cmd))
    try:
        # remote.py --mpi prefixes each rank's lines itself.
        group.spawn(0, cmd, env, label="mpirun", prefix=False)
    except OSError as err:
        log(f"cannot start mpirun (is Open MPI installed? Debian: openmpi-bin): {err}")
        return 127
    return group.supervise(args.grace_seconds)
