"""Jobs on a real one-node Slurm cluster started for these tests
(tests/slurm_cluster.py: munged, slurmctld and slurmd on this machine).

Up to 4 ranks on a node that offers 4 CPUs (this machine may have fewer
cores): started by `srun -n 4` alone, with no launcher (the ranks read
SLURM_*), and by perseusrun inside an allocation (it takes the allocation's
nodes when no -H is given). Needs root; without it the tests skip with the
reason.
"""

import json
import os
import secrets
import shlex
import subprocess
import sys
import time

import pytest

from harness import (ROOT, WORKERS, CheckResults, check_names, rank_env,
                     use_examples_packages)

use_examples_packages()  # the examples' digits data (scikit-learn)
from slurm_cluster import SlurmCluster, SlurmStartError, free_port, not_root_reason

PERSEUSRUN = [sys.executable, "-m", "perseus_tf.runner"]
TOPOLOGY = [sys.executable, os.path.join(WORKERS, "slurm_topology.py")]
# Plain sums, so that distributed training equals one process to 1e-6.
JOB_ENV = {"PERSEUS_ALLREDUCE_DTYPE": "1", "GLOO_TIMEOUT_SECONDS": "30",
           "PERSEUS_STALL_TIMEOUT_SECONDS": "60"}


@pytest.fixture(scope="module")
def slurm():
    why = not_root_reason()
    if why:
        print(f"skipping the Slurm tests: {why}")
        pytest.skip(why)
    try:
        with SlurmCluster(cpus=4) as cluster:
            print(f"local Slurm cluster up in {cluster.startup_seconds:.1f} s "
                  f"(node {cluster.node}, {cluster.cpus} CPUs)")
            yield cluster
    except SlurmStartError as err:
        pytest.fail(str(err), pytrace=False)


def _job_env(extra=None):
    """The tests' rank_env, JOB_ENV and a fresh secret, exported for srun."""
    return rank_env(dict(JOB_ENV, PERSEUS_RENDEZVOUS_SECRET=secrets.token_hex(32),
                         **(extra or {})))


