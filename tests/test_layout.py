"""The native tree's shape: includes stack python/tf -> runtime -> transport ->
core/rendezvous with no circle, the data path never includes the plan, and
no file grows past 600 lines without saying why in its header comment."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CC = os.path.join(ROOT, "cc")
INCLUDE = re.compile(r'^#include "(cc/[^"]+)"', re.M)
# What each folder may include (besides itself).
ALLOWED = {
    "core": set(),
    "rendezvous": {"core"},
    "transport": {"core"},
    "runtime": {"core", "rendezvous", "transport"},
    "tf": {"core", "runtime"},
    "python": {"core", "rendezvous", "runtime"},
    "testing": set(),
}
# The data path: executing a bucket returns an outcome, it never reads plan state.
DATA_PATH = ["cc/runtime/executor.cc", "cc/runtime/collectives.cc",
             "cc/runtime/compression/fp16.cc", "cc/runtime/compression/topk.cc",
             "cc/runtime/compression/downsample.cc", "cc/transport/allreduce_algorithms.cc"]


def _files():
    for folder, _, names in os.walk(CC):
        for name in names:
            if name.endswith((".h", ".cc")):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT), open(path).read()


FILES = dict(_files())


def _layer(path):
    return path.split("/")[1]


def test_includes_go_down_the_layers():
    wrong = []
    for path, text in FILES.items():
        for target in INCLUDE.findall(text):
            if path.endswith("_test.cc") and target == "cc/testing/check.h":
                continue  # unit tests sit beside what they test
            if _layer(target) != _layer(path) and _layer(target) not in ALLOWED[_layer(path)]:
                wrong.append(f"{path} includes {target}")
    assert not wrong, "\n".join(wrong)


def test_no_include_circle():
    graph = {path: [t for t in INCLUDE.findall(text) if t in FILES]
             for path, text in FILES.items()}
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            pytest.fail("include circle: " + " -> ".join(trail[trail.index(node):] + [node]))
        state[node] = "open"
        for nxt in graph[node]:
            visit(nxt, trail + [node])
        state[node] = "done"

    for node in graph:
        visit(node, [])


def _includes_closure(path):
    seen, todo = set(), [path]
    while todo:
        for t in INCLUDE.findall(FILES[todo.pop()]):
            if t in FILES and t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


@pytest.mark.parametrize("path", DATA_PATH)
def test_data_path_never_includes_the_plan(path):
    assert path in FILES
    reached = _includes_closure(path)
    for header in ("cc/runtime/plan.h", "cc/runtime/runtime.h", "cc/runtime/controller.h"):
        assert header not in reached, f"{path} reaches {header}"


def test_no_file_over_600_lines_without_a_reason():
    long = []
    for path, text in FILES.items():
        lines = text.count("\n")
        head = text.split("\n#", 1)[0]
        if lines > 600 and "over 600 lines" not in head:
            long.append(f"{path}: {lines} lines")
    assert not long, "\n".join(long)
