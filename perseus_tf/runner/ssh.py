"""Reaching other hosts over ssh: the command that starts remote.py for one
rank (the secret and -x values on its standard input, never on a command
line), and the check that every host answers before any rank starts.
"""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

from perseus_tf.runner.cli import UsageError
from perseus_tf.runner.placement import forwarded_env


def ssh_base(args, connect_timeout: float) -> list:
    """ssh with perseusrun's -p and -i, never prompting (BatchMode); a
    connection whose far end stops answering ends within 30 s (its rank is
    then lost, and remote.py on that host stops the rank as soon)."""
    cmd = ["ssh", "-o", "BatchMode=yes",
           "-o", f"ConnectTimeout={max(1, int(connect_timeout))}",
           "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=6"]
    if args.ssh_port:
        cmd += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file:
        cmd += ["-i", args.ssh_identity_file]
    return cmd


def remote_command(env: dict, command: list, cwd: str, probe: bool = False) -> str:
    """The shell command ssh runs on a remote host for one rank: remote.py
    reads the secret from its standard input and owns the rank. With probe,
    it only checks that remote.py can start there."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    runner = [sys.executable, "-m", "perseus_tf.runner.remote"]
    runner += ["--probe"] if probe else ["--"] + list(command)
    return (f"cd {shlex.quote(cwd)} && exec env {assignments} "
            + " ".join(shlex.quote(part) for part in runner))


def remote_invocation(args, host: str, env: dict, private: dict, secret: bytes):
    """The ssh command for one remote rank and what goes to its standard
    input. What -x names (`private`: API keys, tokens) travels with the
    secret on standard input, never on a command line, where any local user
    could read it in /proc/PID/cmdline for the whole job. Standard input:
    the secret in hex, a line; then a hex-encoded JSON object of the private
    variables, a line (remote.py reads both)."""
    public = {k: v for k, v in env.items() if k not in private}
    cmd = ssh_base(args, args.start_timeout) + [host, remote_command(public, args.command,
                                                                     os.getcwd())]
    values = json.dumps(private, sort_keys=True).encode().hex().encode()
    return cmd, secret.hex().encode() + b"\n" + values + b"\n"


def check_hosts(args, hosts: list) -> None:
    """Reaches every remote host over ssh, all at once, within
    --start-timeout, and checks that perseus_tf's runner imports there with
    this Python; raises UsageError naming every host that failed."""
    env = forwarded_env(os.environ, [])
    probe = remote_command({k: env[k] for k in ("PYTHONPATH", "PATH") if k in env},
                           [], os.getcwd(), probe=True)
    checks = []
    for host in hosts:
        cmd = ssh_base(args, args.start_timeout) + [host.name, probe]
        checks.append((host, subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)))
    deadline = time.monotonic() + args.start_timeout
    failures = []
    for host, proc in checks:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            failures.append(f"  {host.name}: no answer within --start-timeout "
                            f"{args.start_timeout:g} s")
            continue
        if proc.returncode == 255:
            failures.append(f"  {host.name}: ssh: {(err or out).strip() or 'exit status 255'}")
        elif proc.returncode != 0:
            failures.append(
                f"  {host.name}: {sys.executable} cannot import perseus_tf there "
                f"(hosts must share paths and the virtualenv): {(err or out).strip()[-300:]}")
    if failures:
        raise UsageError("cannot start ranks on " + str(len(failures)) + " host"
                         + ("s" if len(failures) > 1 else "") + ":\n" + "\n".join(failures))
