"""Loads the native runtime and starts or stops it for this process.

Kept free of TensorFlow so that the pybind11 module can be used (and the
runtime tested) where TensorFlow is not installed.
"""

import atexit
import functools
import os
import socket
import sys
import threading

from perseus_tf import config as _config
from perseus_tf.config import spec as _spec

_HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_store_server = None
_config_in_use = None
_topology = None

try:
    from perseus_tf import _core  # noqa: F401  (loads libperseus_core.so)
except ImportError as e:  # pragma: no cover - only without a build
    _elsewhere = [p for p in sys.path if p and os.path.abspath(p) != os.path.dirname(_HERE) and
                  os.path.exists(os.path.join(p, "perseus_tf", "libperseus_core.so"))]
    if _elsewhere:
        # Run from the source folder after `pip install .`: Python imports the
        # package in the current folder (unbuilt), not the installed one.
        raise ImportError(
            f"perseus_tf was imported from the source folder {os.path.dirname(_HERE)} (the "
            f"current folder comes first on Python's path), which has no built library; the "
            f"installed one is in {_elsewhere[0]}: run from another folder (cd ~), or build "
            f"in place with `pip install --no-build-isolation -e .`") from e
    raise ImportError(
        "perseus_tf's native library is not built: run `pip install .` (or `make native`) in "
        f"the source tree ({e})") from e

# Numeric codes, as the native module defines them (cc/core/common.h,
# cc/runtime/message.h): the op attributes and submit take plain ints.
(OP_ALLREDUCE, OP_ALLGATHER, OP_BROADCAST, OP_ALLTOALL, OP_REDUCESCATTER, OP_BARRIER,
 OP_JOIN) = (int(_core.OpType.__members__[name]) for name in (
     "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join"))
DTYPE_CODES = {name: int(code) for name, code in _core.DataType.__members__.items()}
REDUCE_CODES = {name: int(code) for name, code in _core.ReduceOp.__members__.items()}


def init(cluster=None, **overrides):
    """Starts this process's runtime from the environment (idempotent).

    Args:
      cluster: a TF_CONFIG-shaped dict (config.cluster_from_resolver) that
        places this process instead of the environment. If the runtime is
        already running as another rank or size, this raises RuntimeError.
      **overrides: options by Config field name; they win over PERSEUS_*.

    Under a foreign launcher (no perseusrun) rank 0 serves the rendezvous
    store: on the store address itself when it is loopback (one machine) or
    assigned to this machine, else on PERSEUS_GLOO_NETWORK_INTERFACE's
    address if set, else on every interface (0.0.0.0: a Kubernetes service
    address, say, belongs to no pod); clients must hold the job's secret.
    """
    global _store_server, _config_in_use, _topology
    with _lock:
        if _core.is_initialized():
            if cluster is not None:
                _check_same_world(cluster)
            _check_same_options(overrides)
            return
        cfg = _config.load_config(overrides)
        topo = _config.load_topology(cluster=cluster)
        global _warned_unknown
        if topo.rank == 0 and not _warned_unknown:  # once per job, not per rank or round
            _warned_unknown = True
            _config.warn_unknown_variables()
        _check_timeline(cfg.timeline, timeline_path(cfg.timeline, topo.rank))
        cfg.gpu_transport = _resolve_gpu_transport(cfg.gpu_transport)
        if cfg.nccl_iface:
            os.environ.setdefault("NCCL_SOCKET_IFNAME", cfg.nccl_iface)
        # The NVRTC that compiles the CUDA kernels at the first GPU request.
        from perseus_tf import gpu
        gpu.use_wheel_nvrtc()
        if cfg.streams is None:
            cfg.streams = _config.auto_streams(topo.local_size)
        if topo.host_store and _store_server is None:
            from perseus_tf.common.store import StoreServer
            bind = _config.store_bind_address(topo, cfg.gloo_iface)
            server = StoreServer(host=bind, port=topo.store_port, secret=topo.secret,
                                 served_by=f"rank {topo.rank} on {socket.gethostname()}")
            try:
                server.start()
            except OSError as e:
                raise RuntimeError(
                    f"Perseus rank {topo.rank}: cannot serve the rendezvous store on port "
                    f"{topo.store_port} of {bind} ({e.strerror}): is another process of this "
                    f"job also rank 0 (PERSEUS_RANK / RANK set twice?), or another job using "
                    f"the port? Set PERSEUS_MASTER_PORT to a free port (the same on every "
                    f"rank).") from e
            _store_server = server
        options = _core.InitOptions()
        for name, value in dict(
            settings=shared_settings(cfg, topo),
            rank=topo.rank, size=topo.size, local_rank=topo.local_rank,
            local_size=topo.local_size, cross_rank=topo.cross_rank,
            cross_size=topo.cross_size, store_addr=topo.store_addr,
            store_port=topo.store_port, secret=topo.secret, job_id=topo.job_id,
            host_addr=topo.host_addr,
            timeline_path=timeline_path(cfg.timeline, topo.rank),
            nccl=cfg.gpu_transport == "nccl", nccl_dirs=_nccl_wheel_dirs(),
            topk_fallback=_DTYPE_COMPRESSION[cfg.allreduce_dtype]).items():
            setattr(options, name, value)
        for setting in _spec.native_settings():  # each under its own name
            value = getattr(cfg, setting.name)
            if value is None:
                value = setting.none_as
            setattr(options, setting.name, bool(value) if setting.kind == "flag" else value)
        _core.init(options)
        _config_in_use, _topology = cfg, topo
        _watch_launcher()


