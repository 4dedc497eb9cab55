"""The CUDA build: libperseus_cuda.so is built by the host compiler at
`pip install` (no CUDA toolkit, nothing CUDA linked), and compiles its
kernels at run time with NVRTC for the GPU in use. Without a GPU this
checks what can be: the library is there with every entry point and links
no CUDA; NVRTC (the CUDA 12 wheel TF's GPU install brings; `make cuda` puts
it and CUDA 12's headers in .cuda/, and under `make test`,
PERSEUS_REQUIRE_CUDA_WHEELS=1, their absence is a failure) compiles the
kernels for every architecture Perseus supports, and each result holds
code for that architecture; the driver's declarations match CUDA's own
headers; an install finds the wheel's NVRTC by itself. Where a GPU and CuPy
are present, tools/gpu_check.py compares every kernel with numpy; elsewhere
that test skips, saying so."""

import os
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "perseus_tf", "libperseus_cuda.so")
WHEELS = os.path.join(ROOT, ".cuda")
NVRTC = os.path.join(WHEELS, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12")
ENTRY_POINTS = ["perseus_cuda_to_half", "perseus_cuda_from_half", "perseus_cuda_scale",
                "perseus_cuda_sum_chunks", "perseus_cuda_nonfinite", "perseus_cuda_batched_copy",
                "perseus_cuda_topk_scratch_bytes", "perseus_cuda_topk",
                "perseus_cuda_scan_scratch_bytes", "perseus_cuda_exclusive_sum",
                "perseus_cuda_spin", "perseus_cuda_compile_to_file", "perseus_cuda_nvrtc_info",
                "perseus_cuda_plane_create", "perseus_cuda_device_count",
                "perseus_cuda_error_string", "perseus_cuda_test_alloc", "perseus_cuda_test_free",
                "perseus_cuda_test_produce", "perseus_cuda_test_fetch",
                "perseus_cuda_event_destroy", "perseus_cuda_record_event",
                "perseus_cuda_event_synchronize"]
# Volta, Turing, Ampere (A100, A10/A30/3090), Ada (L4, L40) and Hopper: machine code
# for each; PTX of the newest for what comes after (the driver compiles it).
ARCHS = [70, 75, 80, 86, 89, 90]
KERNELS = ["perseus_to_half", "perseus_from_half", "perseus_scale_bf16", "perseus_scale_i16",
           "perseus_sum_chunks", "perseus_nonfinite_16", "perseus_batched_copy",
           "perseus_topk_threshold", "perseus_scan_apply", "perseus_spin"]


def _built():
    assert os.path.exists(LIB), f"{LIB} is missing: `pip install -e .` builds it"
    return LIB


def _wheels():
    if os.path.exists(NVRTC):
        return NVRTC
    if os.environ.get("PERSEUS_REQUIRE_CUDA_WHEELS") == "1":
        pytest.fail(f"{NVRTC} is missing: `make cuda` installs NVRTC and CUDA 12's headers")
    pytest.skip("NVRTC is not installed here (`make cuda` puts it in .cuda/)")


def test_the_library_is_built_by_the_install_with_every_entry_point_and_no_cuda_linked():
    lib = _built()
    symbols = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True,
                             text=True, check=True).stdout
    missing = [name for name in ENTRY_POINTS if f" T {name}\n" not in symbols]
    assert not missing, missing
    needed = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True,
                            check=True).stdout
    linked = [line for line in needed.splitlines() if "NEEDED" in line]
    assert not [line for line in linked if "cuda" in line or "nvrtc" in line], linked


COMPILE_SCRIPT = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
error = ctypes.create_string_buffer(8192)
for arch, path in zip(sys.argv[2::2], sys.argv[3::2]):
    rc = lib.perseus_cuda_compile_to_file(arch.encode(), path.encode(), error,
                                          ctypes.c_size_t(len(error)))
    if rc != 0:
        print("FAILED", arch, error.value.decode())
        sys.exit(1)
