"""The CUDA kernels of cc/cuda. They compile without a GPU: under `make
test` (PERSEUS_REQUIRE_NVCC=1) the Makefile has built libperseus_cuda.so
with CUDA 13's compiler from PyPI, and its absence is a failure. Where a GPU
and CuPy are present, tools/gpu_check.py compares every kernel with numpy;
elsewhere that test skips, saying so."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB = os.path.join(ROOT, "perseus_tf", "libperseus_cuda.so")
ENTRY_POINTS = ["perseus_cuda_to_half", "perseus_cuda_from_half", "perseus_cuda_scale",
                "perseus_cuda_sum_chunks", "perseus_cuda_nonfinite", "perseus_cuda_batched_copy",
                "perseus_cuda_topk_scratch_bytes", "perseus_cuda_topk",
                "perseus_cuda_plane_create", "perseus_cuda_device_count",
                "perseus_cuda_error_string", "perseus_cuda_test_alloc", "perseus_cuda_test_free",
                "perseus_cuda_test_produce", "perseus_cuda_test_fetch",
                "perseus_cuda_event_destroy", "perseus_cuda_record_event",
                "perseus_cuda_event_synchronize"]


def _built():
    if os.path.exists(LIB):
        return LIB
    if os.environ.get("PERSEUS_REQUIRE_NVCC") == "1":
        pytest.fail(f"{LIB} was not built: `make cuda` installs CUDA 13's compiler and builds it")
    pytest.skip("the CUDA kernels are not built here (no nvcc; `make cuda` builds them)")


def test_the_kernels_compile_for_sm80_and_sm90_with_every_entry_point():
    lib = _built()
    symbols = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True,
                             text=True, check=True).stdout
    missing = [name for name in ENTRY_POINTS if f" T {name}\n" not in symbols]
    assert not missing, missing
    # The fat binary holds code for both architectures (the ELF names them).
    with open(lib, "rb") as f:
        blob = f.read()
    assert b"sm_80" in blob and b"sm_90" in blob


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
from perseus_tf.cross_device_ops import _collective_device
class Placed:
    def __init__(self, device):
        self.device = device
found["strategy"] = [_collective_device(Placed(d)) for d in
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
from perseus_tf import _core, _native
_native.init()
h = _core.submit_device(_native.OP_ALLREDUCE, 4096, 4096, [4], "on.gpu",
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

