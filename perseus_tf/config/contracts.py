"""The env contracts: where this process is in the job (rank, size, local and
cross rank), as the launcher or scheduler that started it says.

It comes from the first env contract found, in two classes:

  launchers (they start the processes):
    1. perseusrun:  PERSEUS_RANK, PERSEUS_SIZE, PERSEUS_LOCAL_*, PERSEUS_CROSS_*
    2. mpirun:      OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
    3. horovod:     HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_*, HOROVOD_CROSS_*
  schedulers (they place processes a launcher or the scheduler starts):
    4. slurm:       an srun step (SLURM_STEP_ID or SLURM_STEP_NUM_TASKS set):
                    SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID,
                    SLURM_NODEID, SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE
    5. torchrun:    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
                    GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    6. tf_config:   TF_CONFIG {"cluster": {"chief": [..], "worker": [..]},
                    "task": {"type": .., "index": ..}}

Any launcher wins over every scheduler without comparison: launchers run
inside schedulers' allocations (mpirun in an sbatch script: its ranks also
carry the batch step's SLURM_*). Within a class the first contract found
wins, and every other one present must agree with it on rank and size, or
it is an error naming both ("TF_CONFIG says rank 1 of 4, RANK/WORLD_SIZE say
rank 0 of 2: unset one"). A cluster resolver given to PerseusStrategy wins
over all of them. Topology.source names the winner. No contract: one
process, world size 1 (a plain `python train.py` in an sbatch script too).

What a contract says about the rendezvous store (its address, port, job id)
is only an answer here; rendezvous.py decides where the store is.
"""

import dataclasses
import hashlib
import json
import os
import zlib
from typing import Optional

from perseus_tf.config.settings import ConfigError, env_int

MAX_RANKS = 1 << 20


@dataclasses.dataclass
class Contract:
    """One env contract's answer: the place of this process in the job.

    `names` names the contract's variables in messages ("RANK/WORLD_SIZE");
    store_addr, store_port and job_id are what the contract itself says
    about the rendezvous (None: nothing; the generic variables decide).
    """
    source: str
    names: str
    rank: int
    size: int
    local_rank: int = 0
    local_size: int = 1
    cross_rank: int = 0
    cross_size: int = 1
    store_addr: Optional[str] = None
    store_port: Optional[int] = None
    job_id: Optional[str] = None


# ---- launchers ------------------------------------------------------------------

def _perseusrun(environ):
    size = env_int(environ, "PERSEUS_SIZE", 1, MAX_RANKS)
    c = Contract("perseusrun", "PERSEUS_RANK/PERSEUS_SIZE",
                 rank=env_int(environ, "PERSEUS_RANK", 0, size - 1), size=size)
    c.local_size = env_int(environ, "PERSEUS_LOCAL_SIZE", 1, size) \
        if "PERSEUS_LOCAL_SIZE" in environ else size
    c.local_rank = env_int(environ, "PERSEUS_LOCAL_RANK", 0, c.local_size - 1) \
        if "PERSEUS_LOCAL_RANK" in environ else c.rank
    c.cross_size = env_int(environ, "PERSEUS_CROSS_SIZE", 1, size) \
        if "PERSEUS_CROSS_SIZE" in environ else 1
    c.cross_rank = env_int(environ, "PERSEUS_CROSS_RANK", 0, c.cross_size - 1) \
        if "PERSEUS_CROSS_RANK" in environ else 0
    return c


