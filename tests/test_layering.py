"""The package's layering, kept by a test: every module of `upd` is parsed (never imported), every import in it,
at module level and inside functions, relative ones resolved, is checked against the rules below.

The rules are the README's layering sentence as data: `runfile` (the file format, both sides) imports nothing above
it; the recorder does not reach into the integrations or the analyzer; the analyzer does not reach into the
recorder; no import circle, function-level imports included; and no import of an `upd` module inside a function
(the usual way to dodge a circle) except the few in DEFERRED, each deferring an expensive third-party import for a
stated reason and none closing a circle. A function-level import of an optional third-party package such as wandb
is fine."""
import ast
import os

import pytest

import upd

PACKAGE_DIR = os.path.dirname(upd.__file__)

# (importing package, packages it must not import, why): the README's layering sentence, one line per rule.
FORBIDDEN = [
    ("upd.runfile", ("upd.analyzer", "upd.recorder", "upd.replay", "upd.sinks", "upd.integrations"),
     "the run file is the bottom layer: it imports nothing above it"),
    ("upd.recorder", ("upd.integrations", "upd.analyzer"),
     "the recorder writes files and feeds sinks; integrations and the analyzer sit on top of it"),
    ("upd.analyzer", ("upd.recorder",),
     "the analyzer reads run files; it never needs the code that wrote them"),
]

# (importing module, imported module): why the import waits for the function that needs it. Each defers torch or
# matplotlib, which the commands that never need them must not pay for; test_no_import_circle still sees these edges.
DEFERRED = {
    ("upd.analyzer.analyze", "upd.analyzer.plots"): "matplotlib loads only when figures are drawn (--no-plots)",
    ("upd.analyzer.compare", "upd.analyzer.plots"): "matplotlib loads only when figures are drawn (--no-plots)",
    ("upd.launcher.global_hooks", "upd.launcher.attach"):
        "every process of `upd record` loads the hooks; attach imports torch, at the first step",
    ("upd.recorder", "upd.recorder.recorder"): "`upd record` reads the record options without importing torch",
    ("upd.runfile", "upd.runfile.job"): "job.py imports torch, which reading one file never needs",
    ("upd.runfile.opening", "upd.runfile.job"): "job.py imports torch, which reading one file never needs",
}


def module_name(path):
    rel = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-len(".py")].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def package_modules():
    """{module name: path} for every .py file of the package."""
    found = {}
    for root, _dirs, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                found[module_name(path)] = path
    return found


MODULES = package_modules()


def _is_type_checking(test):
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(module, source, is_package=False):
    """[(line, imported upd module, inside a function)] for every import of an upd module in one file. `from a
    import b` counts as importing a.b when a.b is a module, else a (the package's __init__)."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def target(name):
        return name if name in MODULES else None

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                continue  # annotations only: never executed, so neither a layer nor a circle
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if target(alias.name):
                        found.append((child.lineno, alias.name, in_function))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[:len(package.split(".")) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                if not (source == "upd" or source.startswith("upd.")):
                    continue
                for alias in child.names:
                    sub = f"{source}.{alias.name}"
                    if target(sub):
                        found.append((child.lineno, sub, in_function))
                    elif target(source):
                        found.append((child.lineno, source, in_function))
            visit(child, nested)

    visit(tree, False)
    return sorted(set(found), key=found.index)  # `from m import a, b`: one import of m


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


IMPORTS = {module: imports_of(module, read(path), path.endswith("__init__.py")) for module, path in MODULES.items()}


def within(module, package):
    return module == package or module.startswith(package + ".")


def where(module, line):
    return f"{os.path.relpath(MODULES[module], os.path.dirname(PACKAGE_DIR))}:{line}"


def layer_violations():
    broken = []
    for module, found in sorted(IMPORTS.items()):
        for importer, forbidden, why in FORBIDDEN:
            if not within(module, importer):
                continue
            for line, imported, _in_function in found:
                if any(within(imported, f) for f in forbidden):
                    broken.append(f"{where(module, line)} imports {imported} ({importer}: {why})")
    return broken


def function_level_imports():
    return [f"{where(module, line)} imports {imported} inside a function"
            for module, found in sorted(IMPORTS.items()) for line, imported, in_function in found
            if in_function and (module, imported) not in DEFERRED]


def import_circles(imports=IMPORTS):
    """Every strongly connected set of more than one module (or a module importing itself), over all imports
    (a function-level import that closes a circle still is one: it only moves the failure to run time)."""
    graph = {m: sorted({imported for _line, imported, _f in found if imported != m}) for m, found in imports.items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def connect(v):  # Tarjan's algorithm, iterative enough for a package this size
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return circles


def test_the_scanner_sees_every_kind_of_import():
    """The scanner itself can fail: a planted module with each kind of import is read as expected."""
    source = ("from . import ratios\nimport upd.runfile.schema\n"
              "def f():\n    from ..analyzer import summary\n    import wandb\n")
    found = imports_of("upd.runfile.writer", source)  # read as if it were runfile/writer.py
    assert found == [(1, "upd.runfile", False), (2, "upd.runfile.schema", False),
                     (4, "upd.analyzer.summary", True)]
    assert import_circles({"a": [(1, "b", False)], "b": [(1, "c", True)], "c": [(1, "a", False)], "d": []}) == \
        [["a", "b", "c"]]


def test_every_module_is_scanned():
    assert "upd.runfile.reader" in MODULES and "upd.recorder.recorder" in MODULES
    assert sum(len(found) for found in IMPORTS.values()) > 100


def test_layers_import_only_downwards():
    broken = layer_violations()
    assert not broken, "\n".join(broken)


def test_no_upd_import_inside_a_function():
    found = function_level_imports()
    assert not found, "\n".join(found)


def test_no_import_circle():
    circles = import_circles()
    assert not circles, "\n".join(" <-> ".join(circle) for circle in circles)


if __name__ == "__main__":  # a readable list of what is broken today: python tests/test_layering.py
    for line in layer_violations() + function_level_imports():
        print(line)
    for circle in import_circles():
        print("circle:", " <-> ".join(circle))
    pytest.main([__file__, "-q"])
