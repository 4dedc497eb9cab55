#!/usr/bin/env bash
# Configure and build the native Perseus-TF libraries with Bazel (offline),
# then copy them into OUT_DIR:
#
#   tools/bazel_build.sh OUT_DIR [extra `bazel build` flags...]
#
# Produces OUT_DIR/libperseus_core.so, OUT_DIR/_perseus_ops.so,
# OUT_DIR/_core.so, OUT_DIR/_testing.so (the test hooks) and OUT_DIR/libperseus_cuda.so.
#
# Environment:
#   PYTHON   interpreter whose TensorFlow/pybind11 to build against
#            (default: <repo>/.venv/bin/python, else python3)
#   BAZEL    Bazel binary (default: bazel-4.2.3 or Debian's bazel-4 if present,
#            else bazel).  Debian's /usr/bin/bazel wrapper rejects
#            .bazelversion 4.2.3 because the binary is installed as bazel-4.
#   BAZEL_STARTUP_OPTS  startup options, e.g. "--output_user_root=/tmp/bz"
#   JOBS     parallel actions (default: number of CPUs)
#   EXTRA_TARGETS  more targets of //: to build and copy, e.g. "cc_unit"
#            (the C++ unit tests, tests/test_examples_and_build.py runs them)
#   BAZEL_KEEP_SERVER=1  leave Bazel's server running afterwards (by default
#            it is shut down: otherwise its JVM stays idle for three hours)
set -euo pipefail

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[[ $# -ge 1 && $1 != -* ]] || usage
out_dir=$1
shift
mkdir -p "$out_dir"
out_dir=$(cd "$out_dir" && pwd)

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"

if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $repo_root/.venv/bin/python ]]; then
    PYTHON=$repo_root/.venv/bin/python
  else
    PYTHON=python3
  fi
fi

if [[ -z ${BAZEL:-} ]]; then
  for candidate in bazel-4.2.3 bazel-4 bazel; do
    if command -v "$candidate" >/dev/null 2>&1; then
      BAZEL=$(command -v "$candidate")
      break
    fi
  done
  [[ -n ${BAZEL:-} ]] || { echo "bazel_build.sh: no bazel found" >&2; exit 1; }
fi

jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
# shellcheck disable=SC2206  # word splitting intended
startup=(${BAZEL_STARTUP_OPTS:-})

if [[ ${BAZEL_KEEP_SERVER:-0} != 1 ]]; then
  trap '"$BAZEL" "${startup[@]}" shutdown >/dev/null 2>&1 || true' EXIT
fi

echo "==> configure ($PYTHON)"
"$PYTHON" tools/configure_bazel.py

# shellcheck disable=SC2206  # word splitting intended
extra=(${EXTRA_TARGETS:-})
echo "==> $BAZEL build //:native ${extra[*]/#/\/\/:}"
"$BAZEL" "${startup[@]}" build --jobs="$jobs" "$@" //:native "${extra[@]/#/\/\/:}"

# bazel-bin for the same flags (-c opt from .bazelrc changes the path).
bin_dir=$("$BAZEL" "${startup[@]}" info "$@" bazel-bin 2>/dev/null)

for lib in libperseus_core.so _perseus_ops.so _core.so _testing.so libperseus_cuda.so "${extra[@]}"; do
  # Bazel outputs are read-only; replace rather than overwrite.
  rm -f "$out_dir/$lib"
  cp "$bin_dir/$lib" "$out_dir/$lib"
  chmod u+w "$out_dir/$lib"
  echo "    $out_dir/$lib"
done
