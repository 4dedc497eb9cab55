#!/bin/bash
# Everything that needs a GPU, as one run on a lent GPU machine (no
# TensorFlow there, CuPy and nvidia-nccl-cu13 are): the CUDA kernels against
# numpy, the runtime's CUDA data plane and NCCL through perseus_tf._core and
# perseus_tf._testing (its test hooks: submit_device, the test device), and
# the _core test suite with every array on the GPU.
#
# It expects libperseus_core.so and libperseus_cuda.so built on the
# development machine (tools/build_native.py: the CUDA library needs no
# CUDA to build; it compiles its kernels here with the machine's NVRTC,
# found below unless PERSEUS_NVRTC_LIBRARY names one) and, in .gpu/, Gloo's
# headers (include/gloo) and the shared libraries libperseus_core.so needs
# (lib/: libgloo.so.0 and what it links). It builds _core and _testing for the machine's
# own Python, then runs each step with a time limit. Logs go to $OUT.
#
#   bash tools/gpu_session.sh [steps...]
#       default: setup build kernels nccl staged ranks core corenccl tfharness
#                hier lone soak (the order that verifies most first)
#       BUDGET=420: seconds for the whole run; each step's limit is cut to what
#       is left, and steps that find under 20 s left are skipped, saying so.
#       RANKS="2" (staged, ranks, core, corenccl; "2 4" in a second call),
#       SOAK_STEPS=200.
# Logs go to a folder of their own (LOGS, /tmp/perseus-gpu-logs); $OUT gets
# summary.txt (one line per step: exit status, seconds, last lines) and
# logs.tgz, since a lent machine hands back at most 8 files.
#
# NCCL refuses two ranks of one host on one GPU; the multi-rank NCCL steps
# give each rank an NCCL_HOSTID of its own, so NCCL takes each for a host of
# its own (sockets over loopback, all on the one GPU).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/perseus-gpu}
LOGS=${LOGS:-/tmp/perseus-gpu-logs}
mkdir -p "$OUT" "$LOGS"
export LD_LIBRARY_PATH="$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONPATH="$PWD"
export PY=${PYTHON:-python3}
steps=${*:-setup build kernels nccl staged ranks core corenccl tfharness hier lone soak}
RANKS=${RANKS:-2}
deadline=$(( $(date +%s) + ${BUDGET:-420} ))
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_IB_DISABLE=1
# Runs the rest of the line with NCCL_HOSTID set to the rank's own.
per_rank_host='export NCCL_HOSTID=perseus-rank$PERSEUS_RANK; exec "$0" "$@"'
status=0
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
if [ -z "${PERSEUS_NVRTC_LIBRARY:-}" ]; then
  PERSEUS_NVRTC_LIBRARY=$($PY -c 'from perseus_tf import gpu; print(gpu.nvrtc_library() or "")' 2>/dev/null)
  [ -n "$PERSEUS_NVRTC_LIBRARY" ] || PERSEUS_NVRTC_LIBRARY=$($PY -c 'import glob, site, sys
for d in site.getsitepackages() + sys.path:
    for p in sorted(glob.glob(d + "/nvidia/**/libnvrtc.so.1[23]", recursive=True)):
        print(p); sys.exit()' 2>/dev/null)
  [ -n "$PERSEUS_NVRTC_LIBRARY" ] || PERSEUS_NVRTC_LIBRARY=$(ls /usr/local/cuda*/lib64/libnvrtc.so.1[23] \
    /usr/lib/x86_64-linux-gnu/libnvrtc.so.1[23] 2>/dev/null | head -n 1)
  export PERSEUS_NVRTC_LIBRARY
fi
export PERSEUS_KERNEL_CACHE=${PERSEUS_KERNEL_CACHE:-$LOGS/kernel-cache}

finish() {
  tar czf "$OUT/logs.tgz" -C "$LOGS" --exclude kernel-cache . 2>/dev/null
  echo "=== summary"
  cat "$SUMMARY"
}
trap finish EXIT

step() {  # name, limit in seconds, command...
  local name=$1 limit=$2 left t0 rc
  shift 2
  left=$(( deadline - $(date +%s) ))
  if [ $left -lt 20 ]; then
    printf '%-16s skipped: %ss of the budget left\n' "$name" "$left" | tee -a "$SUMMARY"
    status=1
    return 1
  fi
  [ $limit -le $left ] || limit=$left
  echo "=== $name ($(date +%T), limit ${limit}s)"
  t0=$(date +%s)
  # through bash, so that a step may be one of the functions exported below
  timeout -k 5 "$limit" bash -c '"$@"' "$name" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  tail -n 40 "$LOGS/$name.log"
  echo "=== $name: exit $rc"
  printf '%-16s exit %-3s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" \
    "$(grep -v '^\s*$' "$LOGS/$name.log" | tail -n 1 | cut -c1-150)" >> "$SUMMARY"
  [ $rc -eq 0 ] || status=1
  return $rc
}

results() {  # folder of run_checks.py's rank*.json, name
  $PY -c 'import json, sys, glob
for p in sorted(glob.glob(sys.argv[1] + "/rank[0-9]*.json")):
    if p.endswith(".seconds.json"):
        continue
    r = json.load(open(p))
    bad = {k: v for k, v in r.items() if v != "ok"}
    print(p.split("/")[-1], len(r) - len(bad), "ok,", len(bad), "failed")
    for k, v in list(bad.items())[:8]:
        print("  FAIL", k, v.strip().splitlines()[-1][:400])' "$1" | tee "$LOGS/$2.results"
  sed 's/^/                 /' "$LOGS/$2.results" >> "$SUMMARY"
}

# tests/workers/checks_core.py with every array on the GPU at $RANKS ranks,
# launched directly so that its per-check results survive a failure:
#   core_checks NAME TRANSPORT [WRAPPER...]   (PERSEUS_GPU_TRANSPORT=TRANSPORT)
core_checks() {
  local name=$1 transport=$2
  shift 2
  for n in $RANKS; do
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
    setup)  # fails fast: what every later step needs
      setup_check() {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || return 1
        $PY -c 'import numpy, cupy; print("numpy", numpy.__version__, "cupy", cupy.__version__,
          "devices", cupy.cuda.runtime.getDeviceCount())' || return 1
        $PY -m pybind11 --includes > /dev/null || { echo "no pybind11"; return 1; }
        command -v g++ > /dev/null || { echo "no g++"; return 1; }
        [ -f .gpu/include/gloo/config.h ] || { echo "no .gpu/include/gloo (Gloo's headers)"; return 1; }
        for lib in perseus_tf/libperseus_core.so perseus_tf/libperseus_cuda.so; do
          [ -f $lib ] || { echo "no $lib (carry it)"; return 1; }
          ldd $lib | grep 'not found' && { echo "$lib: libraries missing from .gpu/lib"; return 1; }
        done
        [ -n "$PERSEUS_NVRTC_LIBRARY" ] || { echo "no NVRTC found"; return 1; }
        echo "NVRTC: $PERSEUS_NVRTC_LIBRARY"
        ls $($PY -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))')/nvidia/*/lib/libnccl.so.2 || true
        return 0
      }
      export -f setup_check
      step setup 60 setup_check || { echo "set-up failed: nothing else runs"; exit 1; }
      ;;
    build)
      export PY ext=$($PY -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
      build_core() {  # perseus_tf._core and perseus_tf._testing (the test hooks)
        local objs="" f pids="" module
        mkdir -p /tmp/perseus-core-obj
        for f in cc/python/*.cc cc/python/testing/*.cc; do
          g++ -std=c++17 -O2 -fPIC -fvisibility=hidden -D_GLIBCXX_USE_CXX11_ABI=1 -I. \
            -I.gpu/include $($PY -m pybind11 --includes) -c $f \
            -o /tmp/perseus-core-obj/$(basename $f .cc).o & pids="$pids $!"
        done
        for p in $pids; do wait $p || return 1; done
        for module in _core _testing; do
          if [ $module = _core ]; then
            objs=$(for f in cc/python/*.cc; do echo /tmp/perseus-core-obj/$(basename $f .cc).o; done)
          else
            objs=$(for f in cc/python/testing/*.cc; do echo /tmp/perseus-core-obj/$(basename $f .cc).o; done)
          fi
          g++ -shared $objs -Lperseus_tf -lperseus_core -Wl,-rpath,'$ORIGIN' \
            -o "perseus_tf/$module$ext" || return 1
        done
      }
      export -f build_core
      step build 240 build_core || { echo "build failed: nothing else runs"; exit 1; }
      $PY -c 'from perseus_tf import gpu; print(gpu.cuda_info())'
      ;;
    kernels) step kernels 150 $PY tools/gpu_check.py ;;
    nccl) step nccl 90 $PY tools/gpu_runtime_check.py nccl ;;
    lone) step lone 60 $PY tools/gpu_runtime_check.py lone ;;
    staged)
      for n in $RANKS; do
        step "staged$n" 120 $PY -m perseus_tf.runner -np $n -- $PY tools/gpu_runtime_check.py staged
      done
      ;;
    ranks)  # NCCL among N ranks of the world
      for n in $RANKS; do
        step "nccl$n" 120 $PY -m perseus_tf.runner -np $n -- \
          $PY tools/gpu_runtime_check.py nccl
      done
      ;;
    hier)  # two hosts of two: mixed compression in two levels
      step hier 120 $PY -m perseus_tf.runner -np 4 -H 127.0.0.1:2,127.0.0.2:2 -- \
        $PY tools/gpu_runtime_check.py nccl
      ;;
    core) core_checks core host ;;
    corenccl) core_checks corenccl nccl sh -c "$per_rank_host" ;;  # a host id per rank
    tfharness)  # TF's GPU kernels through tools/tf_gpu_harness.py on this GPU: needs
      # build/tf_gpu_harness/libtf_gpu_harness.so and the op library built on the
      # development machine, and TF 2.21's libtensorflow_framework.so.2 in .gpu/lib
      # (carried as .gpu/libtensorflow_framework.so.2.xz: xz -6 of the wheel's, 45 MB;
      # Python's lzma unpacks it, since such a machine may lack xz and zstd)
      [ -f .gpu/lib/libtensorflow_framework.so.2 ] || $PY -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        .gpu/libtensorflow_framework.so.2.xz .gpu/lib/libtensorflow_framework.so.2
      for n in 1 $RANKS; do
        step "tfharness$n" 120 env PERSEUS_GPU_TRANSPORT=host $PY -m perseus_tf.runner -np $n -- \
          $PY tools/tf_gpu_harness.py build/tf_gpu_harness/libtf_gpu_harness.so
      done
      step tfharness_nccl 90 env PERSEUS_GPU_TRANSPORT=nccl $PY tools/tf_gpu_harness.py \
        build/tf_gpu_harness/libtf_gpu_harness.so
      ;;
    soak)  # tools/soak.py briefly, every array on the GPU
      step soak 90 env PERSEUS_TEST_DEVICE=cuda PERSEUS_GPU_TRANSPORT=host \
        $PY tools/soak.py --np 2 --steps ${SOAK_STEPS:-200} --seed 41
      ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
