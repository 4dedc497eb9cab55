#!/usr/bin/env python3
"""Point Bazel at the pip-installed TensorFlow, pybind11 and Python headers.

Run it with the interpreter whose packages the build should use, normally the
project venv:

    .venv/bin/python tools/configure_bazel.py

It asks tf.sysconfig, pybind11 and sysconfig for their paths and flags and
writes them into a managed block of <workspace>/.bazelrc.user (gitignored,
read by .bazelrc through try-import):

  * --repo_env=PERSEUS_*=...  read by the repository rules in
    third_party/bazel/local_repos.bzl (@local_tensorflow, @pybind11, @python);
  * --cxxopt/--host_cxxopt    TensorFlow's -std=... and -D_GLIBCXX_USE_CXX11_ABI
    so that every object in the build agrees with TensorFlow's C++ ABI.

Lines of .bazelrc.user outside the managed block are kept.  Nothing is
downloaded and no Bazel command is run.
"""

import argparse
import os
import re
import shlex
import sys
import sysconfig
import tempfile

BEGIN = "# >>> perseus configure_bazel.py (generated; do not edit) >>>"
END = "# <<< perseus configure_bazel.py <<<"

# Commands that take --repo_env and do not inherit it from `build`.
# (test/run/cquery/aquery/info/coverage inherit `build` options.)
REPO_ENV_COMMANDS = ("build", "query", "fetch", "sync")


class ConfigureError(Exception):
    pass


def _require(path, what):
    if not os.path.exists(path):
        raise ConfigureError("%s not found: %s" % (what, path))
    return path


def tensorflow_config():
    """Include dir, framework library and compile flags of the installed TF."""
    # TensorFlow logs to fd 2 from C++ at import time (before absl logging
    # is initialised, so TF_CPP_MIN_LOG_LEVEL does not silence all of it).
    # Capture that and only show it if the import fails.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        try:
            import tensorflow as tf  # pylint: disable=import-outside-toplevel
            error = None
        except ImportError as e:
            error = e
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
        if error is not None:
            log.seek(0)
            sys.stderr.write(log.read().decode("utf-8", "replace"))
            raise ConfigureError(
                "cannot import tensorflow with %s (%s); run this script with "
                "the venv's python" % (sys.executable, error))

    include = os.path.realpath(tf.sysconfig.get_include())
    libdir = os.path.realpath(tf.sysconfig.get_lib())
    cflags = list(tf.sysconfig.get_compile_flags())
    ldflags = list(tf.sysconfig.get_link_flags())

    defines, cxxopts = [], []
    for flag in cflags:
        if flag.startswith("-I"):
            inc = os.path.realpath(flag[2:])
            if inc != include:
                raise ConfigureError(
                    "unexpected extra TF include dir %s (expected only %s)"
                    % (inc, include))
        elif flag.startswith("-D"):
            defines.append(flag[2:])
        elif re.match(r"^--?std=", flag):
            cxxopts.append("-std=" + flag.split("=", 1)[1])
        else:
            raise ConfigureError("unhandled TF compile flag %r" % flag)

    libname = None
    for flag in ldflags:
        if flag.startswith("-L"):
            d = os.path.realpath(flag[2:])
            if d != libdir:
                libdir = d
        elif flag.startswith("-l:"):
            libname = flag[3:]
        elif flag.startswith("-l"):
            libname = "lib%s.so" % flag[2:]
        else:
            raise ConfigureError("unhandled TF link flag %r" % flag)
    if libname is None:
        raise ConfigureError("no framework library in TF link flags %r" % ldflags)

    _require(os.path.join(include, "tensorflow", "core", "framework",
                          "op_kernel.h"), "TensorFlow headers")
    _require(os.path.join(libdir, libname), "TensorFlow framework library")

    # The libstdc++ ABI must match TensorFlow's in every translation unit
    # that is linked into the same .so, not only in the TF-facing ones.
    for d in defines:
        if d.startswith("_GLIBCXX_USE_CXX11_ABI="):
            cxxopts.append("-D" + d)

    return {
        "version": tf.__version__,
        "include": include,
        "libdir": libdir,
        "libname": libname,
        "defines": defines,
        "cxxopts": cxxopts,
    }


def pybind11_include():
    try:
        import pybind11  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ConfigureError(
            "cannot import pybind11 with %s (%s)" % (sys.executable, e))
    inc = os.path.realpath(pybind11.get_include())
    _require(os.path.join(inc, "pybind11", "pybind11.h"), "pybind11 headers")
    return inc


def python_include():
    inc = os.path.realpath(sysconfig.get_paths()["include"])
    _require(os.path.join(inc, "Python.h"), "Python.h")
    return inc


def _quote(value):
    # .bazelrc lines are split shell-style.
    return shlex.quote(value)


def render_block(tf, pybind11_inc, python_inc):
    env = [
        ("PERSEUS_TF_INCLUDE", tf["include"]),
        ("PERSEUS_TF_LIBDIR", tf["libdir"]),
        ("PERSEUS_TF_FRAMEWORK_LIB", tf["libname"]),
        ("PERSEUS_TF_DEFINES", ";".join(tf["defines"])),
        ("PERSEUS_PYBIND11_INCLUDE", pybind11_inc),
        ("PERSEUS_PYTHON_INCLUDE", python_inc),
    ]
    lines = [
        BEGIN,
        "# python:     %s (%s)" % (sys.executable, sys.version.split()[0]),
        "# tensorflow: %s" % tf["version"],
    ]
    for cmd in REPO_ENV_COMMANDS:
        for key, value in env:
            lines.append("%s --repo_env=%s" % (cmd, _quote("%s=%s" % (key, value))))
    for opt in tf["cxxopts"]:
        lines.append("build --cxxopt=%s" % _quote(opt))
        lines.append("build --host_cxxopt=%s" % _quote(opt))
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_bazelrc_user(path, block):
    kept = []
    if os.path.exists(path):
        with open(path) as f:
            inside = False
            for line in f:
                if line.rstrip("\n") == BEGIN:
                    inside = True
                elif line.rstrip("\n") == END:
                    inside = False
                elif not inside:
                    kept.append(line)
    # Drop leading blank lines left over from an earlier block.
    while kept and not kept[0].strip():
        kept.pop(0)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(block)
        if kept:
            f.write("\n")
            f.writelines(kept)
    os.replace(tmp, path)


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workspace", default=root,
        help="Bazel workspace root (default: %(default)s)")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the generated block instead of writing .bazelrc.user")
    args = parser.parse_args(argv)

    try:
        tf = tensorflow_config()
        block = render_block(tf, pybind11_include(), python_include())
    except ConfigureError as e:
        print("configure_bazel.py: error: %s" % e, file=sys.stderr)
        return 1

    if args.dry_run:
        sys.stdout.write(block)
        return 0
    path = os.path.join(os.path.abspath(args.workspace), ".bazelrc.user")
    write_bazelrc_user(path, block)
    print("configure_bazel.py: wrote %s (TensorFlow %s, %s/%s)"
          % (path, tf["version"], tf["libdir"], tf["libname"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