# Options the native runtime takes at start-up (the others, such as
# accumulate_n_steps or allreduce_dtype, are read by each strategy or shim).
_RUNTIME_OPTIONS = frozenset(s.name for s in _spec.runtime_settings())


def _check_same_options(overrides):
    """Runtime options given to init() once the runtime runs must be the ones
    it runs with: a different value would be silently ignored."""
    if not overrides or _config_in_use is None:
        return
    wanted = _config.load_config(overrides)  # validates names and ranges too
    differ = [f"{name}={value!r} (it runs with {getattr(_config_in_use, name)!r})"
              for name, value in overrides.items()
              if name in _RUNTIME_OPTIONS and value is not None
              and getattr(wanted, name) != getattr(_config_in_use, name)]
    if differ:
        raise ValueError("Perseus is already initialized with other options: " +
                         ", ".join(differ) + "; call shutdown() first to change them")


def _check_same_world(cluster):
    """A cluster given after the runtime started must place this process
    where it already is."""
    wanted = _config.find_contract(cluster=cluster)
    running = _core.topology()
    if (wanted.rank, wanted.size) != (running["rank"], running["size"]):
        source = _topology.source if _topology is not None else "the environment"
        raise RuntimeError(
            f"Perseus already runs as rank {running['rank']} of {running['size']} (from "
            f"{source}), but the cluster resolver makes this process rank {wanted.rank} of "
            f"{wanted.size}: pass the resolver to the first PerseusStrategy (or "
            f"perseus_tf.init) of the process, or make it agree with the environment")


_LAUNCHER_GONE_GRACE_S = 5.0


_launcher_watched = []


def _watch_launcher():
    """Under perseusrun, a rank whose launcher is gone stops: perseusrun sets
    the kernel's parent-death signal (SIGTERM); if the script handles or
    ignores that, this thread kills the rank's process group (the rank and
    whatever it started) a few seconds later."""
    text = os.environ.get("PERSEUS_LAUNCHER_PID", "")
    if not text.isdigit() or os.getppid() != int(text):
        return  # not started by a live perseusrun (or not its direct child)
    if _launcher_watched:
        return  # one thread for the process, whatever the number of init()s
    _launcher_watched.append(True)
    launcher = int(text)

    def watch():
        import signal
        import sys
        import time
        while os.getppid() == launcher:
            time.sleep(1.0)
        time.sleep(_LAUNCHER_GONE_GRACE_S)
        try:  # best effort: the launcher held the other end of stderr
            print(f"perseus: rank {_topology.rank}: perseusrun (pid {launcher}) is gone; "
                  "stopping this rank", file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        try:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="perseus-launcher-watch", daemon=True).start()


# Settings each rank may choose for itself: its network interfaces, its
# timeline file, and how it waits (cycle time, GLOO_TIMEOUT_SECONDS).
_PER_RANK_SETTINGS = frozenset(s.name for s in _spec.SETTINGS if s.per_rank)


def shared_settings(cfg, topo):
    """The settings every rank must share, as "NAME=value" lines: the world's
    shape and every PERSEUS_* setting that changes what goes on the wire or
    when. The runtime compares them across ranks at init."""
    lines = [f"PERSEUS_SIZE={topo.size}", f"PERSEUS_CROSS_SIZE={topo.cross_size}"]
    for field, (variable, *_rest) in sorted(_config.VARIABLES.items()):
        if field not in _PER_RANK_SETTINGS:
            value = getattr(cfg, field)
            lines.append(f"{variable}={'unset' if value is None else value}")
    lines += [f"{name} version={version}" for name, version in software_versions()]
    return "\n".join(lines)


