"""The documentation: the site builds in strict mode (a broken link, a
missing page or a docstring that fails to render fails it), README's links
resolve, and README's quick start runs as written on 2 ranks (its code is
read from the page, not copied here)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

from harness import ROOT, rank_env

README = os.path.join(ROOT, "README.md")
HAS_MKDOCS = importlib.util.find_spec("mkdocs") is not None


def _build(config_dir, out):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                          cwd=config_dir, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not HAS_MKDOCS, reason="the TF 2.15 venv has no MkDocs: the first pass "
                    "builds the site")
def test_site_builds_in_strict_mode_and_a_broken_link_fails_it(tmp_path):
    proc = _build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    for name in ("DistributedOptimizer", "grouped_allreduce", "PerseusStrategy",
                 "BroadcastGlobalVariablesCallback"):
        assert name in reference, name
    # The same tree with one broken link: the build must fail.
    copy = tmp_path / "copy"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(
        ".venv*", ".cuda", "build", ".git", "*.so", "__pycache__"))
    with open(copy / "docs" / "strategy.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    broken = _build(copy, tmp_path / "broken")
    assert broken.returncode != 0 and "no-such-page.md" in broken.stdout + broken.stderr, \
        broken.stdout[-2000:] + broken.stderr[-2000:]


def _slug(heading):
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


def test_readme_links_reach_pages_and_headings_that_exist():
    text = open(README).read()
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links, "README links nowhere"
    for target, anchor in links:
        if target.startswith("http"):
            continue
        path = os.path.join(ROOT, target)
        assert os.path.exists(path), target
        if anchor:
            with open(path) as f:
                slugs = {_slug(line.lstrip("#")) for line in f if re.match(r"^#+ ", line)}
            assert anchor in slugs, (target, anchor, sorted(slugs))


def _quick_start():
    """{file name: code} and the launch lines of README's quick start."""
    text = open(README).read()
    blocks = re.findall(r"<!-- quickstart: (\S+) -->\n```\w*\n(.*?)```", text, re.S)
    files = {name: code for name, code in blocks if name != "run"}
    runs = [line.split() for name, code in blocks if name == "run"
            for line in code.splitlines() if line.strip()]
    return files, runs


def test_quick_start_runs_as_written(tmp_path):
    files, runs = _quick_start()
    assert sorted(files) == ["train_horovod.py", "train_strategy.py"], sorted(files)
    assert len(runs) == 2 and all(r[:3] == ["perseusrun", "-np", "2"] for r in runs), runs
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    for run in runs:
        assert run[3] == "python", run
        cmd = [sys.executable, "-m", "perseus_tf.runner", "-np", "2", sys.executable] + run[4:]
        proc = subprocess.run(cmd, cwd=tmp_path, env=rank_env(), capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, (run, proc.stdout[-2000:] + proc.stderr[-3000:])
        found = re.findall(r"^\[0\] accuracy ([\d.]+)$", proc.stdout, re.M)
        assert len(found) == 1 and float(found[0]) > 0.8, (run, proc.stdout[-2000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
