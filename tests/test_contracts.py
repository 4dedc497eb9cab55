"""How a rank finds its place when a foreign launcher or scheduler starts it:
Slurm's srun, torchrun-style variables, TF_CONFIG, a cluster resolver; which
contract wins; the rendezvous secret, job id and addresses. Parsing only,
except the last test, which starts 2 ranks by hand (about 15 s)."""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys

import pytest

from perseus_tf import config
from perseus_tf.config import ConfigError, find_contract, load_topology, netaddr
from perseus_tf.common import slurm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = {"PERSEUS_RENDEZVOUS_SECRET": "s3cret", "PERSEUS_HOST_ADDR": "10.1.1.1"}


@pytest.fixture(autouse=True)
def _no_resolve_wait(monkeypatch):
    monkeypatch.setattr(netaddr, "RESOLVE_WAIT_S", 0.0)


# ---- Slurm hostlists and task lists ------------------------------------------------

@pytest.mark.parametrize("text,hosts", [
    ("node[01-04,07],gpu3", ["node01", "node02", "node03", "node04", "node07", "gpu3"]),
    ("gnode[10,20,25-27]", ["gnode10", "gnode20", "gnode25", "gnode26", "gnode27"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("node[001-003]", ["node001", "node002", "node003"]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("single", ["single"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("x[3]", ["x3"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("r[1,3]c[0-1]x", ["r1c0x", "r1c1x", "r3c0x", "r3c1x"]),
])
def test_hostlist_expands(text, hosts):
    assert slurm.expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[05-3]", "node[1-2", "n[1-2]]", "n[]", "n[a-b]",
                                  "a,,b", "n[1-2,]", "n[[1]]", "", "a b", "n[1-2000000]"])
def test_malformed_hostlist_is_a_clear_error(text):
    with pytest.raises(ValueError) as e:
        slurm.expand_hostlist(text)
    assert repr(text) in str(e.value)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol is not installed")
def test_hostlist_expands_as_slurm_does(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=p Nodes=localhost Default=YES\n")
    for text in ["node[01-04,07],gpu3", "rack[1-2]-n[1-2]", "n[8-11],m[001-3]", "a,b[1-2],c"]:
        out = subprocess.run(["scontrol", "show", "hostnames", text], capture_output=True,
                             text=True, timeout=30, env=dict(os.environ, SLURM_CONF=str(conf)))
        assert out.returncode == 0, out.stderr
        assert slurm.expand_hostlist(text) == out.stdout.split(), text


@pytest.mark.parametrize("text,counts", [
    ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]), ("1(x2),3(x2)", [1, 1, 3, 3])])
def test_tasks_per_node_expands(text, counts):
    assert slurm.expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["2(x0)", "a", "", "2(x3", "2,,1", "2(3)"])
def test_malformed_tasks_per_node_is_a_clear_error(text):
    with pytest.raises(ValueError) as e:
        slurm.expand_tasks_per_node(text)
    assert repr(text) in str(e.value)


# ---- Slurm srun steps ------------------------------------------------------------------

# `srun -N 3 -n 7` on node[1-3]: 3 tasks on node1, 2 on node2 and node3.
PLACEMENT = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1)]  # rank -> (node, local)


def slurm_env(rank, job="4242", step="0", **extra):
    node, local = PLACEMENT[rank]
    env = {"SLURM_JOB_ID": job, "SLURM_STEP_ID": step, "SLURM_PROCID": str(rank),
           "SLURM_STEP_NUM_TASKS": "7", "SLURM_NTASKS": "7", "SLURM_LOCALID": str(local),
           "SLURM_NODEID": str(node), "SLURM_STEP_NODELIST": "node[1-3]",
           "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_STEP_TASKS_PER_NODE": "3,2(x2)",
           "SLURM_TASKS_PER_NODE": "3,2(x2)"}
    env.update(extra)
    return env


def test_srun_step_places_every_task():
    for rank, (node, local) in enumerate(PLACEMENT):
        c = find_contract(slurm_env(rank))
        assert c.source == "slurm"
        assert (c.rank, c.size, c.local_rank, c.cross_rank, c.cross_size) == \
            (rank, 7, local, node, 3)
        assert c.local_size == (3 if node == 0 else 2)


def test_srun_store_on_first_node_at_a_port_from_job_and_step():
    tops = [load_topology(dict(slurm_env(r), **SECRET)) for r in range(7)]
    assert {(t.store_addr, t.store_port) for t in tops} == {("node1", tops[0].store_port)}
    assert [t.host_store for t in tops] == [True] + [False] * 6
    assert tops[0].job_id == "slurm-4242.0" and tops[0].source == "slurm"
    port = tops[0].store_port
    assert 10000 <= port < 30000  # below Linux's ephemeral ports
    other_step = load_topology(dict(slurm_env(0, step="1"), **SECRET))
    other_job = load_topology(dict(slurm_env(0, job="4243"), **SECRET))
    assert len({port, other_step.store_port, other_job.store_port}) == 3
    assert len({tops[0].job_id, other_step.job_id, other_job.job_id}) == 3


def test_step_ports_do_not_collide_for_nearby_jobs_and_steps():
    ports = {slurm.step_port(job, step) for job in range(5000, 5999) for step in range(20)}
    assert len(ports) == 999 * 20
    assert all(10000 <= p < 30000 for p in ports)


def test_srun_port_override_and_master_port_ignored():
    t = load_topology(dict(slurm_env(2), PERSEUS_MASTER_PORT="29400", **SECRET))
    assert t.store_port == 29400
    t = load_topology(dict(slurm_env(2), MASTER_PORT="29400", MASTER_ADDR="elsewhere",
                           **SECRET))
    assert t.store_port != 29400 and t.store_addr == "node1"


def test_sbatch_script_itself_is_one_process():
    batch = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node[1-2]",
             "SLURM_TASKS_PER_NODE": "2(x2)"}
    t = load_topology(batch)
    assert (t.size, t.rank, t.source) == (1, 0, "none")


