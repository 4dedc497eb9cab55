"""Loads the native runtime and starts or stops it for this process.

Kept free of TensorFlow so that the pybind11 module can be used (and the
runtime tested) where TensorFlow is not installed.
"""

import atexit
import os
import threading

from perseus_tf import config as _config

_HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_store_server = None
_config_in_use = None
_topology = None

try:
    from perseus_tf import _core  # noqa: F401  (loads libperseus_core.so)
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "perseus_tf's native library is not built: run `pip install --no-build-isolation .` "
        f"(or `make native`) in the source tree ({e})") from e

# Numeric codes shared with cc/runtime/common.h.
OP_ALLREDUCE, OP_ALLGATHER, OP_BROADCAST, OP_ALLTOALL, OP_REDUCESCATTER, OP_BARRIER = range(6)
DTYPE_CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3, "int32": 4,
               "int64": 5, "uint8": 6, "int8": 7, "bool": 8}


def init(**overrides):
    """Starts this process's runtime from the environment (idempotent)."""
    global _store_server, _config_in_use, _topology
    with _lock:
        if _core.is_initialized():
            return
        cfg = _config.load_config(overrides)
        topo = _config.load_topology()
        if topo.host_store and _store_server is None:
            from perseus_tf.runner.store import StoreServer
            _store_server = StoreServer("0.0.0.0", topo.store_port, topo.secret)
            _store_server.start()
        _core.init(dict(
            rank=topo.rank, size=topo.size, local_rank=topo.local_rank,
            local_size=topo.local_size, cross_rank=topo.cross_rank,
            cross_size=topo.cross_size, store_addr=topo.store_addr,
            store_port=topo.store_port, secret=topo.secret, job_id=topo.job_id,
            host_addr=topo.host_addr, gloo_iface=cfg.gloo_iface, streams=cfg.streams,
            timeout_seconds=cfg.timeout_seconds,
            fusion_threshold_bytes=cfg.fusion_threshold_bytes,
            cycle_time_ms=cfg.cycle_time_ms,
            stall_timeout_seconds=cfg.stall_timeout_seconds))
        _config_in_use, _topology = cfg, topo


def ensure_initialized():
    """Starts the runtime on first use only: after a failure or an explicit
    shutdown, collectives must report that, not silently reconnect."""
    if _core.state() == "uninitialized":
        init()


def shutdown():
    """Stops the runtime on every rank (collective); later collectives fail."""
    with _lock:
        _core.shutdown()


def is_initialized():
    return _core.is_initialized()


def config():
    """The Config the runtime was started with (None before init)."""
    return _config_in_use


def topology():
    if _core.state() == "uninitialized":
        raise ValueError("Perseus is not initialized: call perseus_tf.init() first")
    return _core.topology()


def stats():
    """Runtime counters: negotiation cycles, control bytes, responses, per-stream bytes."""
    return _core.stats()


atexit.register(_core.shutdown)
