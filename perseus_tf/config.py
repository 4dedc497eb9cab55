"""Configuration: the env contract that places a rank, and the PERSEUS_* variables.

Everything a rank needs to start is read here, validated, and handed to the
native runtime as plain values. A bad value is an error naming the variable,
the value and what is valid. Constructor arguments (PerseusStrategy, the
Horovod shim) override the environment through `load_config(overrides)`.

Where a process is in the job (rank, size, local and cross rank) comes from
the first env contract found, in two classes:

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

The rendezvous store: perseusrun serves it and says where
(PERSEUS_RENDEZVOUS_ADDR/PORT, with a hex PERSEUS_RENDEZVOUS_SECRET). Under
any other contract rank 0 serves it at PERSEUS_MASTER_ADDR, else the
contract's address (Slurm: the step's first node; torchrun: MASTER_ADDR;
TF_CONFIG: the first address), else MASTER_ADDR; port PERSEUS_MASTER_PORT,
else the contract's (Slurm: from the job and step ids; torchrun: MASTER_PORT,
plus 1 under torchrun itself; TF_CONFIG: the first address's), else
MASTER_PORT, else 6666. Its secret is PERSEUS_RENDEZVOUS_SECRET (as UTF-8
text) or the contents of PERSEUS_RENDEZVOUS_SECRET_FILE (mode 600). Without
one the store may only be on loopback (one machine); a store on the network
with no secret is refused.
"""

import dataclasses
import hashlib
import json
import os
import socket
import stat
import time
import zlib
from typing import Optional


class ConfigError(ValueError):
    """A PERSEUS_* (or launcher) variable has a value outside its valid range."""


@dataclasses.dataclass
class Topology:
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


@dataclasses.dataclass
class Config:
    allreduce_dtype: int = 0          # 0 fp16, 1 none, 2 mixed
    gradient_scale: float = 10.0
    allreduce_mode: Optional[int] = None
    shm_allreduce: int = 1            # 1: shared memory when the world is one host
    streams: Optional[int] = None     # None: auto_streams()
    fusion: Optional[int] = None
    offline_neg: Optional[int] = None
    offline_neg_check_n_steps: int = 0  # compare the ranks' plans every N plan steps
    accumulate_n_steps: int = 1
    downsample_n_elements: int = 1
    gradient_momentum: float = 1.0
    topk: int = 0
    topk_ratio: float = 0.01
    topk_threshold: int = 1048576
    topk_fp16: int = 0
    nancheck: int = 0
    perf_check_n_steps: int = 0
    gloo_iface: str = ""
    nccl_iface: str = ""
    timeout_seconds: float = 60.0
    fusion_threshold_bytes: int = 64 * 1024 * 1024
    cycle_time_ms: float = 1.0
    # A collective that some ranks submitted and others did not: rank 0
    # names it after the check time (Horovod's stall inspector), and every
    # rank fails it after the timeout. 1800 s, like PyTorch's default process
    # group timeout: long enough for a rank-0-only save or evaluation, short
    # enough that a job whose ranks diverged never waits forever.
    stall_check_seconds: float = 60.0
    stall_timeout_seconds: float = 1800.0
    timeline: str = ""


# field -> (variable, parser, description of the valid range)
def _int_range(lo, hi):
    def parse(text):
        value = int(text)
        if not lo <= value <= hi:
            raise ValueError
        return value
    return parse, f"an integer from {lo} to {hi}"


def _choice(*values):
    def parse(text):
        value = int(text)
        if value not in values:
            raise ValueError
        return value
    return parse, "one of " + ", ".join(str(v) for v in values)


def _float_range(lo, hi, lo_open=False):
    def parse(text):
        value = float(text)
        if not (lo < value if lo_open else lo <= value) or not value <= hi:
            raise ValueError
        return value
    return parse, f"a number in {'(' if lo_open else '['}{lo}, {hi}]"


def _string():
    return str, "an interface name"