def test_srun_task_counts_that_do_not_add_up_are_an_error():
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE='3,2'.*node\\[1-3\\]"):
        find_contract(slurm_env(0, SLURM_STEP_TASKS_PER_NODE="3,2"))


def test_srun_without_step_node_list_uses_the_job_one():
    env = slurm_env(4)
    del env["SLURM_STEP_NODELIST"], env["SLURM_STEP_TASKS_PER_NODE"]
    c = find_contract(env)
    assert (c.cross_rank, c.local_rank, c.local_size) == (1, 1, 2)


# ---- TF_CONFIG ---------------------------------------------------------------------------

def tf_config(task_type, index, cluster=None):
    cluster = cluster or {"chief": ["a:2222"], "worker": ["a:2223", "b:2222", "b:2223"]}
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type,
                                                                   "index": index}})}


def test_tf_config_chief_then_workers_local_and_cross_by_host():
    seen = []
    for task_type, index in [("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2)]:
        c = find_contract(tf_config(task_type, index))
        seen.append((c.rank, c.size, c.local_rank, c.local_size, c.cross_rank, c.cross_size))
        assert c.source == "tf_config"
    assert seen == [(0, 4, 0, 2, 0, 2), (1, 4, 1, 2, 0, 2), (2, 4, 0, 2, 1, 2),
                    (3, 4, 1, 2, 1, 2)]


def test_tf_config_workers_only_store_at_first_address():
    cluster = {"worker": ["w0.svc:2222", "w1.svc:2222", "w2.svc:2222"]}
    t = load_topology(dict(tf_config("worker", 1, cluster), **SECRET))
    assert (t.rank, t.size, t.cross_rank, t.cross_size, t.local_size) == (1, 3, 1, 3, 1)
    assert (t.store_addr, t.store_port, t.host_store) == ("w0.svc", 2222, False)
    t0 = load_topology(dict(tf_config("worker", 0, cluster), PERSEUS_MASTER_PORT="7000",
                            **SECRET))
    assert (t0.store_port, t0.host_store) == (7000, True)
    assert t0.job_id == t.job_id and t0.job_id.startswith("tf_config-")
    other = load_topology(dict(tf_config("worker", 0, {"worker": ["x:1", "y:1"]}), **SECRET))
    assert other.job_id != t0.job_id


@pytest.mark.parametrize("env,needle", [
    (tf_config("ps", 0, {"worker": ["a:1"], "ps": ["p:1"]}), "parameter servers"),
    (tf_config("worker", 0, {"worker": ["a:1", "b:1"], "ps": ["p:1"]}), "parameter servers"),
    (tf_config("evaluator", 0, {"worker": ["a:1"], "evaluator": ["e:1"]}),
     "not a training rank"),
    (tf_config("chief", 0, {"worker": ["a:1", "b:1"]}), "task type 'chief' is not in the"),
    (tf_config("worker", 3, {"worker": ["a:1", "b:1"]}), "task index 3 is out of range"),
    ({"TF_CONFIG": "{not json"}, "TF_CONFIG is not valid JSON"),
    (tf_config("worker", 0, {"worker": ["a:http", "b:1"]}), "'a:http' has port 'http'"),
])
def test_tf_config_mistakes_are_clear_errors(env, needle):
    with pytest.raises(ConfigError, match=needle):
        find_contract(env)


def test_tf_config_evaluator_in_cluster_is_not_a_rank():
    cluster = {"chief": ["c:1"], "worker": ["w:1"], "evaluator": ["e:1"]}
    c = find_contract(tf_config("worker", 0, cluster))
    assert (c.rank, c.size) == (1, 2)


# ---- torchrun-style ------------------------------------------------------------------

def torch_env(rank, **extra):
    env = {"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "master.svc", "MASTER_PORT": "29500"}
    env.update(extra)
    return env


def test_torchrun_style_env():
    t = load_topology(dict(torch_env(3), **SECRET))
    assert (t.source, t.rank, t.size, t.local_rank, t.local_size, t.cross_rank,
            t.cross_size) == ("torchrun", 3, 4, 1, 2, 1, 2)
    assert (t.store_addr, t.store_port) == ("master.svc", 29500)
    c = find_contract(torch_env(3, GROUP_RANK="0", GROUP_WORLD_SIZE="3"))
    assert (c.cross_rank, c.cross_size) == (0, 3)
    c = find_contract({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "m"})  # a PyTorchJob
    assert (c.local_rank, c.local_size, c.cross_rank, c.cross_size) == (0, 1, 2, 3)


def test_under_torchrun_the_store_takes_the_next_port():
    t = load_topology(dict(torch_env(1, TORCHELASTIC_RUN_ID="job7"), **SECRET))
    assert (t.store_port, t.job_id) == (29501, "torchelastic-job7")
    t = load_topology(dict(torch_env(1, TORCHELASTIC_RUN_ID="job7",
                                     PERSEUS_MASTER_PORT="31000"), **SECRET))
    assert t.store_port == 31000
    # torchrun's static rendezvous names every run "none": not a job id.
    a = load_topology(dict(torch_env(1, TORCHELASTIC_RUN_ID="none"), **SECRET))
    b = load_topology(dict(torch_env(1, TORCHELASTIC_RUN_ID="none", MASTER_PORT="29600"),
                           **SECRET))
    assert "none" not in a.job_id and a.job_id != b.job_id


def test_torchrun_local_rank_without_local_world_size_is_an_error():
    env = torch_env(1)
    del env["LOCAL_WORLD_SIZE"]
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        find_contract(env)


# ---- precedence ---------------------------------------------------------------------------

OMPI = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def test_a_launcher_wins_over_schedulers_without_comparison():
    env = dict(OMPI, **slurm_env(5), **torch_env(3), **tf_config("worker", 2))
    c = find_contract(env)
    assert (c.source, c.rank, c.size) == ("mpirun", 0, 2)


def test_real_torchrun_under_srun_is_a_launcher():
    # One torchrun per node inside a Slurm step: its workers carry the step's
    # SLURM_* (task 0 of 2) and torchrun's RANK (3 of 8); torchrun placed them.
    env = dict(slurm_env(0), **torch_env(3, WORLD_SIZE="8", LOCAL_WORLD_SIZE="4",
                                         LOCAL_RANK="3"), TORCHELASTIC_RUN_ID="job7")
    c = find_contract(env)
    assert (c.source, c.rank, c.size) == ("torchrun", 3, 8)
    env.pop("TORCHELASTIC_RUN_ID")  # without torchrun they are two schedulers that disagree
    with pytest.raises(ConfigError, match="unset one"):
        find_contract(env)


def test_launchers_in_order_and_agreeing_ones_are_fine():
    perseus = {"PERSEUS_RANK": "0", "PERSEUS_SIZE": "2", "HOROVOD_RANK": "0",
               "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "2"}
    assert find_contract(dict(perseus, **OMPI)).source == "perseusrun"
    assert find_contract(dict(OMPI, HOROVOD_RANK="0", HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK="0",
                              HOROVOD_LOCAL_SIZE="2")).source == "mpirun"


def test_schedulers_in_order_when_they_agree():
    env = dict(slurm_env(3), **torch_env(3, WORLD_SIZE="7", LOCAL_WORLD_SIZE="1",
                                         LOCAL_RANK="0"))
    assert find_contract(env).source == "slurm"
    env = dict(torch_env(1), **tf_config("worker", 0))  # chief + worker 0 = rank 1 of 4
    assert find_contract(env).source == "torchrun"


def test_disagreeing_schedulers_are_an_error_naming_both():
    env = dict(torch_env(0, WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0"),
               **tf_config("worker", 0))
    with pytest.raises(ConfigError) as e:
        find_contract(env)
    assert "RANK/WORLD_SIZE say rank 0 of 2" in str(e.value)
    assert "TF_CONFIG says rank 1 of 4" in str(e.value) and "unset one" in str(e.value)
    with pytest.raises(ConfigError, match="SLURM_PROCID/SLURM_STEP_NUM_TASKS say rank 5 of 7, "
                                          "RANK/WORLD_SIZE say rank 3 of 4"):
        find_contract(dict(slurm_env(5), **torch_env(3)))


def test_disagreeing_launchers_are_an_error_naming_both():
    env = dict(OMPI, HOROVOD_RANK="1", HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK="1",
               HOROVOD_LOCAL_SIZE="2")
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE say rank "
                                          "0 of 2, HOROVOD_RANK/HOROVOD_SIZE say rank 1 of 2"):
        find_contract(env)


def test_a_cluster_from_a_resolver_wins_over_the_environment():
    cluster = {"cluster": {"worker": ["h0:5000", "h1:5000"]}, "task": {"type": "worker",
                                                                       "index": 1}}
    t = load_topology(dict(OMPI, **SECRET), cluster=cluster)
    assert (t.source, t.rank, t.size, t.store_addr, t.store_port) == \
        ("cluster_resolver", 1, 2, "h0", 5000)


# ---- secret, job id, addresses -----------------------------------------------------------

LOOPBACK_OMPI = dict(OMPI, PERSEUS_MASTER_ADDR="127.0.0.1", PERSEUS_MASTER_PORT="7100")


def test_secret_text_is_used_as_utf8_and_perseusrun_secret_as_hex():
    t = load_topology(dict(LOOPBACK_OMPI, PERSEUS_RENDEZVOUS_SECRET="pässwort"))
    assert t.secret == "pässwort".encode()
    t = load_topology(dict(OMPI, PERSEUS_RENDEZVOUS_ADDR="127.0.0.1",
                           PERSEUS_RENDEZVOUS_PORT="5000", PERSEUS_RENDEZVOUS_SECRET="00ff"))
    assert t.secret == b"\x00\xff" and not t.host_store


def test_secret_file_must_be_private(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  from-a-file\n")
    path.chmod(0o600)
    t = load_topology(dict(LOOPBACK_OMPI, PERSEUS_RENDEZVOUS_SECRET_FILE=str(path)))
    assert t.secret == b"from-a-file"
    path.chmod(0o644)
    with pytest.raises(ConfigError) as e:
        load_topology(dict(LOOPBACK_OMPI, PERSEUS_RENDEZVOUS_SECRET_FILE=str(path)))
    assert str(path) in str(e.value) and "0644" in str(e.value) and "chmod 600" in str(e.value)
    with pytest.raises(ConfigError, match="set only one"):
        load_topology(dict(LOOPBACK_OMPI, PERSEUS_RENDEZVOUS_SECRET_FILE=str(path),
                           PERSEUS_RENDEZVOUS_SECRET="x"))
    with pytest.raises(ConfigError, match="cannot be read"):
        load_topology(dict(LOOPBACK_OMPI,
                           PERSEUS_RENDEZVOUS_SECRET_FILE=str(tmp_path / "missing")))


def test_loopback_store_without_secret_is_allowed_on_loopback_only():
    t = load_topology(LOOPBACK_OMPI)
    assert t.secret == ("perseus:" + t.job_id).encode() and t.host_store
    assert t.host_addr == "127.0.0.1"
    assert config.store_bind_address(t) == "127.0.0.1"
    t = load_topology(dict(OMPI, PERSEUS_MASTER_ADDR="localhost"))
    assert config.store_bind_address(t) == "127.0.0.1"


def test_network_store_without_secret_is_refused():
    env = dict(OMPI, PERSEUS_MASTER_ADDR="198.51.100.7")
    with pytest.raises(ConfigError) as e:
        load_topology(env)
    message = str(e.value)
    assert "to the network" in message and "no secret" in message
    assert "PERSEUS_RENDEZVOUS_SECRET" in message and "PERSEUS_RENDEZVOUS_SECRET_FILE" in message
    load_topology(dict(env, PERSEUS_RENDEZVOUS_SECRET="x", PERSEUS_HOST_ADDR="10.0.0.1"))


def test_a_name_on_loopback_here_is_network_when_the_job_spans_hosts(monkeypatch):
    real = socket.gethostbyname
    monkeypatch.setattr(socket, "gethostbyname",
                        lambda name: "127.0.1.1" if name == "node1" else real(name))
    with pytest.raises(ConfigError, match="no secret"):
        load_topology(slurm_env(0))  # 3 nodes: node1's 127.0.1.1 is not the job's address
    one_node = dict(slurm_env(0), SLURM_STEP_NODELIST="node1", SLURM_STEP_TASKS_PER_NODE="7")
    t = load_topology(dict(one_node, SLURM_NODEID="0", SLURM_LOCALID="0"))
    assert t.host_addr == "127.0.0.1" and config.store_bind_address(t) == "127.0.1.1"


def test_job_ids_differ_per_store_port_and_secret():
    def job(**extra):
        return load_topology(dict(LOOPBACK_OMPI, **extra)).job_id
    ids = {job(), job(PERSEUS_MASTER_PORT="7101"), job(PERSEUS_RENDEZVOUS_SECRET="a"),
           job(PERSEUS_RENDEZVOUS_SECRET="b")}
    assert len(ids) == 4 and "perseus-job" not in ids
    assert job() == job() and job(PERSEUS_JOB_ID="mine") == "mine"
    assert job(OMPI_MCA_ess_base_jobid="123") == "123"


def test_host_address_is_the_one_that_routes_to_the_store():
    assert config.route_address("127.0.0.1") == "127.0.0.1"
    try:
        outward = config.route_address("198.51.100.7")
    except ConfigError:
        pytest.skip("this machine has no route off loopback")
    assert not outward.startswith("127.")
    t = load_topology(dict(OMPI, PERSEUS_MASTER_ADDR="198.51.100.7",
                           PERSEUS_RENDEZVOUS_SECRET="x"))
    assert t.host_addr == outward
    # Not an address of this machine: the store serves on every interface,
    # or on the named interface's address.
    assert config.store_bind_address(t) == "0.0.0.0"
    assert config.store_bind_address(t, "lo") == "127.0.0.1"
    with pytest.raises(ConfigError, match="PERSEUS_GLOO_NETWORK_INTERFACE='nope0'.*lo"):
        config.store_bind_address(t, "nope0")
    mine = load_topology(dict(OMPI, PERSEUS_MASTER_ADDR=outward,
                              PERSEUS_RENDEZVOUS_SECRET="x"))
    assert config.store_bind_address(mine) == outward and mine.host_addr == outward


def test_unresolvable_store_address_names_it():
    with pytest.raises(ConfigError, match="'no-such-host.invalid' does not resolve"):
        load_topology(dict(OMPI, PERSEUS_MASTER_ADDR="no-such-host.invalid",
                           PERSEUS_RENDEZVOUS_SECRET="x"))


# ---- cluster resolvers --------------------------------------------------------------------

tf = pytest.importorskip("tensorflow")
resolvers = tf.distribute.cluster_resolver


def test_tf_config_cluster_resolver_converts(monkeypatch):
    cluster = {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": "worker", "index": 1}}))
    got = config.cluster_from_resolver(resolvers.TFConfigClusterResolver())
    assert got == {"cluster": cluster, "task": {"type": "worker", "index": 1}}
    c = find_contract({}, cluster=got)
    assert (c.source, c.rank, c.size, c.store_addr, c.store_port) == \
        ("cluster_resolver", 2, 3, "c", 2222)


def test_slurm_cluster_resolver_converts_without_scontrol(monkeypatch):
    for name, value in slurm_env(4).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol, no nvidia-smi
    resolver = resolvers.SlurmClusterResolver(gpus_per_node=3, gpus_per_task=1,
                                              auto_set_gpu=False)
    got = config.cluster_from_resolver(resolver)
    assert got["task"] == {"type": "worker", "index": 4}
    assert got["cluster"]["worker"][:4] == ["node1:8888", "node1:8889", "node1:8890",
                                            "node2:8888"]
    c = find_contract({}, cluster=got)
    assert (c.rank, c.size, c.local_rank, c.local_size, c.cross_rank, c.cross_size) == \
        (4, 7, 1, 2, 1, 3)


def test_simple_cluster_resolver_converts_and_needs_a_task():
    spec = tf.train.ClusterSpec({"worker": ["a:1", "b:1"]})
    got = config.cluster_from_resolver(resolvers.SimpleClusterResolver(spec, task_type="worker",
                                                                     task_id=1))
    assert find_contract({}, cluster=got).rank == 1
    with pytest.raises(ConfigError, match="has no task"):
        config.cluster_from_resolver(resolvers.SimpleClusterResolver(spec))


def test_a_running_runtime_refuses_a_resolver_that_moves_it(monkeypatch):
    from perseus_tf import _native

    class Running:
        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def topology():
            return {"rank": 0, "size": 2}

    monkeypatch.setattr(_native, "_core", Running)
    cluster = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(RuntimeError, match="already runs as rank 0 of 2.*rank 1 of 2"):
        _native.init(cluster=cluster)
    _native.init(cluster=dict(cluster, task={"type": "worker", "index": 0}))  # agrees


def test_two_ranks_placed_by_a_resolver_train_together():
    """2 ranks started by hand: SimpleClusterResolver places them, though the
    environment's TF_CONFIG describes another job."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               GLOO_TIMEOUT_SECONDS="60",
               TF_CONFIG=json.dumps({"cluster": {"worker": ["x:1", "y:1", "z:1"]},
                                     "task": {"type": "worker", "index": 2}}))
    for name in list(env):
        if name.startswith(("PERSEUS_", "HOROVOD_", "OMPI_", "SLURM_")):
            del env[name]
    worker = os.path.join(ROOT, "tests", "workers", "resolver_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(r), str(port)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    results = []
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
    for rank, r in enumerate(results):
        assert r == {"rank": rank, "size": 2, "sum": 3.0, "source": "cluster_resolver",
                     "store_port": port, "replicas": 2, "same_resolver": True}, r
