"""The native tree's shape: includes stack python/tf -> runtime -> transport ->
core/rendezvous with no circle, the data path never includes the plan, and
no file grows past 600 lines without saying why in its header comment. The
Python package's: the modules of config/ and runner/ import each other one
way, and the runner needs nothing of the package beyond config/."""

import ast
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
    "device": {"core"},
    "cuda": {"core", "device"},
    "runtime": {"core", "device", "rendezvous", "transport"},
    "tf": {"core", "device", "runtime"},
    "python": {"core", "device", "rendezvous", "runtime", "transport"},
    # The stand-in CUDA driver runs the kernels of cc/cuda/ (kernels.cu, kernel_list.h).
    "testing": {"cuda"},
}
# The data path: executing a bucket returns an outcome, it never reads plan state.
DATA_PATH = ["cc/runtime/executor.cc", "cc/runtime/collectives.cc",
             "cc/runtime/fused_allreduce.cc", "cc/runtime/staging.cc",
             "cc/runtime/compression/fp16.cc", "cc/runtime/compression/topk.cc",
             "cc/runtime/compression/downsample.cc", "cc/runtime/compression/compressors.cc",
             "cc/transport/allreduce_algorithms.cc"]


def _files():
    for folder, _, names in os.walk(CC):
        for name in names:
            if name.endswith((".h", ".cc")):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT), open(path).read()


FILES = dict(_files())


def _layer(path):
    return path.split("/")[1]


def test_only_unit_tests_include_the_fakes():
    """cc/runtime/fakes_for_tests.h is test code: no file of the product
    includes it."""
    wrong = [path for path, text in FILES.items()
             if '#include "cc/runtime/fakes_for_tests.h"' in text and not path.endswith("_test.cc")]
    assert not wrong, wrong


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
    for header in ("cc/runtime/runtime.h", "cc/runtime/controller.h",
                   "cc/runtime/request_table.h", "cc/runtime/negotiation.h"):
        assert header not in reached, f"{path} reaches {header}"
    plan = sorted(h for h in reached if h.startswith(PLAN) and h != PLAN + "envelope.h")
    assert not plan, f"{path} reaches {plan}: the data path sees a bucket's envelope only"


# The offline plan lives in cc/runtime/plan/; the rest of the tree reaches it
# through its interface (plan.h) and a bucket's envelope (envelope.h) only.
PLAN = "cc/runtime/plan/"
PLAN_INTERFACE = {PLAN + "plan.h", PLAN + "envelope.h"}


# What only tests, benchmarks and GPU tools use lives in perseus_tf._testing
# (cc/python/testing/): the product module binds none of it, includes none of
# it, and no module of the package imports it.
TEST_HOOKS = ("sim_device_launches", "submit_device", "nccl_lone_communicator",
              "raw_allreduce", "hmac_sha256", "use_test_device", "PERSEUS_TEST_DEVICE",
              "PlaceOnTestDevice", "SimDevice")


def test_no_test_hook_in_the_product_module():
    product = {p: t for p, t in FILES.items()
               if p.startswith("cc/python/") and not p.startswith("cc/python/testing/")}
    assert "cc/python/core_module.cc" in product
    wrong = [f"{path} names {hook}" for path, text in product.items()
             for hook in TEST_HOOKS if hook in text]
    wrong += [f"{path} includes {t}" for path, text in product.items()
              for t in INCLUDE.findall(text) if t.startswith("cc/python/testing/")]
    assert not wrong, "\n".join(wrong)
    binds = re.findall(r'PYBIND11_MODULE\((\w+)', FILES["cc/python/testing/testing_module.cc"])
    assert binds == ["_testing"]
    package = os.path.join(ROOT, "perseus_tf")
    importers = []
    for folder, _, names in os.walk(package):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                if re.search(r"\b_testing\b", open(path).read()):
                    importers.append(os.path.relpath(path, ROOT))
    assert not importers, f"the package reaches perseus_tf._testing: {importers}"