print("OK")
"""


def _elf_arch(blob):
    """A cubin's target architecture: ELF machine 190 (CUDA), the SM in the
    low byte of e_flags (ELF ABI version 7, what NVRTC 12 writes)."""
    assert blob[:4] == b"\x7fELF", blob[:16]
    machine = struct.unpack_from("<H", blob, 18)[0]
    flags = struct.unpack_from("<I", blob, 48)[0]
    assert machine == 190, machine
    return flags & 0xFF


def test_nvrtc_compiles_the_kernels_for_every_supported_gpu(tmp_path):
    lib, nvrtc = _built(), _wheels()
    args = []
    for arch in ARCHS:
        args += [f"sm_{arch}", str(tmp_path / f"sm_{arch}.cubin")]
    args += ["compute_90", str(tmp_path / "compute_90.ptx")]
    env = dict(os.environ, PERSEUS_NVRTC_LIBRARY=nvrtc)
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, lib] + args,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-4000:] + proc.stderr
    for arch in ARCHS:
        blob = (tmp_path / f"sm_{arch}.cubin").read_bytes()
        assert _elf_arch(blob) == arch, (arch, _elf_arch(blob))
        for kernel in KERNELS:
            assert kernel.encode() in blob, (arch, kernel)
    ptx = (tmp_path / "compute_90.ptx").read_text()
    assert ".target sm_90" in ptx
    for kernel in KERNELS:
        assert f".entry {kernel}(" in ptx, kernel


def test_a_bad_architecture_is_named_with_nvrtcs_message(tmp_path):
    lib, nvrtc = _built(), _wheels()
    env = dict(os.environ, PERSEUS_NVRTC_LIBRARY=nvrtc)
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, lib, "sm_12",
                           str(tmp_path / "x")], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 1 and "could not compile the kernels for sm_12" in proc.stdout, \
        proc.stdout + proc.stderr


def test_the_driver_declarations_match_cuda_h_and_nvrtc_h(tmp_path):
    """tools/cuda_abi_check.cc: each call's types against the header's, and
    the symbol loaded against the one the header maps its name to."""
    _wheels()
    include = [os.path.join(WHEELS, "nvidia", "cuda_runtime", "include"),
               os.path.join(WHEELS, "nvidia", "cuda_nvrtc", "include")]
    exe = str(tmp_path / "abi")
    subprocess.run(["g++", "-std=c++17", "-I" + ROOT] + ["-I" + d for d in include] +
                   [os.path.join(ROOT, "tools", "cuda_abi_check.cc"), "-o", exe],
                   check=True, capture_output=True, text=True)
    proc = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    assert "0 mismatches" in proc.stdout and "ok MemAlloc -> cuMemAlloc_v2" in proc.stdout


def test_an_install_finds_the_wheels_nvrtc_by_itself():
    """With nvidia-cuda-nvrtc-cu12 on sys.path (as tensorflow[and-cuda]
    installs it) and no PERSEUS_NVRTC_LIBRARY, perseus_tf.gpu finds it and
    the installed library loads it; without it, the reason says what to
    install."""
    _built()
    nvrtc = _wheels()
    script = "import json; from perseus_tf import gpu; print(json.dumps(gpu.cuda_info()))"
    env = {k: v for k, v in os.environ.items() if k != "PERSEUS_NVRTC_LIBRARY"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, WHEELS])
    import json
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, cwd="/")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["nvrtc_ok"] and info["nvrtc"].startswith("12.5:"), info
    assert " 70 " in info["nvrtc"] and " 90 " in info["nvrtc"] and nvrtc in info["nvrtc"], info
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, cwd="/")
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not info["nvrtc_ok"] and "install nvidia-cuda-nvrtc-cu12" in info["nvrtc"], info


def test_the_kernels_and_their_launches_match_numpy_on_the_cpu():
    """tools/gpu_check.py --emulated: every kernel of kernels.cu,
    launched through kernels.cc's C calls (the driver's argument arrays,
    unpacked by each kernel's parameter types) on the stand-in driver of
    cc/testing/fake_cuda.cc, against numpy: casts, scaling, the sum of
    chunks, the NaN check, the batched copy, the scan and top-k with ties.
    Only the two PTX float16 casts are replaced (by software)."""
    _built()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import fake_cuda_env
    env = dict(os.environ, **fake_cuda_env())
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"),
                           "--emulated", "--lib", LIB], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0 and "0 failed" in proc.stdout, proc.stdout[-6000:] + proc.stderr
    assert "ok   topk n=100000 k=5000" in proc.stdout and "exclusive_sum n=70001" in proc.stdout
    assert "ok   scale bfloat16" in proc.stdout and "ok   scale int8" in proc.stdout


FIRST_LAUNCH_SCRIPT = """
import ctypes, os, sys
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
fake = ctypes.CDLL(os.environ["PERSEUS_CUDA_DRIVER"])
fake.fake_cuda_last_arch.restype = ctypes.c_char_p
fake.fake_cuda_last_options.restype = ctypes.c_char_p
lib.perseus_cuda_error_string.restype = ctypes.c_char_p
x = np.arange(10, dtype=np.float32)
h = np.zeros(10, np.uint16)
ctx = ctypes.c_void_p()  # device 0's context, current (as CuPy or TF make it)
assert fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and fake.cuCtxSetCurrent(ctx) == 0
rc = lib.perseus_cuda_to_half(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(h.ctypes.data),
                              ctypes.c_size_t(10), ctypes.c_float(1.0), None)
