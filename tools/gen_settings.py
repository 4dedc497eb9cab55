"""Writes cc/runtime/settings.h, and the settings' rows of
docs/configuration.md, from perseus_tf/config/spec.py.

The header has one struct per part of the runtime that reads settings
(spec.PARTS), each field named as the setting is everywhere else, with the
spec's default, and PERSEUS_NATIVE_SETTINGS(X): X(Part, name) for every
field, which the binding (cc/python/core_module.cc) expands. InitOptions
(cc/runtime/options.h) is the topology and these parts. tools/build_native.py
runs this before compiling; the header is checked in for the Bazel build and
for readers, and tests/test_config.py fails when the header or the page
differs from what this writes.

  python tools/gen_settings.py           write the header if it changed
  python tools/gen_settings.py --docs    also rewrite the page's setting rows
  python tools/gen_settings.py --check   exit 1 if either is out of date
"""

import importlib.util
import os
import re
import sys
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_store_protocol import write_if_changed  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "perseus_tf/config/spec.py"
HEADER = "cc/runtime/settings.h"
PAGE = "docs/configuration.md"


def load_spec(root=ROOT):
    """spec.py, loaded from its file alone (the build runs before the
    package is importable)."""
    loader = importlib.util.spec_from_file_location("_perseus_spec", os.path.join(root, SOURCE))
    module = importlib.util.module_from_spec(loader)
    sys.modules[loader.name] = module  # NamedTuple wants its module findable
    loader.loader.exec_module(module)
    return module


def _cc_value(spec, s):
    value = s.none_as if s.default is None else s.default
    if value is None:
        raise ValueError(f"{SOURCE}: {s.name} has no default and no none_as for the runtime")
    kind = spec.cc_type(s)
    if kind == "bool":
        return "true" if value else "false"
    if kind == "std::string":
        return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if kind == "double":
        return repr(float(value))
    if isinstance(value, float):
        raise ValueError(f"{SOURCE}: {s.name}: {value} for an integer field")
    if kind == "int64_t" and abs(value) >= 2**31:
        return f"int64_t{{{value}}}"
    return str(value)


def render(root=ROOT):
    spec = load_spec(root)
    body = []
    for part, struct in spec.PARTS.items():
        body.append(f"struct {struct} {{")
        for s in spec.native_settings():
            if s.part != part:
                continue
            unset = "" if s.default is not None else f" Unset: {s.none_as} ({s.default_text})."
            comment = textwrap.wrap(f"{s.variable}: {s.doc}{unset}", 76)
            body += ["  // " + line for line in comment]
            body.append(f"  {spec.cc_type(s)} {s.name} = {_cc_value(spec, s)};")
        body += ["};", ""]
    body.append("// Every field above as X(Part, name), in the table's order.")
    body.append("#define PERSEUS_NATIVE_SETTINGS(X) \\")
    natives = spec.native_settings()
    for i, s in enumerate(natives):
        end = " \\" if i + 1 < len(natives) else ""
        body.append(f"  X({spec.PARTS[s.part]}, {s.name}){end}")
    return "\n".join([
        f"// Generated from {SOURCE} by tools/gen_settings.py: do not edit.",
        "// The runtime's settings, one struct per part that reads them; names,",
        "// defaults and meanings are the table's (that module's docstring).",
        "#pragma once",
        "",
        "#include <cstdint>",
        "#include <string>",
        "",
        "namespace perseus {",
        "",
        *body,
        "",
        "}  // namespace perseus",
        "",
    ])


def write(root=ROOT):
    """Writes the header when its text changed; returns True if it did."""
    return write_if_changed(os.path.join(root, HEADER), render(root))


_ROW = re.compile(r"^\| `(?P<variable>[A-Z0-9_]+)` \(`(?P<name>[a-z0-9_]+)`\) \|")


def page_problems(text, root=ROOT):
    """What differs between the page and the table: [(setting, problem)]."""
    spec = load_spec(root)
    problems, seen = [], set()
    section = None
    for line in text.split("\n"):
        if line.startswith("## "):
            section = line[3:].strip()
        m = _ROW.match(line)
        if not m:
            continue
        s = spec.BY_NAME.get(m["name"])
        if s is None:
            problems.append((m["name"], "is not a setting of spec.py"))
            continue
        seen.add(s.name)
        if line != spec.doc_row(s):
            problems.append((s.name, f"row differs from spec.py's: {spec.doc_row(s)}"))
        if section != s.topic:
            problems.append((s.name, f"is under '{section}', spec.py puts it under '{s.topic}'"))
    for s in spec.SETTINGS:
        if s.name not in seen:
            problems.append((s.name, f"has no row (spec.py: under '{s.topic}')"))
    return problems


def render_page(text, root=ROOT):
    """The page with each setting's row made from the table."""
    spec = load_spec(root)
    out = []
    for line in text.split("\n"):
        m = _ROW.match(line)
        if m and m["name"] in spec.BY_NAME:
            line = spec.doc_row(spec.BY_NAME[m["name"]])
        out.append(line)
    return "\n".join(out)


def main(argv):
    page = os.path.join(ROOT, PAGE)
    if argv[1:] == ["--check"]:
        failed = False
        with open(os.path.join(ROOT, HEADER), encoding="utf-8") as f:
            if f.read() != render():
                print(f"{HEADER} is out of date: run python tools/gen_settings.py",
                      file=sys.stderr)
                failed = True
        with open(page, encoding="utf-8") as f:
            for name, problem in page_problems(f.read()):
                print(f"{PAGE}: {name} {problem}", file=sys.stderr)
                failed = True
        return 1 if failed else 0
    if argv[1:] not in ([], ["--docs"]):
        print(__doc__, file=sys.stderr)
        return 2
    if write():
        print(f"wrote {HEADER}")
    if argv[1:] == ["--docs"]:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        if write_if_changed(page, render_page(text)):
            print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
