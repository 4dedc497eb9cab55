"""Compiles Perseus-TF's native code against the TensorFlow that is installed.

Five shared objects land in one directory (the `perseus_tf` package):
  libperseus_core.so   cc/core, cc/rendezvous, cc/transport, cc/device, cc/runtime; no TensorFlow
  libperseus_cuda.so   cc/cuda: the CUDA data plane and its kernels' source, built by the host
                       compiler (no CUDA toolkit, no GPU); it opens CUDA's driver and NVRTC
                       at run time and compiles the kernels for the GPU in use
  _perseus_ops_tfX_Y.so  TensorFlow ops and kernels for TF X.Y, linked to libperseus_core.so
  _core<EXT_SUFFIX>    pybind11 module, linked to libperseus_core.so
  _testing<EXT_SUFFIX> pybind11 module of test hooks (cc/python/testing), which only the
                       tests, benchmarks and GPU tools import; linked to libperseus_core.so
Both front ends load the same libperseus_core.so (found through
rpath=$ORIGIN), so a process has exactly one runtime.

Before compiling it writes cc/rendezvous/store_protocol.h from
perseus_tf/common/store_protocol.py when that changed (gen_store_protocol.py),
so the C++ client always speaks the protocol the Python store defines, and
cc/runtime/settings.h from perseus_tf/config/spec.py (gen_settings.py), so
the runtime's settings are the table's, and cc/cuda/kernel_source.cc from cc/cuda/kernels.cu
(gen_kernel_source.py), the CUDA kernels as the string NVRTC compiles.

Used by setup.py (pip install) and runnable by hand:
  python tools/build_native.py [OUT_DIR]     (default: perseus_tf/)
"""

import concurrent.futures
import functools
import json
import os
import shutil
import subprocess
import sys
import sysconfig

import gen_kernel_source  # beside this file: tools/ is on sys.path (setup.py, or run here)
import gen_settings
import gen_store_protocol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources(folder):
    path = os.path.join(ROOT, "cc", folder)
    return sorted(os.path.join(path, f) for f in os.listdir(path)
                  if f.endswith(".cc") and not f.endswith("_test.cc"))


def _link(cxx, target, args):
    """Links to a new file and renames it over target: a process that has
    the old library mapped (a running job) keeps it intact."""
    partial = target + ".partial"
    _run([cxx, "-shared", "-o", partial] + args)
    os.replace(partial, target)


def place(path, folder):
    """Copies the built library `path` into `folder` through a new file that
    is renamed over the old one. Writing into the old file instead (what
    shutil.copy does) truncates a library that running processes have mapped:
    a training job on this tree dies with SIGBUS when its next page is read
    (a `pip install -e .` of a second TF version beside a running job did)."""
    target = os.path.join(folder, os.path.basename(path))
    if os.path.abspath(path) == os.path.abspath(target):
        return target
    partial = target + ".partial"
    shutil.copy2(path, partial)
    os.replace(partial, target)
    return target


# The TensorFlow releases Perseus-TF supports (README, docs/installation.md).
TF_OLDEST, TF_NEWEST = (2, 15), (2, 21)


@functools.lru_cache(maxsize=None)
def tf_info():
    """(version, compile flags, link flags) of the TensorFlow this build is
    for: the one this Python imports, or, inside pip's isolated build
    environment (`pip install .` with pyproject.toml's build requirements),
    the one of the environment being installed into. pip hides that
    environment's site-packages from the build through PYTHONPATH and a
    sitecustomize module; the same interpreter without them sees it."""
    try:
        import tensorflow as tf  # noqa: F401
    except ImportError:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
        env["TF_CPP_MIN_LOG_LEVEL"] = "3"
        code = ("import json, tensorflow as tf; print(json.dumps([tf.__version__, "
                "tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()]))")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise SystemExit(
                "perseus-tf: the build needs TensorFlow installed first in the environment it "
                f"installs into ({sys.prefix}): pip install 'tensorflow>=2.15,<2.22' (or "
                "tensorflow[and-cuda] for GPUs), then install perseus-tf again")
        version, cflags, lflags = json.loads(proc.stdout.strip().splitlines()[-1])
        return version, tuple(cflags), tuple(lflags)
    return tf.__version__, tuple(tf.sysconfig.get_compile_flags()), \
        tuple(tf.sysconfig.get_link_flags())


def check_tf_version():
    """Stops the build on a TensorFlow older than the supported range, and
    says so (and builds) on one newer than the newest tested."""
    full = tf_info()[0]
    version = tuple(int(p) for p in full.split(".")[:2])
    if version < TF_OLDEST:
        raise SystemExit(f"perseus-tf supports TensorFlow 2.15 to 2.21; this environment has "
                         f"{full}: pip install 'tensorflow>=2.15,<2.22'")
    if version > TF_NEWEST:
        print(f"perseus-tf: TensorFlow {full} is newer than the newest tested "
              f"(2.21); building anyway", flush=True)


def tf_tag():
    """`tf2_15` for TensorFlow 2.15.x: the op library is built per TF minor
    version, so environments with different TensorFlows can share one tree."""
    major, minor = tf_info()[0].split(".")[:2]
    return f"tf{major}_{minor}"


def _tf_flags():
    """The installed TF's compile and link flags: its headers and ABI."""
    return list(tf_info()[1]), list(tf_info()[2])