def _run(slurm, argv, env, timeout=120):
    start = time.monotonic()
    try:
        proc = slurm.run(argv, env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(
            f"{shlex.join(argv[:4])} ... still running after {timeout} s\n--- output ---\n"
            f"{(err.stdout or b'')[-3000:]!r}\n{(err.stderr or b'')[-3000:]!r}\n"
            f"{slurm.logs(1500)}") from None
    return proc, time.monotonic() - start


def _explain(proc, slurm):
    return (f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n"
            f"--- stderr ---\n{proc.stderr[-3000:]}\n{slurm.logs(1500)}")


def _reports(out):
    """What slurm_topology.py wrote, one report per rank."""
    reports = []
    for name in sorted(os.listdir(out)):
        if name.endswith(".json"):
            with open(os.path.join(out, name)) as f:
                reports.append(json.load(f))
    return reports


def test_srun_sets_the_variables_perseus_reads(slurm):
    """Slurm's side of the contract, as this Slurm version sets it."""
    # One variable a line, labelled with its task (-l): srun passes output
    # on in pieces of at most 1 KiB, which interleave between tasks.
    proc, took = _run(slurm, ["srun", "-n", "4", "-l", "--export=ALL", "env"], env=_job_env())
    assert proc.returncode == 0, _explain(proc, slurm)
    by_task = {}
    for line in proc.stdout.splitlines():
        task, _, variable = line.partition(": ")
        if variable.startswith("SLURM_"):
            name, _, value = variable.partition("=")
            by_task.setdefault(task.strip(), {})[name] = value
    ranks = list(by_task.values())
    print(f"srun -n 4 env: {took:.1f} s; task 0 sees "
          + json.dumps(by_task.get("0"), sort_keys=True))
    assert sorted(int(e["SLURM_PROCID"]) for e in ranks) == [0, 1, 2, 3], ranks
    for e in ranks:
        assert e["SLURM_LOCALID"] == e["SLURM_PROCID"] and e["SLURM_NODEID"] == "0", e
        assert e["SLURM_STEP_NUM_TASKS"] == "4" and e["SLURM_STEP_TASKS_PER_NODE"] == "4", e
        assert e["SLURM_STEP_NODELIST"] == slurm.node and e["SLURM_STEP_ID"] == "0", e
    assert len({e["SLURM_JOB_ID"] for e in ranks}) == 1, ranks


@pytest.mark.parametrize("master_port", [False, True], ids=["derived_port", "PERSEUS_MASTER_PORT"])
def test_srun_ranks_read_their_place_from_slurm(slurm, master_port, tmp_path):
    """Without a launcher: rank, size, local and cross ranks from SLURM_*,
    the store on rank 0's node at a port every rank derives alike (or
    PERSEUS_MASTER_PORT), the exported secret; then a real allreduce."""
    port = free_port() if master_port else None
    env = _job_env({"PERSEUS_MASTER_PORT": port})
    proc, took = _run(slurm, ["srun", "-n", "4", "--export=ALL", "--kill-on-bad-exit=1"]
                      + TOPOLOGY + [str(tmp_path), "--allreduce"], env=env)
    print(f"srun -n 4 rendezvous + allreduce (no TensorFlow): {took:.1f} s")
    reports = _reports(tmp_path)
    assert len(reports) == 4 and all("topology" in r for r in reports), \
        json.dumps(reports) + _explain(proc, slurm)
    secret = env["PERSEUS_RENDEZVOUS_SECRET"]
    for r in reports:
        t, e = r["topology"], r["env"]
        assert t["source"] == "slurm", t
        assert (t["rank"], t["size"]) == (int(e["SLURM_PROCID"]), 4), r
        assert (t["local_rank"], t["local_size"]) == (int(e["SLURM_LOCALID"]), 4), r
        assert (t["cross_rank"], t["cross_size"]) == (0, 1), r
        # As bytes: the hex text decoded, or the text itself.
        assert t["secret"] in (secret, secret.encode().hex()), t
        assert t["host_store"] == (t["rank"] == 0), t
        assert r["sum"] == 1 + 2 + 3 + 4, r
    assert sorted(r["topology"]["rank"] for r in reports) == [0, 1, 2, 3]
    stores = {(r["topology"]["store_addr"], r["topology"]["store_port"]) for r in reports}
    assert len(stores) == 1, stores
    addr, store_port = stores.pop()
    assert addr in (slurm.node, "127.0.0.1"), addr
    if port:
        assert store_port == port, (store_port, port)
    else:
        assert 1024 <= store_port <= 65535, store_port
    assert proc.returncode == 0, _explain(proc, slurm)


def test_srun_strategy_fit_equals_one_process(slurm, tmp_path):
    """The real thing: 4 srun tasks, each imports TensorFlow, builds a Keras
    model under PerseusStrategy() and trains with fit, no launcher."""
    proc, took = _run(slurm, ["srun", "-n", "4", "--export=ALL", "--kill-on-bad-exit=1",
                              sys.executable, os.path.join(WORKERS, "run_checks.py"),
                              "checks_slurm", str(tmp_path)], env=_job_env(), timeout=300)
    print(f"srun -n 4 PerseusStrategy fit: {took:.1f} s")
    results = {}
    for rank in range(4):
        path = tmp_path / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    checked = CheckResults(4, results, proc)
    for check in check_names("checks_slurm"):
        checked.assert_ok(check)
    assert proc.returncode == 0, _explain(proc, slurm)


def test_a_bare_batch_script_is_one_process(slurm, tmp_path):
    """A batch script's own shell has SLURM_PROCID=0 and SLURM_NTASKS=4 but
    is one process: without srun it must train alone, not wait for 3 more."""
    state, code, _ = slurm.sbatch(["-n", "4", f"--output={tmp_path}/job.out", "--wrap",
                                   shlex.join(TOPOLOGY + [str(tmp_path)])],
                                  env=_job_env(), timeout=60, cwd=ROOT)
    reports = _reports(tmp_path)
    assert (state, code) == ("COMPLETED", 0) and len(reports) == 1, \
        (state, code, (tmp_path / "job.out").read_text())
    assert "topology" in reports[0], reports[0]
    t = reports[0]["topology"]
    assert (t["rank"], t["size"]) == (0, 1), reports[0]


@pytest.mark.parametrize("how", ["salloc", "sbatch"])
def test_perseusrun_in_an_allocation_takes_its_hosts_from_slurm(slurm, tmp_path, how):
    """`perseusrun -np 4` with no -H inside a 4-task allocation: the ranks
    run on the allocation's node, named as SLURM_JOB_NODELIST names it, and
    perseusrun's contract wins over the SLURM_* the ranks inherit (inside a
    batch script those include SLURM_PROCID=0)."""
    out = tmp_path / "reports"
    out.mkdir()
    command = PERSEUSRUN + ["-np", "4", "--"] + TOPOLOGY + [str(out), "--allreduce"]
    start = time.monotonic()
    if how == "salloc":
        proc, _ = _run(slurm, ["salloc", "-n", "4"] + command, env=rank_env(JOB_ENV))
        ok, text = proc.returncode == 0, _explain(proc, slurm)
    else:
        state, code, _ = slurm.sbatch(["-n", "4", f"--output={tmp_path}/job.out",
                                       "--wrap", shlex.join(command)],
                                      env=rank_env(JOB_ENV), timeout=120, cwd=ROOT)
        ok, text = (state, code) == ("COMPLETED", 0), (
            f"{state} {code}\n" + (tmp_path / "job.out").read_text()[-3000:])
    print(f"{how} -n 4 perseusrun -np 4 (no TensorFlow): {time.monotonic() - start:.1f} s")
    reports = _reports(out)
    assert len(reports) == 4 and all("topology" in r for r in reports), \
        json.dumps(reports) + "\n" + text
    for r in reports:
        t, e = r["topology"], r["env"]
        assert t["source"] == "perseusrun", t
        assert (t["size"], t["local_size"], t["cross_size"]) == (4, 4, 1), t
        assert e["SLURM_JOB_NODELIST"] == slurm.node and e["SLURM_JOB_ID"], e
        # The host as perseusrun wrote it down: the allocation's node name,
        # where a launch without Slurm says "localhost".
        assert e["HOROVOD_HOSTNAME"] == slurm.node, e
        assert r["sum"] == 1 + 2 + 3 + 4, r
    assert sorted(r["topology"]["rank"] for r in reports) == [0, 1, 2, 3]
    assert ok, text


def test_perseusrun_in_an_allocation_refuses_more_ranks_than_it_has(slurm):
    proc, _ = _run(slurm, ["salloc", "-n", "2"] + PERSEUSRUN + ["-np", "4", "--", "true"],
                   env=rank_env(JOB_ENV), timeout=60)
    assert proc.returncode != 0, _explain(proc, slurm)
    assert "-np 4" in proc.stderr and "Slurm" in proc.stderr, _explain(proc, slurm)


def test_sbatch_example_trains(slurm, tmp_path):
    """examples/slurm/train.sbatch as a user submits it, on this one node:
    2 tasks instead of its 2 nodes x 2 (command-line options override the
    script's #SBATCH lines), with the secret the script makes."""
    out = tmp_path / "job.out"
    env = rank_env({"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
                    "PERSEUS_RENDEZVOUS_SECRET": None})
    start = time.monotonic()
    state, code, submit = slurm.sbatch(
        ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", f"--output={out}",
         os.path.join(ROOT, "examples", "slurm", "train.sbatch"), "--epochs", "1"],
        env=env, timeout=300, cwd=ROOT)
    print(f"sbatch examples/slurm/train.sbatch, 2 ranks, 1 epoch: "
          f"{time.monotonic() - start:.1f} s")
    text = out.read_text() if out.exists() else "(no job output)"
    assert (state, code) == ("COMPLETED", 0), \
        f"{state} {code}\n{submit.stderr}\n--- job output ---\n{text[-3000:]}"
    assert "2 ranks (processes) share each batch" in text, text[-3000:]
    assert "epoch 1/1" in text and "val_accuracy" in text, text[-3000:]
