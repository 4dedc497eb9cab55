"""Writes cc/rendezvous/store_protocol.h from perseus_tf/common/store_protocol.py.

The rendezvous store's wire protocol is defined once, in Python; the C++
client includes this header instead of literals of its own. Each upper-case
constant of the module becomes a `constexpr` of the header, in the same
order and with the same comments:

  an int                       uint8_t if it fits in a byte, else int64_t;
                               size_t for a NAME_LEN (a length)
  a float NAME_S (seconds)     std::chrono::milliseconds kName
  bytes                        char kName[] and size_t kNameLen (its length,
                               without the terminating NUL)

Names become kCamelCase in namespace perseus::store_protocol (CMD_SET ->
kCmdSet). tools/build_native.py runs this before compiling; the header is
checked in for the Bazel build and for readers, and
tests/test_store_protocol.py fails when it differs from what this writes.

  python tools/gen_store_protocol.py           write the header if it changed
  python tools/gen_store_protocol.py --check   exit 1 if it is out of date
"""

import ast
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = "perseus_tf/common/store_protocol.py"
HEADER = "cc/rendezvous/store_protocol.h"


def _load_module(path):
    """The protocol module, loaded from its file alone: no perseus_tf import
    (the build runs before the package is importable)."""
    spec = importlib.util.spec_from_file_location("_store_protocol", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cc_name(name):
    return "k" + "".join(part.capitalize() for part in name.split("_"))


def _cc_string(value):
    # Octal escapes take at most three digits, so a following digit cannot
    # join them (a hex escape would swallow it).
    out = []
    for byte in value:
        char = chr(byte)
        if char in '"\\':
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _declarations(name, value):
    if isinstance(value, bool):
        raise TypeError(f"{SOURCE}: {name} is a bool; use an int")
    if isinstance(value, int):
        if name.endswith("_LEN"):
            cc_type = "size_t"
        elif 0 <= value <= 0xFF:
            cc_type = "uint8_t"
        else:
            cc_type = "int64_t"
        return [f"constexpr {cc_type} {_cc_name(name)} = {value};"]
    if isinstance(value, float) and name.endswith("_S"):
        ms = value * 1000
        if ms != int(ms):
            raise ValueError(f"{SOURCE}: {name}={value} is not a whole number of milliseconds")
        return [f"constexpr std::chrono::milliseconds {_cc_name(name[:-2])}{{{int(ms)}}};"]
    if isinstance(value, bytes):
        cc = _cc_name(name)
        return [f"constexpr char {cc}[] = {_cc_string(value)};",
                f"constexpr size_t {cc}Len = {len(value)};"]
    raise TypeError(f"{SOURCE}: {name} = {value!r}: no C++ form for a "
                    f"{type(value).__name__} (see {os.path.basename(__file__)})")


def render(root=ROOT):
    """The header's text, from the module's constants, comments and layout."""
    path = os.path.join(root, SOURCE)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    module = _load_module(path)
    tree = ast.parse(text)
    lines = text.split("\n")
    # Top-level statements by their first line; the docstring is left out.
    statements = {}
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            statements[node.lineno] = (None, node.end_lineno)
            continue
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            raise ValueError(f"{SOURCE}:{node.lineno}: only NAME = value statements "
                             "may follow the docstring")
        statements[node.lineno] = (node.targets[0].id, node.end_lineno)

    body = []
    number = 1
    while number <= len(lines):
        line = lines[number - 1].strip()
        if number in statements:
            name, end = statements[number]
            if name is not None:
                body += _declarations(name, getattr(module, name))
            number = end + 1
            continue
        if line.startswith("#"):
            body.append("//" + line[1:])
        elif not line and body and body[-1]:
            body.append("")
        number += 1
    while body and not body[-1]:
        body.pop()

    return "\n".join([
        f"// Generated from {SOURCE} by tools/gen_store_protocol.py: do not edit.",
        "// The rendezvous store's wire protocol (that module's docstring describes",
        "// it); the C++ client, store_client.cc, takes every constant from here.",
        "#pragma once",
        "",
        "#include <chrono>",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        "namespace perseus {",
        "namespace store_protocol {",
        "",
        *body,
        "",
        "}  // namespace store_protocol",
        "}  // namespace perseus",
        "",
    ])


def write_if_changed(path, text):
    """Writes `text` to `path` unless the file holds it already (so make and
    the compiler see no change); returns True if it wrote."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return False
    except FileNotFoundError:
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return True


def write(root=ROOT):
    """Writes the header when its text changed; returns True if it did."""
    return write_if_changed(os.path.join(root, HEADER), render(root))


def main(argv):
    if argv[1:] == ["--check"]:
        path = os.path.join(ROOT, HEADER)
        with open(path, encoding="utf-8") as f:
            if f.read() != render():
                print(f"{HEADER} is out of date: run python tools/gen_store_protocol.py",
                      file=sys.stderr)
                return 1
        return 0
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    if write():
        print(f"wrote {HEADER}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