def test_nothing_outside_plan_includes_the_plans_own_headers():
    wrong = [f"{path} includes {target}" for path, text in FILES.items()
             if not path.startswith(PLAN)
             for target in INCLUDE.findall(text)
             if target.startswith(PLAN) and target not in PLAN_INTERFACE]
    assert not wrong, "\n".join(wrong)
    # and the plan's code is there: its objects' methods are defined nowhere else
    methods = re.compile(r"^\S.*\b(PlanLearner|OfflinePlan)::\w+\(|^\S.*\b(DigestPlan|CheckPlans)\(.*\{$"
                         r"|^\S.*\bRequestTable::\w*Plan\w*\(|^\S.*\bController::\w*(Plan|Offline)\w*\(",
                         re.M)
    outside = [f"{path}: {m.group(0)}" for path, text in FILES.items()
               if not path.startswith(PLAN) and not path.endswith("_test.cc")
               for m in methods.finditer(text)]
    assert not outside, "\n".join(outside)


# The runtime's parts reach the rest of a round through their own interfaces
# (a context of callbacks and the objects they are handed), never the facade.
PARTS = ["cc/runtime/controller.cc", "cc/runtime/plan/offline.cc", "cc/runtime/health.cc",
         "cc/runtime/request_table.cc", "cc/runtime/plan/request_table_plan.cc",
         "cc/runtime/executor.cc"]


@pytest.mark.parametrize("path", PARTS)
def test_the_runtimes_parts_never_include_the_facade(path):
    assert path in FILES
    assert "cc/runtime/runtime.h" not in _includes_closure(path), \
        f"{path} reaches cc/runtime/runtime.h: talk to the part's interface instead"


def _class_body(text, name):
    start = re.search(r"^class %s \{$" % name, text, re.M)
    assert start, f"no class {name}"
    end = text.index("\n};", start.end())
    return text[start.end():end]


def test_runtime_has_no_friend_and_fewer_than_20_data_members():
    text = FILES["cc/runtime/runtime.h"]
    body = _class_body(text, "Runtime")
    assert not re.search(r"\bfriend\b", body), "Runtime has a friend"
    members = []
    for line in body.split("\n"):
        code = line.split("//")[0].strip()
        m = re.match(r"^[\w:<>, ]+[ *&](\w+_)(\{[^}]*\})?;$", code)
        if m:
            members.append(m.group(1))
    assert 10 <= len(members) < 20, members
    for path, other in FILES.items():
        if path.startswith("cc/runtime/"):
            assert not re.search(r"^\s*friend\b", other, re.M), f"{path} declares a friend"


def _definitions(text, owner):
    """(name, lines) of each function of `owner` defined at column 0."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^[\w:<>*&, ]*\b%s::(~?\w+)\(" % owner, line)
        if not m:
            continue
        if line.rstrip().endswith((";", "{}")):
            out.append((m.group(1), 1))  # = default, or an empty body
            continue
        for j in range(i, len(lines)):
            if lines[j] == "}":
                out.append((m.group(1), j - i + 1))
                break
    return out


def test_no_runtime_method_over_60_lines():
    found = {}
    for path, text in FILES.items():
        if path.startswith("cc/runtime/") and path.endswith(".cc"):
            for name, length in _definitions(text, "Runtime"):
                found[f"{path}:{name}"] = length
    assert len(found) > 20, found  # the parse found the methods
    long = {k: v for k, v in found.items() if v > 60}
    assert not long, f"Runtime methods over 60 lines: {long}"


def test_no_file_over_600_lines_without_a_reason():
    long = []
    for path, text in FILES.items():
        lines = text.count("\n")
        head = text.split("\n#", 1)[0]
        if lines > 600 and "over 600 lines" not in head:
            long.append(f"{path}: {lines} lines")
    assert not long, "\n".join(long)


# ---- the Python package -------------------------------------------------------------

PACKAGE = os.path.join(ROOT, "perseus_tf")


def _python_modules():
    """Module name -> the perseus_tf modules it imports when it is loaded
    (imports inside functions are left out: they run later, on purpose)."""
    import ast

    modules = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            imported = set()
            for node in ast.parse(open(path).read()).body:
                if isinstance(node, ast.Import):
                    imported.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module)
                    imported.update(f"{node.module}.{a.name}" for a in node.names)
            modules[".".join(parts)] = imported
    return {m: {i for i in imported if i in modules and i != m}
            for m, imported in modules.items()}


@pytest.mark.parametrize("package", ["perseus_tf.config", "perseus_tf.runner",
                                     "perseus_tf.common"])
def test_python_modules_of_a_package_import_without_a_circle(package):
    """Inside config/ and runner/ each module has one job and the modules
    import each other one way: a circle would mean two of them share one."""
    graph = {m: {i for i in imported if i.startswith(package + ".")}
             for m, imported in _python_modules().items() if m.startswith(package + ".")}
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        if state.get(node) == "open":
            pytest.fail("import circle: " + " -> ".join(trail[trail.index(node):] + [node]))
        state[node] = "open"
        for nxt in sorted(graph[node]):
            visit(nxt, trail + [node])
        state[node] = "done"

    assert len(graph) >= 3, sorted(graph)
    for node in sorted(graph):
        visit(node, [])


def _all_imports(module_path):
    """Every perseus_tf module a file imports, inside functions too."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(open(module_path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("perseus_tf"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.startswith("perseus_tf"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


