"""camkv's modules import one another without a cycle, counting imports inside
functions too: a cycle is two modules that can only be understood (and changed)
together, whether Python happens to resolve it at import time or not."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "camkv"

# Compiled modules (no Python source to read; they import nothing of camkv's).
COMPILED = ("camkv._ext",)

# Cycles being removed elsewhere, each as a sorted tuple of modules: the cache hands
# the hook its queries and the hook calls back into the cache (a change of cache.py
# and hook.py under way); empty this set when it lands.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _module_name(path: Path, package: Path) -> str:
    parts = ("camkv",) + path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool, modules) -> list[str]:
    """The modules an import statement names: `from X import Y` names X.Y where that
    is a module (a submodule of package X), else X (Y is one of X's names)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the camkv modules it imports anywhere in its text."""
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in COMPILED}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        names = [n for node in ast.walk(tree)
                 for n in _imported(node, module, path.name == "__init__.py", set(graph) | set(files))]
        graph[module] = {n for n in names if n in graph or n in files} - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[tuple[str, ...]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_camkv_has_no_import_cycle():
    assert cycles(import_graph()) - KNOWN_CYCLES == set()


def test_the_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    package = tmp_path / "camkv"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .c import g\n")
    (package / "c.py").write_text("import camkv.a\n")
    (package / "d.py").write_text("from .a import thing\n")
    assert cycles(import_graph(package)) == {("camkv.a", "camkv.b", "camkv.c")}


# The oracle (docs/algorithm.md computed one step at a time) is for tests and for the
# reference backend's own runtime; production modules reach it only through the
# registry, which loads it by name (camkv.backends.oracle) when a cache asks for it.
ORACLE = "camkv.reference"


def importers_of(target: str, graph: dict[str, set[str]]) -> set[str]:
    """The modules whose text imports target (anywhere, functions included)."""
    return {module for module, imported in graph.items() if target in imported}


def test_no_production_module_imports_the_reference():
    assert importers_of(ORACLE, import_graph()) == set()


def test_the_check_sees_a_function_level_import_of_the_reference(tmp_path):
    package = tmp_path / "camkv"
    (package / "backends").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "reference.py").write_text("")
    (package / "backends" / "__init__.py").write_text("def f():\n    from .. import reference\n")
    (package / "backends" / "oracle.py").write_text("import importlib\nimportlib.import_module('camkv.reference')\n")
    assert importers_of(ORACLE, import_graph(package)) == {"camkv.backends"}


def test_a_cache_on_a_kernel_backend_never_loads_the_reference():
    from camkv import backends

    if backends.available()["ext"] is not None:
        pytest.skip(f"ext: {backends.available()['ext']}")
    code = ("import sys, mlx.core as mx, camkv\n"
            "mx.set_default_device(mx.cpu)\n"
            "c = camkv.CaMKVCache(budget=8, slack=2, scoring='key')\n"
            "k = mx.random.normal((1, 2, 20, 16))\n"
            "c.update_and_fetch(k, k); mx.eval(c.stored())\n"
            f"print({ORACLE!r} in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
