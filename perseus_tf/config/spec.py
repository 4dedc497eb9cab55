"""Every PERSEUS_* setting, once.

One row per setting: its name (the same in Config, in constructor
arguments, in the C++ options and in the binding), its variable, its type,
default and valid range, who reads it, whether ranks may differ in it, and
the configuration page's text for it. Everything else is made from this
table:

- perseus_tf/config/settings.py: Config, VARIABLES, the parsers and their
  error messages;
- cc/runtime/settings.h (tools/gen_settings.py): one C++ struct per part of
  the runtime that reads settings, and the list the binding
  (cc/python/core_module.cc) exposes;
- perseus_tf/_native.py: which settings go to the runtime, which must match
  across ranks, which a second init() may not change;
- docs/configuration.md: each setting's table row (tools/gen_settings.py
  --docs writes them; tests/test_config.py fails when a row differs).

Adding a setting: a row here, `python tools/gen_settings.py --docs`, and the
code that uses it. This module imports nothing of perseus_tf, so the build
can read it before the package is importable.
"""

from typing import NamedTuple, Optional, Tuple

# Parts of the runtime that read settings (cc/runtime/settings.h has a
# struct for each), and "python": read by the front ends only.
PARTS = {
    "transport": "TransportSettings",      # connections, streams, shared memory, hierarchy
    "negotiation": "NegotiationSettings",  # cycles, fusion, stalls, the offline plan
    "compression": "CompressionSettings",  # what a bucket is turned into on the wire
    "health": "HealthSettings",            # slow-rank checks
}


class Setting(NamedTuple):
    name: str
    variable: str
    kind: str            # "int", "flag" (0 or 1), "float", "word" (one of valid), "text"
    default: object      # None: chosen at init (default_text says how)
    valid: Tuple         # ("range", lo, hi), ("choice", a, b...), ("zero_or_range", lo, hi),
                         # ("above", lo, hi): lo < x <= hi, ("words", a, b...), ("text", what)
    part: str            # a PARTS key, or "python"
    per_rank: bool       # ranks may differ in it (not compared at init)
    topic: str           # the section of docs/configuration.md that lists it
    default_text: str    # the page's default column
    valid_text: str      # the page's valid-values column
    doc: str             # the page's "what it does" column
    native: bool = True  # (part not "python") copied as is into the C++ field `name`
    ctype: str = ""      # the C++ type, when not the kind's own
    none_as: Optional[int] = None  # the runtime's value for an unset (None) default


def _s(*args, **kwargs):
    return Setting(*args, **kwargs)


LAUNCH = "Launch and rendezvous"
FUSION = "Fusion and negotiation"
COMPRESSION = "Compression and accumulation"
STREAMS = "Streams and transports"
TIMEOUTS = "Timeouts and fault handling"
DIAGNOSTICS = "Diagnostics"
MEMORY = "Host memory"
GPU = "GPU variables"

