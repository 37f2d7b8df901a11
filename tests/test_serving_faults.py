"""Serving faults: a tuned kernel that fails in the middle of serving, the canary (TUNEKIT_CANARY), and a table
tuned for another tensor-parallel size.

The kernels are Triton's under the interpreter, made to fail after a few good
calls (``fault_backend:RAISE_AFTER``, ``fault_backend:DRIFT``): a kernel that
passed its warm-up and then breaks. Each test asserts what the user gets
after the fault (the vendor path's outputs, bit for bit), the one log line,
and the dispatch markers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import fault_backend
import pytest
import torch
import torch.nn.functional as F
from test_ops import make_table, timed_entry
from torch import nn

import tunekit
from tunekit import ops
from tunekit.dispatch import canary
from tunekit.dispatch import gemv as gemv_mod

pytestmark = pytest.mark.usefixtures("clean_ops")

K = 64
AFTER = fault_backend.AFTER_CALLS


@pytest.fixture(autouse=True)
def _no_canary(monkeypatch) -> None:
    monkeypatch.delenv(canary.CANARY_ENV, raising=False)


def _table(tmp_path: Path, op: str, n: int, backend: str, k: int = K) -> None:
    entry = dict(timed_entry(op, n, k), backend=backend)
    ops.load_tables(str(make_table(tmp_path / f"{op}-{n}.json", [entry])))


def _rows(op: str) -> dict[tuple[str, str], int]:
    """(impl, counted_at) -> calls of ``op``'s marker rows."""
    out: dict[tuple[str, str], int] = {}
    for r in ops.dispatch_stats():
        if r["op"] == op:
            out[(r["impl"], r["counted_at"])] = out.get((r["impl"], r["counted_at"]), 0) + r["calls"]
    return out


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tunekit.ops" and text in r.getMessage()]


def _xw(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, K, generator=gen).bfloat16(), (torch.randn(n, K, generator=gen) / 8).bfloat16()


# ----------------------------------------------------------------------------- a kernel that raises mid-serve


def test_a_gemv_kernel_that_raises_after_warm_up_falls_back_logged_once_and_counted(tmp_path: Path,
                                                                                    caplog) -> None:
    n = 24
    _table(tmp_path, "gemv", n, "fault_backend:RAISE_AFTER")
    _, w = _xw(n, 0)
    caplog.set_level(logging.WARNING, logger="tunekit.ops")
    outs = []
    for i in range(AFTER + 4):
        x, _ = _xw(n, 100 + i)
        outs.append((x, torch.ops.tunekit.gemv(x, w, None)))
    for x, y in outs[AFTER:]:  # after the fault: the vendor path's bits
        assert torch.equal(y, F.linear(x, w))
    tuned = "tuned:fault_backend:RAISE_AFTER"
    assert _rows("gemv") == {(tuned, "call"): AFTER, ("fallback:kernel_error", "call"): 4}
    vendors = {r["vendor"] for r in ops.dispatch_stats() if r["impl"] == "fallback:kernel_error"}
    assert vendors == {"F.linear"}
    lines = _warnings(caplog, "tuned kernel raised")
    assert len(lines) == 1, lines
    assert f"gemv bf16 M=1 N={n} K={K}" in lines[0] and "injected fault" in lines[0]


def test_a_raising_kernel_in_a_patched_model_falls_back_and_the_model_keeps_serving(tmp_path: Path,
                                                                                    caplog) -> None:
    n = 40
    _table(tmp_path, "gemv", n, "fault_backend:RAISE_AFTER")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, n, bias=False)).bfloat16()
    plain = nn.Sequential(nn.Linear(K, n, bias=False)).bfloat16()
    plain.load_state_dict(model.state_dict())
    caplog.set_level(logging.WARNING, logger="tunekit.ops")
    assert tunekit.patch(model)["linear"] == 1
    for i in range(AFTER + 3):
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(i)).bfloat16()
        with torch.no_grad():
            y = model(x)
            if i >= AFTER:
                assert torch.equal(y, plain(x)), i
    assert _rows("gemv")[("fallback:kernel_error", "call")] == 3
    assert len(_warnings(caplog, "tuned kernel raised")) == 1
    tunekit.unpatch(model)


