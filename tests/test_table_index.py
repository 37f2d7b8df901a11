"""The tables serving a device at a TP size, as one immutable index (``tunekit.dispatch.index``): what it keeps
(the first table wins a key, a foreign stamp or TP size is left out), its lookups (the table's M rule, O(1)
per key), that dispatch, coverage and the vLLM plugin's compile ranges all read it, that ``TUNEKIT_TABLE`` is
read in one function, and that serving reads no search-time TOML."""

from __future__ import annotations

import ast
import os
import random
from pathlib import Path

import pytest
import torch

import search_spaces
from tunekit import backends, ops
from tunekit import table as table_mod
from tunekit.backends.hip_elementwise import FAMILIES
from tunekit.dispatch import index as index_mod
from tunekit.integrations.vllm import compile as vllm_compile
from tunekit.measure.device import detect
from tunekit.problems import oprecords

pytestmark = pytest.mark.usefixtures("clean_ops")
REPO = Path(__file__).resolve().parents[1]
GEMV = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 1, "num_stages": 1}


def _table(rows: list[tuple], tp: int | None = None, **env) -> dict:
    """A table stamped for this machine (``env`` overrides stamp fields) of (op, m, n, k[, params]) rows."""
    entries = [{"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "backend": "triton",
                "params": rest[0] if rest else GEMV, "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0,
                "gbps": 1.0} for op, m, n, k, *rest in rows]
    table = table_mod.build_table(entries, detect().as_dict(), {}, 0.0, ["triton"], tp=tp)
    table["environment"].update(env)
    return table


def _save(tmp_path: Path, name: str, table: dict) -> str:
    return str(table_mod.save(table, tmp_path / name))


def test_the_index_keeps_what_serving_keeps_and_answers_by_key() -> None:
    first = _table([("gemv", 4, 16, 64), ("gemv", 1, 16, 64), ("rms_norm", 8, 64, 64, {"BLOCK_N": 64})], tp=2)
    second = _table([("gemv", 1, 16, 64, {**GEMV, "BLOCK_N": 8}), ("gemv", 2, 16, 64), ("gemv", 1, 24, 64)])
    foreign = _table([("gemv", 16, 16, 64)], gpu="another GPU")
    other_tp = _table([("gemv", 1, 32, 64)], tp=1)
    index, why = index_mod.build([("a", first), ("b", second), ("c", foreign), ("d", other_tp)], detect(), 2)
    assert why is None and index.size == 5
    assert index.ms("gemv", "bf16", 16, 64) == (1, 2, 4)  # sorted; the foreign table's M=16 left out
    assert index.lookup("gemv", "bf16", 1, 16, 64).params == GEMV  # the first table wins a key
    assert index.lookup("gemv", "bf16", 3, 16, 64).m == 4 and index.lookup("gemv", "bf16", 5, 16, 64) is None
    assert index.largest_m("gemv", "bf16", 16, 64) == 4 and index.largest_m("gemv", "bf16", None, 64) == 4
    assert index.largest_rows("rms_norm", "bf16", 64) == 8 and index.widths("gemv", "bf16", 64) == (16, 24)
    assert index.other_tp == {("gemv", "bf16", 32, 64): 1} and index.unmeasured == ("a", "b")
    assert index.tops() == {"gemv": 4, "rms_norm": 8} and index.holds("rms_norm") and not index.holds("gemv_add")
    with pytest.raises(TypeError):
        index.other_tp[("gemv", "bf16", 8, 8)] = 2  # read-only views: the index cannot change once built
    assert index_mod.build([("c", foreign)], detect(), None) == (None, "env_mismatch")


def test_lookup_agrees_with_the_table_rule() -> None:
    rng = random.Random(0)
    rows = sorted({("gemv", rng.choice((1, 2, 3, 4, 8, 16)), rng.choice((8, 16)), 64) for _ in range(40)})
    table = _table(rows)
    index, _ = index_mod.build([("t", table)], detect(), None)
    for m in range(1, 20):
        for n in (8, 16, 24):
            assert index.lookup("gemv", "bf16", m, n, 64) == table_mod.lookup(table, "gemv", "bf16", m, n, 64)