SETTINGS = (
    _s("gloo_iface", "PERSEUS_GLOO_NETWORK_INTERFACE", "text", "", ("text", "an interface name"),
       "transport", True, LAUNCH, "auto (`PERSEUS_HOST_ADDR`)",
       "an interface name, such as `eth0`",
       "The interface Gloo binds to. `perseusrun --network-interface` sets it on every host."),

    _s("fusion_threshold_bytes", "PERSEUS_FUSION_THRESHOLD", "int", 64 * 1024 * 1024,
       ("range", 0, 2**40), "negotiation", False, FUSION, "67108864 (64 MiB)", "0 to 2^40",
       "The largest bucket, in bytes, that allreduces ready in the same cycle are fused "
       "into. 0 turns fusion off.", ctype="int64_t"),
    _s("cycle_time_ms", "PERSEUS_CYCLE_TIME_MS", "float", 1.0, ("range", 0.05, 1000),
       "negotiation", True, FUSION, "1", "0.05 to 1000",
       "Negotiation cycles start at least this many milliseconds apart (further apart "
       "after a quiet spell: [Communication](communication.md#fusion))."),
    _s("fusion", "PERSEUS_ALLREDUCE_FUSION", "int", None, ("range", 0, 128),
       "negotiation", False, FUSION, "auto", "0 to 128",
       "Buckets of an offline plan: N splits a step's gradient bytes into buckets of about "
       "1/N each; 0 puts one tensor in each bucket.", none_as=-1),
    _s("offline_neg", "PERSEUS_OFFLINE_NEG", "int", None, ("choice", 0, 1),
       "python", False, FUSION, "unset (auto)", "0, 1",
       "Which allreduces may run from an offline plan. Unset: gradient reductions; 1: every "
       "allreduce; 0: none, everything is negotiated online."),

    _s("allreduce_dtype", "PERSEUS_ALLREDUCE_DTYPE", "int", 0, ("choice", 0, 1, 2),
       "python", False, COMPRESSION, "0", "0, 1, 2",
       "0: float16 compression; 1: no compression; 2: mixed, float32 within a host and "
       "float16 between hosts."),
    _s("gradient_scale", "PERSEUS_ALLREDUCE_GRADIENT_SCALE", "float", 10.0, ("above", 0, 1e6),
       "compression", False, COMPRESSION, "10", "a number above 0, up to 10^6",
       "Gradients are multiplied by it before they become float16, and divided by it "
       "after the sum."),
    _s("topk", "PERSEUS_TOPK_ALLREDUCE", "flag", 0, ("choice", 0, 1),
       "python", False, COMPRESSION, "0", "0, 1",
       "1: top-k sparsification with error feedback for large gradient tensors."),
    _s("topk_ratio", "PERSEUS_TOPK_RATIO", "float", 0.01, ("above", 0, 1),
       "compression", False, COMPRESSION, "0.01", "above 0, up to 1",
       "The fraction of a tensor's elements that top-k sends."),
    _s("topk_threshold", "PERSEUS_TOPK_THRESHOLD", "int", 1048576, ("range", 0, 2**40),
       "compression", False, COMPRESSION, "1048576 (1 MiB)", "0 to 2^40",
       "The smallest tensor, in bytes, that top-k applies to. Smaller ones follow "
       "`PERSEUS_ALLREDUCE_DTYPE`.", ctype="int64_t"),
    _s("topk_fp16", "PERSEUS_TOPK_FP16", "flag", 0, ("choice", 0, 1),
       "compression", False, COMPRESSION, "0", "0, 1",
       "1: top-k values travel as float16, times the gradient scale."),
    _s("downsample_n_elements", "PERSEUS_DOWNSAMPLE_N_ELEMENTS", "int", 1, ("range", 1, 1024),
       "compression", False, COMPRESSION, "1 (off)", "1 to 1024",
       "N above 1: each step a tensor sends every N-th element; the rest waits in a "
       "residual for later steps."),
    _s("gradient_momentum", "PERSEUS_GRADIENT_MOMENTUM", "float", 1.0, ("above", 0, 1),
       "compression", False, COMPRESSION, "1", "above 0, up to 1",
       "Downsampling: the residual is multiplied by this every step."),
    _s("accumulate_n_steps", "PERSEUS_ACCUMULATE_N_STEPS", "int", 1, ("range", 1, 1024),
       "python", False, COMPRESSION, "1", "1 to 1024",
       "PerseusStrategy: each rank sums its gradients for N steps, then they are reduced "
       "and applied once."),
    _s("shard_optimizer_state", "PERSEUS_SHARD_OPTIMIZER_STATE", "flag", 0, ("choice", 0, 1),
       "python", False, COMPRESSION, "0", "0, 1",
       "PerseusStrategy: 1 keeps each optimizer slot on one rank only "
       "([Sharded optimizer state](sharding.md)): gradients are reduce-scattered, each rank "
       "updates the weights it owns, and the updated weights are allgathered."),

    _s("streams", "PERSEUS_ALLREDUCE_STREAMS", "int", None, ("range", 1, 12),
       "transport", False, STREAMS, "auto", "1 to 12",
       "The number of communication streams: Gloo contexts, each with its own thread and "
       "TCP connections, that reduce buckets in parallel.", none_as=4),
    _s("shm_allreduce", "PERSEUS_SHM_ALLREDUCE", "flag", 1, ("choice", 0, 1),
       "transport", False, STREAMS, "1", "0, 1",
       "1: the ranks of a host reduce through shared memory (`/dev/shm`); 0: Gloo over TCP."),
    _s("allreduce_mode", "PERSEUS_ALLREDUCE_MODE", "int", None, ("choice", 0, 1),
       "transport", False, STREAMS, "auto", "0, 1",
       "0: one flat ring over all ranks. 1: hierarchical: reduce within each host, "
       "allreduce among hosts, broadcast within each host. Unset: a cost model picks one for "
       "each bucket ([Communication](communication.md#two-levels-or-flat)).", none_as=-1),

    _s("allreduce_doubling_bytes", "PERSEUS_ALLREDUCE_DOUBLING_BYTES", "int", None,
       ("range", 0, 2**30), "transport", False, STREAMS, "auto", "0 to 2^30",
       "Buckets of at most this many bytes that cross hosts over one flat group reduce by "
       "recursive doubling (log2 N exchanges) instead of the ring (2(N-1) steps). 0: always "
       "the ring. Unset: a cost model draws the line at init "
       "([Communication](communication.md#the-cost-model)).", ctype="int64_t",
       none_as=-1),
    _s("link_latency_us", "PERSEUS_LINK_LATENCY_US", "float", None, ("above", 0, 1e7),
       "transport", False, STREAMS, "measured", "above 0, up to 10^7",
       "The cost model's latency of one hop between hosts, in microseconds, instead of the "
       "one measured at init.", none_as=0),
    _s("link_bandwidth_mbytes", "PERSEUS_LINK_BANDWIDTH_MBYTES", "float", None,
       ("above", 0, 1e7), "transport", False, STREAMS, "measured", "above 0, up to 10^7",
       "The cost model's bandwidth of a link between hosts, in MB (10^6 bytes) a second, "
       "instead of the one measured at init.", none_as=0),

    _s("timeout_seconds", "GLOO_TIMEOUT_SECONDS", "float", 60.0, ("range", 1, 86400),
       "transport", True, TIMEOUTS, "60", "1 to 86400",
       "How long a rank waits on its peers, or on a store that stopped answering, before "
       "it reports the rank or store as gone."),
    _s("stall_check_seconds", "PERSEUS_STALL_CHECK_TIME_SECONDS", "float", 60.0,
       ("range", 0, 86400), "negotiation", True, TIMEOUTS, "60", "0 to 86400",
       "Stall inspector: rank 0 prints a collective that some ranks submitted and others "
       "did not once it has waited this long, then again every interval. 0 turns it off."),
    # 1800 s, like PyTorch's default process group timeout: long enough for a
    # rank-0-only save or evaluation, short enough that a job whose ranks
    # diverged never waits forever.
    _s("stall_timeout_seconds", "PERSEUS_STALL_TIMEOUT_SECONDS", "float", 1800.0,
       ("range", 0, 86400), "negotiation", False, TIMEOUTS, "1800", "0 to 86400",
       "Such a collective then fails on every rank, naming who submitted it and who did "
       "not. 0 waits forever."),
    _s("preemption_check_seconds", "PERSEUS_PREEMPTION_CHECK_SECONDS", "float", 1.0,
       ("range", 0, 3600), "python", False, TIMEOUTS, "1", "0 to 3600",
       "PerseusStrategy `fit` with `BackupAndRestore`: about how often the ranks compare "
       "SIGTERM notices. 0: after every batch."),

    _s("timeline", "PERSEUS_TIMELINE", "text", "", ("text", "a file path"),
       "health", True, DIAGNOSTICS, "off", "a file path",
       "Writes a Chrome trace for each rank at shutdown, to view in Perfetto.",
       native=False),  # the runtime gets this rank's file: timeline_path
    _s("perf_check_n_steps", "PERSEUS_PERF_CHECK_N_STEPS", "int", 0, ("range", 0, 10**9),
       "health", False, DIAGNOSTICS, "0 (off)", "0 to 10^9",
       "Every N offline-plan steps, names the ranks whose time outside communication is "
       "over 1.5 times the median."),
    _s("nancheck", "PERSEUS_ALLREDUCE_NANCHECK", "flag", 0, ("choice", 0, 1),
       "compression", False, DIAGNOSTICS, "0", "0, 1",
       "1: a reduction whose input holds NaN or Inf fails on every rank, naming the "
       "tensor and the ranks."),
    _s("offline_neg_check_n_steps", "PERSEUS_OFFLINE_NEG_CHECK_N_STEPS", "int", 0,
       ("range", 0, 10**9), "negotiation", False, DIAGNOSTICS, "0 (off)", "0 to 10^9",
       "Compares the ranks' copies of the offline plan when it starts and every N plan "
       "steps. Different plans fail the job, naming the tensor."),

    # glibc's mmap threshold that PerseusStrategy sets back after TF 2.21's
    # tf.data froze it at 128 KiB (perseus_tf/_malloc.py). 32 MiB is the most
    # glibc accepts on 64-bit Linux and the highest its own dynamic rule goes.
    _s("malloc_mmap_threshold", "PERSEUS_MALLOC_MMAP_THRESHOLD", "int", 32 * 1024 * 1024,
       ("zero_or_range", 128 * 1024, 32 * 1024 * 1024), "python", False, MEMORY,
       "33554432 (32 MiB)", "0, or 131072 to 33554432",
       "PerseusStrategy on TensorFlow 2.21: the glibc mmap threshold it sets back after "
       "tf.data fixed it at 128 KiB; the trim threshold becomes twice it. 0 keeps "
       "TensorFlow's setting."),

    # Resolved at init ("auto": nccl where NCCL loads) and handed to the
    # runtime as InitOptions::nccl.
    _s("gpu_transport", "PERSEUS_GPU_TRANSPORT", "word", "auto", ("words", "auto", "nccl", "host"),
       "python", False, GPU, "auto", "`auto`, `nccl`, `host`",
       "How tensors on GPUs are reduced. `nccl`: with NCCL; `host`: staged through pinned "
       "host memory for Gloo or shared memory; `auto`: `nccl` where NCCL loads, else `host`."),
    _s("gpu_memory_growth", "PERSEUS_GPU_MEMORY_GROWTH", "flag", 1, ("choice", 0, 1),
       "python", False, GPU, "1", "0, 1",
       "1: TensorFlow's memory growth on the rank's GPU, leaving room for NCCL and "
       "Perseus-TF's buffers. 0: TensorFlow's default, which takes almost all the memory."),
    _s("nccl_iface", "PERSEUS_NCCL_NETWORK_INTERFACE", "text", "", ("text", "an interface name"),
       "python", True, GPU, "auto (NCCL's choice)", "an interface name",
       "Set as `NCCL_SOCKET_IFNAME` at `init`, unless that is already set."),
)

BY_NAME = {s.name: s for s in SETTINGS}


def cc_type(setting):
    """The C++ type of a setting's field."""
    return setting.ctype or {"int": "int", "flag": "bool", "float": "double",
                             "text": "std::string", "word": "std::string"}[setting.kind]


def native_settings():
    """The settings copied into the runtime's options, in table order."""
    return [s for s in SETTINGS if s.part != "python" and s.native]


def runtime_settings():
    """The settings the runtime takes at start-up (a second init() may not
    change them): the native ones, and those it gets in another form."""
    return [s for s in SETTINGS if s.part != "python"]


def doc_row(setting):
    """The setting's row of docs/configuration.md."""
    return (f"| `{setting.variable}` (`{setting.name}`) | {setting.default_text} | "
            f"{setting.valid_text} | {setting.doc} |")