def test_a_fused_rms_gemv_kernel_that_raises_falls_back_to_the_norm_then_the_gemv(tmp_path: Path, caplog) -> None:
    n = 48
    _table(tmp_path, "rms_gemv", n, "fault_backend:RAISE_AFTER")
    _, w = _xw(n, 1)
    caplog.set_level(logging.WARNING, logger="tunekit.ops")
    for i in range(AFTER + 2):
        x, _ = _xw(n, 200 + i)
        y = torch.ops.tunekit.rms_gemv(x, w, 1e-6)
        if i >= AFTER:
            xf = x.float()
            normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
            # the unfused sequence, as the op's fallback runs it (norm rounded to BF16, then the vendor GEMM)
            assert (y.float() - F.linear(normed, w).float()).abs().max().item() <= 2 ** -6
    assert _rows("rms_gemv")[("fallback:kernel_error", "call")] == 2
    assert len(_warnings(caplog, "rms_gemv bf16 M=1")) == 1


def test_a_raise_while_a_cuda_graph_is_captured_records_the_vendor_path_in_the_graph(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """The kernel was built and served at warm-up; it raises while a graph is being captured: the graph records
    the vendor path (Python runs once, at capture; a replay runs no Python, so no fallback can happen there).
    The capture is simulated on the CPU (the op's capture flag)."""
    n = 56
    _table(tmp_path, "gemv", n, "fault_backend:RAISE_AFTER")
    _, w = _xw(n, 2)
    for i in range(AFTER):  # warm-up: built and served eagerly
        torch.ops.tunekit.gemv(_xw(n, 300 + i)[0], w, None)
    monkeypatch.setattr(gemv_mod, "is_capturing", lambda x: True)
    x, _ = _xw(n, 399)
    assert torch.equal(torch.ops.tunekit.gemv(x, w, None), F.linear(x, w))
    rows = _rows("gemv")
    assert rows[("tuned:fault_backend:RAISE_AFTER", "call")] == AFTER
    assert rows[("fallback:kernel_error", "capture")] == 1


# ----------------------------------------------------------------------------- the canary


def test_without_the_canary_a_drifting_kernel_is_served_and_guard_is_the_kernel_itself(tmp_path: Path) -> None:
    n = 32
    _table(tmp_path, "gemv", n, "fault_backend:DRIFT")
    _, w = _xw(n, 3)
    wrong = 0
    for i in range(AFTER + 2):
        x, _ = _xw(n, 400 + i)
        y = torch.ops.tunekit.gemv(x, w, None)
        wrong += not torch.allclose(y.float(), F.linear(x, w).float(), rtol=0.03, atol=1e-3)
    assert wrong == 2  # what the canary is for: nothing else notices
    assert _rows("gemv") == {("tuned:fault_backend:DRIFT", "call"): AFTER + 2}

    def kernel(inputs, out):
        return None

    # off: the route keeps the kernel itself (the hot path is the code without the canary)
    assert canary.guard("gemv", "bf16", 1, n, K, torch.device("cpu"), kernel) is kernel


def test_the_canary_demotes_a_key_whose_kernel_drifts_beyond_the_bound(tmp_path: Path, monkeypatch,
                                                                       caplog) -> None:
    monkeypatch.setenv(canary.CANARY_ENV, "1")
    n = 16
    _table(tmp_path, "gemv", n, "fault_backend:DRIFT")
    _, w = _xw(n, 4)
    caplog.set_level(logging.WARNING, logger="tunekit.ops")
    outs = []
    for i in range(AFTER + 3):
        x, _ = _xw(n, 500 + i)
        outs.append((x, torch.ops.tunekit.gemv(x, w, None)))
    for x, y in outs[AFTER:]:
        assert torch.equal(y, F.linear(x, w))
    assert _rows("gemv") == {("tuned:fault_backend:DRIFT", "call"): AFTER, ("fallback:canary_mismatch", "call"): 3}
    lines = _warnings(caplog, "canary")
    assert len(lines) == 1 and "the op's bound" in lines[0], lines


def test_the_canary_checks_one_call_in_n_and_passes_a_right_kernel(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(canary.CANARY_ENV, "3")
    n = 8
    _table(tmp_path, "rms_gemv", n, "triton")
    checked = []
    real = canary.mismatch
    monkeypatch.setattr(canary, "mismatch", lambda *a: checked.append(1) or real(*a))
    _, w = _xw(n, 5)
    for i in range(9):
        torch.ops.tunekit.rms_gemv(_xw(n, 600 + i)[0], w, 1e-6)
    assert len(checked) == 3
    assert _rows("rms_gemv") == {("tuned:triton", "call"): 9}


def test_a_canary_value_that_is_not_a_number_is_off_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.setenv(canary.CANARY_ENV, "often")
    caplog.set_level(logging.WARNING, logger="tunekit.ops")
    assert canary.every() == 0 and canary.every() == 0
    assert len(_warnings(caplog, "TUNEKIT_CANARY='often'")) == 1


# ----------------------------------------------------------------------------- a table for another TP size


def _tp_table(tmp_path: Path, n: int, tp: int | None) -> str:
    path = make_table(tmp_path / f"tp{tp}.json", [dict(timed_entry("gemv", n, K))])
    table = json.loads(path.read_text())
    if tp is None:
        table.pop("tp")  # a table written before the TP size was recorded
    else:
        table["tp"] = tp
    path.write_text(json.dumps(table))
    return str(path)


def test_a_table_for_another_tp_size_serves_none_of_its_shapes_with_the_reason_counted(tmp_path: Path,
                                                                                      caplog) -> None:
    from tunekit.dispatch import tables

    n = 72
    caplog.set_level(logging.WARNING, logger="tunekit.ops")
    x, w = _xw(n, 7)
    try:
        tables.set_tensor_parallel(2)
        for tp, impl in ((1, "fallback:tp_mismatch"), (2, "tuned:triton"), (None, "tuned:triton")):
            ops.load_tables(_tp_table(tmp_path, n, tp))
            ops.reset_stats()
            y = torch.ops.tunekit.gemv(x, w, None)
            assert [r["impl"] for r in ops.dispatch_stats()] == [impl], tp
            assert ops.loaded_tables()[0]["tp"] == tp
            if tp == 1:
                assert torch.equal(y, F.linear(x, w))
                assert tables.other_tp("gemv", "bf16", n, K, "cpu") == 1
                assert not tables.covers("gemv", "bf16", n, K, "cpu")
        lines = _warnings(caplog, "was tuned for tp=1, this process serves tp=2")
        assert len(lines) == 1 and "--tp 2" in lines[0], lines
        tables.set_tensor_parallel(None)  # unknown TP: every table serves as it records
        ops.load_tables(_tp_table(tmp_path, n, 1))
        assert tables.covers("gemv", "bf16", n, K, "cpu")
    finally:
        tables.set_tensor_parallel(None)


def test_tables_record_their_tp_size_and_older_tables_read_as_unknown(tmp_path: Path) -> None:
    from tunekit import table as table_mod
    from tunekit.measure.device import detect
    from tunekit.search.common import SearchConfig
    from tunekit.search.results import write_run_json

    rows = [dict(timed_entry("gemv", 8, K), backend="triton")]
    assert table_mod.build_table(rows, detect().as_dict(), {}, 0.0, ["triton"], tp=2)["tp"] == 2
    assert table_mod.build_table(rows, detect().as_dict(), {}, 0.0, ["triton"])["tp"] is None
    old = json.loads(make_table(tmp_path / "old.json", rows).read_text())
    old.pop("tp")
    table_mod.validate(old)
    assert table_mod.table_tp(old) is None
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(table_mod.TableError, match="tp="):
            table_mod.validate(dict(old, tp=bad))
    # the search records the --tp it sharded for in run.json, which tunekit export reads back
    cfg = SearchConfig(problems=[], backends=["triton"], out_dir=tmp_path, tp=4)
    written = write_run_json(tmp_path, cfg, "sqlite://", detect().as_dict(), {}, ["triton"])
    assert json.loads(written.read_text())["tp"] == 4
