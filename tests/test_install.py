"""README's install recipes, run as written in fresh virtual environments:
the CPU one (`pip install tensorflow`, then `pip install .`) and the GPU one
(`tensorflow[and-cuda]`, whose CUDA wheels bring NVRTC and NCCL), each
ending in the command README gives to check it. No GPU is needed: the GPU
recipe must build and report that the CUDA path would load.

What differs from a user's machine: `.` is a copy of this tree that carries
its compiled objects (build/native-obj, with their times), so the build
links instead of compiling again (`make native` compiled the same sources
with the same flags); pip's cache is this machine's. The system packages
the recipe's first line installs are there already (`make test` installs
them); the test checks that line names what the build's system check asks
for, and that the check stops a build without them in one line."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from harness import ROOT

README = os.path.join(ROOT, "README.md")


def recipe(name):
    """The lines of README's install block `name` (cpu or gpu)."""
    text = open(README).read()
    found = re.findall(r"<!-- install: " + name + r" -->\n```sh\n(.*?)```", text, re.S)
    assert len(found) == 1, f"README has no single install block {name!r}"
    return [line.split("  #")[0].strip() for line in found[0].splitlines() if line.strip()]


def packages(line):
    """The Debian packages an `apt-get install` line names."""
    return [w for w in line.split()[3:] if not w.startswith("-")]


def tree_copy(dest):
    """This tree's files (tracked and new, not ignored) and its compiled
    objects, with their modification times, under dest."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    shutil.copytree(os.path.join(ROOT, "build", "native-obj"),
                    os.path.join(dest, "build", "native-obj"))
    return dest


def run_recipe(name, tmp_path):
    """Runs README's block in bash, with the venv it makes under tmp_path,
    from a copy of the tree; returns its output."""
    lines = recipe(name)
    assert lines[0].startswith("sudo apt-get install"), lines[0]
    missing = [p for p in packages(lines[0]) if subprocess.run(
        ["dpkg", "-s", p], capture_output=True).returncode != 0]
    assert not missing, f"make test installs the system packages; missing: {missing}"
    source = tree_copy(str(tmp_path / "perseus-tf"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PERSEUS_"))}
    env["PATH"] = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                  if "/.venv" not in p)
    # The venv goes under tmp_path rather than the home folder.
    commands = [line.replace("~/", str(tmp_path) + "/") for line in lines[1:]]
    script = "set -euo pipefail\ncd " + source + "\n" + "\n".join(commands) + "\n"
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def test_system_line_names_what_the_build_checks_for():
    for name in ("cpu", "gpu"):
        names = packages(recipe(name)[0])
        assert {"g++", "libgloo-dev", "python3-venv"} <= set(names), names


def test_a_build_without_a_compiler_or_gloo_stops_in_one_line(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import build_native
    for cxx, what in (("no-such-compiler-g++", "the C++ compiler"),):
        with pytest.raises(SystemExit) as stop:
            build_native.check_system(cxx)
        message = str(stop.value)
        assert what in message and "apt-get install g++ libgloo-dev" in message, message
        assert "\n" not in message, message
    # A compiler that cannot find Gloo's headers: one that searches nowhere.
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\nexec g++ -nostdinc++ -nostdinc \"$@\"\n")
    fake.chmod(0o755)
    with pytest.raises(SystemExit) as stop:
        build_native.check_system(str(fake))
    assert "Gloo's headers and library" in str(stop.value), str(stop.value)


def test_cpu_recipe_installs_in_a_fresh_venv_and_trains(tmp_path):
    out = run_recipe("cpu", tmp_path)
    # The recipe's last line runs the installed package's collectives on 2 ranks.
    assert re.search(r"\[0\] perseus-tf \S+ on TensorFlow 2\.[\d.]+: allreduce over 2 ranks ok", out), \
        out[-3000:]


def test_gpu_recipe_installs_in_a_fresh_venv_and_the_cuda_path_would_load(tmp_path):
    out = run_recipe("gpu", tmp_path)
    assert "NVRTC          [ok]" in out and "NCCL           [ok]" in out, out[-3000:]
    assert "The CUDA path would load" in out, out[-3000:]