# The Python layers, lowest first: a package may import its own modules and
# those of the layers below it, never one above (imports inside functions
# count too). common/ is the standard library's only; config/ reads the
# environment; runner/ is the launcher; the rest of the package (TensorFlow's
# side) may use all three but the launcher never reaches up to it.
PYTHON_LAYERS = [("perseus_tf.common", ()),
                 ("perseus_tf.config", ("perseus_tf.common",)),
                 ("perseus_tf.runner", ("perseus_tf.common", "perseus_tf.config",
                                        "perseus_tf._failure_record"))]


@pytest.mark.parametrize("package,below", PYTHON_LAYERS, ids=[p for p, _ in PYTHON_LAYERS])
def test_python_packages_import_only_the_layers_below(package, below):
    folder = os.path.join(ROOT, *package.split("."))
    wrong = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                for imported in sorted(_all_imports(path)):
                    if imported == "perseus_tf" or imported.startswith(package) or \
                            imported.startswith(below):
                        continue
                    wrong.append(f"{os.path.relpath(path, ROOT)} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_no_package_imports_a_private_name_of_another():
    """`from perseus_tf.x import _name`, where _name is a function or class
    (not a module) and x is in another package than the importer: what two
    packages share lives where both may import it under a public name.
    Within one package, private helpers are the package's own."""
    import ast
    package = os.path.join(ROOT, "perseus_tf")
    wrong = []
    for dirpath, _, names in os.walk(package):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and
                        node.module.startswith("perseus_tf")):
                    continue
                folder = os.path.join(ROOT, *node.module.split("."))
                home = folder if os.path.isdir(folder) else os.path.dirname(folder)
                if home == dirpath:
                    continue
                for a in node.names:
                    if not a.name.startswith("_") or a.name.startswith("__"):
                        continue
                    if os.path.exists(os.path.join(folder, a.name + ".py")) or \
                            os.path.isdir(os.path.join(folder, a.name)) or \
                            (os.path.isdir(folder) and
                             any(f.startswith(a.name + ".") for f in os.listdir(folder))):
                        continue  # a package-private module (or extension)
                    wrong.append(f"{os.path.relpath(path, ROOT)}: from {node.module} import {a.name}")
    assert not wrong, "\n".join(wrong)


def test_only_the_launcher_imports_the_launcher():
    """runner/ is perseusrun, not a library: what the rest of the package
    shares with it lives in common/ (or config/), so the library never
    imports the launcher (imports inside functions count too)."""
    package = os.path.join(ROOT, "perseus_tf")
    runner = os.path.join(package, "runner")
    wrong = []
    for dirpath, _, names in os.walk(package):
        if dirpath == runner or dirpath.startswith(runner + os.sep):
            continue
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                wrong += [f"{os.path.relpath(path, ROOT)} imports {m}"
                          for m in sorted(_all_imports(path))
                          if m == "perseus_tf.runner" or m.startswith("perseus_tf.runner.")]
    assert not wrong, "\n".join(wrong)


