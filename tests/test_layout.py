"""The house rules of the package layout (ARCHITECTURE.md): small modules, and no import circle, neither
between modules nor between packages (a package that imports another one that imports it back cannot be read,
tested or installed apart from it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tunekit"
#: A module past this many lines holds more than one duty (the hubs split were 900-1400 lines).
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tunekit modules ``name`` imports anywhere: at the top and lazily inside functions alike (a lazy
    import that closes a circle is still two modules that cannot be read apart). Not counted: the root
    package ``tunekit`` (its ``patch`` / ``dispatch_stats`` facade imports the serving side lazily) and a
    module's own parent packages (imported by Python on the way, not by the module)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return {mod for mod in found
            if mod in modules and mod not in (name, "tunekit") and not name.startswith(mod + ".")}


def test_no_module_over_the_size_limit():
    too_big = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
               if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not too_big, f"modules over {MAX_LINES} lines (split them by duty): {too_big}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_circle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert not _cycles(graph), f"import circles (move what both need to a module below both): {_cycles(graph)}"


def _package(name: str, modules: dict[str, Path], depth: int | None) -> str:
    """The node ``name`` counts under in the package graph: the package it is (or is a module of), cut to
    ``depth`` levels below ``tunekit`` (1: the layers, tunekit.search, tunekit.evidence ...; None: every
    package, subpackages apart). A module of the root package (tunekit.table, tunekit.ops ...) is a node of its
    own: the root package is no layer."""
    parts = name.split(".")
    package = parts if modules[name].name == "__init__.py" else parts[:-1]
    if len(package) == 1:
        return name
    return ".".join(package if depth is None else package[: 1 + depth])


def _package_graph(depth: int | None) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = _package(name, modules, depth)
        for target in _imports(name, path, modules):
            there = _package(target, modules, depth)
            if there != here:
                graph.setdefault(here, set()).add(there)
    return graph


@pytest.mark.parametrize("depth", [1, None], ids=["layers", "every-package"])
def test_no_import_circle_between_packages(depth: int | None):
    """Packages as nodes (tunekit.search -> tunekit.evidence -> tunekit.search is a circle even where no two
    modules import each other): each layer, and each package with its subpackages apart."""
    graph = _package_graph(depth)
    circles = _cycles(graph)
    edges = {tuple(c): sorted(f"{a} -> {b}" for a in c for b in graph.get(a, ()) if b in c) for c in circles}
    assert not circles, f"package import circles (move what both need below both): {edges}"


def test_the_circle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    modules = {"tunekit.search.engine": Path("engine.py"), "tunekit.evidence.chain": Path("__init__.py"),
               "tunekit.evidence.chain.steps": Path("steps.py"), "tunekit.table": Path("table.py")}
    assert _package("tunekit.search.engine", modules, 1) == "tunekit.search"
    assert _package("tunekit.evidence.chain.steps", modules, 1) == "tunekit.evidence"
    assert _package("tunekit.evidence.chain.steps", modules, None) == "tunekit.evidence.chain"
    assert _package("tunekit.evidence.chain", modules, None) == "tunekit.evidence.chain"
    assert _package("tunekit.table", modules, 1) == "tunekit.table"
