"""The package's layers, read from the source of every module: its import graph (function-local
imports count) has no cycle; `ops` imports no other subpackage; `control` imports only `ops`; and
the served worker reaches neither the standalone engine nor transformers."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sglang_dflash"
# Modules every layer may import: the package itself (imports nothing), the settings registry and
# the extension loader (standard library only).
BASE = {PACKAGE, f"{PACKAGE}.settings", f"{PACKAGE}._extension"}


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Module name -> source file, for every .py file of `package` under `root`."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The absolute names an import statement asks for (for `from X import a`, X.a as well as X)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of `package` that importing it runs, from every import statement in
    its source, at any depth. Importing a.b.c also runs a/__init__ and a/b/__init__: those count
    too, except the importer's own parent packages, which have run before it."""
    files = module_files(root, package)

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        parents = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, module, is_package):
                target = owner(name)
                if target is None:
                    continue
                chain = [target] + [target.rsplit(".", i)[0] for i in range(1, target.count(".") + 1)]
                deps.update(m for m in chain if m != module and m not in parents)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [m0, m1, ..., m0], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def in_layer(module: str, layer: str) -> bool:
    return module == f"{PACKAGE}.{layer}" or module.startswith(f"{PACKAGE}.{layer}.")


# -- the package ----------------------------------------------------------------------------------


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_ops_imports_nothing_above_it():
    graph = import_graph()
    wrong = sorted(f"{m} -> {d}" for m in graph if in_layer(m, "ops") for d in graph[m]
                   if not in_layer(d, "ops") and d not in BASE)
    assert not wrong, wrong


def test_control_imports_only_ops():
    graph = import_graph()
    wrong = sorted(f"{m} -> {d}" for m in graph if in_layer(m, "control") for d in graph[m]
                   if not (in_layer(d, "control") or in_layer(d, "ops")) and d not in BASE)
    assert not wrong, wrong


def test_serving_never_reaches_the_engine():
    graph = import_graph()
    served = set().union(*(reachable(graph, m) for m in graph if in_layer(m, "serving")))
    wrong = sorted(d for d in served if any(in_layer(d, layer) for layer in ("engine", "train", "cli", "demo")))
    assert not wrong, wrong


def test_the_workers_modules_import_without_transformers():
    """Everything of ours the served worker imports, imported in a fresh process, leaves
    transformers and the engine unloaded (the worker itself imports SGLang, which loads transformers
    for its own reasons)."""
    worker = f"{PACKAGE}.serving.worker"
    modules = sorted(reachable(import_graph(), worker) - {worker})
    assert f"{PACKAGE}.control.block_size" in modules and f"{PACKAGE}.serving.trees" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'transformers' or m.startswith('sglang_dflash.engine'))\n"
        "assert not loaded, loaded\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


# -- the checks themselves ------------------------------------------------------------------------


def test_the_graph_sees_a_cycle_through_a_function_local_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "a.py").write_text("import os\n\ndef f():\n    from pkg.sub.b import g\n    return g\n")
    (pkg / "sub" / "b.py").write_text("from .c import h\n")
    (pkg / "sub" / "c.py").write_text("def h():\n    from pkg import a\n    return a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b", "pkg.sub"}  # importing pkg.sub.b runs pkg/sub/__init__ first
    assert graph["pkg.sub.b"] == {"pkg.sub.c"}  # its own package has run before it
    assert find_cycle(graph) == ["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (pkg / "sub" / "c.py").write_text("def h():\n    return 1\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None