# -- Patches of Keras and TensorFlow go through perseus_tf/patches.py ----------------

def _functions_defined(tree):
    """Names of the functions a module defines (at any depth), and those of
    them that build and return a function of their own (wrapper factories)."""
    defined, factories = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.add(node.name)
            inner = {n.name for n in ast.walk(node)
                     if isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not node
                     and isinstance(n, ast.FunctionDef)}
            returns = {r.value.id for r in ast.walk(node)
                       if isinstance(r, ast.Return) and isinstance(r.value, ast.Name)}
            if inner & returns:
                factories.add(node.name)
    return defined, factories


def _is_function_value(value, defined, factories):
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name):
        return value.id in defined
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
            and value.func.id in factories)


def _patches_outside_registry(text):
    """(line, what) of each place that sets a function on another object's
    attribute (`Class.method = wrapper`, `setattr(module, name, fn)`) rather
    than through the registry's Patching; an instance's own (`self.x = ...`)
    does not count."""
    tree = ast.parse(text)
    defined, factories = _functions_defined(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Attribute)
                        and not (isinstance(target.value, ast.Name)
                                 and target.value.id == "self")
                        and _is_function_value(node.value, defined, factories)):
                    found.append((node.lineno, ast.unparse(target)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and len(node.args) == 3
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")
              and _is_function_value(node.args[2], defined, factories)):
            found.append((node.lineno, ast.unparse(node)))
    return found


# Python's own documented hooks are meant to be set.
PYTHON_HOOKS = {"sys.excepthook"}


def test_patches_go_through_the_registry_only():
    wrong = []
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            if not name.endswith(".py") or rel == "perseus_tf/patches.py":
                continue
            for line, what in _patches_outside_registry(open(path).read()):
                if what not in PYTHON_HOOKS:
                    wrong.append(f"{rel}:{line}: {what}")
    assert not wrong, ("patch these through perseus_tf/patches.py (a row in PATCHES, "
                       "Patching.wrap/replace):\n" + "\n".join(wrong))


def test_the_patch_rule_sees_each_way_of_patching():
    """The rule above finds a function, a lambda and a wrapper factory's
    result set on a class or module, by assignment and by setattr, and lets an
    instance's own attributes and plain values be."""
    text = '''
import functools
def _wrap(fn):
    @functools.wraps(fn)
    def wrapper(*a):
        return fn(*a)
    return wrapper
def install(cls, module):
    def replacement(self):
        pass
    cls.method = replacement
    module.function = _wrap(module.function)
    cls.hook = lambda self: True
    setattr(cls, "other", replacement)
    setattr(module, "other", _wrap(module.other))
def fine(self, options):
    self.method = _wrap(print)
    options.enabled = False
    self.count = len([])
'''
    found = [what for _, what in _patches_outside_registry(text)]
    assert found == ["cls.method", "module.function", "cls.hook",
                     "setattr(cls, 'other', replacement)",
                     "setattr(module, 'other', _wrap(module.other))"], found


def test_patch_table_order_and_targets():
    """Each patch comes after those it names in `after`, its apply function
    exists, and every name an entry point installs is in the table."""
    from perseus_tf import patches
    patches._check_table()
    for patch in patches.PATCHES:
        module, function = patch.apply.split(":")
        source = open(os.path.join(ROOT, *module.split(".")) +
                      ("/__init__.py" if module == "perseus_tf.strategy" else ".py")).read()
        assert f"def {function}(patching, flavour" in source, patch
        assert patch.targets and all("." in t for t in patch.targets), patch
    for group in (patches.STRATEGY, patches.STRATEGY_MULTI_RANK, patches.STEP_RESUME,
                  patches.BACKPORTS, patches.SHIM):
        assert set(group) <= set(patches.BY_NAME), set(group) - set(patches.BY_NAME)
