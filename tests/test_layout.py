"""The package's layout rules (docs/architecture.md), checked on the source:

- no import cycles between flashtile's modules, counting imports inside functions too;
- no file mixes device and host code: a file that defines @triton.jit / @gluon.jit functions
  imports no torch and defines no classes (host plans live in the launch / plan modules);
- kernels/ never imports the layers above it (ops, the public API, the dispatcher, tools).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flashtile"


def _modules() -> dict:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _imports(name: str) -> set:
    """The flashtile modules ``name`` imports anywhere in its file (module level or in functions).
    ``from pkg import sub`` counts as importing pkg.sub; a module's own packages are not counted
    (Python initialises them first in any case)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            target = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES]
            found.update(submodules)
            if target in MODULES and len(submodules) < len(node.names):
                found.add(target)
    return {m for m in found if m != name and not name.startswith(m + ".")}


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = {name: _imports(name) for name in MODULES}
    assert _cycles(graph) == []


def _decorated_jit(tree) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(target, ast.Attribute) and target.attr == "jit":
                    return True
    return False


def test_device_files_hold_no_host_code():
    device_files = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        if not _decorated_jit(tree):
            continue
        device_files.append(name)
        assert "torch" not in _imported_names(tree), f"{name} defines kernels and imports torch"
        classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
        assert not classes, f"{name} defines kernels and host classes {classes}"
    assert len(device_files) >= 10, device_files  # the kernels were found at all


def _imported_names(tree) -> set:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add((node.module or "").split(".")[0])
    return names


def test_kernels_do_not_import_the_layers_above():
    above = ("flashtile.ops", "flashtile.interface", "flashtile.varlen", "flashtile.kvcache", "flashtile.dispatch",
             "flashtile.explanation", "flashtile.tools", "flashtile.compat", "flashtile.modules")
    for name in MODULES:
        if name.startswith("flashtile.kernels"):
            bad = [m for m in _imports(name) if m.startswith(above)]
            assert not bad, f"{name} imports {bad}"