VARIABLES = {
    "allreduce_dtype": ("PERSEUS_ALLREDUCE_DTYPE", *_choice(0, 1, 2)),
    "gradient_scale": ("PERSEUS_ALLREDUCE_GRADIENT_SCALE", *_float_range(0, 1e6, lo_open=True)),
    "allreduce_mode": ("PERSEUS_ALLREDUCE_MODE", *_choice(0, 1)),
    "shm_allreduce": ("PERSEUS_SHM_ALLREDUCE", *_choice(0, 1)),
    "streams": ("PERSEUS_ALLREDUCE_STREAMS", *_int_range(1, 12)),
    "fusion": ("PERSEUS_ALLREDUCE_FUSION", *_int_range(0, 128)),
    "offline_neg": ("PERSEUS_OFFLINE_NEG", *_choice(0, 1)),
    "offline_neg_check_n_steps": ("PERSEUS_OFFLINE_NEG_CHECK_N_STEPS", *_int_range(0, 10**9)),
    "accumulate_n_steps": ("PERSEUS_ACCUMULATE_N_STEPS", *_int_range(1, 1024)),
    "downsample_n_elements": ("PERSEUS_DOWNSAMPLE_N_ELEMENTS", *_int_range(1, 1024)),
    "gradient_momentum": ("PERSEUS_GRADIENT_MOMENTUM", *_float_range(0, 1, lo_open=True)),
    "topk": ("PERSEUS_TOPK_ALLREDUCE", *_choice(0, 1)),
    "topk_ratio": ("PERSEUS_TOPK_RATIO", *_float_range(0, 1, lo_open=True)),
    "topk_threshold": ("PERSEUS_TOPK_THRESHOLD", *_int_range(0, 2**40)),
    "topk_fp16": ("PERSEUS_TOPK_FP16", *_choice(0, 1)),
    "nancheck": ("PERSEUS_ALLREDUCE_NANCHECK", *_choice(0, 1)),
    "perf_check_n_steps": ("PERSEUS_PERF_CHECK_N_STEPS", *_int_range(0, 10**9)),
    "gloo_iface": ("PERSEUS_GLOO_NETWORK_INTERFACE", *_string()),
    "nccl_iface": ("PERSEUS_NCCL_NETWORK_INTERFACE", *_string()),
    "timeout_seconds": ("GLOO_TIMEOUT_SECONDS", *_float_range(1, 86400)),
    "fusion_threshold_bytes": ("PERSEUS_FUSION_THRESHOLD", *_int_range(0, 2**40)),
    "cycle_time_ms": ("PERSEUS_CYCLE_TIME_MS", *_float_range(0.05, 1000)),
    "stall_check_seconds": ("PERSEUS_STALL_CHECK_TIME_SECONDS", *_float_range(0, 86400)),
    "stall_timeout_seconds": ("PERSEUS_STALL_TIMEOUT_SECONDS", *_float_range(0, 86400)),
    "timeline": ("PERSEUS_TIMELINE", *_string()),
}


def _parse(field, text, source):
    variable, parser, valid = VARIABLES[field]
    try:
        return parser(str(text).strip())
    except (TypeError, ValueError):
        raise ConfigError(
            f"{source}={text!r} is invalid: it must be {valid}") from None


def load_config(overrides=None, environ=None) -> Config:
    """Reads every PERSEUS_* variable; `overrides` (field -> value) win."""
    environ = os.environ if environ is None else environ
    config = Config()
    for field, (variable, _, _) in VARIABLES.items():
        text = environ.get(variable)
        if text is not None and text.strip() != "":
            setattr(config, field, _parse(field, text, variable))
    for field, value in (overrides or {}).items():
        if field not in VARIABLES:
            raise ConfigError(
                f"unknown option {field!r}; valid options are: {', '.join(sorted(VARIABLES))}")
        if value is not None:
            setattr(config, field, _parse(field, value, f"option {field}"))
    return config


