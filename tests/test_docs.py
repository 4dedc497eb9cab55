"""The documentation: the site builds in strict mode (a broken link, a
missing page or a docstring that fails to render fails it) and opens from
disk; README's links resolve; README's quick start runs as written on 2
ranks (its code is read from the page, not copied here), and the site's
index holds the same code; every page keeps the rules of
tests/doc_rules.py (short paragraphs and cells, GPU status on the GPU page
only). README's install recipes run in tests/test_install.py."""

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
    site = tmp_path / "site"
    reference = (site / "reference.html").read_text()
    for name in ("DistributedOptimizer", "grouped_allreduce", "PerseusStrategy",
                 "BroadcastGlobalVariablesCallback"):
        assert name in reference, name
    # Opened from disk (file://), a link to a folder shows a listing: every
    # page links to the others as files.
    index = (site / "index.html").read_text()
    pages = re.findall(r'href="([^"#:]+)"', index)
    assert "gpu.html" in pages and "strategy.html" in pages, pages
    assert not [p for p in pages if p.endswith("/")], pages
    # Definition lists render as such (troubleshooting's entries).
    assert "<dl>" in (site / "troubleshooting.html").read_text()
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


def test_every_page_keeps_the_rules_of_a_readable_manual():
    """tests/doc_rules.py on README and every page of docs/; and the rules
    catch what they are for (a wall of text, a GPU status outside the GPU
    page)."""
    import doc_rules
    pages = [README] + sorted(os.path.join(ROOT, "docs", f)
                              for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    found = [p for page in pages for p in doc_rules.problems(page)]
    assert not found, "\n".join(found)
    wall = "word " * 200
    assert doc_rules.problems("docs/x.md", f"# X\n\n{wall}\n")
    assert doc_rules.problems("docs/x.md", "# X\n\n- item\n- " + wall + "\n")
    assert doc_rules.problems("docs/x.md", "| a | b |\n|---|---|\n| x | " + wall + " |\n")
    status = "# X\n\nTF's GPU kernels have not run on a GPU yet; not yet verified.\n"
    assert doc_rules.problems("docs/x.md", status)
    assert not doc_rules.problems("docs/gpu.md", status)
    assert not doc_rules.problems("docs/x.md", "# X\n\n```\n" + wall + "\n```\n")


def test_the_sites_index_is_readmes_quick_start():
    """The site opens on the quick start: the same files and commands as
    README's, which CI runs (below)."""
    index = open(os.path.join(ROOT, "docs", "index.md")).read()
    assert _quick_start(index) == _quick_start(), "docs/index.md's quick start differs from README's"


def _quick_start(text=None):
    """{file name: code} and the launch lines of README's quick start (or of
    the page `text`)."""
    text = open(README).read() if text is None else text
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
