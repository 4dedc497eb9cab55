"""Which GPU a rank trains on (perseus_tf.gpu), on TF's terms: CI has no
GPU, so pin() is given a stand-in for the tf.config calls it makes, with the
GPUs a machine would show. The same calls on real TF run on this machine in
test_gpu_calls_on_real_tensorflow (no GPU: the CPU placement) and, with the
allgather that carries each rank's GPU, in checks_strategy.
"""

import subprocess
import sys
import textwrap
import warnings

import pytest

from perseus_tf import gpu
from perseus_tf.config import ConfigError, load_config


class Device:
    def __init__(self, index):
        self.name = f"/physical_device:GPU:{index}"

    def __repr__(self):
        return self.name


class FakeConfig:
    """tf.config as pin() uses it, for a machine with `count` GPUs."""

    def __init__(self, count, started=False, visible=None, limits=()):
        self.gpus = [Device(i) for i in range(count)]
        self.shown = list(self.gpus if visible is None else [self.gpus[i] for i in visible])
        self._started = started
        self.limits = {self.gpus[i].name for i in limits}
        self.growth = []
        self.calls = []

    def started(self):
        return self._started

    def physical(self):
        return list(self.gpus)

    def visible(self):
        return list(self.shown)

    def set_visible(self, devices):
        assert not self._started, "TF refuses to change visible devices once started"
        self.calls.append(("set_visible", [d.name for d in devices]))
        self.shown = list(devices)

    def has_limit(self, device):
        return device.name in self.limits

    def set_memory_growth(self, device):
        assert not self._started
        self.growth.append(device.name)

    def growth_on(self, device):
        return device.name in self.growth


def test_no_gpu_trains_on_the_cpu_and_touches_nothing():
    cfg = FakeConfig(0)
    p = gpu.pin(0, 2, memory_growth=True, tf_config=cfg, env={})
    assert (p.device, p.gpu, p.identity) == ("/cpu:0", None, "")
    assert cfg.calls == [] and cfg.growth == []


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_each_local_rank_gets_its_own_gpu_alone_with_memory_growth(local_rank):
    cfg = FakeConfig(4)
    p = gpu.pin(local_rank, 4, memory_growth=True, tf_config=cfg, env={})
    assert p.device == "/gpu:0" and p.gpu == local_rank and not p.shared
    assert cfg.calls == [("set_visible", [f"/physical_device:GPU:{local_rank}"])]
    assert cfg.growth == [f"/physical_device:GPU:{local_rank}"] and p.memory_growth
    assert p.identity == str(local_rank)


def test_cuda_visible_devices_names_the_physical_gpu():
    # A launcher that gives each rank one GPU: TF sees one, whatever the rank.
    cfg = FakeConfig(1)
    p = gpu.pin(3, 4, memory_growth=True, tf_config=cfg, env={"CUDA_VISIBLE_DEVICES": "6"})
    assert (p.device, p.gpu, p.identity, p.shared) == ("/gpu:0", 0, "6", True)
    cfg = FakeConfig(2)
    p = gpu.pin(1, 2, memory_growth=True, tf_config=cfg,
                env={"CUDA_VISIBLE_DEVICES": "GPU-aaaa, GPU-bbbb"})
    assert p.identity == "GPU-bbbb"


def test_the_scripts_own_visible_devices_win():
    # Horovod's recipe already ran: TF shows only GPU 2 to this process.
    cfg = FakeConfig(4, visible=[2])
    p = gpu.pin(2, 4, memory_growth=True, tf_config=cfg, env={})
    assert p.device == "/gpu:0" and p.identity == "2"
    assert cfg.calls == [("set_visible", ["/physical_device:GPU:2"])]
    # ... or hid every GPU: the CPU.
    cfg = FakeConfig(4, visible=[])
    assert gpu.pin(0, 4, memory_growth=True, tf_config=cfg, env={}).device == "/cpu:0"
    assert cfg.calls == []


