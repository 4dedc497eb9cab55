#!/bin/bash
# Everything that needs a GPU, as one run on a lent GPU machine (no
# TensorFlow there, CuPy and nvidia-nccl-cu13 are): the CUDA kernels against
# numpy, the runtime's CUDA data plane and NCCL through perseus_tf._core, and
# the _core test suite with every array on the GPU.
#
# It expects libperseus_core.so and libperseus_cuda.so built on the
# development machine (tools/build_native.py: the CUDA library needs no
# CUDA to build; it compiles its kernels here with the machine's NVRTC,
# found below unless PERSEUS_NVRTC_LIBRARY names one) and, in .gpu/, Gloo's
# headers (include/gloo) and the shared libraries libperseus_core.so needs
# (lib/: libgloo.so.0 and what it links). It builds _core for the machine's
# own Python, then runs each step with a time limit. Logs go to $OUT.
#
#   bash tools/gpu_session.sh [steps...]
#       (default: build kernels nccl lone staged ranks hier core corenccl soak tfharness;
#       CORE_RANKS="2 4", SOAK_STEPS=400)
#
# NCCL refuses two ranks of one host on one GPU; the multi-rank NCCL steps
# give each rank an NCCL_HOSTID of its own, so NCCL takes each for a host of
# its own (sockets over loopback, all on the one GPU).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/perseus-gpu}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD"
PY=${PYTHON:-python3}
steps=${*:-build kernels nccl lone staged ranks hier core corenccl soak tfharness}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_IB_DISABLE=1
# Runs the rest of the line with NCCL_HOSTID set to the rank's own.
per_rank_host='export NCCL_HOSTID=perseus-rank$PERSEUS_RANK; exec "$0" "$@"'
status=0
if [ -z "${PERSEUS_NVRTC_LIBRARY:-}" ]; then
  PERSEUS_NVRTC_LIBRARY=$($PY -c 'from perseus_tf import gpu; print(gpu.nvrtc_library() or "")')
  [ -n "$PERSEUS_NVRTC_LIBRARY" ] || PERSEUS_NVRTC_LIBRARY=$(ls /usr/local/cuda*/lib64/libnvrtc.so.1[23] \
    /usr/lib/x86_64-linux-gnu/libnvrtc.so.1[23] 2>/dev/null | head -n 1)
  export PERSEUS_NVRTC_LIBRARY
fi
export PERSEUS_KERNEL_CACHE=${PERSEUS_KERNEL_CACHE:-$OUT/kernel-cache}

step() {  # name, limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 60 "$OUT/$name.log"
  echo "=== $name: exit $rc"
  [ $rc -eq 0 ] || status=1
}

results() {  # folder of run_checks.py's rank*.json, name
  $PY -c 'import json, sys, glob
for p in sorted(glob.glob(sys.argv[1] + "/rank*.json")):
    r = json.load(open(p))
    bad = {k: v for k, v in r.items() if v != "ok"}
    print(p.split("/")[-1], len(r) - len(bad), "ok,", len(bad), "failed")
    for k, v in list(bad.items())[:8]:
        print("  FAIL", k, v.strip().splitlines()[-1][:400])' "$1" | tee "$OUT/$2.results"
}

# tests/workers/checks_core.py with every array on the GPU at CORE_RANKS
# ranks, launched directly so that its per-check results survive a failure:
#   core_checks NAME TRANSPORT [WRAPPER...]   (PERSEUS_GPU_TRANSPORT=TRANSPORT)
core_checks() {
  local name=$1 transport=$2
  shift 2
  for n in ${CORE_RANKS:-2 4}; do
    local dir extra=""
    dir=$(mktemp -d)
    [ $n = 4 ] && extra="PERSEUS_SHM_ALLREDUCE=0 PERSEUS_ALLREDUCE_STREAMS=2"
    step "$name$n" 200 env PERSEUS_TEST_DEVICE=cuda PERSEUS_GPU_TRANSPORT=$transport \
      GLOO_TIMEOUT_SECONDS=20 PERSEUS_STALL_TIMEOUT_SECONDS=20 $extra \
      $PY -m perseus_tf.runner -np $n -- "$@" $PY tests/workers/run_checks.py checks_core "$dir"
    results "$dir" "$name$n"
  done
}

for s in $steps; do
  case $s in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      $PY -c 'from perseus_tf import gpu; print(gpu.cuda_info())'
      ext=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
      step build 300 g++ -std=c++17 -O2 -fPIC -shared -fvisibility=hidden \
        -D_GLIBCXX_USE_CXX11_ABI=1 -I. -I.gpu/include $($PY -m pybind11 --includes) \
        cc/python/*.cc -Lperseus_tf -lperseus_core -Wl,-rpath,'$ORIGIN' \
        -o "perseus_tf/_core$ext"
      ;;
    kernels) step kernels 300 $PY tools/gpu_check.py ;;
    nccl) step nccl 200 $PY tools/gpu_runtime_check.py nccl ;;
    lone) step lone 60 $PY tools/gpu_runtime_check.py lone ;;
    staged)
      for n in 2 4; do
        step "staged$n" 300 $PY -m perseus_tf.runner -np $n -- $PY tools/gpu_runtime_check.py staged
      done
      ;;
    ranks)  # NCCL among N ranks of the world
      for n in 2 4; do
        step "nccl$n" 300 $PY -m perseus_tf.runner -np $n -- $PY tools/gpu_runtime_check.py nccl
      done
      ;;
    hier)  # two hosts of two: mixed compression in two levels
      step hier 300 $PY -m perseus_tf.runner -np 4 -H 127.0.0.1:2,127.0.0.2:2 -- \
        $PY tools/gpu_runtime_check.py nccl
      ;;
    core) core_checks core host ;;
    corenccl) core_checks corenccl nccl sh -c "$per_rank_host" ;;  # a host id per rank
    tfharness)  # TF's GPU kernels through tools/tf_gpu_harness.py on this GPU: needs
      # build/tf_gpu_harness/libtf_gpu_harness.so and the op library built on the
      # development machine, and TF 2.21's libtensorflow_framework.so.2 in .gpu/lib
      # (carried as .gpu/libtensorflow_framework.so.2.zst: zstd -19 of the wheel's)
      [ -f .gpu/lib/libtensorflow_framework.so.2 ] || \
        zstd -q -d .gpu/libtensorflow_framework.so.2.zst -o .gpu/lib/libtensorflow_framework.so.2
      for n in 1 2 4; do
        step "tfharness$n" 300 env PERSEUS_GPU_TRANSPORT=host $PY -m perseus_tf.runner -np $n -- \
          $PY tools/tf_gpu_harness.py build/tf_gpu_harness/libtf_gpu_harness.so
      done
      step tfharness_nccl 300 env PERSEUS_GPU_TRANSPORT=nccl $PY tools/tf_gpu_harness.py \
        build/tf_gpu_harness/libtf_gpu_harness.so
      ;;
    soak)  # tools/soak.py briefly, every array on the GPU
      step soak 150 env PERSEUS_TEST_DEVICE=cuda PERSEUS_GPU_TRANSPORT=host \
        $PY tools/soak.py --np 2 --steps ${SOAK_STEPS:-400} --seed 41
      ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
