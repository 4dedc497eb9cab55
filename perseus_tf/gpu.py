"""Which GPU a process trains on: one rank per GPU, as data parallelism on
GPU machines runs.

PerseusStrategy calls `pin()` itself when it is built without `devices=`;
Horovod-style scripts pin with `hvd.local_rank()` as Horovod's documentation
shows (hvd.init() starts no GPU, so that still works), or call `pin()`.

`pin()`:
  - leaves a machine without GPUs alone (returns None);
  - picks the GPU of this process's local rank among those TF sees (after
    CUDA_VISIBLE_DEVICES, and after any tf.config.set_visible_devices the
    script made): GPU local_rank when there are at least as many GPUs as
    ranks on the host, else local_rank modulo their number (ranks share
    GPUs: fine with PERSEUS_GPU_TRANSPORT=host, refused by NCCL);
  - makes it the only GPU TF starts in this process, so no rank takes memory
    on another rank's GPU;
  - turns on memory growth for it, so that TF's allocator takes memory as
    the model needs it and leaves the rest to NCCL and the runtime's own
    buffers (PERSEUS_GPU_MEMORY_GROWTH=0 keeps TF's default of taking almost
    all; a memory limit set by the script, or TF_FORCE_GPU_ALLOW_GROWTH,
    wins over both).

Both must happen before TF starts its GPUs (its first op, or the first
strategy built). When they have started already, `pin()` can no longer
hide the other GPUs: it picks the local rank's among them and warns once.
"""

import os
import warnings

_warned_late = False
_warned_memory = False


class Placement:
    """What pin() chose: `device` is the TF device to place replicas on
    ("/gpu:0", or "/cpu:0" without a GPU), `gpu` the chosen GPU's index among
    the GPUs TF saw before pinning (None without a GPU), `identity` names the
    physical GPU for the one-rank-per-GPU check (its CUDA_VISIBLE_DEVICES
    entry, or its CUDA ordinal), `memory_growth` whether pin() turned it on."""

    def __init__(self, device, gpu=None, identity="", memory_growth=False, shared=False):
        self.device = device
        self.gpu = gpu
        self.identity = identity
        self.memory_growth = memory_growth
        self.shared = shared  # more ranks than GPUs on this host

    def __repr__(self):
        return (f"Placement(device={self.device!r}, gpu={self.gpu}, identity={self.identity!r}, "
                f"memory_growth={self.memory_growth})")


def choose(gpu_count, local_rank, local_size):
    """The index, among `gpu_count` GPUs, of local rank `local_rank`'s GPU
    (None without GPUs)."""
    if gpu_count <= 0:
        return None
    if local_rank < 0 or local_rank >= max(local_size, 1):
        raise ValueError(f"local rank {local_rank} is outside 0..{local_size - 1} "
                         f"(PERSEUS_LOCAL_RANK / PERSEUS_LOCAL_SIZE)")
    return local_rank % gpu_count


def identity(physical_name, env=None):
    """The physical GPU behind TF's "/physical_device:GPU:N": entry N of
    CUDA_VISIBLE_DEVICES when it is set (an index or a UUID), else N."""
    env = os.environ if env is None else env
    index = int(str(physical_name).rsplit(":", 1)[-1])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index < len(entries):
            return entries[index]
    return str(index)


class _TfConfig:
    """The tf.config calls pin() makes (tests hand in a stand-in: CI has no
    GPU)."""

    def __init__(self):
        import tensorflow as tf
        from tensorflow.python.eager import context
        self._tf = tf
        self._context = context

    def started(self):
        return self._context.context()._context_handle is not None

    def physical(self):
        return self._tf.config.list_physical_devices("GPU")

    def visible(self):
        return self._tf.config.get_visible_devices("GPU")

    def set_visible(self, devices):
        self._tf.config.set_visible_devices(devices, "GPU")

    def has_limit(self, device):
        return bool(self._tf.config.get_logical_device_configuration(device))

    def set_memory_growth(self, device):
        self._tf.config.experimental.set_memory_growth(device, True)

    def growth_on(self, device):
        return bool(self._tf.config.experimental.get_memory_growth(device))


