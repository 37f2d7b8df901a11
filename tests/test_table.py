"""Dispatch table: schema round-trip, rejection of corrupt tables, lookup rule."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tunekit import table as table_mod

DEVICE = {"name": "NVIDIA H200", "arch": "sm_90", "cu_count": 132, "wave_size": 32, "l2_bytes": 62914560,
          "memory_bytes": 1, "runtime": "cuda 13.0", "vendor": "nvidia", "torch_device": "cuda:0"}
PROBE = {"read_gbps": 4600.0}


def _row(m, n, k, backend, time_us, baseline_us, params=None):
    return {"op": "gemv", "dtype": "bf16", "m": m, "n": n, "k": k, "count": 48, "backend": backend,
            "label": backend, "params": json.dumps(params or {}), "time_us": time_us, "baseline_us": baseline_us,
            "speedup": baseline_us / time_us, "gbps": n * k * 2 / (time_us * 1e-6) / 1e9,
            "pct_of_limit": 90.0, "max_abs_err": 0.01, "err_ratio": 0.2, "timing_kind": "gpu"}


ROWS = [
    _row(1, 96, 5120, "vendor", 7.2, 7.2),
    _row(1, 96, 5120, "triton", 2.5, 7.2, {"BLOCK_N": 2}),
    _row(1, 96, 5120, "triton", 2.6, 7.2, {"BLOCK_N": 1}),
    _row(1, 5120, 6144, "vendor", 18.0, 18.0),
    _row(1, 5120, 6144, "triton", 17.9, 18.0, {"BLOCK_N": 8}),  # < 1% gain: stays out
    _row(4, 96, 5120, "vendor", 8.0, 8.0),
    _row(4, 96, 5120, "triton", 3.0, 8.0, {"BLOCK_N": 4}),
]


def _table():
    return table_mod.build_table(ROWS, DEVICE, PROBE, min_gain=0.01, backends=["triton"])


def _json_table():
    """:func:`_table` as its JSON file holds it (entries as JSON objects, to be broken by the tests)."""
    return table_mod.as_json(_table())


def test_round_trip(tmp_path) -> None:
    table = _table()
    path = table_mod.save(table, tmp_path / "table.json")
    loaded = table_mod.load(path)
    assert loaded == table and table_mod.as_json(loaded) == json.loads(path.read_text())
    assert loaded["format"] == table_mod.FORMAT
    keys = {(e.m, e.n, e.k) for e in table_mod.entries(loaded)}
    assert keys == {(1, 96, 5120), (4, 96, 5120)}  # 5120x6144 gained < min_gain
    best = next(e for e in table_mod.entries(loaded) if e.m == 1)
    assert best.params == {"BLOCK_N": 2} and best.time_us == 2.5
    env = loaded["environment"]
    assert env["gpu"] == "NVIDIA H200" and env["arch"] == "sm_90" and "triton" in env["kernel_hash"]


def test_min_gain_zero_admits_the_marginal_winner() -> None:
    table = table_mod.build_table(ROWS, DEVICE, PROBE, min_gain=0.0, backends=["triton"])
    assert any(e.n == 5120 for e in table_mod.entries(table))


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda t: t.update(format="other/9"), "unknown format"),
        (lambda t: t.pop("environment"), "environment"),
        (lambda t: t["environment"].pop("arch"), "lacks"),
        (lambda t: t["entries"][0].pop("params"), "params"),
        (lambda t: t["entries"][0].update(time_us=-1.0), "time_us"),
        (lambda t: t["entries"][0].update(m="1"), "'m'"),
        (lambda t: t["entries"].append(dict(t["entries"][0])), "duplicate"),
        (lambda t: t.update(entries={}), "list"),
    ],
)
def test_invalid_tables_are_refused(tmp_path, mutate, fragment) -> None:
    table = _json_table()
    mutate(table)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(table))
    with pytest.raises(table_mod.TableError) as err:
        table_mod.load(path)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_a_cpu_table_records_no_read_limit_as_the_report_says_none(tmp_path) -> None:
    # the CPU probe's "read_gbps" is an interpreter figure: the search and `compare` say "read limit: none"
    cpu_probe = {"read_gbps": 0.05, "copy_gbps": 0.04, "kind": "cpu"}
    table = table_mod.build_table(ROWS, DEVICE, cpu_probe, min_gain=0.01, backends=["triton"])
    assert table["read_limit_gbps"] is None
    assert table["entries"] and all(e.pct_of_limit is None for e in table_mod.entries(table))
    loaded = table_mod.load(table_mod.save(table, tmp_path / "cpu.json"), strict=True)
    assert loaded["read_limit_gbps"] is None
    # a GPU probe keeps its figure; a table written before (the CPU figure recorded) or without the field loads
    assert _table()["read_limit_gbps"] == 4600.0
    old = dict(table_mod.as_json(table), read_limit_gbps=0.05)
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert table_mod.load(tmp_path / "old.json")["read_limit_gbps"] == 0.05
    older = {k: v for k, v in table_mod.as_json(table).items() if k != "read_limit_gbps"}
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert "read_limit_gbps" not in table_mod.load(tmp_path / "older.json")


def test_corrupt_json_is_one_clear_error(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text('{"format": "tunekit.dispatch/1", "entr')
    with pytest.raises(table_mod.TableError, match="corrupt table"):
        table_mod.load(path)
    with pytest.raises(table_mod.TableError, match="no such table"):
        table_mod.load(tmp_path / "missing.json")


def test_lookup_takes_exact_m_then_the_smallest_larger_m() -> None:
    table = _table()
    assert table_mod.lookup(table, "gemv", "bf16", 1, 96, 5120).m == 1
    assert table_mod.lookup(table, "gemv", "bf16", 2, 96, 5120).m == 4
    assert table_mod.lookup(table, "gemv", "bf16", 5, 96, 5120) is None
    assert table_mod.lookup(table, "gemv", "bf16", 1, 97, 5120) is None


def test_environment_mismatch_names_the_fields() -> None:
    table = _table()
    other = dict(DEVICE, name="AMD Instinct MI250X", arch="gfx90a", wave_size=64)
    diffs = table_mod.environment_mismatch(table, other)
    assert any(d.startswith("gpu") for d in diffs) and any(d.startswith("arch") for d in diffs)


def test_changed_kernel_sources_are_a_mismatch() -> None:
    table = _table()
    here = dict(DEVICE)
    # same device and software as the stamp: no mismatch on those fields
    table["environment"].update({k: v for k, v in table_mod.environment_stamp(here, []).items()
                                 if k != "kernel_hash"})
    assert table_mod.environment_mismatch(table, here) == []
    table["environment"]["kernel_hash"]["triton"] = "0000000000000000"
    diffs = table_mod.environment_mismatch(table, here)
    assert len(diffs) == 1 and diffs[0].startswith("triton kernel sources")


@pytest.mark.parametrize("path", sorted((Path(table_mod.__file__).parent / "tables").glob("*/*.json")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_shipped_table_loads_as_entries_and_saves_byte_for_byte(tmp_path, path) -> None:
    """Every shipped table: its entries typed at load, and written back by ``save`` as the same bytes ``save``
    writes for its JSON (the entries' key order and number types kept)."""
    raw = json.loads(path.read_text())
    loaded = table_mod.load(path)
    assert loaded["entries"] and all(type(e) is table_mod.Entry for e in loaded["entries"])
    assert json.dumps(table_mod.as_json(loaded)) == json.dumps(raw)  # the same keys, in the same order
    typed = table_mod.save(loaded, tmp_path / "typed.json").read_bytes()
    assert typed == table_mod.save(raw, tmp_path / "raw.json").read_bytes()
    assert table_mod.load(tmp_path / "typed.json") == loaded


def test_an_entry_is_frozen_and_its_params_read_only() -> None:
    entry = table_mod.entries(_table())[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.m = 2
    with pytest.raises(TypeError):
        entry.params["BLOCK_N"] = 8
    assert dict(**entry.params) == {"BLOCK_N": 2} and {**entry.params} == {"BLOCK_N": 2}  # what kernels are given
    mine = dict(entry.params)
    mine["BLOCK_N"] = 8
    assert entry.params == {"BLOCK_N": 2} and entry.key == ("gemv", "bf16", 1, 96, 5120)
    assert entry.problem.key == "gemv|bf16|m1|n96|k5120" and entry.shape_key == ("gemv", "bf16", 96, 5120)
    assert {entry: 1}[table_mod.entries(_table())[0]] == 1  # hashable, equal by value
    # a dict given is copied behind the view: the caller's later writes do not reach the entry
    params = {"BLOCK_N": 4}
    made = table_mod.Entry("gemv", "bf16", 1, 8, 8, "triton", "k", params, 1.0, 2.0, 2.0, 1.0)
    params["BLOCK_N"] = 16
    assert made.params == {"BLOCK_N": 4}
    assert dataclasses.replace(made, time_us=0.5).params == {"BLOCK_N": 4}


def test_from_json_refuses_a_bad_entry_as_load_does(tmp_path) -> None:
    good = _json_table()["entries"][0]
    assert table_mod.Entry.from_json(good).to_json() == good
    bad = dict(good, time_us=-1.0)
    with pytest.raises(table_mod.TableError) as err:
        table_mod.Entry.from_json(bad, 3, "t.json")
    assert str(err.value) == "t.json: entry 3 (gemv bf16 m1 96x5120 triton): time_us=-1.0 (must be finite and > 0)"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(dict(_json_table(), entries=[bad])))
    with pytest.raises(table_mod.TableError, match=r"entry 0 \(gemv bf16 m1 96x5120 triton\): time_us=-1.0"):
        table_mod.load(path)
    with pytest.raises(table_mod.TableError, match="entry 0 is not an object"):
        table_mod.Entry.from_json([1])


def test_entries_converts_a_plain_dict_table_and_keeps_what_the_json_had() -> None:
    """A table written as a dict (tests, an integration) goes through the one converter; an older entry's
    missing optional fields read as their defaults and stay missing in its JSON; keys beyond the schema are
    kept."""
    table = _json_table()
    sparse = {k: v for k, v in table["entries"][0].items() if k not in ("count", "timing_kind", "err_ratio")}
    table["entries"][0] = dict(sparse, note="hand-edited")
    typed = table_mod.entries(table)
    assert [type(e) for e in typed] == [table_mod.Entry, table_mod.Entry]
    assert typed[0].count == 1 and typed[0].timing_kind is None and typed[0].err_ratio is None
    assert typed[0].to_json() == table["entries"][0] and list(typed[0].to_json()) == list(table["entries"][0])
    assert table_mod.entries({"entries": typed}) == typed  # entries already made pass as they are
    assert table_mod.lookup(table, "gemv", "bf16", 1, 96, 5120) == typed[0]
    table["entries"][1] = dict(table["entries"][1], m=0)
    with pytest.raises(table_mod.TableError, match=r"t.json: entry 1 \(gemv bf16 m0 96x5120 triton\): m=0"):
        table_mod.entries(table, "t.json")


def test_validate_checks_an_entry_made_directly() -> None:
    table = _table()
    table["entries"].append(dataclasses.replace(table["entries"][0], m=2, speedup=float("nan")))
    with pytest.raises(table_mod.TableError, match=r"entry 2 \(gemv bf16 m2 96x5120 triton\): speedup=nan"):
        table_mod.validate(table)
