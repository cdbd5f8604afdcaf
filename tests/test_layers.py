"""The package's import graph: no cycles, and every layer imports only the layers below it.

The layers, bottom to top (docs/architecture.md): the foundation (errors, schema, interrupts,
walk), storage, optim, kernels, autodiff, passes, runtime, lora, builder, training, then the applications
built on them (export, migrate, distributed, backend; conformance, demo; cli). Imports inside
functions count: a lazy import is still a dependency. The checkout's other folders (benchmarks/,
tests/, examples/, models/) are not installed: the package imports none of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import onnx_training_ops

PACKAGE = "onnx_training_ops"
ROOT = Path(onnx_training_ops.__file__).parent
LAYERS = [
    {"errors", "schema", "interrupts", "walk", "_version"},
    {"storage"},
    {"optim", "schedules"},
    {"kernels"},
    {"autodiff"},
    {"passes"},
    {"runtime"},
    {"lora"},
    {"builder"},
    {"training"},
    {"export", "migrate", "distributed", "backend"},
    {"conformance", "demo"},
    {"demo_ddp"},
    {"cli"},
    {"__main__"},
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join((PACKAGE, *parts))] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (resolved to modules, not names in them)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
    # importing a.b.c first runs the __init__ of a and a.b (unless we are inside them)
    for target in list(found):
        parent = target.rpartition(".")[0]
        while parent.startswith(PACKAGE) and parent != PACKAGE:
            if not name.startswith(parent + ".") and parent != name:
                found.add(parent)
            parent = parent.rpartition(".")[0]
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    if module == PACKAGE:
        return len(LAYERS)
    top = module.split(".")[1]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"{module}: its folder is in no layer of LAYERS (add it, and to docs/architecture.md)")


def test_the_package_has_no_import_cycle():
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_every_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, targets in sorted(_graph().items()):
        for target in sorted(targets):
            same_folder = target.split(".")[:2] == module.split(".")[:2]
            if not same_folder and _layer(target) >= _layer(module):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(wrong)


def test_the_package_imports_nothing_of_the_checkout_around_it():
    outside = {"benchmarks", "tests", "examples", "models", "docs_hooks"}
    wrong = []
    for name, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                sources = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                sources = [node.module or ""]
            else:
                continue
            wrong += [f"{name} -> {s}" for s in sources if s.split(".")[0] in outside]
    assert not wrong, "the installed package imports the checkout's other folders:\n" + "\n".join(wrong)


def test_the_walk_sees_the_imports_it_must():
    graph = _graph()  # a check of the checker: known edges, lazy ones included
    assert "onnx_training_ops.runtime.options" in graph["onnx_training_ops.runtime.pipeline"]
    assert "onnx_training_ops.kernels._native_kernels" in graph["onnx_training_ops.runtime.native"]
    assert "onnx_training_ops.storage" in graph["onnx_training_ops.training.session.session"]