def software_versions():
    """(name, version) of what every rank must run alike: ranks with different
    TensorFlow or Keras versions name their gradients and variables
    differently (a job then stalls at its first fused step), and a different
    Perseus-TF may speak another protocol. Python is compared by its minor
    version (a patch release changes nothing that crosses ranks). Read from
    the installed packages' metadata: nothing is imported."""
    import importlib.metadata
    import platform

    def installed(*names):
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "not installed"

    tf_module = sys.modules.get("tensorflow")
    tensorflow = getattr(tf_module, "__version__", None) or installed(
        "tensorflow", "tensorflow-cpu", "tf-nightly")
    return [("Perseus-TF", installed("perseus-tf")), ("TensorFlow", tensorflow),
            ("Keras", installed("keras", "tf-keras")),
            ("Python", ".".join(platform.python_version_tuple()[:2]))]


_warned_unknown = False


def _check_timeline(template, path):
    """PERSEUS_TIMELINE is written at exit: a path this rank cannot write
    would lose the whole trace then, so it is tried now."""
    if not path:
        return
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise _config.ConfigError(
            f"PERSEUS_TIMELINE={template!r}: this rank cannot write its timeline "
            f"{path!r} ({e.strerror}); give a path in a writable directory that exists on "
            f"every host") from None


def timeline_path(template, rank):
    """This rank's PERSEUS_TIMELINE file: "{rank}" in the name is replaced,
    otherwise ".rank<R>" goes before the extension (trace.json ->
    trace.rank0.json). Empty: no timeline."""
    if not template:
        return ""
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    root, ext = os.path.splitext(template)
    return f"{root}.rank{rank}{ext or '.json'}"


# How gradient reductions travel.
COMPRESS_NONE, COMPRESS_FP16, COMPRESS_MIXED, COMPRESS_TOPK, COMPRESS_DOWNSAMPLE = (
    _core.COMPRESSION[name] for name in ("none", "fp16", "mixed", "topk", "downsample"))
# PERSEUS_ALLREDUCE_DTYPE -> code: 0 float16, 1 none, 2 mixed (float32 inside
# a host, float16 between hosts).
_DTYPE_COMPRESSION = {0: COMPRESS_FP16, 1: COMPRESS_NONE, 2: COMPRESS_MIXED}


def gradient_compression():
    """The compression code for gradient reductions of float32 tensors:
    downsampling when PERSEUS_DOWNSAMPLE_N_ELEMENTS > 1, else top-k when
    PERSEUS_TOPK_ALLREDUCE=1 (the runtime sends tensors under
    PERSEUS_TOPK_THRESHOLD bytes by PERSEUS_ALLREDUCE_DTYPE instead), else
    PERSEUS_ALLREDUCE_DTYPE's."""
    cfg = _config_in_use
    if cfg is None:
        return COMPRESS_NONE
    if cfg.downsample_n_elements > 1:
        return COMPRESS_DOWNSAMPLE
    if cfg.topk:
        return COMPRESS_TOPK
    return _DTYPE_COMPRESSION[cfg.allreduce_dtype]


def ensure_initialized():
    """Starts the runtime on first use only: after a failure or an explicit
    shutdown, collectives must report that, not silently reconnect. Nor in
    a process forked after init(): it would join its parent's job as its
    parent's rank; it must call init() itself."""
    if _core.state() == "uninitialized":
        forked = _core.forked_after_init()
        if forked:
            raise RuntimeError(forked)
        init()


def shutdown():
    """Stops the runtime on every rank (collective); later collectives fail."""
    with _lock:
        _shutdown_all()


def abort(reason=""):
    """Stops this rank's runtime at once (not collective). Takes no lock: the
    thread that holds it may be the one waiting in a collective."""
    _core.abort(str(reason))
    _forget_process_sets()


def _shutdown_all():
    # Process sets first: each is a collective among its members, who are
    # all on their way out too.
    for set_id in _core.process_set_ids():
        _core.remove_process_set(set_id)
    _forget_process_sets()
    _core.shutdown()


def _forget_process_sets():
    # Ids are the round's: every rank of the next round counts from 1 again,
    # whichever rounds it sat out.
    _process_sets.clear()
    _next_set_id[0] = 1


# ---- process sets (sub-groups with their own negotiation and contexts) ------

_process_sets = {}  # id -> tuple of world ranks, on every rank
_next_set_id = [1]


