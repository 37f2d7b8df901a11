"""The house rules of the package layout (ARCHITECTURE.md): small modules, no import circle, and every
import path that moved still working (the same module object, with a DeprecationWarning)."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

from tunekit import _moved

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


def test_the_circle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_moved_import_path_still_works():
    """In a fresh interpreter (the alias must work on a first import, not only on a cached one): each old
    path warns, naming the new one, and is the very module object of the new path."""
    code = """
import importlib, json, sys, warnings
import tunekit
from tunekit._moved import MOVED
bad = []
for old, new in sorted(MOVED.items()):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    if not any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught):
        bad.append(f"{old}: no DeprecationWarning naming {new}")
    if module is not importlib.import_module(new) or module.__spec__.name != new:
        bad.append(f"{old}: not the module {new}")
print(json.dumps(bad))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    assert len(_moved.MOVED) >= 18


def test_old_submodule_and_from_import_forms():
    """``from tunekit.serving import markers`` and ``import tunekit.serve.analysis`` (a submodule of a moved
    package) give the new modules, not second copies."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from tunekit.serving import markers  # noqa: F401
        old_analysis = importlib.import_module("tunekit.serve.analysis")
    from tunekit.dispatch import markers as new_markers
    from tunekit.evidence.serve_bench import analysis

    assert markers is new_markers
    assert old_analysis is analysis
    assert _moved.new_path("tunekit.serving.state") == "tunekit.dispatch.state"
    assert _moved.new_path("tunekit.table") is None
