"""The evidence modules import one another in layers: no module-level import circle, and the end-of-search
summary loads neither optuna nor torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The modules checked: every module of tunekit.evidence, and the search's summary (it imports the compare report).
ROOTS = (REPO / "tunekit" / "evidence", REPO / "tunekit" / "search" / "summary.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    files = [p for root in ROOTS for p in ([root] if root.is_file() else sorted(root.rglob("*.py")))]
    return {_module_name(p): p for p in files}


def _imports(path: Path, known: set[str], anywhere: bool) -> set[str]:
    """The known modules ``path`` imports: when it is imported (its module-level statements; functions'
    bodies and ``if TYPE_CHECKING:`` blocks run later or never), or ``anywhere`` in it."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    out: set[str] = set()

    def add(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif base in known:
                    out.add(base)

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            add(node)
            if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody)

    tree = ast.parse(path.read_text())
    if anywhere:
        for node in ast.walk(tree):
            add(node)
    else:
        visit(tree.body)
    return out


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(name: str, path: list[str]) -> list[str] | None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt, path + [nxt])):
                return found
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := walk(name, [name])):
            return found
    return None


@pytest.mark.parametrize("anywhere", [False, True], ids=["module-level", "function-level too"])
def test_no_import_circle(anywhere: bool) -> None:
    """No circle among the modules' imports at import time; none either counting the imports inside
    functions (a package's ``__init__`` importing its own modules is not a circle: they import their
    siblings, never the package)."""
    modules = _modules()
    graph = {name: _imports(path, set(modules), anywhere) - {name} for name, path in modules.items()}
    found = _circle(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_search_summary_loads_neither_optuna_nor_torch() -> None:
    code = ("import sys, tunekit.search.summary, tunekit.evidence.console; "
            "print(sorted(m for m in ('optuna', 'torch', 'matplotlib') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