def _process_set_members(ranks, size):
    """The sorted members, or (None, why) when `ranks` is not a list of
    distinct integer ranks from 0 to size - 1."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        return None, f"a process set needs a list of integer ranks, got {ranks!r}"
    ranks = list(ranks)
    import numpy as np
    if any(isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, np.integer))
           for r in ranks):
        return None, f"process set ranks must be integers, got {ranks!r}"
    if len(set(ranks)) != len(ranks):
        return None, f"process set ranks must be distinct, got {ranks!r}"
    bad = [r for r in ranks if not 0 <= r < size]
    if not ranks or bad:
        return None, (f"process set ranks must be a non-empty list of ranks from 0 to "
                      f"{size - 1}; got {ranks!r}")
    return sorted(int(r) for r in ranks), None


def add_process_set(ranks):
    """Registers a process set made of world `ranks`; returns its id.

    Collective: every rank of the world calls it, in the same order, with the
    same ranks (checked: a disagreement, or a bad list on any rank, raises
    ValueError on every rank, at once, and no id is used up on any).
    Members connect the set's own Gloo contexts; collectives then take the
    id (`process_set_id=`), and ranks in them are positions in the set.
    """
    import numpy as np

    ensure_initialized()
    world = _core.topology()
    me, size = world["rank"], world["size"]
    members, why = _process_set_members(ranks, size)
    set_id = _next_set_id[0]
    # Every rank must describe the same set: gather all descriptions (an
    # invalid one as [-1]), so that a bad list on one rank fails them all now.
    mine = np.array([len(members)] + members if members else [-1], dtype=np.int64)
    lens, _ = _core.submit(OP_ALLGATHER, np.array([mine.size], np.int64),
                           f"perseus.process_set.{set_id}.len", DTYPE_CODES["int64"]).wait()
    everyone, _ = _core.submit(OP_ALLGATHER, mine, f"perseus.process_set.{set_id}.ranks",
                               DTYPE_CODES["int64"]).wait()
    if why:
        raise ValueError(why)
    seen, offset = [], 0
    for n in lens:
        row = everyone[offset:offset + int(n)].tolist()
        seen.append(None if row == [-1] else row[1:])
        offset += int(n)
    refused = [r for r, s in enumerate(seen) if s is None]
    if refused:
        raise ValueError(f"add_process_set: rank(s) {', '.join(map(str, refused))} passed an "
                         f"invalid list of ranks (their error names it); no process set "
                         f"was added")
    if any(s != members for s in seen):
        described = "; ".join(f"rank {r} gave {s}" for r, s in enumerate(seen))
        raise ValueError(f"add_process_set: ranks disagree on the members of process set "
                         f"{set_id}: {described}; every rank must pass the same ranks")
    _next_set_id[0] += 1
    if me in members:
        _core.add_process_set(set_id, members)
    _process_sets[set_id] = tuple(members)
    return set_id


def remove_process_set(set_id):
    """Removes a process set (collective over the world, like add)."""
    set_id = int(set_id)
    if set_id not in _process_sets:
        raise ValueError(f"process set {set_id} does not exist (known: "
                         f"{sorted(_process_sets) or 'none'})")
    members = _process_sets.pop(set_id)
    if _core.topology()["rank"] in members:
        _core.remove_process_set(set_id)


def process_set_ranks(set_id):
    """World ranks of a process set (0: the whole world)."""
    set_id = int(set_id)
    if set_id == 0:
        return tuple(range(_core.topology()["size"]))
    if set_id not in _process_sets:
        raise ValueError(f"process set {set_id} does not exist")
    return _process_sets[set_id]


def process_set_topology(set_id):
    """{rank, size, ranks} of this process in a set, or None if not a member."""
    return _core.process_set_topology(int(set_id))


def is_initialized():
    return _core.is_initialized()


def config():
    """The Config the runtime was started with (None before init)."""
    return _config_in_use


def topology():
    if _core.state() == "uninitialized":
        raise ValueError("Perseus is not initialized: call perseus_tf.init() first")
    return _core.topology()


def host_addr():
    """The address this rank's host is reached at (PERSEUS_HOST_ADDR)."""
    return _topology.host_addr if _topology is not None else "127.0.0.1"


def stats(process_set_id=0):
    """Runtime counters: negotiation cycles, control bytes, responses, per-stream bytes."""
    return _core.stats(int(process_set_id))


atexit.register(_shutdown_all)


def _after_fork_in_child():
    """In a child forked after init() the native runtime is a new one, not
    initialized (cc/runtime/process_sets.cc); what this module kept of the
    parent's goes too (the store server's thread did not come along)."""
    global _lock, _store_server, _config_in_use, _topology
    if not _core.forked_after_init():
        return
    _lock = threading.Lock()
    _store_server = _config_in_use = _topology = None
    _process_sets.clear()
    _launcher_watched.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