def test_dispatch_coverage_and_compile_ranges_read_the_same_index(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A table of another TP size holds the largest M: serving drops it, and so do coverage and the compile
    ranges (they were computed from every entry of the named tables, kept or not)."""
    kept = _save(tmp_path, "kept.json", _table([("gemv", 1, 16, 64), ("gemv", 4, 16, 64)], tp=2))
    dropped = _save(tmp_path, "tp1.json", _table([("gemv", 8, 16, 64), ("rms_gemv", 8, 16, 64)], tp=1))
    stale = _save(tmp_path, "stale.json", _table([("gemv", 64, 16, 64)], torch="0.0.1"))
    monkeypatch.setenv("TUNEKIT_TABLE", os.pathsep.join([kept, dropped, stale]))  # as vLLM is started
    ops.load_tables(None)
    try:
        ops.set_tensor_parallel(2)
        index = ops.serving_table("cpu")
        assert index.tops() == {"gemv": 4} and ops.largest_m("gemv", "bf16", 16, 64, "cpu") == 4
        assert ops.other_tp("rms_gemv", "bf16", 16, 64, "cpu") == 1
        assert not ops.covers("rms_gemv", "bf16", 16, 64, "cpu")
        assert vllm_compile.tables_tops(2) == {"gemv": 4}  # the endpoints vLLM gets: [4], not [8, 64]
        assert vllm_compile.range_endpoints(vllm_compile.tables_tops(2)) == [4]
        assert vllm_compile.tables_tops(None) == {"gemv": 8, "rms_gemv": 8}  # TP unknown: every TP serves
        x, w = torch.randn(3, 64).bfloat16(), torch.randn(16, 64).bfloat16()
        torch.ops.tunekit.gemv(x, w, None)
        assert [r["impl"] for r in ops.dispatch_stats()] == ["tuned:triton"]
    finally:
        ops.set_tensor_parallel(None)


def _env_reads(tree: ast.AST) -> list[str]:
    """The functions (``<module>`` at the top) that read ``TUNEKIT_TABLE`` from the environment: an
    ``os.environ.get`` / ``os.environ[...]`` / ``os.getenv`` of the string or of a ``TABLE_ENV`` name."""
    def names_table(arg: ast.AST) -> bool:
        return (isinstance(arg, ast.Constant) and arg.value == "TUNEKIT_TABLE") or \
            (isinstance(arg, ast.Name) and arg.id == "TABLE_ENV") or \
            (isinstance(arg, ast.Attribute) and arg.attr == "TABLE_ENV")

    def reads(node: ast.AST) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            environ = node.func.attr == "get" and isinstance(node.func.value, ast.Attribute) \
                and node.func.value.attr == "environ"
            return (environ or node.func.attr == "getenv") and names_table(node.args[0])
        return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
            and node.value.attr == "environ" and names_table(node.slice)

    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
            else:
                if reads(child):
                    found.append(where)
                visit(child, where)

    visit(tree, "<module>")
    return found


def test_tunekit_table_is_read_in_one_function() -> None:
    readers = sorted({(path.relative_to(REPO).as_posix(), where) for path in (REPO / "tunekit").rglob("*.py")
                      for where in _env_reads(ast.parse(path.read_text()))})
    assert readers == [("tunekit/dispatch/index.py", "table_paths")], readers
    # the check can fail
    assert _env_reads(ast.parse("import os\ndef f():\n    return os.environ['TUNEKIT_TABLE']\n"
                                "x = os.getenv(state.TABLE_ENV)\n")) == ["f", "<module>"]


def test_serving_reads_no_search_space_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries are checked against the kernel's own names and types and fallbacks built at the kernel's own
    default config: no search-time TOML is read while serving."""
    norm = backends.get("triton").serving_space(_problem("rms_norm")).default
    path = _save(tmp_path, "t.json", _table([("gemv", 1, 16, 64), ("rms_norm", 1, 64, 64, norm)]))
    search_spaces._read.cache_clear()

    def no_toml(stem: str):
        raise AssertionError(f"serving read search_spaces/{stem}.toml")

    monkeypatch.setattr(search_spaces, "_read", no_toml)
    ops.load_tables([path])
    torch.ops.tunekit.gemv(torch.randn(1, 64).bfloat16(), torch.randn(16, 64).bfloat16(), None)
    torch.ops.tunekit.rms_norm(torch.randn(3, 64).bfloat16(), torch.randn(64).bfloat16(), 1e-6)  # M above: default
    rows = {(r["op"], r["m"]): (r["impl"], r.get("vendor")) for r in ops.dispatch_stats()}
    assert rows[("gemv", 1)][0] == "tuned:triton", rows
    assert rows[("rms_norm", 3)] == ("fallback:m_above_table", ops.DEFAULT_VENDOR), rows


def _problem(op: str):
    from tunekit.problems.shapes import Problem

    return Problem(op, "bf16", 1, 64, 64)


@pytest.mark.parametrize("op", oprecords.names(backend="triton"))
def test_the_kernels_defaults_are_their_search_spaces(op: str) -> None:
    """What serving reads in place of the TOML (``serving_space``: the kernel's DEFAULT config, HIP's define
    names) says what the search space says: the same default and fixed values, names and value types."""
    triton = backends.get("triton")
    space, served = search_spaces.load(op, "triton"), triton.serving_space(_problem(op))
    if op in oprecords.names(kind="elementwise"):  # the ops whose fallbacks a default-config kernel serves
        assert served.default == dict(space.fixed) | dict(space.default)
    assert set(space.domains) | set(space.fixed) <= set(served.default)
    for name, values in space.domains.items():
        assert {type(v) for v in values} == {type(served.default[name])}, name
    if op in oprecords.names(backend="hip"):
        hip = search_spaces.load(op, "hip")
        names = set(backends.get("hip").serving_space(_problem(op)).domains)
        assert set(hip.domains) | set(hip.fixed) <= names and all(type(v) is int for vs in hip.domains.values()
                                                                      for v in vs)
        assert op == "gemv" or names == set(FAMILIES[op].params)


def test_every_ops_largest_m_ends_a_compile_range() -> None:
    """Issue 55: above an elementwise op's entries its nodes go back to Inductor's math (what vanilla compiles),
    not to a default-config kernel inside the op: SiLU-and-mul tabulated at M=1 ends the range [1, 2]."""
    assert vllm_compile.range_endpoints({"gemv": 16, "silu_and_mul": 1, "rms_norm": 8, "rms_gemv": 4}) == [2, 4, 8, 16]
    assert vllm_compile.range_endpoints({"gemv": 1}) == [2] and vllm_compile.range_endpoints({}) == []
