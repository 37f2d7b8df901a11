"""``torch.ops.tunekit.rms_gemv`` / ``gemv_add``: served from a table (tuned) or by the unfused vendor
sequence, counted, opaque under torch.compile, built by prepare (CPU tier, Triton interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_ops import _entry, make_table

from tunekit import ops
from tunekit.backends import get
from tunekit.dispatch.state import STATE
from tunekit.measure import verify
from tunekit.problems import opspec, opspec_gemv
from tunekit.problems.shapes import Problem

pytestmark = pytest.mark.usefixtures("clean_ops")  # conftest.py: no table, markers or vendor GEMM leak

CPU = torch.device("cpu")
N, K = 40, 384


def _table(tmp_path: Path, op: str, ms: tuple[int, ...] = (1,)) -> Path:
    params = get("triton").space(Problem(op, "bf16", 1, N, K)).default
    path = make_table(tmp_path / f"{op}.json", [_entry(op, m, N, K, params=params) for m in ms])
    ops.load_tables(str(path))
    return path


def _rows(op: str, **match) -> list[dict]:
    return [r for r in ops.dispatch_stats() if r["op"] == op and all(r[k] == v for k, v in match.items())]


def _served(op: str):
    fn = getattr(torch.ops.tunekit, op)
    return (lambda inputs, out: out.copy_(fn(*inputs, opspec.EPS))) if op == "rms_gemv" else \
        (lambda inputs, out: out.copy_(fn(*inputs)))


@pytest.mark.parametrize("op", ["rms_gemv", "gemv_add"])
def test_a_tabled_m_runs_the_tuned_kernel_and_others_the_vendor_sequence(tmp_path: Path, op: str) -> None:
    _table(tmp_path, op, ms=(1, 4))
    spec = opspec.get(op)
    for m in (1, 3, 4):  # 3: the M=4 entry serves it (the tables' M rule)
        assert verify.verify(_served(op), spec, Problem(op, "bf16", m, N, K), CPU, seed=m).ok
    assert verify.verify(_served(op), spec, Problem(op, "bf16", 5, N, K), CPU, seed=5).ok  # above the table
    assert {r["m"] for r in _rows(op, impl="tuned:triton")} == {1, 3, 4}
    (above,) = _rows(op, m=5)
    assert above["impl"] == "fallback:m_above_table" and above["vendor"] == (
        "rms_norm+gemv" if op == "rms_gemv" else "gemv+add")
    if op == "rms_gemv":
        # the folded norm's fallback: one launch of the Gemma norm kernel (zero weight), not the composition
        default = STATE.defaults.get(("gemma_rms_norm", "bf16", 5, K, K, "cpu"))
        assert default is not None and default.kernel is not None


def test_the_folded_norms_fallback_is_one_norm_kernel_within_the_bound(tmp_path: Path, monkeypatch) -> None:
    """Above the rms_gemv entries the vendor path normalises x with tunekit's norm kernel (x * (1 + 0));
    without a table, or where that kernel cannot serve, PyTorch's composition does, the same values
    within the norm's rounding."""
    from kernels_triton import rms_norm as rms_norm_kernels
    from tunekit.dispatch import fused_gemv

    _table(tmp_path, "rms_gemv", ms=(1,))
    launched = []
    real = rms_norm_kernels.rms_norm
    monkeypatch.setattr(rms_norm_kernels, "rms_norm", lambda *a, **kw: launched.append(kw) or real(*a, **kw))
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, K, generator=gen) * 3).bfloat16()
    got = fused_gemv._unweighted_norm(x, opspec.EPS)
    assert launched and launched[0]["gemma"] is True
    want = fused_gemv.unweighted_rms_norm(x, opspec.EPS)
    assert (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()  # BF16 ulps apart
    # a layout the kernel does not take (rows not contiguous): the composition, exactly
    strided = torch.randn(K, 6, generator=gen).bfloat16().t()
    assert torch.equal(fused_gemv._unweighted_norm(strided, opspec.EPS),
                       fused_gemv.unweighted_rms_norm(strided, opspec.EPS))
    ops.load_tables([])  # no table serves the device: tunekit does not serve here at all
    launched.clear()
    assert torch.equal(fused_gemv._unweighted_norm(x, opspec.EPS), want) and not launched


@pytest.mark.parametrize("op", ["rms_gemv", "gemv_add"])
def test_without_a_table_the_vendor_sequence_serves_and_the_bound_holds(op: str) -> None:
    assert verify.verify(_served(op), opspec.get(op), Problem(op, "bf16", 2, N, K), CPU, seed=0).ok
    (row,) = _rows(op)
    assert row["impl"] == "fallback:no_table" and row["calls"] >= 1


def test_leading_dims_strides_and_bad_inputs(tmp_path: Path) -> None:
    _table(tmp_path, "rms_gemv", ms=(1, 2, 4, 6))
    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(2, 3, K, generator=gen)).bfloat16()
    w = (torch.randn(N, K, generator=gen) / K**0.5).bfloat16()
    y = torch.ops.tunekit.rms_gemv(x, w, 1e-6)
    assert y.shape == (2, 3, N) and y.is_contiguous()
    ref = opspec_gemv.RMS_GEMV.reference((x.view(6, K), w)).view(2, 3, N)
    assert (y.double() - ref).abs().max() < 0.05
    # x's rows 2K apart (a slice of a wider tensor): the kernel takes the row stride
    wide = torch.randn(2, 2 * K, generator=gen).bfloat16()
    strided = wide[:, :K]
    ys = torch.ops.tunekit.rms_gemv(strided, w, 1e-6)
    assert (ys.double() - opspec_gemv.RMS_GEMV.reference((strided.contiguous(), w))).abs().max() < 0.05
    assert _rows("rms_gemv", m=6, impl="tuned:triton") and _rows("rms_gemv", m=2, impl="tuned:triton")
    # x and the weight of different dtypes: the vendor path (and its own error, as without tunekit)
    with pytest.raises(RuntimeError):
        torch.ops.tunekit.rms_gemv(x, w.float(), 1e-6)
    assert _rows("rms_gemv", impl="fallback:dtype")


