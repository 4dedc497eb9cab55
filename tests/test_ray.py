"""PerseusStrategy under Ray Train (examples/ray_train_keras.py): a real Ray
cluster of two nodes, each a network-namespace host (`ray start --head` on
one, a worker node on the other), runs TensorflowTrainer with one worker on
each node. Ray sets TF_CONFIG, nothing else is exported (the rendezvous
store's secret goes through Ray's key-value store); the workers' weights
must be identical and the training must have converged."""

import importlib.util
import json
import os
import secrets
import shutil
import sys
import tempfile

import pytest

from harness import ROOT
from netns_hosts import NetnsHosts, missing_requirements

HAS_RAY = importlib.util.find_spec("ray") is not None
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
EXAMPLE = os.path.join(ROOT, "examples", "ray_train_keras.py")


@pytest.mark.skipif(not HAS_RAY and not os.environ.get("PERSEUS_TEST_PASS"),
                    reason="make check without Ray (make test installs it: make ray)")
@pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))
def test_perseus_strategy_trains_under_ray_train_on_two_nodes(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PERSEUS_", "OMPI_", "HOROVOD_", "TF_CONFIG", "SLURM_"))}
    env.update(PYTHONPATH=ROOT, RAY_USAGE_STATS_ENABLED="0")
    # The cluster's own authentication, as a multi-node Ray cluster runs it:
    # one token for the nodes and the driver (in this test's directory, not
    # the user's ~/.ray).
    token = tmp_path / "ray_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    # Ray's sockets live under its temporary directories: short paths.
    temps = [tempfile.mkdtemp(prefix=f"ray{i}", dir="/tmp") for i in range(2)]
    out = tmp_path / "out"
    out.mkdir()
    try:
        with NetnsHosts(2) as hosts:
            head = f"{hosts.addrs[0]}:6390"
            started = hosts.exec(0, RAY, "start", "--head", f"--node-ip-address={hosts.addrs[0]}",
                                 "--port=6390", "--num-cpus=1", "--include-dashboard=false",
                                 f"--temp-dir={temps[0]}", check=False, env=env, timeout=180)
            assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
            joined = hosts.exec(1, RAY, "start", f"--address={head}",
                                f"--node-ip-address={hosts.addrs[1]}", "--num-cpus=1",
                                check=False, env=env, timeout=180)
            assert joined.returncode == 0, joined.stdout[-2000:] + joined.stderr[-2000:]
            proc = hosts.exec(0, sys.executable, EXAMPLE, "--address", head, "--workers", "2",
                              "--spread", "--epochs", "3", "--out", str(out), check=False,
                              env=env, timeout=600, cwd=str(tmp_path))
            for host in (1, 0):
                hosts.exec(host, RAY, "stop", "--force", check=False, env=env, timeout=60)
    finally:
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-5000:]
    assert "no secret" not in text, text[-3000:]
    results = []
    for rank in range(2):
        with open(out / f"rank{rank}.json") as f:
            results.append(json.load(f))
    assert results[0]["weights"] == results[1]["weights"]
    assert results[0]["accuracy"] > 0.9, results[0]["accuracy"]
    print(f"perseus under Ray Train, 2 nodes: {results[0]['step_ms']:.1f} ms a step")