def _warn_if_tf_takes_the_gpu(device_index, growth_on, has_limit, env):
    """One warning per process when TensorFlow will reserve nearly all of
    the rank's GPU (memory growth off, no memory limit): NCCL's buffers,
    hundreds of MB per communicator, then fail at the first step."""
    global _warned_memory
    forced = env.get("TF_FORCE_GPU_ALLOW_GROWTH", "").strip().lower() == "true"
    if growth_on or has_limit or forced or _warned_memory:
        return
    _warned_memory = True
    warnings.warn(
        f"Perseus: TensorFlow will reserve nearly all of GPU {device_index}'s memory (memory "
        f"growth is off and no memory limit is set), leaving little for NCCL's buffers "
        f"(hundreds of MB per communicator): expect an out-of-memory error at the first step. "
        f"Set PERSEUS_GPU_MEMORY_GROWTH=1 (the default) or TF_FORCE_GPU_ALLOW_GROWTH=true, or "
        f"give TF a limit with tf.config.set_logical_device_configuration.", stacklevel=3)


def pin(local_rank=None, local_size=None, memory_growth=None, tf_config=None, env=None):
    """Makes this process train on its local rank's GPU; returns a Placement
    (see the module's text). `local_rank`/`local_size` default to the
    running runtime's (perseus_tf.horovod.local_rank()), `memory_growth` to
    PERSEUS_GPU_MEMORY_GROWTH (1)."""
    global _warned_late
    env = os.environ if env is None else env
    cfg = tf_config or _TfConfig()
    if local_rank is None or local_size is None:
        from perseus_tf import _native
        _native.ensure_initialized()
        topo = _native.topology()
        local_rank = topo["local_rank"] if local_rank is None else local_rank
        local_size = topo["local_size"] if local_size is None else local_size
    if not cfg.physical():
        return Placement("/cpu:0")
    pool = cfg.visible()
    if not pool:  # the script hid every GPU: it trains on the CPU
        return Placement("/cpu:0")
    index = choose(len(pool), local_rank, local_size)
    shared = len(pool) < local_size
    chosen = pool[index]
    if cfg.started():
        # TF already runs on every GPU in `pool`: use the rank's among them.
        if len(pool) > 1 and not _warned_late:
            _warned_late = True
            warnings.warn(
                f"Perseus: TensorFlow had already started its {len(pool)} GPUs before the "
                f"strategy was built, so every rank holds memory on each of them; rank with "
                f"local rank {local_rank} trains on /gpu:{index}. Build the strategy (or call "
                f"perseus_tf.gpu.pin()) before any TF op runs to give each rank its GPU alone.",
                stacklevel=2)
        _warn_if_tf_takes_the_gpu(index, cfg.growth_on(chosen), cfg.has_limit(chosen), env)
        return Placement(f"/gpu:{index}", index, identity(chosen.name, env), False, shared)
    if memory_growth is None:
        from perseus_tf import config
        memory_growth = bool(config.load_config(environ=env).gpu_memory_growth)
    growth = memory_growth and "TF_FORCE_GPU_ALLOW_GROWTH" not in env \
        and not cfg.has_limit(chosen)
    cfg.set_visible([chosen])
    if growth:
        cfg.set_memory_growth(chosen)
    _warn_if_tf_takes_the_gpu(index, growth, cfg.has_limit(chosen), env)
    return Placement("/gpu:0", index, identity(chosen.name, env), growth, shared)


def check_one_rank_per_gpu(hosts, identities, gpu_transport):
    """Raises RuntimeError when two ranks of one host use one GPU while NCCL
    moves the gradients (NCCL refuses that, at the first step). `hosts` and
    `identities` are every rank's, in rank order ("" identity: no GPU)."""
    if gpu_transport != "nccl":
        return
    seen = {}
    for rank, (host, gpu) in enumerate(zip(hosts, identities)):
        if not gpu:
            continue
        key = (host, gpu)
        if key in seen:
            raise RuntimeError(
                f"ranks {seen[key]} and {rank} both train on GPU {gpu} of host {host}, and NCCL "
                f"needs a GPU per rank: start at most as many ranks per host as it has GPUs "
                f"(perseusrun -np), give each rank its own GPU (CUDA_VISIBLE_DEVICES, or pin "
                f"with hvd.local_rank()), or set PERSEUS_GPU_TRANSPORT=host on every rank")
        seen[key] = rank


def nvrtc_library():
    """The libnvrtc the CUDA kernels are compiled with: PERSEUS_NVRTC_LIBRARY,
    else the nvidia-cuda-nvrtc-cu12 (or -cu13) wheel's on sys.path (TF's CUDA
    wheels install it), else None (libperseus_cuda.so then asks the system's
    loader: a CUDA toolkit)."""
    import glob
    import sys
    if os.environ.get("PERSEUS_NVRTC_LIBRARY"):
        return os.environ["PERSEUS_NVRTC_LIBRARY"]
    for base in sys.path:
        for name in ("libnvrtc.so.12", "libnvrtc.so.13"):
            found = sorted(glob.glob(os.path.join(base or ".", "nvidia", "**", name),
                                     recursive=True))
            if found:
                return found[0]
    return None


