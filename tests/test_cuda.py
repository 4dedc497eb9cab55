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
                "perseus_cuda_topk_scratch_bytes", "perseus_cuda_topk"]


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
