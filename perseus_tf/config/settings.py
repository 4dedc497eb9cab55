"""The PERSEUS_* settings: Config, the variables that fill it, and ConfigError.

Every variable is read here, validated, and handed to the native runtime as
plain values. A bad value is an error naming the variable, the value and
what is valid. Constructor arguments (PerseusStrategy, the Horovod shim)
override the environment through `load_config(overrides)`.
"""

import dataclasses
import os
from typing import Optional


class ConfigError(ValueError):
    """A PERSEUS_* (or launcher) variable has a value outside its valid range.

    Every part of perseus_tf.config raises it: settings, env contracts,
    addresses and the rendezvous store's secret."""


@dataclasses.dataclass
class Config:
    """The runtime's options, one field a PERSEUS_* variable (VARIABLES)."""
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
    # Tensors on GPUs: "nccl" reduces them with NCCL, "host" stages them
    # through pinned host memory for Gloo / shared memory, "auto" is nccl
    # where NCCL loads (resolved at init, the same on every rank).
    gpu_transport: str = "auto"
    # The GPU PerseusStrategy (perseus_tf.gpu.pin) gives a rank: 1 turns on
    # TF's memory growth there, leaving room for NCCL and the runtime's
    # buffers; 0 leaves TF's default (it takes almost all the memory).
    gpu_memory_growth: int = 1
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
    # Keras fit with BackupAndRestore under PerseusStrategy: how often (about)
    # the ranks compare SIGTERM notices (strategy/keras_preempt.py); 0: after
    # every batch.
    preemption_check_seconds: float = 1.0
    # glibc's mmap threshold that PerseusStrategy sets back after TF 2.21's
    # tf.data froze it at 128 KiB (perseus_tf/_malloc.py); 0: leave it.
    # 32 MiB is the most glibc accepts on 64-bit Linux and the highest its
    # own dynamic rule goes.
    malloc_mmap_threshold: int = 32 * 1024 * 1024


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


def _zero_or_range(lo, hi):
    def parse(text):
        value = int(text)
        if value != 0 and not lo <= value <= hi:
            raise ValueError
        return value
    return parse, f"0 or an integer from {lo} to {hi}"


def _float_range(lo, hi, lo_open=False):
    def parse(text):
        value = float(text)
        if not (lo < value if lo_open else lo <= value) or not value <= hi:
            raise ValueError
        return value
    return parse, f"a number in {'(' if lo_open else '['}{lo}, {hi}]"


def _string():
    return str, "an interface name"


def _word(*values):
    def parse(text):
        if text not in values:
            raise ValueError
        return text
    return parse, "one of " + ", ".join(values)


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
    "gpu_transport": ("PERSEUS_GPU_TRANSPORT", *_word("auto", "nccl", "host")),
    "gpu_memory_growth": ("PERSEUS_GPU_MEMORY_GROWTH", *_choice(0, 1)),
    "timeout_seconds": ("GLOO_TIMEOUT_SECONDS", *_float_range(1, 86400)),
    "fusion_threshold_bytes": ("PERSEUS_FUSION_THRESHOLD", *_int_range(0, 2**40)),
    "cycle_time_ms": ("PERSEUS_CYCLE_TIME_MS", *_float_range(0.05, 1000)),
    "stall_check_seconds": ("PERSEUS_STALL_CHECK_TIME_SECONDS", *_float_range(0, 86400)),
    "stall_timeout_seconds": ("PERSEUS_STALL_TIMEOUT_SECONDS", *_float_range(0, 86400)),
    "timeline": ("PERSEUS_TIMELINE", *_string()),
    "preemption_check_seconds": ("PERSEUS_PREEMPTION_CHECK_SECONDS",
                                 *_float_range(0, 3600)),
    "malloc_mmap_threshold": ("PERSEUS_MALLOC_MMAP_THRESHOLD", *_zero_or_range(
        128 * 1024, 32 * 1024 * 1024)),
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


def env_int(environ, name, lo, hi):
    """The integer variable `name` of environ, from lo to hi (ConfigError if not)."""
    text = environ.get(name)
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={text!r} is invalid: it must be an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: it must be from {lo} to {hi}")
    return value



# PERSEUS_* variables read outside Config: the launch contract perseusrun
# (or a user) sets for each rank, the rendezvous store, elastic jobs, the
# native libraries' locations, perseusrun's own and the build's. With
# VARIABLES, every name Perseus-TF reads (tests/test_config.py checks the
# sources against this list).
OTHER_VARIABLES = frozenset({
    "PERSEUS_RANK", "PERSEUS_SIZE", "PERSEUS_LOCAL_RANK", "PERSEUS_LOCAL_SIZE",
    "PERSEUS_CROSS_RANK", "PERSEUS_CROSS_SIZE", "PERSEUS_HOST_ADDR", "PERSEUS_JOB_ID",
    "PERSEUS_MASTER_ADDR", "PERSEUS_MASTER_PORT", "PERSEUS_RENDEZVOUS_ADDR",
    "PERSEUS_RENDEZVOUS_PORT", "PERSEUS_RENDEZVOUS_SECRET", "PERSEUS_RENDEZVOUS_SECRET_FILE",
    "PERSEUS_ELASTIC_WORKER", "PERSEUS_ELASTIC_KEY", "PERSEUS_ELASTIC_TIMEOUT",
    "PERSEUS_LAUNCHER_PID", "PERSEUS_FAILURE_RECORD", "PERSEUS_TF_LOGS",
    "PERSEUS_NCCL_LIBRARY", "PERSEUS_CUDA_LIBRARY", "PERSEUS_CUDA_DRIVER", "PERSEUS_NVRTC_LIBRARY",
    "PERSEUS_KERNEL_CACHE", "PERSEUS_REQUIRE_CUDA_WHEELS",
    "PERSEUS_TF_INCLUDE", "PERSEUS_TF_LIBDIR", "PERSEUS_TF_FRAMEWORK_LIB", "PERSEUS_TF_DEFINES",
    "PERSEUS_PYTHON_INCLUDE", "PERSEUS_PYBIND11_INCLUDE",
})
# The test suite's hooks (tests/, and the runtime's fault injection).
TEST_PREFIXES = ("PERSEUS_TEST_", "PERSEUS_CHECK")


def known_variables():
    return {variable for variable, *_ in VARIABLES.values()} | OTHER_VARIABLES


def unknown_variables(environ=None):
    """[(name, closest known name or None)] of the PERSEUS_* variables in
    environ that Perseus-TF does not read: a misspelled one would otherwise
    be ignored in silence."""
    import difflib
    environ = os.environ if environ is None else environ
    known = known_variables()
    found = []
    for name in sorted(environ):
        if name.startswith("PERSEUS_") and name not in known and \
                not name.startswith(TEST_PREFIXES):
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
            found.append((name, close[0] if close else None))
    return found


def warn_unknown_variables(environ=None, stream=None):
    """Writes one line per PERSEUS_* variable nobody reads, naming the closest
    known one."""
    import sys
    stream = stream or sys.stderr
    for name, close in unknown_variables(environ):
        hint = f"; did you mean {close}?" if close else " (docs/configuration.md lists them)"
        stream.write(f"Perseus-TF: {name} is not a Perseus-TF variable and is ignored{hint}\n")
    stream.flush()