def test_memory_growth_yields_to_a_limit_the_env_or_the_option():
    cfg = FakeConfig(2, limits=[1])
    p = gpu.pin(1, 2, memory_growth=True, tf_config=cfg, env={})
    assert cfg.growth == [] and not p.memory_growth  # the script set a memory limit
    cfg = FakeConfig(2)
    gpu.pin(0, 2, memory_growth=True, tf_config=cfg, env={"TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert cfg.growth == []
    cfg = FakeConfig(2)
    gpu.pin(0, 2, memory_growth=False, tf_config=cfg, env={})
    assert cfg.growth == []
    cfg = FakeConfig(2)  # the default comes from PERSEUS_GPU_MEMORY_GROWTH
    gpu.pin(0, 2, tf_config=cfg, env={"PERSEUS_GPU_MEMORY_GROWTH": "0"})
    assert cfg.growth == []
    cfg = FakeConfig(2)
    gpu.pin(0, 2, tf_config=cfg, env={})
    assert cfg.growth == ["/physical_device:GPU:0"]


def test_memory_growth_variable_is_validated():
    assert load_config(environ={}).gpu_memory_growth == 1
    with pytest.raises(ConfigError, match=r"PERSEUS_GPU_MEMORY_GROWTH='yes' .*one of 0, 1"):
        load_config(environ={"PERSEUS_GPU_MEMORY_GROWTH": "yes"})


def test_more_ranks_than_gpus_share_them_round_robin():
    picks = [gpu.pin(r, 4, memory_growth=True, tf_config=FakeConfig(2), env={}) for r in range(4)]
    assert [p.gpu for p in picks] == [0, 1, 0, 1] and all(p.shared for p in picks)
    assert gpu.choose(0, 0, 1) is None
    with pytest.raises(ValueError, match="local rank 4 is outside 0..3"):
        gpu.choose(2, 4, 4)


def test_after_tf_started_its_gpus_the_rank_still_gets_its_own():
    gpu._warned_late = False
    cfg = FakeConfig(4, started=True)
    with pytest.warns(UserWarning, match="had already started its 4 GPUs"):
        p = gpu.pin(3, 4, memory_growth=True, tf_config=cfg, env={})
    assert (p.device, p.gpu, p.identity) == ("/gpu:3", 3, "3")
    assert cfg.calls == [] and cfg.growth == []


def test_two_ranks_of_a_host_on_one_gpu_are_refused_with_nccl_only():
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    gpu.check_one_rank_per_gpu(hosts, ["0", "1", "0", "1"], "nccl")  # one each: fine
    gpu.check_one_rank_per_gpu(hosts, ["", "", "", ""], "nccl")       # no GPUs
    gpu.check_one_rank_per_gpu(hosts, ["0", "0", "0", "0"], "host")   # staged: shared is fine
    with pytest.raises(RuntimeError) as e:
        gpu.check_one_rank_per_gpu(hosts, ["0", "1", "1", "1"], "nccl")
    text = str(e.value)
    assert "ranks 2 and 3 both train on GPU 1 of host 10.0.0.2" in text
    assert "PERSEUS_GPU_TRANSPORT=host" in text and "CUDA_VISIBLE_DEVICES" in text


def test_gpu_calls_on_real_tensorflow():
    """On this (GPU-less) machine with real TF: hvd.init() starts no device,
    so Horovod's pinning recipe still works after it; pin() and
    PerseusStrategy then place the replicas on the CPU."""
    script = textwrap.dedent("""
        import tensorflow as tf
        from tensorflow.python.eager import context
        import perseus_tf.horovod as hvd
        from perseus_tf import gpu
        hvd.init()
        assert context.context()._context_handle is None, "hvd.init() started TF's devices"
        gpus = tf.config.list_physical_devices("GPU")
        for g in gpus:
            tf.config.experimental.set_memory_growth(g, True)
        if gpus:
            tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
        # Changing visible devices raises once TF started: it has not.
        tf.config.set_visible_devices(tf.config.list_physical_devices("CPU"), "CPU")
        assert gpu.pin().device == "/cpu:0"
        import perseus_tf
        s = perseus_tf.PerseusStrategy()
        assert s.placement.device == "/cpu:0", s.placement
        assert [d.lower() for d in s.extended.worker_devices] == \\
            ["/job:localhost/replica:0/task:0/device:cpu:0"], s.extended.worker_devices
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_the_nccl_that_the_driver_can_run_is_preferred_and_a_mismatch_is_named(tmp_path,
                                                                               monkeypatch):
    """Two nvidia-nccl wheels on sys.path (cu12 and cu13, as a venv shared
    with PyTorch can hold): on a CUDA 12 driver the cu12 one comes first, on
    a CUDA 13 driver the cu13 one (TF not loaded); NCCL built for a newer
    CUDA than the driver's is refused at init with what to install."""
    from perseus_tf import _native
    dirs = {}
    for major in (12, 13):
        site = tmp_path / f"site{major}"
        lib = site / "nvidia" / "nccl" / "lib"
        lib.mkdir(parents=True)
        (lib / "libnccl.so.2").write_bytes(b"")
        info = site / f"nvidia_nccl_cu{major}-2.28.9.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: nvidia-nccl-cu{major}\n"
                                       "Version: 2.28.9\n")
        (info / "RECORD").write_text("nvidia/nccl/lib/libnccl.so.2,,\n")
        monkeypatch.syspath_prepend(str(site))
        dirs[major] = str(lib)
    assert _native.nccl_cuda_major(dirs[12] + "/libnccl.so.2") == 12
    assert _native.nccl_cuda_major(dirs[13] + "/libnccl.so.2") == 13
    for driver, first in ((12, 12), (13, 13)):
        monkeypatch.setattr(_native, "driver_cuda_major", lambda d=driver: d)
        _native._nccl_wheel_dirs.cache_clear()
        found = [d for d in _native._nccl_wheel_dirs() if d in dirs.values()]
        assert found[0] == dirs[first], (driver, found)
    _native._nccl_wheel_dirs.cache_clear()
    why = _native.nccl_driver_mismatch("/x/libnccl.so.2", 13, 12)
    assert "built for CUDA 13" in why and "supports CUDA 12" in why and \
        "nvidia-nccl-cu12" in why and "PERSEUS_GPU_TRANSPORT=host" in why, why
    assert _native.nccl_driver_mismatch("/x", 12, 13) is None
    assert _native.nccl_driver_mismatch("/x", None, 12) is None


@pytest.mark.parametrize("case", ["growth off", "forced off", "started without growth",
                                  "growth on", "limit", "forced on", "started with growth"])
def test_a_rank_whose_tf_takes_the_whole_gpu_is_warned_once(case, monkeypatch):
    """Memory growth off and no limit: TF reserves nearly all of the GPU and
    NCCL's buffers fail at the first step; the rank is told once, with the
    variables that change it. Growth on, a limit or TF_FORCE_GPU_ALLOW_GROWTH
    say nothing."""
    monkeypatch.setattr(gpu, "_warned_memory", False)
    started = case.startswith("started")
    cfg = FakeConfig(2, started=started, limits=[1] if case == "limit" else ())
    if case == "started with growth":
        cfg.growth.append(cfg.gpus[1].name)
    env = {"TF_FORCE_GPU_ALLOW_GROWTH": "false" if case == "forced off" else "true"} \
        if case.startswith("forced") else {}
    growth = case in ("growth on", "forced off", "limit")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            gpu.pin(1, 2, memory_growth=growth, tf_config=cfg, env=env)
    memory = [w for w in seen if "reserve nearly all of GPU 1" in str(w.message)]
    expected = 1 if case in ("growth off", "forced off", "started without growth") else 0
    assert len(memory) == expected, [str(w.message) for w in seen]
    if memory:
        text = str(memory[0].message)
        assert "PERSEUS_GPU_MEMORY_GROWTH=1" in text and "TF_FORCE_GPU_ALLOW_GROWTH=true" in text