def auto_streams(local_size, cpus=None):
    """PERSEUS_ALLREDUCE_STREAMS when unset: 4 (the documented default) when
    each local rank has 4 or more CPUs, down to 2 on small machines, where
    more stream threads compete with the ranks for cores."""
    cpus = cpus or os.cpu_count() or 1
    return max(2, min(4, cpus // max(1, local_size)))


# ---- the env contract: where this process is in the job ----------------------

MAX_RANKS = 1 << 20
DEFAULT_MASTER_PORT = 6666
# How long a store address that does not resolve (yet) is retried: a
# Kubernetes service name appears in DNS only once its pod is up.
RESOLVE_WAIT_S = 60.0


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


def _env_int(environ, name, lo, hi):
    text = environ.get(name)
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={text!r} is invalid: it must be an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: it must be from {lo} to {hi}")
    return value


# ---- launchers ------------------------------------------------------------------

def _perseusrun(environ):
    size = _env_int(environ, "PERSEUS_SIZE", 1, MAX_RANKS)
    c = Contract("perseusrun", "PERSEUS_RANK/PERSEUS_SIZE",
                 rank=_env_int(environ, "PERSEUS_RANK", 0, size - 1), size=size)
    c.local_size = _env_int(environ, "PERSEUS_LOCAL_SIZE", 1, size) \
        if "PERSEUS_LOCAL_SIZE" in environ else size
    c.local_rank = _env_int(environ, "PERSEUS_LOCAL_RANK", 0, c.local_size - 1) \
        if "PERSEUS_LOCAL_RANK" in environ else c.rank
    c.cross_size = _env_int(environ, "PERSEUS_CROSS_SIZE", 1, size) \
        if "PERSEUS_CROSS_SIZE" in environ else 1
    c.cross_rank = _env_int(environ, "PERSEUS_CROSS_RANK", 0, c.cross_size - 1) \
        if "PERSEUS_CROSS_RANK" in environ else 0
    return c


def _mpirun(environ):
    size = _env_int(environ, "OMPI_COMM_WORLD_SIZE", 1, MAX_RANKS)
    c = Contract("mpirun", "OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE",
                 rank=_env_int(environ, "OMPI_COMM_WORLD_RANK", 0, size - 1), size=size)
    c.local_size = _env_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, size)
    c.local_rank = _env_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0, c.local_size - 1)
    c.cross_size = max(1, size // c.local_size)
    c.cross_rank = c.rank // c.local_size
    c.job_id = environ.get("OMPI_MCA_ess_base_jobid") or None
    return c


def _horovod(environ):
    size = _env_int(environ, "HOROVOD_SIZE", 1, MAX_RANKS)
    c = Contract("horovod", "HOROVOD_RANK/HOROVOD_SIZE",
                 rank=_env_int(environ, "HOROVOD_RANK", 0, size - 1), size=size)
    c.local_size = _env_int(environ, "HOROVOD_LOCAL_SIZE", 1, size)
    c.local_rank = _env_int(environ, "HOROVOD_LOCAL_RANK", 0, c.local_size - 1)
    c.cross_size = _env_int(environ, "HOROVOD_CROSS_SIZE", 1, size) \
        if "HOROVOD_CROSS_SIZE" in environ else max(1, size // c.local_size)
    c.cross_rank = _env_int(environ, "HOROVOD_CROSS_RANK", 0, c.cross_size - 1) \
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
    from perseus_tf.runner import slurm

    size_var = _first_set(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if size_var is None or "SLURM_PROCID" not in environ:
        missing = "SLURM_PROCID" if size_var else "SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)"
        raise ConfigError(f"this process is in a Slurm job step (SLURM_STEP_ID or "
                          f"SLURM_STEP_NUM_TASKS is set) but {missing} is not set: start it "
                          "with srun, or unset SLURM_STEP_ID and SLURM_STEP_NUM_TASKS")
    size = _env_int(environ, size_var, 1, MAX_RANKS)
    c = Contract("slurm", f"SLURM_PROCID/{size_var}",
                 rank=_env_int(environ, "SLURM_PROCID", 0, size - 1), size=size)
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
    c.cross_rank = _env_int(environ, "SLURM_NODEID", 0, len(nodes) - 1)
    c.local_size = tasks[c.cross_rank]
    c.local_rank = _env_int(environ, "SLURM_LOCALID", 0, c.local_size - 1)
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
    size = _env_int(environ, "WORLD_SIZE", 1, MAX_RANKS)
    c = Contract("torchrun", "RANK/WORLD_SIZE",
                 rank=_env_int(environ, "RANK", 0, size - 1), size=size)
    if "LOCAL_WORLD_SIZE" in environ:
        c.local_size = _env_int(environ, "LOCAL_WORLD_SIZE", 1, size)
        c.local_rank = _env_int(environ, "LOCAL_RANK", 0, c.local_size - 1)
    elif "LOCAL_RANK" in environ:
        raise ConfigError(f"LOCAL_RANK={environ['LOCAL_RANK']!r} is set but LOCAL_WORLD_SIZE "
                          "is not: set LOCAL_WORLD_SIZE to the number of ranks on this machine")
    if "GROUP_WORLD_SIZE" in environ:
        c.cross_size = _env_int(environ, "GROUP_WORLD_SIZE", 1, size)
        c.cross_rank = _env_int(environ, "GROUP_RANK", 0, c.cross_size - 1)
    else:
        c.cross_size = -(-size // c.local_size)
        c.cross_rank = c.rank // c.local_size
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    # torchrun's static rendezvous calls every run "none": not an id.
    c.job_id = f"torchelastic-{run_id}" if run_id and run_id != "none" else None
    if environ.get("MASTER_ADDR"):
        c.store_addr = environ["MASTER_ADDR"]
        if "MASTER_PORT" in environ:
            port = _env_int(environ, "MASTER_PORT", 1, 65535)
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


# ---- addresses ------------------------------------------------------------------

def _resolve(addr, what):
    """addr's IPv4 address, retried for RESOLVE_WAIT_S while it does not resolve."""
    deadline = time.monotonic() + RESOLVE_WAIT_S
    while True:
        try:
            return socket.gethostbyname(addr)
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(f"{what} {addr!r} does not resolve to an IPv4 address on "
                                  f"this host ({e}); it must be an address or a host name "
                                  "that every rank can resolve") from None
            time.sleep(1.0)


def _is_loopback_ip(ip):
    return ip.startswith("127.")


def route_address(addr, port=9):
    """This machine's IPv4 address that routes to addr: the source address of
    a UDP socket connected there (which sends nothing). Unlike
    gethostbyname(gethostname()) it tells apart network namespaces, which
    share one host name, and hosts whose name maps to 127.0.1.1."""
    ip = _resolve(addr, "the rendezvous address")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((ip, port or 9))
        except OSError as e:
            raise ConfigError(f"no route from this host to the rendezvous address {addr!r} "
                              f"({ip}): {e.strerror}; set PERSEUS_HOST_ADDR to this host's "
                              "address on the job's network") from None
        return sock.getsockname()[0]


def interface_address(name):
    """The IPv4 address of network interface `name` (e.g. "eth0")."""
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            names = sorted(n for _, n in socket.if_nameindex())
            raise ConfigError(f"PERSEUS_GLOO_NETWORK_INTERFACE={name!r} is not an interface "
                              f"with an IPv4 address on this host: it must be one of "
                              f"{', '.join(names)}") from None
    return socket.inet_ntoa(packed[20:24])


def can_bind(ip):
    """True if ip is assigned to this machine (only those can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, 0))
        except OSError:
            return False
    return True


def _store_is_loopback(addr, cross_size):
    """True when the store is on loopback: one machine, the store private to it.

    A loopback address (127.x.y.z, "localhost") is. A host name is only when
    the job is on one host: a name can resolve to 127.0.1.1 on its own host
    (Debian's /etc/hosts) while the other hosts reach it over the network.
    """
    ip = _resolve(addr, "the rendezvous address")
    if not _is_loopback_ip(ip):
        return False
    return addr in (ip, "localhost") or cross_size == 1


def store_bind_address(topology, gloo_iface=""):
    """Where rank 0 serves the rendezvous store under a foreign launcher: the
    store address itself when it is loopback (one machine) or assigned to
    this machine; else the address of PERSEUS_GLOO_NETWORK_INTERFACE if set;
    else every interface (0.0.0.0), e.g. behind a Kubernetes service whose
    address belongs to no pod. Clients must hold the secret either way."""
    ip = _resolve(topology.store_addr, "the rendezvous address")
    if _store_is_loopback(topology.store_addr, topology.cross_size):
        return ip
    if not _is_loopback_ip(ip) and can_bind(ip):
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
        t.store_port = _env_int(environ, "PERSEUS_RENDEZVOUS_PORT", 1, 65535)
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
        t.secret = _foreign_secret(environ)
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
    if not _is_loopback_ip(addr):
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
        t.store_port = _env_int(environ, "PERSEUS_MASTER_PORT", 1, 65535)
    elif contract.store_port is not None:
        t.store_port = contract.store_port
    elif contract.store_addr is None and "MASTER_PORT" in environ:
        t.store_port = _env_int(environ, "MASTER_PORT", 1, 65535)
    else:
        t.store_port = DEFAULT_MASTER_PORT


def _derived_job_id(t):
    """A job id from the store address and port: two jobs running at once on
    one host cannot share a store port, so it is unique among them. Hashed
    with the secret, when there is one, so it does not tell the port's
    previous job from this one."""
    h = hashlib.sha256(f"{t.store_addr}:{t.store_port}\0".encode() + t.secret)
    return "store-" + h.hexdigest()[:16]