def test_gemv_add_adds_the_residual_once_and_refuses_a_wrong_one(tmp_path: Path) -> None:
    _table(tmp_path, "gemv_add", ms=(2,))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, K, generator=gen).bfloat16()
    w = (torch.randn(N, K, generator=gen) / K**0.5).bfloat16()
    r = torch.randn(2, N, generator=gen).bfloat16()
    y = torch.ops.tunekit.gemv_add(x, w, r)
    expected = x.double() @ w.double().T + r.double()
    assert (y.double() - expected).abs().max() < 0.05
    assert (torch.ops.tunekit.gemv_add(x, w, torch.zeros_like(r)).double() - expected).abs().max() > 0.5
    assert _rows("gemv_add", impl="tuned:triton", calls=2)
    with pytest.raises(RuntimeError):  # a residual of another width: the vendor's own error
        torch.ops.tunekit.gemv_add(x, w, torch.zeros(2, N + 1, dtype=torch.bfloat16))
    assert _rows("gemv_add", impl="fallback:bad_input")


def test_opaque_under_torch_compile_and_built_by_prepare(tmp_path: Path) -> None:
    _table(tmp_path, "rms_gemv")
    summary = ops.prepare(CPU, ms=[1])
    assert summary["tuned"] == 1 and not summary["errors"], summary

    def f(x, w):
        return torch.ops.tunekit.rms_gemv(x, w, 1e-6) * 2

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, K, generator=gen).bfloat16()
    w = (torch.randn(N, K, generator=gen) / K**0.5).bfloat16()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w), f(x, w))


def test_an_eager_tuned_call_binds_once_at_the_callers_epsilon(tmp_path: Path, monkeypatch) -> None:
    """As the GEMV's: the first eager call binds the kernel's launches (a stand-in binder here: the
    interpreter has no launcher to record), later calls replay them, at the epsilon the caller passed."""
    from test_dispatch_overhead import _stand_in_binding

    from tunekit.measure.device import detect

    binds, replays = _stand_in_binding(monkeypatch)
    _table(tmp_path, "rms_gemv")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, K, generator=gen).bfloat16()
    w = (torch.randn(N, K, generator=gen) / K**0.5).bfloat16()
    problem = Problem("rms_gemv", "bf16", 1, N, K)
    kernel = get("triton").build(problem, get("triton").space(problem).default, detect())
    at_half = torch.empty(1, N, dtype=torch.bfloat16)
    kernel((x, w), at_half, eps=0.5)  # an epsilon that changes the scale: a replay at another would differ
    for _ in range(3):
        assert torch.equal(torch.ops.tunekit.rms_gemv(x, w, 0.5), at_half)
    assert len(binds) == 1 and len(replays) == 2
    assert [(r["impl"], r["calls"]) for r in ops.dispatch_stats()] == [("tuned:triton", 3)]