print(rc, fake.fake_cuda_last_arch().decode() or "cached",
      lib.perseus_cuda_error_string(rc).decode() if rc else [int(v) for v in h[:3]])
# A product and a sum are never fused (the host rounds each: top-k's keys).
options = fake.fake_cuda_last_options().decode()
sys.exit(3 if options and "--fmad=false" not in options.split() else 0)
"""


def test_the_kernels_are_compiled_for_the_gpu_in_use_and_cached(tmp_path):
    """The first launch of a process compiles for the GPU's own architecture
    (PTX of NVRTC's newest for a newer GPU; a GPU older than NVRTC knows is
    named), later processes read the cache, and a cache entry the driver
    refuses is compiled again and replaced."""
    _built()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import fake_cuda_env

    def first_launch(cc, cache):
        env = dict(os.environ, **fake_cuda_env())
        env.update(FAKE_CUDA_CC=str(cc), PERSEUS_KERNEL_CACHE=str(cache))
        proc = subprocess.run([sys.executable, "-c", FIRST_LAUNCH_SCRIPT, LIB],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.strip()

    cache = tmp_path / "cache"
    assert first_launch(86, cache) == "0 sm_86 [0, 15360, 16384]"  # float16 of 0, 1, 2
    (entry,) = cache.iterdir()
    assert entry.name.endswith("-sm_86.bin") and entry.read_bytes().startswith(b"FAKE-CUBIN")
    assert first_launch(86, cache) == "0 cached [0, 15360, 16384]"
    entry.write_bytes(b"a damaged file")
    assert first_launch(86, cache) == "0 sm_86 [0, 15360, 16384]"
    assert entry.read_bytes().startswith(b"FAKE-CUBIN")
    assert first_launch(100, tmp_path / "c2") == "0 compute_90 [0, 15360, 16384]"
    out = first_launch(35, tmp_path / "c3")
    assert out.startswith("999999 cached") and "compute capability 3.5, which NVRTC 12.5 " \
        "does not compile for (it knows 50 to 90)" in out, out


DEVICES_SCRIPT = """
import ctypes, os, sys
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
fake = ctypes.CDLL(os.environ["PERSEUS_CUDA_DRIVER"])
lib.perseus_cuda_error_string.restype = ctypes.c_char_p
p = ctypes.c_void_p
x = np.arange(8, dtype=np.float32)
h = np.zeros(8, np.uint16)
# No context current: an error naming that, never device 0's kernels.
rc = lib.perseus_cuda_to_half(p(x.ctypes.data), p(h.ctypes.data), ctypes.c_size_t(8),
                              ctypes.c_float(1.0), None)