def use_wheel_nvrtc():
    """Names the wheel's NVRTC in PERSEUS_NVRTC_LIBRARY for the runtime
    (perseus_tf.init does this), unless it is set already."""
    found = nvrtc_library()
    if found and not os.environ.get("PERSEUS_NVRTC_LIBRARY"):
        os.environ["PERSEUS_NVRTC_LIBRARY"] = found
    return found


def _driver():
    """(found, text): whether the NVIDIA driver's libcuda.so.1 loads, and
    how many GPUs it sees, without TensorFlow."""
    import ctypes
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False, ("libcuda.so.1 not found: no NVIDIA driver on this machine (building "
                       "needs none; training on GPUs needs driver 525 or later)")
    if cuda.cuInit(0) != 0:
        return True, "libcuda.so.1 loads, but cuInit failed: no usable GPU"
    count = ctypes.c_int(0)
    cuda.cuDeviceGetCount(ctypes.byref(count))
    version = ctypes.c_int(0)
    cuda.cuDriverGetVersion(ctypes.byref(version))
    return True, (f"CUDA {version.value // 1000}.{version.value % 1000 // 10} driver, "
                  f"{count.value} GPU(s)")


def cuda_library():
    """The libperseus_cuda.so this install built (beside the runtime), or
    None."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libperseus_cuda.so")
    return path if os.path.exists(path) else None


def cuda_info():
    """What this install's GPU path finds, with or without a GPU:
    {"library": the libperseus_cuda.so beside the runtime (built at install
    by the host compiler) or None, "nvrtc": its version and the
    architectures it compiles the kernels for, or why it cannot be loaded,
    "nvrtc_ok": bool, "nccl": NCCL's version and path, or why not,
    "nccl_ok": bool, "driver": what the NVIDIA driver says, "driver_ok":
    bool, "would_load": whether the CUDA path loads on a machine with a
    driver (library, NVRTC and NCCL all found)}. `python -m perseus_tf.gpu`
    prints it as a table."""
    import ctypes
    use_wheel_nvrtc()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libperseus_cuda.so")
    info = {"library": cuda_library(), "nvrtc": "", "nvrtc_ok": False,
            "nccl": "", "nccl_ok": False, "driver": "", "driver_ok": False,
            "would_load": False}
    if info["library"] is None:
        info["nvrtc"] = f"{path} is missing: reinstall Perseus-TF (pip install builds it)"
    else:
        lib = ctypes.CDLL(path)
        text = ctypes.create_string_buffer(4096)
        info["nvrtc_ok"] = lib.perseus_cuda_nvrtc_info(text, ctypes.c_size_t(len(text))) == 0
        info["nvrtc"] = text.value.decode()
    from perseus_tf import _native
    nccl = _native.nccl_library()
    info["nccl_ok"] = bool(nccl.get("available"))
    info["nccl"] = (f"{nccl.get('version')} from {nccl.get('path')}" if info["nccl_ok"] else
                    f"{nccl.get('why_not')} (tensorflow[and-cuda] brings nvidia-nccl-cu12)")
    info["driver_ok"], info["driver"] = _driver()
    info["would_load"] = bool(info["library"]) and info["nvrtc_ok"] and info["nccl_ok"]
    return info


def _report():
    """`python -m perseus_tf.gpu`: the GPU path of this install, one line
    each; exit status 0 when it would load on a machine with a driver."""
    info = cuda_info()
    mark = {True: "ok", False: "MISSING"}
    print("Perseus-TF's GPU path")
    print(f"  CUDA library   [{mark[bool(info['library'])]}] "
          f"{info['library'] or 'libperseus_cuda.so is missing: reinstall Perseus-TF'}")
    print(f"  NVRTC          [{mark[info['nvrtc_ok']]}] {info['nvrtc']}")
    print(f"  NCCL           [{mark[info['nccl_ok']]}] {info['nccl']}")
    print(f"  NVIDIA driver  [{'ok' if info['driver_ok'] else 'none'}] {info['driver']}")
    if info["would_load"]:
        where = "here" if info["driver_ok"] else "on a machine with an NVIDIA driver"
        print(f"The CUDA path would load {where}: GPU tensors are reduced on the GPU.")
    else:
        print("The CUDA path would NOT load: install what is marked MISSING "
              "(docs/gpu.md, Installing).")
    return 0 if info["would_load"] else 1


if __name__ == "__main__":
    raise SystemExit(_report())
