"""The house rules of the package layout (ARCHITECTURE.md): small modules, and no import circle, neither
between modules nor between packages (a package that imports another one that imports it back cannot be read,
tested or installed apart from it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "tunekit"
#: Every package of the project whose imports the circle checks read: tunekit and the packages beside it.
PACKAGES = (PACKAGE, REPO / "search_spaces", REPO / "kernels_triton", REPO / "kernels_hip")
#: A module past this many lines holds more than one duty (the hubs split were 900-1400 lines).
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in (p for package in PACKAGES for p in package.rglob("*.py")):
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
    if parts[0] != "tunekit":  # search_spaces, kernels_triton: each package beside tunekit is one node
        return parts[0]
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


def _serving_api() -> set[str]:
    """``tunekit.ops.__all__``, read from its source (no torch imported here)."""
    tree = ast.parse((PACKAGE / "ops.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {elt.value for elt in node.value.elts}
    raise AssertionError("tunekit/ops.py has no __all__")


def _serving_imports(text: str, api: set[str]) -> list[tuple[int, str]]:
    """What a module of ``tunekit/integrations`` takes from the serving package other than the public names of
    ``tunekit.ops`` (line, what): a ``tunekit.dispatch`` module (or the package), a name ``tunekit.ops`` does
    not export (a ``_private`` one included), or such an attribute of the ``ops`` module (``ops.X``,
    ``_ops().X``)."""
    bad = []
    for node in ast.walk(ast.parse(text)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            bad += [(line, f"import {a.name}") for a in node.names if a.name.startswith("tunekit.dispatch")]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            if module == "tunekit.dispatch" or module.startswith("tunekit.dispatch."):
                bad.append((line, f"from {module} import {', '.join(a.name for a in node.names)}"))
            elif module == "tunekit.ops":
                bad += [(line, f"from tunekit.ops import {a.name}") for a in node.names if a.name not in api]
            elif module == "tunekit":
                bad += [(line, "from tunekit import dispatch") for a in node.names if a.name == "dispatch"]
        elif isinstance(node, ast.Attribute):
            value = node.value
            owner = value.id if isinstance(value, ast.Name) else (
                value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) else None)
            if owner in ("ops", "_ops") and node.attr not in api:
                bad.append((line, f"ops.{node.attr}"))
    return sorted(bad)


def test_integrations_use_only_the_public_serving_api():
    """``tunekit/integrations`` reaches serving through ``tunekit.ops``' public names only (``__all__``): no
    ``tunekit.dispatch.<module>`` import, no private name, so the dispatch layer can change inside."""
    api = _serving_api()
    bad = [f"{path.relative_to(REPO)}:{line} {what}" for path in sorted((PACKAGE / "integrations").rglob("*.py"))
           for line, what in _serving_imports(path.read_text(), api)]
    assert not bad, f"integrations use serving internals (export them from tunekit.ops if they are API): {bad}"


def test_the_serving_api_check_can_fail():
    text = ("from tunekit.dispatch.state import STATE\nimport tunekit.dispatch.tables\n"
            "from tunekit.ops import covers, _private\nfrom tunekit import ops, dispatch\nops.covers\nops.STATE\n"
            "_ops().largest_m\n_ops()._cache\n")
    assert [what for _, what in _serving_imports(text, {"covers", "largest_m"})] == [
        "from tunekit.dispatch.state import STATE", "import tunekit.dispatch.tables",
        "from tunekit.ops import _private", "from tunekit import dispatch", "ops.STATE", "ops._cache"]


def _op_name_tests(tree: ast.AST) -> list[str]:
    """Comparisons of an ``op`` (a name or an attribute ending ``.op``, not an FX node's) with a string literal:
    ``op == "gemv"``, ``problem.op != "..."``, ``op in ("...", ...)``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or len(node.ops) != 1:
            continue
        left, right = node.left, node.comparators[0]
        named_op = (isinstance(left, ast.Name) and left.id == "op") or (
            isinstance(left, ast.Attribute) and left.attr == "op"
            and not (isinstance(left.value, ast.Name) and left.value.id in ("node", "user", "add", "p")))
        literal = isinstance(right, ast.Constant) and isinstance(right.value, str) or (
            isinstance(right, ast.Tuple) and all(isinstance(e, ast.Constant) for e in right.elts))
        if named_op and literal and isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
            found.append(ast.unparse(node))
    return found


#: Op-name branches left outside the op records (39 before the records held layouts, gain offsets, fused-add
#: forms and the HIP families): the fused GEMV families' own semantics (rms_gemv's eps, gemv_add's residual) in
#: the vLLM compile pass, the merge, the fused dispatch label and the skinny GEMM's epilogue; the gated norm's
#: layout in the warm-up; the Triton backend's plain GEMV launch (kernels_triton/gemv.py's bytes stamp the
#: shipped tables, so its launch() takes the plain GEMV once a retune reships them); table.invalid_at_m's HIP
#: GEMV (built for its tabulated M; asked without importing the backend and its torch, which the HIP family's
#: ``built_up_to_m`` needs): there before, uncounted while entries were dicts (``entry["op"]`` is no ``.op``).
#: Lower it as they move into the records; never raise it.
OP_NAME_BRANCHES = 9


def test_op_names_are_not_branched_on_outside_the_records():
    """What an op is (its layout, gain offset, fused-add form, kernel family) is read from its record, not
    from an ``op == "..."`` test scattered over the package (evidence/ reports name ops on purpose)."""
    found = []
    for path in sorted((REPO / "tunekit").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("tunekit/evidence/") or rel == "tunekit/problems/oprecords.py":
            continue
        found += [f"{rel}: {text}" for text in _op_name_tests(ast.parse(path.read_text()))]
    assert len(found) <= OP_NAME_BRANCHES, "\n".join(found)
    assert _op_name_tests(ast.parse('if problem.op == "gemv":\n    pass\nif node.op == "call_function": pass'))


def test_the_op_name_check_can_fail():
    assert _op_name_tests(ast.parse('x = 1 if op in ("rms_norm", "gemma_rms_norm") else 2')) == [
        "op in ('rms_norm', 'gemma_rms_norm')"]


#: The keys of a table entry (``tunekit.table.ENTRY_KEYS``): outside the table module an entry is a
#: ``tunekit.table.Entry``, read by attribute.
ENTRY_KEYS = frozenset(("op", "dtype", "m", "n", "k", "backend", "kernel", "params", "time_us", "baseline_us",
                        "speedup", "gbps", "pct_of_limit", "max_abs_err", "err_ratio", "count", "timing_kind"))
#: The names entries go by in the package (search rows, trial records and problem dicts share the keys but
#: not these names: ``r``, ``row``, ``best`` (a search row), ``record``, ``p`` are not counted).
ENTRY_NAMES = frozenset(("e", "entry", "candidate", "merged", "plain", "gemv", "served"))
#: What hands out an entry: a call of one of these subscripted at once (``lookup(...)["m"]``) is an entry read.
ENTRY_GETTERS = frozenset(("lookup", "serving_lookup", "served_entry"))
#: The names tables go by: their ``["entries"]`` read outside the table module bypasses ``table.entries``,
#: the one converter (a hand-written table's entries are JSON objects until it makes them entries).
TABLE_NAMES = frozenset(("table", "t", "doc", "loaded", "served", "merged"))


def _names(node: ast.AST) -> str | None:
    """The name an expression goes by: ``x`` of a name, ``y`` of an attribute ``x.y``, ``f`` of a call ``f(...)``
    or ``x.f(...)``."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _string_key(node: ast.AST) -> tuple[ast.AST, str] | None:
    """(what is read, the key) of a read by string key: ``x["key"]`` (not a store) or ``x.get("key", ...)``."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant) \
            and isinstance(node.slice.value, str):
        return node.value, node.slice.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args \
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.func.value, node.args[0].value
    return None


def _entry_key_reads(tree: ast.AST) -> list[str]:
    """Table entries read by string key: an entry field of an entry-like expression (a name of
    :data:`ENTRY_NAMES` or one ending ``entry``, ``choice.entry``, ``table["entries"][i]``, ``lookup(...)``),
    and ``["entries"]`` of a table-like name (:data:`TABLE_NAMES`, ``lt.table``): a reader around the converter."""
    found = []
    for node in ast.walk(tree):
        read = _string_key(node)
        if read is None:
            continue
        target, key = read
        name = _names(target)
        inner = _string_key(target.value) if isinstance(target, ast.Subscript) else None
        entry_like = (not isinstance(target, ast.Call) and name is not None
                      and (name in ENTRY_NAMES or name.endswith("entry"))) \
            or (isinstance(target, ast.Call) and name in ENTRY_GETTERS) \
            or (inner is not None and inner[1] == "entries")
        table_like = not isinstance(target, ast.Call) and name is not None and \
            (name in TABLE_NAMES or name.endswith("table"))
        if (key in ENTRY_KEYS and entry_like) or (key == "entries" and table_like):
            found.append(ast.unparse(node))
    return found


#: Entry reads by string key left outside tunekit/table.py: 136 by this count before entries were typed (116
#: entry fields, 20 tables' "entries"). Never raise it.
ENTRY_KEY_READS = 0


def test_table_entries_are_read_by_attribute_outside_the_table_module():
    """An entry's fields are ``Entry`` attributes (checked once, where the table is read), not string keys a
    typo or an older table's missing field turns into a KeyError at serving time; a table's entries are had
    through ``tunekit.table.entries``, which makes a hand-written table's JSON objects entries."""
    found = []
    for path in sorted([*(REPO / "tunekit").rglob("*.py"), *(REPO / "scripts").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel == "tunekit/table.py":
            continue
        found += [f"{rel}: {text}" for text in _entry_key_reads(ast.parse(path.read_text()))]
    assert len(found) <= ENTRY_KEY_READS, "\n".join(found)


def test_the_entry_key_check_can_fail():
    from tunekit.table import ENTRY_KEYS as keys  # no torch: the table module is the serving path's

    assert ENTRY_KEYS == frozenset(keys)
    text = ('x = entry["m"]\ny = e.get("backend")\nz = choice.entry["time_us"]\nw = table["entries"][0]["params"]\n'
            'v = lookup(t, "gemv", "bf16", 1, 8, 8)["m"]\nfor e in lt.table["entries"]: pass\n'
            'ok = row["m"] + r.get("op") + entry.m + problem["k"] + report["entries"]\ntable["entries"] = []\n')
    assert _entry_key_reads(ast.parse(text)) == [
        "entry['m']", "e.get('backend')", "choice.entry['time_us']", "table['entries'][0]['params']",
        "lookup(t, 'gemv', 'bf16', 1, 8, 8)['m']", "lt.table['entries']", "table['entries']"]