@functools.lru_cache(maxsize=None)
def _nccl_wheel_dirs():
    """The lib/ folders of the nvidia-nccl-cu12/-cu13 wheels on sys.path,
    those that the driver can run first: the CUDA major of the wheel that
    installed each (cuNN) no newer than the driver's, and among those
    TensorFlow's own (when TF is loaded), then the newest."""
    import glob
    import sys
    found = []
    for base in sys.path:
        for lib in sorted(glob.glob(os.path.join(base or ".", "nvidia", "**", "libnccl.so.2"),
                                    recursive=True)):
            folder = os.path.dirname(lib)
            if folder not in found:
                found.append(folder)
    driver = driver_cuda_major()
    tf_major = _tensorflow_cuda_major()

    def rank(folder):
        major = nccl_cuda_major(os.path.join(folder, "libnccl.so.2"))
        runs = major is None or driver is None or major <= driver
        return (not runs, major != tf_major, -(major or 0))
    return tuple(sorted(found, key=rank))


def driver_cuda_major():
    """The CUDA major version the NVIDIA driver supports (cuDriverGetVersion),
    or None without a driver."""
    import ctypes
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
            return None
    except (OSError, AttributeError):
        return None
    return version.value // 1000


def _tensorflow_cuda_major():
    """The CUDA major TensorFlow was built with, if TF is already imported
    (importing it here would cost every _core-only process seconds)."""
    import sys
    tf = sys.modules.get("tensorflow")
    try:
        version = str(tf.sysconfig.get_build_info().get("cuda_version", "")) if tf else ""
        return int(version.split(".")[0]) if version else None
    except (AttributeError, ValueError):
        return None


@functools.lru_cache(maxsize=None)
def nccl_cuda_major(path):
    """The CUDA major of the nvidia-nccl-cuNN wheel that installed `path`
    (its libnccl.so.2), or None when no such wheel did (a system NCCL, or
    PERSEUS_NCCL_LIBRARY's)."""
    import importlib.metadata
    import re
    target = os.path.realpath(path)
    for dist in importlib.metadata.distributions():
        match = re.fullmatch(r"nvidia[-_]nccl[-_]cu(\d+)", (dist.metadata["Name"] or "").lower())
        if not match:
            continue
        for f in dist.files or ():
            if f.name == "libnccl.so.2" and os.path.realpath(dist.locate_file(f)) == target:
                return int(match.group(1))
    return None


def nccl_driver_mismatch(path, nccl_major, driver_major):
    """Why NCCL at `path`, built for CUDA `nccl_major`, cannot run on a
    driver of CUDA `driver_major` (None: it can, or either is unknown)."""
    if nccl_major is None or driver_major is None or nccl_major <= driver_major:
        return None
    return (f"the NCCL at {path} is built for CUDA {nccl_major} (nvidia-nccl-cu{nccl_major}), "
            f"but this machine's NVIDIA driver supports CUDA {driver_major} at most: install "
            f"nvidia-nccl-cu{driver_major} (tensorflow[and-cuda] brings nvidia-nccl-cu12), set "
            f"PERSEUS_NCCL_LIBRARY to a libnccl.so.2 built for CUDA {driver_major}, or set "
            f"PERSEUS_GPU_TRANSPORT=host on every rank")


def _resolve_gpu_transport(wanted):
    """PERSEUS_GPU_TRANSPORT as the runtime uses it: "nccl" or "host" ("auto":
    nccl where NCCL loads). The resolved value is among the settings every
    rank must share, so ranks that resolve differently fail at init."""
    if wanted == "host":
        return "host"
    info = nccl_library()
    if info["available"]:
        why = nccl_driver_mismatch(info["path"], nccl_cuda_major(info["path"]),
                                   driver_cuda_major())
        if why:
            raise RuntimeError(f"PERSEUS_GPU_TRANSPORT={wanted}: {why}")
        return "nccl"
    if wanted == "nccl":
        raise RuntimeError(f"PERSEUS_GPU_TRANSPORT=nccl, but NCCL cannot be loaded: "
                           f"{info['why_not']}; install nvidia-nccl-cu12 or nvidia-nccl-cu13, "
                           f"or set PERSEUS_GPU_TRANSPORT=host (or auto) on every rank")
    return "host"


def nccl_library():
    """{"available", "path", "version", "why_not"}: NCCL as the runtime would
    load it (PERSEUS_NCCL_LIBRARY, else the nvidia-nccl wheels, else the
    system's loader path). Loaded once per process."""
    return dict(_core.nccl_library(_nccl_wheel_dirs()))