def _mpirun(environ):
    size = env_int(environ, "OMPI_COMM_WORLD_SIZE", 1, MAX_RANKS)
    c = Contract("mpirun", "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE",
                 rank=env_int(environ, "OMPI_COMM_WORLD_RANK", 0, size - 1), size=size)
    c.local_size = env_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, size)
    c.local_rank = env_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0, c.local_size - 1)
    c.cross_size = max(1, size // c.local_size)
    c.cross_rank = c.rank // c.local_size
    c.job_id = environ.get("OMPI_MCA_ess_base_jobid") or None
    return c


def _horovod(environ):
    size = env_int(environ, "HOROVOD_SIZE", 1, MAX_RANKS)
    c = Contract("horovod", "HOROVOD_RANK/HOROVOD_SIZE",
                 rank=env_int(environ, "HOROVOD_RANK", 0, size - 1), size=size)
    c.local_size = env_int(environ, "HOROVOD_LOCAL_SIZE", 1, size)
    c.local_rank = env_int(environ, "HOROVOD_LOCAL_RANK", 0, c.local_size - 1)
    c.cross_size = env_int(environ, "HOROVOD_CROSS_SIZE", 1, size) \
        if "HOROVOD_CROSS_SIZE" in environ else max(1, size // c.local_size)
    c.cross_rank = env_int(environ, "HOROVOD_CROSS_RANK", 0, c.cross_size - 1) \
        if "HOROVOD_CROSS_RANK" in environ else c.rank // c.local_size
    return c


# ---- schedulers -------------------------------------------------------------------

def _in_slurm_step(environ):
    # A batch script (sbatch) has SLURM_JOB_ID, SLURM_NTASKS and SLURM_PROCID=0
    # but is one process; only srun's tasks carry the step's variables.
    return "SLURM_STEP_ID" in environ or "SLURM_STEP_NUM_TASKS" in environ


def _first_set(environ, *names):
    return next((n for n in names if environ.get(n, "").strip()), None)


def _slurm(environ):
    """Tasks of `srun` (no launcher), read from what srun sets in every task.

    rank SLURM_PROCID; size SLURM_STEP_NUM_TASKS (else SLURM_NTASKS); local
    rank SLURM_LOCALID; node index SLURM_NODEID; nodes SLURM_STEP_NODELIST
    with SLURM_STEP_TASKS_PER_NODE tasks each (else the job's
    SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE); job SLURM_JOB_ID, step
    SLURM_STEP_ID (srun(1) and sbatch(1) of Slurm 22.05 list these; the batch
    script's own environment has no SLURM_STEP_*, which is how it is told
    apart). Assumed: SLURM_NODEID counts the step's nodes in the order of
    SLURM_STEP_NODELIST; rank 0 runs on the step's first node (true for
    srun's block, cyclic and plane distributions; with
    --distribution=arbitrary set PERSEUS_MASTER_ADDR); the step is not
    heterogeneous (its task counts would not add up: an error). A salloc
    interactive step is a step of one task: world size 1.
    """
    from perseus_tf.common import slurm

    size_var = _first_set(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if size_var is None or "SLURM_PROCID" not in environ:
        missing = "SLURM_PROCID" if size_var else "SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)"
        raise ConfigError(f"this process is in a Slurm job step (SLURM_STEP_ID or "
                          f"SLURM_STEP_NUM_TASKS is set) but {missing} is not set: start it "
                          "with srun, or unset SLURM_STEP_ID and SLURM_STEP_NUM_TASKS")
    size = env_int(environ, size_var, 1, MAX_RANKS)
    c = Contract("slurm", f"SLURM_PROCID/{size_var}",
                 rank=env_int(environ, "SLURM_PROCID", 0, size - 1), size=size)
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or ""
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "0"
    c.job_id = f"slurm-{job}.{step}"
    if size == 1:
        return c
    nodes_var = _first_set(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                           "SLURM_NODELIST")
    tasks_var = _first_set(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if nodes_var is None or tasks_var is None:
        missing = "SLURM_STEP_NODELIST" if nodes_var is None else "SLURM_STEP_TASKS_PER_NODE"
        raise ConfigError(f"{c.names} say rank {c.rank} of {size} but {missing} is not set: "
                          "start the tasks with srun")
    try:
        nodes = slurm.expand_hostlist(environ[nodes_var])
    except ValueError as e:
        raise ConfigError(f"{nodes_var}: {e}") from None
    try:
        tasks = slurm.expand_tasks_per_node(environ[tasks_var])
    except ValueError as e:
        raise ConfigError(f"{tasks_var}: {e}") from None
    if len(tasks) != len(nodes) or sum(tasks) != size:
        raise ConfigError(
            f"{tasks_var}={environ[tasks_var]!r} ({sum(tasks)} tasks on {len(tasks)} nodes) does "
            f"not match {nodes_var}={environ[nodes_var]!r} ({len(nodes)} nodes) and "
            f"{size_var}={size}: a heterogeneous Slurm step is not supported")
    c.cross_size = len(nodes)
    c.cross_rank = env_int(environ, "SLURM_NODEID", 0, len(nodes) - 1)
    c.local_size = tasks[c.cross_rank]
    c.local_rank = env_int(environ, "SLURM_LOCALID", 0, c.local_size - 1)
    c.store_addr = nodes[0]
    if job.isdigit():
        # Special steps may have names; any number will do, the same in every task.
        step_number = int(step) if step.isdigit() else zlib.crc32(step.encode())
        c.store_port = slurm.step_port(int(job), step_number)
    elif "PERSEUS_MASTER_PORT" not in environ:
        raise ConfigError(f"SLURM_JOB_ID={job!r} is invalid: it must be the job's number "
                          "(Slurm sets it), or set PERSEUS_MASTER_PORT")
    return c


def _torchrun(environ):
    """What torchrun (and Kubeflow's PyTorchJob, Ray Train) give each process.

    RANK and WORLD_SIZE; LOCAL_RANK and LOCAL_WORLD_SIZE (absent: one process
    per machine); GROUP_RANK / GROUP_WORLD_SIZE (the machine's index and the
    number of machines) or, without them, rank // LOCAL_WORLD_SIZE. The store
    is at MASTER_ADDR:MASTER_PORT, except under torchrun itself
    (TORCHELASTIC_RUN_ID set), whose agent already serves its own store on
    MASTER_PORT: then MASTER_PORT + 1.
    """
    size = env_int(environ, "WORLD_SIZE", 1, MAX_RANKS)
    c = Contract("torchrun", "RANK/WORLD_SIZE",
                 rank=env_int(environ, "RANK", 0, size - 1), size=size)
    if "LOCAL_WORLD_SIZE" in environ:
        c.local_size = env_int(environ, "LOCAL_WORLD_SIZE", 1, size)
        c.local_rank = env_int(environ, "LOCAL_RANK", 0, c.local_size - 1)
    elif "LOCAL_RANK" in environ:
        raise ConfigError(f"LOCAL_RANK={environ['LOCAL_RANK']!r} is set but LOCAL_WORLD_SIZE "
                          "is not: set LOCAL_WORLD_SIZE to the number of ranks on this machine")
    if "GROUP_WORLD_SIZE" in environ:
        c.cross_size = env_int(environ, "GROUP_WORLD_SIZE", 1, size)
        c.cross_rank = env_int(environ, "GROUP_RANK", 0, c.cross_size - 1)
    else:
        c.cross_size = -(-size // c.local_size)
        c.cross_rank = c.rank // c.local_size
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    # torchrun's static rendezvous calls every run "none": not an id.
    c.job_id = f"torchelastic-{run_id}" if run_id and run_id != "none" else None
    if environ.get("MASTER_ADDR"):
        c.store_addr = environ["MASTER_ADDR"]
        if "MASTER_PORT" in environ:
            port = env_int(environ, "MASTER_PORT", 1, 65535)
            if "TORCHELASTIC_RUN_ID" not in environ:
                c.store_port = port
            elif port < 65535:
                c.store_port = port + 1
            elif "PERSEUS_MASTER_PORT" not in environ:
                raise ConfigError("MASTER_PORT=65535 leaves no port for Perseus' store "
                                  "(under torchrun it uses MASTER_PORT + 1): set "
                                  "PERSEUS_MASTER_PORT to a free port")
    return c


def _tf_config_text(environ):
    text = environ.get("TF_CONFIG", "").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"TF_CONFIG is not valid JSON ({e}): {text[:200]!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"TF_CONFIG must be a JSON object with \"cluster\" and \"task\", "
                          f"got {text[:200]!r}")
    return value


def _has_tf_cluster(environ):
    value = _tf_config_text(environ)
    return bool(value and value.get("cluster"))


def _tf_config(environ):
    return cluster_contract(_tf_config_text(environ), "tf_config", "TF_CONFIG")


def _address_list(job, entries, where):
    """A job's addresses as a list, from a list or a {index: address} dict."""
    if isinstance(entries, dict):
        try:
            indexed = {int(k): v for k, v in entries.items()}
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: job {job!r} has task indices that are not "
                              f"integers: {sorted(entries)!r}") from None
        if sorted(indexed) != list(range(len(indexed))):
            raise ConfigError(f"{where}: job {job!r} has tasks {sorted(indexed)}; they must "
                              f"be numbered 0 to {len(indexed) - 1} without gaps")
        entries = [indexed[i] for i in range(len(indexed))]
    if not isinstance(entries, (list, tuple)) or \
            not all(isinstance(a, str) and a.strip() for a in entries):
        raise ConfigError(f"{where}: job {job!r} must be a list of \"host:port\" addresses, "
                          f"got {entries!r}")
    return [a.strip() for a in entries]


def _split_address(address, where):
    """"host:port" -> (host, port); "host" -> (host, None); "[v6]:port" keeps
    v6 without brackets."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif address.count(":") == 1:
        host, _, port = address.partition(":")
    else:
        host, port = address, ""
    if not port:
        return host, None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{where}: address {address!r} has port {port!r}; it must be an "
                          "integer from 1 to 65535")
    return host, int(port)


def cluster_contract(config, source, where):
    """The contract of a TF_CONFIG-shaped dict: {"cluster": {"chief": [...],
    "worker": [...]}, "task": {"type": ..., "index": ...}}.

    Ranks are the chief (if any) then the workers in order. Ranks whose
    addresses share a host part are on one machine (local rank: position
    among them); machines are numbered in the order their first rank
    appears (cross rank). The store goes to the first address.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"{where} must be a dict with \"cluster\" and \"task\", got "
                          f"{config!r}")
    cluster, task = config.get("cluster") or {}, config.get("task") or {}
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise ConfigError(f"{where}: \"cluster\" and \"task\" must be objects, got "
                          f"cluster={cluster!r}, task={task!r}")
    task_type, index = task.get("type"), task.get("index", 0)
    if task_type == "ps" or cluster.get("ps"):
        raise ConfigError(f"{where} lists parameter servers (\"ps\": {cluster.get('ps')!r}): "
                          "Perseus does not support parameter servers; every training "
                          "process is a \"chief\" or \"worker\" task")
    if task_type == "evaluator":
        raise ConfigError(f"{where}: this task is an \"evaluator\", which is not a training "
                          "rank: run the evaluator without Perseus (e.g. a plain "
                          "tf.distribute strategy), or make it a \"worker\"")
    chief_key = "chief" if "chief" in cluster else ("master" if "master" in cluster else None)
    chiefs = _address_list(chief_key, cluster[chief_key], where) if chief_key else []
    workers = _address_list("worker", cluster.get("worker", []), where)
    if len(chiefs) > 1:
        raise ConfigError(f"{where}: the cluster has {len(chiefs)} chiefs {chiefs!r}; "
                          "there can be one")
    jobs = {"chief": chiefs, "master": chiefs, "worker": workers}
    if task_type not in ("chief", "master", "worker") or not jobs[task_type]:
        have = [j for j in ("chief", "worker") if jobs[j]]
        raise ConfigError(f"{where}: task type {task_type!r} is not in the cluster: it must "
                          f"be one of {have} (the cluster lists {sorted(cluster)})")
    if isinstance(index, str) and index.strip().isdigit():
        index = int(index)
    if not isinstance(index, int) or not 0 <= index < len(jobs[task_type]):
        raise ConfigError(f"{where}: task index {index!r} is out of range: the cluster has "
                          f"{len(jobs[task_type])} {task_type} task(s), so it must be from 0 "
                          f"to {len(jobs[task_type]) - 1}")
    addresses = chiefs + workers
    rank = index if task_type in ("chief", "master") else len(chiefs) + index
    hosts = [_split_address(a, where)[0] for a in addresses]
    distinct = list(dict.fromkeys(hosts))
    mine = hosts[rank]
    c = Contract(source, where, rank=rank, size=len(addresses),
                 local_rank=hosts[:rank].count(mine), local_size=hosts.count(mine),
                 cross_rank=distinct.index(mine), cross_size=len(distinct))
    c.store_addr, c.store_port = _split_address(addresses[0], where)
    digest = hashlib.sha256(json.dumps(cluster, sort_keys=True).encode()).hexdigest()
    c.job_id = f"{source}-{digest[:12]}"
    return c


def cluster_from_resolver(resolver):
    """A tf.distribute ClusterResolver (TFConfigClusterResolver,
    SlurmClusterResolver, SimpleClusterResolver, ...) as a TF_CONFIG-shaped
    dict, for load_topology(cluster=...). cluster_spec() is called first:
    SlurmClusterResolver only knows its task_type and task_id afterwards."""
    spec = resolver.cluster_spec()
    jobs = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type is None or task_id is None:
        raise ConfigError(f"cluster_resolver {type(resolver).__name__} has no task "
                          f"(task_type={task_type!r}, task_id={task_id!r}): give it both, "
                          "e.g. SimpleClusterResolver(spec, task_type='worker', task_id=0)")
    cluster = {job: (list(v) if isinstance(v, (list, tuple)) else dict(v))
               for job, v in jobs.items()}
    return {"cluster": cluster, "task": {"type": task_type, "index": int(task_id)}}


# Launchers start the processes; they run inside a scheduler's allocation
# (mpirun in an sbatch script: its ranks inherit the batch step's SLURM_*),
# so any launcher wins over every scheduler without comparison. Within a
# class the first present contract wins, and each other present one must
# agree with it on rank and size.
LAUNCHERS = (
    ("perseusrun", lambda e: "PERSEUS_RANK" in e or "PERSEUS_SIZE" in e, _perseusrun),
    ("mpirun", lambda e: "OMPI_COMM_WORLD_RANK" in e, _mpirun),
    ("horovod", lambda e: "HOROVOD_RANK" in e, _horovod),
    # Real torchrun (its agent sets TORCHELASTIC_RUN_ID) started the process,
    # e.g. one torchrun per node under srun: it wins over the step's SLURM_*.
    ("torchrun", lambda e: "TORCHELASTIC_RUN_ID" in e and "RANK" in e and "WORLD_SIZE" in e,
     _torchrun),
)
SCHEDULERS = (
    ("slurm", _in_slurm_step, _slurm),
    ("torchrun", lambda e: "RANK" in e and "WORLD_SIZE" in e, _torchrun),
    ("tf_config", _has_tf_cluster, _tf_config),
)


def _say(contract):
    return "say" if "/" in contract.names else "says"


def find_contract(environ=None, cluster=None) -> Optional[Contract]:
    """The contract that places this process (None: a single process).

    `cluster` (a TF_CONFIG-shaped dict, from a cluster resolver) wins over
    the environment. Otherwise see the module docstring for the order.
    """
    environ = os.environ if environ is None else environ
    if cluster is not None:
        return cluster_contract(cluster, "cluster_resolver", "the cluster resolver")
    for group in (LAUNCHERS, SCHEDULERS):
        found = [read(environ) for _, present, read in group if present(environ)]
        if not found:
            continue
        first = found[0]
        for other in found[1:]:
            if (other.rank, other.size) != (first.rank, first.size):
                raise ConfigError(
                    f"{first.names} {_say(first)} rank {first.rank} of {first.size}, "
                    f"{other.names} {_say(other)} rank {other.rank} of {other.size}: unset "
                    f"one ({first.source} and {other.source} both describe this process)")
        return first
    return None