def check_system(cxx):
    """Stops the build at once, in one line, when the system lacks the C++
    compiler or Gloo (Debian's libgloo-dev), instead of a compiler error
    pages later."""
    missing = []
    if shutil.which(cxx) is None:
        missing.append(f"the C++ compiler {cxx!r}")
    else:
        probe = subprocess.run([cxx, "-std=c++17", "-x", "c++", "-E", "-", "-o", os.devnull],
                               input="#include <gloo/allreduce_ring.h>\n", capture_output=True,
                               text=True)
        library = subprocess.run([cxx, "-print-file-name=libgloo.so"], capture_output=True,
                                 text=True).stdout.strip()
        if probe.returncode != 0 or not os.path.isabs(library):
            missing.append("Gloo's headers and library")
    if missing:
        raise SystemExit("perseus-tf: the build needs " + " and ".join(missing) +
                         ": on Debian or Ubuntu, sudo apt-get install g++ libgloo-dev")


def _abi_flag(compile_flags):
    for flag in compile_flags:
        if flag.startswith("-D_GLIBCXX_USE_CXX11_ABI="):
            return [flag]
    return []


def _run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError("command failed:\n  " + " ".join(cmd) + "\n" + proc.stderr[-6000:])
    return cmd[-1]


def _newer(target, deps):
    if not os.path.exists(target):
        return False
    t = os.path.getmtime(target)
    return all(os.path.getmtime(d) <= t for d in deps)


def build(out_dir=None, jobs=None, verbose=True):
    out_dir = os.path.abspath(out_dir or os.path.join(ROOT, "perseus_tf"))
    obj_dir = os.path.join(ROOT, "build", "native-obj")
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(obj_dir, exist_ok=True)
    for generator in (gen_store_protocol, gen_settings, gen_kernel_source):
        if generator.write(ROOT) and verbose:
            print("wrote", generator.HEADER, flush=True)
    jobs = jobs or os.cpu_count() or 2
    cxx = os.environ.get("CXX", "g++")
    check_system(cxx)
    import pybind11

    check_tf_version()
    tf_cflags, tf_lflags = _tf_flags()
    common = ["-std=c++17", "-O3", "-fPIC", "-Wall", "-Wno-sign-compare", "-I" + ROOT]
    common += _abi_flag(tf_cflags)
    headers = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "cc"))
               for f in fs if f.endswith(".h")]

    groups = {
        "core": (_sources("core") + _sources("rendezvous") + _sources("transport") +
                 _sources("device") + _sources("runtime") + _sources("runtime/compression") +
                 _sources("runtime/plan"), []),
        "tf": (_sources("tf"), [f for f in tf_cflags if not f.startswith("-std=")]),
        "py": (_sources("python"), ["-I" + pybind11.get_include(),
                                    "-I" + sysconfig.get_paths()["include"],
                                    "-fvisibility=hidden"]),
        "testing": (_sources("python/testing"), ["-I" + pybind11.get_include(),
                                                 "-I" + sysconfig.get_paths()["include"],
                                                 "-fvisibility=hidden"]),
        "cuda": (_sources("cuda") + [os.path.join(ROOT, "cc", "core", "shared_library.cc")], []),
    }
    compile_jobs, objects = [], {}
    for group, (srcs, extra) in groups.items():
        objects[group] = []
        for src in srcs:
            sub = os.path.join(obj_dir, tf_tag()) if group == "tf" else obj_dir
            os.makedirs(sub, exist_ok=True)
            obj = os.path.join(sub, group + "_" + os.path.basename(src)[:-3] + ".o")
            objects[group].append(obj)
            if not _newer(obj, [src] + headers):
                compile_jobs.append([cxx] + common + extra + ["-c", src, "-o", obj])
    if verbose and compile_jobs:
        print(f"perseus-tf: compiling {len(compile_jobs)} C++ files with {jobs} jobs "
              "(about 5 minutes on 2 cores from nothing; only changed files after that)",
              flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for n, done in enumerate(pool.map(_run, compile_jobs), 1):
            if verbose:
                print(f"  [{n}/{len(compile_jobs)}] compiled {os.path.basename(done)}",
                      flush=True)

    rpath = ["-Wl,-rpath,$ORIGIN"]
    core = os.path.join(out_dir, "libperseus_core.so")
    _link(cxx, core, objects["core"] + ["-lgloo", "-lpthread", "-ldl"] +
          ["-Wl,-soname,libperseus_core.so"])
    link_core = ["-L" + out_dir, "-lperseus_core"] + rpath
    ops = os.path.join(out_dir, f"_perseus_ops_{tf_tag()}.so")
    _link(cxx, ops, objects["tf"] + link_core + tf_lflags)
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    pymod = os.path.join(out_dir, "_core" + ext)
    _link(cxx, pymod, objects["py"] + link_core)
    testing = os.path.join(out_dir, "_testing" + ext)
    _link(cxx, testing, objects["testing"] + link_core)
    cuda = os.path.join(out_dir, "libperseus_cuda.so")
    _link(cxx, cuda, objects["cuda"] + ["-ldl", "-lpthread", "-Wl,-soname,libperseus_cuda.so"])
    if verbose:
        print("built", core, ops, pymod, testing, cuda, sep="\n  ", flush=True)
    return [core, ops, pymod, testing, cuda]


if __name__ == "__main__":
    build(sys.argv[1] if len(sys.argv) > 1 else None)
