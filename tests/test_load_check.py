"""The load check (tunekit.dispatch.load_check): a table named by path is checked at load on this device, every
entry at every M it serves, on unit-scale and outlier inputs, several calls; an entry wrong anywhere is dropped and
named, its calls take the next path, and one line says what it cost. On the CPU interpreter the check is opt-in
(TUNEKIT_LOAD_CHECK=1); on a GPU it is the default (``auto``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from test_ops import make_table, timed_entry

import tunekit
import tunekit.ops as ops
from tunekit.dispatch import load_check

pytestmark = pytest.mark.usefixtures("clean_ops")  # conftest.py: no table, markers or vendor GEMM leak

N, K = 8, 64


def _table(tmp_path: Path, backend_at_4: str = "triton", backend_at_1: str = "triton") -> Path:
    """gemv N x K tabulated at M = 1 and M = 4 (M = 2..4 served by the M = 4 entry)."""
    return make_table(tmp_path / "table.json", [dict(timed_entry("gemv", N, K, m=1), backend=backend_at_1),
                                                dict(timed_entry("gemv", N, K, m=4), backend=backend_at_4)])


def _line(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if "load check" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


def _call(m: int) -> tuple[torch.Tensor, str]:
    """One served GEMV at M = m: its output against F.linear's, and the impl that served it."""
    torch.manual_seed(m)
    x, w = torch.randn(m, K, dtype=torch.bfloat16), torch.randn(N, K, dtype=torch.bfloat16)
    before = {r["impl"]: r["calls"] for r in ops.dispatch_stats() if r["op"] == "gemv" and r["m"] == m}
    y = torch.ops.tunekit.gemv(x, w, None)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), rtol=2e-2, atol=2e-2)
    after = {r["impl"]: r["calls"] for r in ops.dispatch_stats() if r["op"] == "gemv" and r["m"] == m}
    served = [impl for impl, calls in after.items() if calls > before.get(impl, 0)]
    assert len(served) == 1, (before, after)
    return y, served[0]


def test_served_ms_run_from_the_next_smaller_tabulated_m(tmp_path) -> None:
    from tunekit import table as table_mod

    path = make_table(tmp_path / "t.json", [timed_entry("gemv", N, K, m=m) for m in (1, 4, 16)])
    entries = sorted(table_mod.entries(table_mod.load(path)), key=lambda e: e.m)
    assert [load_check.served_ms(entries, e) for e in entries] == [(1,), (2, 3, 4), tuple(range(5, 17))]


def test_outlier_inputs_reach_the_magnitude_in_a_few_columns_and_leave_the_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(8, 256, dtype=torch.bfloat16)
    big, same = load_check.outlier_inputs((x, w), gen)
    assert same is w and big.dtype == x.dtype
    assert float(big.abs().max()) == pytest.approx(load_check.MAGNITUDE, rel=1e-2)
    changed = (big != x).any(dim=0)
    assert 1 <= int(changed.sum()) <= 256 * load_check.OUTLIER_CHANNELS


@pytest.mark.parametrize(("backend", "named"), [
    ("fault_backend:ZERO_AT_M3", "M=3, unit-scale inputs, call 1"),                 # an in-between M only
    ("fault_backend:ZERO_ABOVE_8", "M=2, |x| up to 1e+04 inputs, call 1"),         # large activations only
    ("fault_backend:ZERO_AFTER_FIRST", "M=2, unit-scale inputs, call 2"),           # after its first call only
])
def test_a_table_by_path_drops_an_entry_wrong_anywhere_it_serves_and_names_where(tmp_path, monkeypatch, caplog,
                                                                                backend, named) -> None:
    monkeypatch.setenv(load_check.ENV, "1")
    path = _table(tmp_path, backend_at_4=backend)
    ops.load_tables(str(path))
    with caplog.at_level(logging.INFO, logger="tunekit"):
        _, impl = _call(3)
    line = _line(caplog)
    assert f"dropped 1: {path}: gemv m4 8x64 {backend}: {named}" in line
    assert "2 entries at every M they serve" in line and " ms an entry" in line
    assert impl == "fallback:m_above_table"  # the M = 4 entry is gone: M = 3 has no entry at or above it
    assert _call(1)[1] == "tuned:triton"  # the right entry still serves


def test_the_same_check_through_tunekit_patch_and_tunekit_table(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv(load_check.ENV, "1")
    path = _table(tmp_path, backend_at_1="fault_backend:ZERO_ABOVE_8")
    tunekit.patch(torch.nn.Sequential(torch.nn.Linear(K, N)), table=path)
    with caplog.at_level(logging.INFO, logger="tunekit"):
        _call(1)
    assert ops.served_entry("gemv", "bf16", 1, N, K, "cpu").m == 4  # M = 1 now takes the M = 4 entry
    assert "gemv m1 8x64 fault_backend:ZERO_ABOVE_8: M=1, |x| up to 1e+04 inputs" in _line(caplog)
    caplog.clear()
    monkeypatch.setenv("TUNEKIT_TABLE", str(path))
    ops.load_tables(None)
    with caplog.at_level(logging.INFO, logger="tunekit"):
        _call(2)
    assert "fault_backend:ZERO_ABOVE_8" in _line(caplog)


def test_a_correct_table_keeps_every_entry_and_says_what_the_check_cost(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv(load_check.ENV, "1")
    ops.load_tables(str(_table(tmp_path)))
    with caplog.at_level(logging.INFO, logger="tunekit"):
        assert [_call(m)[1] for m in (1, 2, 3, 4)] == ["tuned:triton"] * 4
    line = _line(caplog)
    # 1 M for the M = 1 entry, 3 for the M = 4 entry; 2 input sets x CALLS calls each
    assert f"2 entries at every M they serve, {4 * 2 * load_check.CALLS} calls" in line and "all passed" in line


def test_on_the_interpreter_the_check_is_opt_in(tmp_path, monkeypatch, caplog) -> None:
    """``auto`` (the default) checks on GPUs only; "0" nowhere; a typo reads as auto, said once."""
    for value in ("auto", "0", "sometimes"):
        ops.load_tables(None)
        monkeypatch.setenv(load_check.ENV, value)
        ops.load_tables(str(_table(tmp_path, backend_at_4="fault_backend:ZERO_AT_M3")))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tunekit"):
            x, w = torch.randn(3, K, dtype=torch.bfloat16), torch.randn(N, K, dtype=torch.bfloat16)
            y = torch.ops.tunekit.gemv(x, w, None)
        assert not [r for r in caplog.records if "load check" in r.getMessage()]
        assert float(y.abs().max()) == 0.0  # unchecked, the defect serves: why a GPU checks by default
        if value == "sometimes":
            assert any("is not auto, 0 or 1" in r.getMessage() for r in caplog.records)