print("none:", rc, lib.perseus_cuda_error_string(rc).decode())
ctx0, ctx1 = p(), p()
fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx0), 0)
fake.cuDevicePrimaryCtxRetain(ctypes.byref(ctx1), 1)
fake.cuCtxSetCurrent(ctx1)
s1 = p()
assert fake.cuStreamCreate(ctypes.byref(s1), 1) == 0
rc = lib.perseus_cuda_to_half(p(x.ctypes.data), p(h.ctypes.data), ctypes.c_size_t(8),
                              ctypes.c_float(1.0), s1)
print("device 1:", rc, [int(v) for v in h[:3]])
# Device 1's stream while device 0's context is current: refused, as CUDA does.
fake.cuCtxSetCurrent(ctx0)
rc = lib.perseus_cuda_to_half(p(x.ctypes.data), p(h.ctypes.data), ctypes.c_size_t(8),
                              ctypes.c_float(1.0), s1)
print("mismatch:", rc)
# The plane of device 1 works whatever context the caller left current.
err = ctypes.create_string_buffer(512)
lib.perseus_cuda_plane_create.restype = ctypes.c_void_p
plane = lib.perseus_cuda_plane_create(1, 2, err, 512)
print("plane:", bool(plane), err.value.decode())
"""


def test_kernels_run_in_the_current_device_and_the_stand_in_tells_devices_apart():
    """Several devices (the stand-in driver's FAKE_CUDA_DEVICES): with no
    context current a launch fails saying so (it used to fall back to device
    0's); on device 1's context it runs; device 1's stream under device 0's
    context is refused by the stand-in as by CUDA; a plane of device 1 comes
    up from another device's context."""
    _built()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import fake_cuda_env
    env = dict(os.environ, **fake_cuda_env(), FAKE_CUDA_DEVICES="2")
    proc = subprocess.run([sys.executable, "-c", DEVICES_SCRIPT, LIB], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["none"].startswith("999999 ") and "no CUDA context is current" in \
        lines["none"], proc.stdout
    assert lines["device 1"] == "0 [0, 15360, 16384]", proc.stdout
    assert lines["mismatch"] == "400", proc.stdout
    assert lines["plane"].strip() == "True", proc.stdout


OUT_OF_MEMORY_SCRIPT = """
import numpy as np
from perseus_tf import _core, _native, _testing
_testing.use_test_device()  # PERSEUS_TEST_DEVICE=cuda: the arrays go on the GPU
_native.init()
arrays = [np.ones(1 << 18, np.float32) for _ in range(4)]  # 1 MiB each: one 4 MiB bucket
try:
    _core.submit_group(arrays, [f"oom.{i}" for i in range(4)],
                       _native.DTYPE_CODES["float32"]).wait()
    print("no error")
except Exception as e:
    print("ERROR", e)
"""


def test_a_plane_buffer_that_does_not_fit_names_the_device_the_size_and_the_remedy():
    """The fused bucket's device buffer is refused (the stand-in driver's
    FAKE_CUDA_ALLOC_LIMIT, as a GPU whose memory TF took): every rank's
    error says which device, how much, what it holds, and which settings
    leave room, not only CUDA's "out of memory"."""
    _built()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import fake_cuda_env, launch
    env = dict(fake_cuda_env(), PERSEUS_TEST_DEVICE="cuda", PERSEUS_GPU_TRANSPORT="host",
               FAKE_CUDA_ALLOC_LIMIT=str(3 << 20), GLOO_TIMEOUT_SECONDS="20")
    proc = launch(2, [sys.executable, "-c", OUT_OF_MEMORY_SCRIPT], timeout=300, env=env)
    out = proc.stdout + proc.stderr
    errors = [line for line in proc.stdout.splitlines() if "ERROR" in line]
    assert len(errors) == 2, out[-4000:]
    for line in errors:
        assert "could not allocate 4.0 MiB of device memory" in line or \
            "could not allocate 5.0 MiB of device memory" in line, line
        assert "CUDA device 0" in line and "PERSEUS_GPU_MEMORY_GROWTH=1" in line and \
            "TF_FORCE_GPU_ALLOW_GROWTH=true" in line, line


@pytest.mark.parametrize("np_,devices", [(2, 1), (4, 1), (2, 2)],
                         ids=["2ranks", "4ranks", "2ranks-2gpus"])
def test_the_tf_gpu_kernels_run_in_the_harness(np_, devices):
    """tools/tf_gpu_harness.py: TF's DEVICE_GPU kernels of every op with a
    tensor, created through TF's kernel registry on a stand-in GPU device
    (the stand-in CUDA driver here: its "device" memory is host memory and
    its streams finish at once), with their memory types (alltoall's splits
    on the host), run at 2 and 4 ranks against numpy; and at 2 ranks on two
    stand-in GPUs, a rank on each, where the driver refuses work of the
    wrong device. On a GPU machine the same harness runs on the real driver
    (tools/gpu_session.sh)."""
    _built()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import fake_cuda_env, launch, tf_gpu_harness
    harness_lib = tf_gpu_harness()
    env = fake_cuda_env()
    if devices > 1:
        env.update(FAKE_CUDA_DEVICES=str(devices), PERSEUS_TEST_HARNESS_GPU="local")
    proc = launch(np_, [sys.executable, os.path.join(ROOT, "tools", "tf_gpu_harness.py"),
                        harness_lib], timeout=600, env=env)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    for r in range(np_):
        assert f"rank {r}: 0 failed" in out, out[-6000:]
        assert out.count(f"rank {r}: ok ") == 14, out[-6000:]
    assert "PerseusAlltoall: DEVICE_GPU kernel created, memory types: DH/DH async" in out


def test_the_kernels_match_numpy_on_a_gpu():
    lib = _built()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"),
                           "--lib", lib], capture_output=True, text=True, timeout=600)
    if proc.returncode == 2:
        pytest.skip(proc.stdout.strip() or "no GPU here")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


TF_KERNELS_SCRIPT = """
import json
import perseus_tf.ops  # loads the op library
from tensorflow.python.framework import kernels
found = {}
for op in ("PerseusAllreduce", "PerseusGroupedAllreduce", "PerseusBroadcast", "PerseusAllgather",
           "PerseusAlltoall", "PerseusReducescatter", "PerseusBarrier", "PerseusJoin"):
    found[op] = sorted([k.device_type, sorted(k.host_memory_arg)]
                       for k in kernels.get_registered_kernels_for_op(op).kernel)
# Where PerseusStrategy puts a collective of a tensor placed on each device.
from perseus_tf.cross_device_ops import collective_device
class Placed:
    def __init__(self, device):
        self.device = device
found["strategy"] = [collective_device(Placed(d)) for d in
                     ("/job:worker/replica:0/task:1/device:GPU:1", "/device:CPU:0", "")]
print(json.dumps(found))
"""


def test_tf_kernels_are_registered_for_gpus_with_host_memory_where_needed():
    """The op library registers every collective that takes a tensor for
    TF's GPUs too (compiled here against the installed TF's stream
    executor; nothing in it links CUDA), so TF keeps a GPU tensor on its GPU
    instead of copying it to the host. Alltoall's split counts stay in host
    memory; barrier and join, which have no tensor, run on the CPU."""
    import json
    proc = subprocess.run([sys.executable, "-c", TF_KERNELS_SCRIPT], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    for op in ("PerseusAllreduce", "PerseusGroupedAllreduce", "PerseusBroadcast",
               "PerseusAllgather", "PerseusReducescatter"):
        assert found[op] == [["CPU", []], ["GPU", []]], (op, found[op])
    assert found["PerseusAlltoall"] == [["CPU", []], ["GPU", ["received_splits", "splits"]]], \
        found["PerseusAlltoall"]
    assert found["PerseusBarrier"] == found["PerseusJoin"] == [["CPU", []]], found
    # PerseusStrategy runs a GPU tensor's collective on that GPU.
    assert found["strategy"] == ["/job:worker/replica:0/task:1/device:GPU:1", "/cpu:0",
                                 "/cpu:0"], found["strategy"]


NO_GPU_SCRIPT = """
import os
from perseus_tf import _native, _testing
_native.init()
h = _testing.submit_device(_native.OP_ALLREDUCE, 4096, 4096, [4], "on.gpu",
                        _native.DTYPE_CODES["float32"])
try:
    h.wait()
    print("NO ERROR")
except RuntimeError as e:
    print("ERROR", e)
"""


def test_a_gpu_tensor_without_a_usable_gpu_fails_with_the_reason():
    """Where CUDA cannot run (no GPU, no driver), a tensor placed on a CUDA
    device fails its collective with CUDA's reason, on a runtime thread,
    instead of crashing the process."""
    _built()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import cuda_devices
    if cuda_devices():
        pytest.skip("a GPU is here: the GPU runs below use it")
    env = dict(os.environ, PYTHONPATH=ROOT)
    for name in ("PERSEUS_RANK", "PERSEUS_SIZE"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", NO_GPU_SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ERROR" in proc.stdout and "cannot use CUDA device 0" in proc.stdout, proc.stdout
    assert "the CUDA driver (libcuda.so.1, part of the NVIDIA driver) cannot be loaded" in \
        proc.stdout, proc.stdout
    assert "on.gpu" in proc.stdout, proc.stdout


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_the_runtime_on_a_gpu(np_):
    """tools/gpu_runtime_check.py: at 1 rank NCCL (every dtype and reduction,
    fused buckets, broadcast, fp16, an aborted communicator); at 2 and 4
    ranks sharing the GPU, the host-staged path."""
    _built()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import cuda_devices, launch
    if cuda_devices() == 0:
        pytest.skip("no GPU here")
    script = os.path.join(ROOT, "tools", "gpu_runtime_check.py")
    if np_ == 1:
        proc = subprocess.run([sys.executable, script, "nccl"], capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
    else:
        proc = launch(np_, [sys.executable, script, "staged"], timeout=600)
    assert proc.returncode == 0 and "FAIL" not in proc.stdout, (
        proc.stdout[-6000:] + proc.stderr[-3000:])



def test_one_kernel_list_and_the_embedded_source_is_current():
    """cc/cuda/kernel_list.h names exactly the `extern "C" __global__`
    functions of kernels.cu, in any order, once each; a synchronising entry
    is one whose body calls __syncthreads; and kernel_source.cc (the string
    NVRTC compiles) is kernels.cu as it is now."""
    import re
    cu = open(os.path.join(ROOT, "cc", "cuda", "kernels.cu")).read()
    listed = re.findall(r"X\((\w+), (\w+), (true|false)\)",
                        open(os.path.join(ROOT, "cc", "cuda", "kernel_list.h")).read())
    defined = re.findall(r'extern "C" __global__ void (\w+)\(', cu)
    names = [function for _, function, _ in listed]
    assert sorted(names) == sorted(defined) and len(set(names)) == len(names), (names, defined)
    starts = {m.group(1): m.start() for m in re.finditer(r'extern "C" __global__ void (\w+)\(', cu)}
    ends = sorted(starts.values()) + [len(cu)]
    for _, function, synchronising in listed:
        body = cu[starts[function]:ends[ends.index(starts[function]) + 1]]
        assert ("__syncthreads" in body) == (synchronising == "true"), function
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gen_kernel_source.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
