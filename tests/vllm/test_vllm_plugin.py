"""The tunekit vLLM plugin against real vLLM 0.33 on the CPU (run in the vLLM virtualenv).

What is checked: the entry point is found and loads once, and installs
nothing without a table; vLLM's UnquantizedLinearMethod (bind-at-construction)
reaches ``tunekit::gemv`` for a covered (dtype, N, K) and vLLM's own GEMM
otherwise; RMSNorm, GemmaRMSNorm, RMSNormGated and SiluAndMul built by vLLM
are the plugin's subclasses and reach the tunekit elementwise ops for the
widths the table covers; uncovered layers (no table, or tables for other
shapes; custom ops on or off) trace exactly the graph vLLM traces without the
plugin; misses inside a covered layer run vLLM's kernel where it has one and
the markers name it; the ops are single opaque nodes under torch.compile and
under vLLM's compile backend (one graph serves every M).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import vllm
import vllm.plugins
from torch import nn

from tunekit.integrations.vllm import compile as vllm_compile
from tunekit.integrations.vllm import coverage as vllm_coverage
from tunekit.integrations.vllm import gemm as vllm_gemm
from tunekit.integrations.vllm import state as vllm_state
from tunekit.integrations.vllm import vendors as vllm_vendors

PARAMS = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 1, "num_stages": 1}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


PLUGIN_LOG = _Records()
logging.getLogger("vllm.tunekit").addHandler(PLUGIN_LOG)
logging.getLogger("vllm.tunekit").setLevel(logging.INFO)


def _entry(op: str, m: int, n: int, k: int, backend: str = "triton", params: dict | None = None) -> dict:
    return {"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "backend": backend,
            "params": params if params is not None else dict(PARAMS), "kernel": "test",
            "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0}


def _table(path: Path, entries: list[dict]) -> Path:
    from tunekit import table as table_mod
    from tunekit.measure.device import detect

    table = {"format": table_mod.FORMAT, "created": "test", "environment": table_mod.environment_stamp(
        detect().as_dict(), []), "read_limit_gbps": None, "entries": entries}
    return table_mod.save(table, path)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """Load vLLM's general plugins the way vLLM does (once per process), with a table named.

    Without ``TUNEKIT_TABLE`` the plugin installs nothing; an empty table
    gets every hook in, and each test loads the table it needs.
    """
    assert vllm.__version__.startswith("0.33"), vllm.__version__
    if not os.environ.get("TUNEKIT_TABLE"):
        os.environ["TUNEKIT_TABLE"] = str(_table(tmp_path_factory.mktemp("tables") / "empty.json", []))
    vllm.plugins.load_general_plugins()
    from tunekit.integrations.vllm import plugin as vllm_plugin

    return vllm_plugin


@pytest.fixture(autouse=True)
def _fresh_ops():
    from tunekit import ops

    ops.load_tables([])
    ops.reset_stats()
    yield ops
    ops.load_tables([])
    ops.reset_stats()


def _impls(**match) -> list[tuple]:
    from tunekit import ops

    return [(r["op"], r["shape"], r["m"], r["impl"]) for r in ops.dispatch_stats()
            if all(r[k] == v for k, v in match.items())]


def _vendors(**match) -> list[tuple]:
    """(op, m, impl, vendor) of the markers: which vendor served each fallback."""
    from tunekit import ops

    return [(r["op"], r["m"], r["impl"], r["vendor"]) for r in ops.dispatch_stats()
            if all(r[k] == v for k, v in match.items())]


# ----------------------------------------------------------------------------- loading


def _install_logs() -> list[str]:
    """The plugin's "installed ..." lines (not its "nothing installed" ones)."""
    return [r.getMessage() for r in PLUGIN_LOG.records if r.getMessage().startswith("tunekit vLLM plugin: installed")]


def test_entry_point_loads_once_and_installs_every_hook(plugin) -> None:
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "tunekit"]
    assert [ep.value for ep in eps] == ["tunekit.integrations.vllm.plugin:register"]
    # the fold is on by default (TUNEKIT_FOLD_NORMS=0 turns it off: tests/vllm/test_vllm_refold.py)
    assert set(plugin.installed()) == {"linear", "RMSNorm", "GemmaRMSNorm", "RMSNormGated", "SiluAndMul",
                                       "compile_cache_key", "fold_norms", "merge_siblings"}
    assert "passes its check" in plugin.installed()["fold_norms"]
    # the session's table is empty: no M to end a compile range at (test_token_counts_above_the_tables_...)
    assert plugin.skipped() == {"compile_ranges": "the named tables hold no entry"}
    # the tables join vLLM's compile-cache key: a graph traced under another table is not reused
    import vllm.envs as envs

    # and so does what the load checks decided (the norms folded, the shapes refused), read at compile time
    assert envs.compile_factors()[vllm_compile.COMPILE_FACTOR] == vllm_compile.tables_digest() + \
        vllm_compile.load_outcome()
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.utils as utils
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    from vllm.model_executor.custom_op import op_registry_oot

    wrapped = utils.dispatch_unquantized_gemm
    assert getattr(wrapped, "_tunekit_wrapped", False)
    assert linear.dispatch_unquantized_gemm is wrapped and vocab.dispatch_unquantized_gemm is wrapped
    registered = {name: op_registry_oot[name] for name in ("RMSNorm", "GemmaRMSNorm", "RMSNormGated", "SiluAndMul")}
    # the fixture's load installed once (other tests of this worker may have logged "nothing installed" since:
    # pytest-xdist runs the module's tests in any order)
    assert len(_install_logs()) == 1
    # a second load, by vLLM or by hand, changes nothing and logs nothing
    logged = len(PLUGIN_LOG.records)
    vllm.plugins.plugins_loaded = False
    vllm.plugins.load_general_plugins()
    plugin.register()
    assert utils.dispatch_unquantized_gemm is wrapped
    assert {name: op_registry_oot[name] for name in registered} == registered
    assert [r.getMessage() for r in PLUGIN_LOG.records[logged:] if "installed" in r.getMessage()] == []
    assert len(_install_logs()) == 1
    assert not torch.cuda.is_initialized()  # no GPU work at load


def test_without_a_table_nothing_is_installed(plugin, monkeypatch) -> None:
    import vllm.model_executor.layers.linear as linear
    from vllm.model_executor.custom_op import op_registry_oot

    registry_before = dict(op_registry_oot)
    gemm_before = linear.dispatch_unquantized_gemm
    calls = []
    monkeypatch.setattr(plugin, "_install", lambda: calls.append("install") or ({}, {}))
    for value in (None, "", " : "):
        # a fresh process's plugin state: register() decides again
        monkeypatch.setattr(vllm_state, "STATE", {"registered": False, "installed": {}, "skipped": {}})
        if value is None:
            monkeypatch.delenv("TUNEKIT_TABLE", raising=False)
        else:
            monkeypatch.setenv("TUNEKIT_TABLE", value)
        plugin.register()
        assert plugin.installed() == {}
        assert set(plugin.skipped()) == {"linear", "RMSNorm", "GemmaRMSNorm", "RMSNormGated", "SiluAndMul",
                                         "compile_cache_key", "compile_ranges", "fold_norms", "merge_siblings"}
        assert all("TUNEKIT_TABLE is not set" in why for why in plugin.skipped().values())
    assert calls == []  # no hook was attempted
    assert dict(op_registry_oot) == registry_before and linear.dispatch_unquantized_gemm is gemm_before
    assert any("nothing installed" in r.getMessage() for r in PLUGIN_LOG.records)


# ----------------------------------------------------------------------------- linear


def test_unquantized_linear_and_lm_head_route_to_tunekit_gemv(plugin, vllm_config, tmp_path: Path) -> None:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from tunekit import ops

    ops.load_tables(str(_table(tmp_path / "t.json", [_entry("gemv", 2, 48, 64)])))
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, [32, 16], bias=False, params_dtype=torch.bfloat16)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert getattr(layer.quant_method._gemm_impl, "_tunekit_wrapped", False)
    layer.weight.data.normal_(0, 64**-0.5)
    for m in (1, 2, 3):
        x = torch.randn(m, 64).bfloat16()
        y, _ = layer(x)
        ref = x.double() @ layer.weight.data.double().T
        assert y.shape == (m, 48) and (y.double() - ref).abs().max() < 0.05
        if m == 3:  # above the table: vLLM's own GEMM, F.linear's bits
            assert torch.equal(y, F.linear(x, layer.weight))
    # an eager call knows M: above the table's largest M the layer runs vLLM's impl and never enters
    # the op (vLLM's logits at every step, enforce_eager); under tracing the op decides per call
    assert _vendors(op="gemv") == [("gemv", 1, "tuned:triton", None), ("gemv", 2, "tuned:triton", None)]
    # linears no table covers (another N x K; the tabulated N x K in another dtype) keep vLLM's own GEMM:
    # the tunekit op is never entered
    head = ParallelLMHead(96, 64, params_dtype=torch.bfloat16)
    head.weight.data.normal_()
    x = torch.randn(2, 64).bfloat16()
    assert torch.equal(head.quant_method.apply(head, x), F.linear(x, head.weight))
    half = MergedColumnParallelLinear(64, [32, 16], bias=False, params_dtype=torch.float16)
    half.weight.data.normal_(0, 64**-0.5)
    xh = torch.randn(2, 64).half()
    assert torch.equal(half(xh)[0], F.linear(xh, half.weight))
    assert len(_impls()) == 2  # only the covered layer's two calls within the table


def test_uncovered_linear_runs_vllms_impl_itself(plugin) -> None:
    calls = []

    def plain(layer, x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return F.linear(x, weight, bias)

    wrapped = vllm_gemm.wrap_gemm(plain, (plain,))
    assert wrapped is not plain and getattr(wrapped, "_tunekit_wrapped", False)
    w = torch.randn(40, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(wrapped(None, x, w, None), F.linear(x, w))  # no table loaded: vLLM's impl, called as is
    assert calls == [(40, 64)] and _impls() == []


def test_linear_hook_respects_rocm_aiter_and_older_forks(plugin, monkeypatch) -> None:
    import vllm.model_executor.layers.utils as utils

    from tunekit import ops
    from tunekit.dispatch.state import STATE

    monkeypatch.setattr(torch.version, "hip", "6.3.0")
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    done, why = vllm_gemm.install_linear()
    assert not done and "AITER" in why
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "0")
    try:
        done, why = vllm_gemm.install_linear()  # ROCm without AITER: vLLM's rocm gemm is the fallback
        assert done and "rocm_unquantized_gemm" in why
        assert STATE.vendor_gemm is not None
        assert getattr(utils.dispatch_unquantized_gemm, "_tunekit_wrapped", False)
    finally:
        ops.set_vendor_gemm(None)
    monkeypatch.delattr(utils, "dispatch_unquantized_gemm")
    done, why = vllm_gemm.install_linear()
    assert not done and "older fork" in why


def test_non_plain_gemms_are_left_to_vllm(plugin) -> None:
    def flashinfer_like(layer, x, weight, bias=None):
        return F.linear(x, weight, bias)

    assert vllm_gemm.wrap_gemm(flashinfer_like, ()) is flashinfer_like


# ----------------------------------------------------------------------------- norms and activation


@pytest.fixture
def elementwise_table(tmp_path: Path) -> Path:
    from tunekit import ops

    backend = "serving_backend:BACKEND"
    entries = [_entry(op, 4, n, k, backend=backend, params={}) for op, n, k in (
        ("rms_norm", 64, 64), ("fused_add_rms_norm", 64, 64), ("gemma_rms_norm", 64, 64),
        ("gemma_fused_add_rms_norm", 64, 64), ("gated_rms_norm", 128, 32), ("silu_and_mul", 48, 96))]
    path = _table(tmp_path / "ew.json", entries)
    ops.load_tables(str(path))
    return path


def test_norms_and_activation_route_to_tunekit_ops(plugin, vllm_config, elementwise_table: Path) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated

    torch.manual_seed(0)
    x = torch.randn(3, 64).bfloat16()
    r = torch.randn(3, 64).bfloat16()
    norm = RMSNorm(64, eps=1e-5, dtype=torch.bfloat16)
    assert type(norm).__name__ == "TunekitRMSNorm" and norm._forward_method == norm._tunekit_forward
    assert norm._tunekit_stock_forward == norm.forward_cuda  # vLLM's own choice here (custom ops on: "all")
    norm.weight.data.normal_()
    assert (norm(x).float() - norm.forward_native(x).float()).abs().max() < 0.05
    y, s = norm(x, r)
    y_ref, s_ref = norm.forward_native(x.clone(), r.clone())
    assert torch.equal(s, s_ref) and (y.float() - y_ref.float()).abs().max() < 0.05

    gemma = GemmaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    assert type(gemma).__name__ == "TunekitGemmaRMSNorm"
    gemma.weight.data.normal_(0, 0.3)
    assert (gemma(x).float() - gemma.forward_native(x).float()).abs().max() < 0.05
    gy, gs = gemma(x, r)
    assert (gy.float() - gemma.forward_native(x, r)[0].float()).abs().max() < 0.05

    gated = RMSNormGated(32, eps=1e-6, group_size=None, norm_before_gate=True, dtype=torch.bfloat16,
                         activation="silu")
    assert type(gated).__name__ == "TunekitRMSNormGated"
    gated.weight.data.normal_()
    h = torch.randn(2, 4, 32).bfloat16()  # [tokens, heads, head_dim], as vLLM's Qwen3.5 calls it
    z = torch.randn(2, 4, 32).bfloat16()
    assert (gated(h, z).float() - gated.forward_native(h, z).float()).abs().max() < 0.05
    # vLLM 0.26's Qwen3.5 flattens heads first: [tokens * heads, head_dim] (3 tokens of 4 heads here),
    # matched by width and served as the table's [tokens, heads * head_dim] rows
    h2, z2 = torch.randn(12, 32).bfloat16(), torch.randn(12, 32).bfloat16()
    assert (gated(h2, z2).float() - gated.forward_native(h2, z2).float()).abs().max() < 0.05

    act = SiluAndMul()
    assert type(act).__name__ == "TunekitSiluAndMul"
    a = torch.randn(3, 96).bfloat16()
    assert (act(a).float() - act.forward_native(a).float()).abs().max() < 0.05

    impls = _impls()
    assert ("rms_norm", "64x64", 3, "tuned:serving_backend:BACKEND") in impls
    assert ("fused_add_rms_norm", "64x64", 3, "tuned:serving_backend:BACKEND") in impls
    assert ("gemma_rms_norm", "64x64", 3, "tuned:serving_backend:BACKEND") in impls
    assert ("gemma_fused_add_rms_norm", "64x64", 3, "tuned:serving_backend:BACKEND") in impls
    assert ("gated_rms_norm", "128x32", 2, "tuned:serving_backend:BACKEND") in impls
    assert ("gated_rms_norm", "128x32", 3, "tuned:serving_backend:BACKEND") in impls
    assert ("silu_and_mul", "48x96", 3, "tuned:serving_backend:BACKEND") in impls
    # a miss inside a covered layer (M above the table) falls back in the op; this CPU wheel has no
    # vLLM _C kernel, so tunekit's default-config kernel serves it, at this norm's own eps (1e-5)
    big = torch.randn(9, 64).bfloat16()
    assert torch.equal(norm(big), torch.ops.tunekit.rms_norm(big, norm.weight.data, 1e-5))
    assert (norm(big).float() - norm.forward_native(big).float()).abs().max() < 0.05
    assert _vendors(op="rms_norm", m=9) == [("rms_norm", 9, "fallback:m_above_table", "tunekit:triton-default")]


class _Block(nn.Module):
    """A decoder's elementwise + linear mix at width 32: fused add + norm, norm, up proj, SiLU-and-mul, gated norm."""

    def __init__(self, full: bool) -> None:
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.layernorm import RMSNorm, RMSNormGated
        from vllm.model_executor.layers.linear import ReplicatedLinear

        super().__init__()
        # full=False: the layers whose enabled (forward_cuda) path runs on this CPU platform too
        self.full = full
        self.norm = RMSNorm(32, eps=1e-6, dtype=torch.bfloat16)
        self.up = ReplicatedLinear(32, 64, bias=False, params_dtype=torch.bfloat16)
        if full:
            self.act = SiluAndMul()
            self.gate_norm = RMSNormGated(16, eps=1e-6, group_size=None, norm_before_gate=True,
                                          dtype=torch.bfloat16, activation="silu")

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.norm(x, residual)
        h = self.up(self.norm(h))[0]
        if self.full:
            a = self.act(h)  # [T, 32]
            h = self.gate_norm(a.view(a.shape[0], 2, 16), h[:, 32:].reshape(a.shape[0], 2, 16))
        return h, residual


def _traced(model: nn.Module, *inputs: torch.Tensor) -> tuple[list[str], object]:
    """The call targets of the graph torch.compile traces for ``model`` (dynamic M), and its output."""
    torch._dynamo.reset()
    targets: list[str] = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    for t in inputs:  # as vLLM compiles: the token dim dynamic, the widths static
        torch._dynamo.mark_dynamic(t, 0)
    out = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    return targets, out


def _stock_block(monkeypatch, full: bool, state: dict) -> nn.Module:
    """The same block built by vLLM without the plugin: OOT classes and GEMM wrapper taken out meanwhile."""
    import vllm.model_executor.layers.linear as linear
    from vllm.model_executor.custom_op import op_registry_oot

    with monkeypatch.context() as mp:
        for name in ("RMSNorm", "GemmaRMSNorm", "RMSNormGated", "SiluAndMul"):
            mp.delitem(op_registry_oot, name)
        mp.setattr(linear, "dispatch_unquantized_gemm", linear.dispatch_unquantized_gemm.__wrapped__)
        block = _Block(full)
    assert not any(type(m).__name__.startswith("Tunekit") for m in block.modules())
    block.load_state_dict(state)
    return block


@pytest.mark.parametrize("tables", ["none loaded", "other shapes only"])
@pytest.mark.parametrize("custom_ops", ["none", "all"])
def test_uncovered_layers_trace_vanillas_graph(plugin, vllm_config, monkeypatch, tmp_path: Path, tables: str,
                                                custom_ops: str) -> None:
    from vllm.config import get_cached_compilation_config

    from tunekit import ops

    if tables == "other shapes only":  # every op tabulated, none at this block's widths
        ops.load_tables(str(_table(tmp_path / "other.json", [
            _entry("gemv", 4, 96, 64), *[_entry(op, 4, n, k, backend="serving_backend:BACKEND", params={})
                                         for op, n, k in (("rms_norm", 64, 64), ("fused_add_rms_norm", 64, 64),
                                                          ("silu_and_mul", 48, 96), ("gated_rms_norm", 128, 32))]])))
    # custom ops off is vLLM's default under inductor (forward_native, which inductor fuses); on, its
    # kernels. On this CPU platform SiluAndMul / RMSNormGated have no enabled path, so "all" leaves them out.
    monkeypatch.setattr(vllm_config.compilation_config, "custom_ops", [custom_ops])
    get_cached_compilation_config.cache_clear()
    try:
        full = custom_ops == "none"
        torch.manual_seed(0)
        block = _Block(full)
        assert type(block.norm).__name__ == "TunekitRMSNorm"
        for p in block.parameters():
            p.data.normal_(0, 0.2)
        stock = _stock_block(monkeypatch, full, block.state_dict())
        # the subclass kept vLLM's own forward as its stock one
        assert block.norm._tunekit_stock_forward == (block.norm.forward_native if full else block.norm.forward_cuda)
        assert stock.norm._forward_method == (stock.norm.forward_native if full else stock.norm.forward_cuda)
        x, r = torch.randn(5, 32).bfloat16(), torch.randn(5, 32).bfloat16()
        got, y = _traced(block, x.clone(), r.clone())
        want, y_stock = _traced(stock, x.clone(), r.clone())
        assert not [t for t in got if "tunekit" in t], got
        # the very graph vLLM traces without the plugin
        assert got == want, "\n".join(difflib.unified_diff(want, got, "vLLM", "with the plugin", lineterm=""))
        assert all(torch.equal(a, b) for a, b in zip(y, y_stock, strict=True))
        assert _impls() == []  # and, eagerly too, no tunekit op was entered
        block(x.clone(), r.clone())
        assert _impls() == []
    finally:
        get_cached_compilation_config.cache_clear()


def test_the_same_block_covered_reaches_the_tunekit_ops(plugin, vllm_config, monkeypatch, tmp_path: Path) -> None:
    """The counterpart of the test above: with its widths tabulated, the block's graph holds the tunekit ops."""
    from vllm.config import get_cached_compilation_config

    from tunekit import ops

    ops.load_tables(str(_table(tmp_path / "block.json", [
        _entry("gemv", 4, 64, 32), *[_entry(op, 4, n, k, backend="serving_backend:BACKEND", params={})
                                     for op, n, k in (("rms_norm", 32, 32), ("fused_add_rms_norm", 32, 32),
                                                      ("silu_and_mul", 32, 64), ("gated_rms_norm", 32, 16))]])))
    monkeypatch.setattr(vllm_config.compilation_config, "custom_ops", ["none"])
    get_cached_compilation_config.cache_clear()
    try:
        torch.manual_seed(0)
        block = _Block(True)
        for p in block.parameters():
            p.data.normal_(0, 0.2)
        got, _ = _traced(block, torch.randn(5, 32).bfloat16(), torch.randn(5, 32).bfloat16())
    finally:
        get_cached_compilation_config.cache_clear()
    assert [t for t in got if t.startswith("tunekit.")] == [
        "tunekit.fused_add_rms_norm", "tunekit.rms_norm", "tunekit.gemv", "tunekit.silu_and_mul",
        "tunekit.gated_rms_norm"], got


def test_norm_inputs_the_op_would_not_serve_keep_vllms_own_path(plugin, vllm_config, elementwise_table: Path) -> None:
    from vllm.model_executor.layers.layernorm import RMSNorm

    norm = RMSNorm(64, eps=1e-5, dtype=torch.bfloat16)
    norm.weight.data.normal_()
    qkv = torch.randn(2, 2 * 64 + 2 * 64).bfloat16()
    q_by_head = qkv[:, :128].view(2, 2, 64)  # vLLM's q_norm input: rows not evenly strided
    assert torch.equal(norm(q_by_head), norm.forward_native(q_by_head))
    assert _impls(op="rms_norm") == []  # never entered the tunekit op
    even = torch.randn(2, 2, 128).bfloat16()[..., :64]  # rows 128 apart: served with the row stride
    assert (norm(even).float() - norm.forward_native(even.contiguous()).float()).abs().max() < 0.05
    assert _impls(op="rms_norm") == [("rms_norm", "64x64", 4, "tuned:serving_backend:BACKEND")]


# ----------------------------------------------------------------------------- fallbacks: vLLM's kernels


@pytest.fixture
def vllm_c_kernels(plugin):
    """``torch.ops._C.rms_norm`` / ``silu_and_mul`` as vLLM's CUDA build registers them (schema and calling
    convention), with counting CPU kernels: this CPU wheel has no _C extension. The plugin's vendor
    state is put back afterwards."""
    from tunekit.dispatch.state import STATE

    for name in ("rms_norm", "silu_and_mul"):  # the real ones would shadow the counting ones
        assert vllm_vendors._torch_op("_C", name) is None, f"this vLLM has torch.ops._C.{name}"
    calls: list[tuple[str, tuple[int, ...]]] = []
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define("rms_norm(Tensor(a!) result, Tensor input, Tensor weight, float epsilon) -> ()")
    lib.define("silu_and_mul(Tensor(a!) result, Tensor input) -> ()")

    def rms_norm(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, eps: float) -> None:
        calls.append(("rms_norm", tuple(x.shape)))
        xf = x.float()
        out.copy_((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w)

    def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
        calls.append(("silu_and_mul", tuple(x.shape)))
        d = x.shape[-1] // 2
        out.copy_(F.silu(x[..., :d]) * x[..., d:])

    lib.impl("rms_norm", rms_norm, "CPU")
    lib.impl("silu_and_mul", silu_and_mul, "CPU")
    saved, off = dict(STATE.vendor_ew), set(STATE.vendor_off_engine_path)
    try:
        yield calls
    finally:
        with STATE.lock:
            STATE.vendor_ew.clear()
            STATE.vendor_ew.update(saved)
            STATE.vendor_off_engine_path.clear()
            STATE.vendor_off_engine_path.update(off)
        lib._destroy()


def test_covered_layers_above_the_table_run_vllms_kernels(plugin, vllm_config, elementwise_table: Path,
                                                          vllm_c_kernels, monkeypatch, caplog) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated

    # The op's own fallbacks, as a compiled graph's range meets them (M symbolic: the op decides). An
    # eager call above the tables skips the op (test_an_eager_call_above_the_tables_skips_the_op).
    monkeypatch.setattr(vllm_coverage, "eager_above_tables", lambda *args, **kwargs: False)
    found = vllm_vendors.install_vendor_kernels(("rms_norm", "fused_add_rms_norm", "silu_and_mul",
                                                 "gemma_rms_norm", "gated_rms_norm"))
    assert "rms_norm: torch.ops._C.rms_norm on cpu" in found
    assert ("fused_add_rms_norm: torch.ops._C.rms_norm(x + residual) on cpu (after tunekit's default-config "
            "Triton kernel, one launch)") in found
    assert "silu_and_mul: torch.ops._C.silu_and_mul on cpu" in found
    assert "gemma_rms_norm: no vLLM kernel (vLLM's GemmaRMSNorm has no kernel" in found
    assert "gated_rms_norm: no vLLM kernel (vLLM has no Triton here" in found
    assert "tunekit's default-config Triton kernel, else the PyTorch composition" in found

    torch.manual_seed(0)
    x, r = torch.randn(9, 64).bfloat16(), torch.randn(9, 64).bfloat16()  # 9 tokens: above the table's M=4
    norm = RMSNorm(64, eps=1e-5, dtype=torch.bfloat16)
    norm.weight.data.normal_()
    assert (norm(x).float() - norm.forward_native(x).float()).abs().max() < 0.05
    y, s = norm(x, r)
    y_ref, s_ref = norm.forward_native(x.clone(), r.clone())
    assert torch.equal(s, s_ref) and (y.float() - y_ref.float()).abs().max() < 0.05
    act = SiluAndMul()
    a = torch.randn(9, 96).bfloat16()
    assert torch.equal(act(a), act.forward_native(a))
    # the fused add's vLLM path would be two launches (an add, then _C.rms_norm: vLLM's own fused kernel
    # works in place): tunekit's default-config kernel serves it in one
    assert vllm_c_kernels == [("rms_norm", (9, 64)), ("silu_and_mul", (9, 96))]
    # vLLM has no kernel of its own for these here: tunekit's default-config Triton kernel (this CPU: the
    # interpreter), one launch where the composition takes several, and the markers say so
    gemma = GemmaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    assert (gemma(x).float() - gemma.forward_native(x).float()).abs().max() < 0.05
    gated = RMSNormGated(32, eps=1e-6, group_size=None, norm_before_gate=True, dtype=torch.bfloat16,
                         activation="silu")
    h, z = torch.randn(9, 4, 32).bfloat16(), torch.randn(9, 4, 32).bfloat16()
    assert (gated(h, z).float() - gated.forward_native(h, z).float()).abs().max() < 0.05
    # vLLM's real gated-norm op is found once Triton is claimed; here its Triton is a placeholder, so it
    # raises: the call is still served (the composition), logged once, and the marker says why
    monkeypatch.setattr(vllm_vendors, "_vllm_has_triton", lambda: True)
    assert "gated_rms_norm: torch.ops.vllm.fla_rms_norm_gated on cpu" in vllm_vendors.install_vendor_kernels(
        ("gated_rms_norm",))
    with caplog.at_level(logging.WARNING, logger="tunekit.ops"):
        assert (gated(h, z).float() - gated.forward_native(h, z).float()).abs().max() < 0.05
    assert any("fla_rms_norm_gated raised" in rec.getMessage() for rec in caplog.records)
    assert sorted(_vendors(m=9)) == [
        ("fused_add_rms_norm", 9, "fallback:m_above_table", "tunekit:triton-default"),
        ("gated_rms_norm", 9, "fallback:m_above_table", "eager:vendor_error"),
        ("gated_rms_norm", 9, "fallback:m_above_table", "tunekit:triton-default"),
        ("gemma_rms_norm", 9, "fallback:m_above_table", "tunekit:triton-default"),
        ("rms_norm", 9, "fallback:m_above_table", "torch.ops._C.rms_norm"),
        ("silu_and_mul", 9, "fallback:m_above_table", "torch.ops._C.silu_and_mul"),
    ]
    # a table hit never reaches vLLM's kernel
    norm(x[:3])
    assert len(vllm_c_kernels) == 2 and _vendors(op="rms_norm", m=3) == [
        ("rms_norm", 3, "tuned:serving_backend:BACKEND", None)]
    from tunekit import ops

    assert ops.vendor_kernels()["silu_and_mul"]["serves_first"] is True  # this config enables the custom ops
    # With the custom ops off (vLLM's default under Inductor) vLLM would not run its _C kernels: it compiles
    # the native math into one kernel. The layers built under that config say so, and tunekit's
    # default-config kernel serves their fallbacks first (vLLM's _C.silu_and_mul took ~4.5 us at M=2..8 on
    # the H200 where Inductor's kernel and this one take 1.4-2.1).
    monkeypatch.setattr(vllm_config.compilation_config, "custom_ops", ["none"])
    act_off, norm_off = SiluAndMul(), RMSNorm(64, eps=1e-5, dtype=torch.bfloat16)
    norm_off.weight.data.copy_(norm.weight.data)
    assert ops.vendor_kernels()["silu_and_mul"]["serves_first"] is False
    assert ops.vendor_kernels()["rms_norm"]["serves_first"] is False
    assert (act_off(a).float() - act.forward_native(a).float()).abs().max() < 0.05
    assert (norm_off(x).float() - norm.forward_native(x).float()).abs().max() < 0.05
    assert len(vllm_c_kernels) == 2  # neither reached vLLM's kernel
    assert ("silu_and_mul", 9, "fallback:m_above_table", "tunekit:triton-default") in _vendors(op="silu_and_mul")
    assert ("rms_norm", 9, "fallback:m_above_table", "tunekit:triton-default") in _vendors(op="rms_norm", m=9)


# ----------------------------------------------------------------------------- compilation


def _norm_up_act_block() -> type:
    """A vLLM-compiled block, RMSNorm(64) -> ReplicatedLinear(64 -> 96) -> SiluAndMul, dynamic in the token dim."""
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ReplicatedLinear

    @support_torch_compile(dynamic_arg_dims={"x": 0})
    class Block(nn.Module):
        def __init__(self, *, vllm_config, prefix: str = "") -> None:
            super().__init__()
            self.norm = RMSNorm(64, dtype=torch.bfloat16)
            self.up = ReplicatedLinear(64, 96, bias=False, params_dtype=torch.bfloat16)
            self.act = SiluAndMul()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.up(self.norm(x))[0])

    return Block


@pytest.fixture
def vllm_graphs(monkeypatch) -> list:
    """The FX graphs vLLM's compile backend receives while the test runs."""
    from vllm.compilation import backends

    graphs: list = []
    original = backends.VllmBackend.__call__

    def recording(self, graph, example_inputs):
        graphs.append(graph)
        return original(self, graph, example_inputs)

    monkeypatch.setattr(backends.VllmBackend, "__call__", recording)
    return graphs


def test_vllm_compile_without_a_table_traces_no_tunekit_op(plugin, vllm_config, monkeypatch, vllm_graphs) -> None:
    from vllm.config import get_cached_compilation_config

    Plain, graphs = _norm_up_act_block(), vllm_graphs
    # custom ops off, as under inductor: forward_native everywhere (SiluAndMul's kernel path needs _C)
    monkeypatch.setattr(vllm_config.compilation_config, "custom_ops", ["none"])
    get_cached_compilation_config.cache_clear()
    try:
        torch.manual_seed(0)
        model = Plain(vllm_config=vllm_config)
        model.up.weight.data.normal_(0, 0.125)
        for m in (2, 7):
            x = torch.randn(m, 64).bfloat16()
            assert torch.equal(model(x), Plain.forward(model, x))
    finally:
        get_cached_compilation_config.cache_clear()
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if "tunekit" in t] and any("linear" in t for t in targets), targets
    assert _impls() == []


def test_ops_are_opaque_under_vllm_compile_and_torch_compile(plugin, vllm_config, tmp_path: Path,
                                                             vllm_graphs, monkeypatch) -> None:
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from tunekit import ops

    entries = [_entry("gemv", 2, 96, 64), _entry("rms_norm", 4, 64, 64, backend="serving_backend:BACKEND",
                                                  params={}),
               _entry("silu_and_mul", 4, 48, 96, backend="serving_backend:BACKEND", params={})]
    ops.load_tables(str(_table(tmp_path / "c.json", entries)))
    Tiny, graphs = _norm_up_act_block(), vllm_graphs
    torch.manual_seed(0)
    model = Tiny(vllm_config=vllm_config)
    model.up.weight.data.normal_(0, 0.125)
    eager = Tiny.forward  # the undecorated forward, for the reference
    # the reference goes through the ops at every M, as the graph does (eagerly, an M above the
    # tables would skip them: test_an_eager_call_above_the_tables_skips_the_op)
    monkeypatch.setattr(vllm_coverage, "eager_above_tables", lambda *args, **kwargs: False)
    for m in (2, 3, 6):
        x = torch.randn(m, 64).bfloat16()
        y = model(x)
        assert torch.equal(y, eager(model, x)), m
    assert len(graphs) == 1  # one graph for every M: the choice is inside the ops
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [t for t in targets if t.startswith("tunekit.")] == ["tunekit.rms_norm", "tunekit.gemv",
                                                                "tunekit.silu_and_mul"], targets
    assert not any("linear" in t or "mm" in t for t in targets)
    got = {(op, m): impl for op, _, m, impl in _impls()}
    assert got[("gemv", 2)] == "tuned:triton" and got[("gemv", 3)] == "fallback:m_above_table"
    assert got[("rms_norm", 3)].startswith("tuned:") and got[("rms_norm", 6)] == "fallback:m_above_table"

    # plain torch.compile of a vLLM layer: one opaque node as well
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    layer = ReplicatedLinear(64, 96, bias=False, params_dtype=torch.bfloat16)
    layer.weight.data.normal_(0, 0.125)
    compiled = torch.compile(lambda x: layer(x)[0], backend=backend, fullgraph=True)
    x = torch.randn(2, 64).bfloat16()
    assert torch.equal(compiled(x), layer(x)[0])
    assert seen.count("tunekit.gemv") == 1
    torch._dynamo.reset()


def test_dispatch_stats_are_json(plugin) -> None:
    from tunekit import ops

    json.dumps(ops.dispatch_log())


def test_token_counts_above_the_tables_compile_vllms_own_math(plugin, vllm_config, monkeypatch,
                                                               tmp_path: Path) -> None:
    """vLLM's inductor compile per token-count range: a range ending at the tables' largest M keeps the
    tunekit ops; in the range above, the plugin's post-grad pass hands them back to vLLM's math, so an
    eager prefill there calls no tunekit op at all (and pays none of its Python)."""
    from vllm.compilation.passes import pass_manager
    from vllm.config import CompilationConfig, CompilationMode, DeviceConfig, VllmConfig, set_current_vllm_config

    from tunekit import ops

    path = _table(tmp_path / "ranges.json", [
        _entry("gemv", 2, 96, 64), _entry("rms_norm", 4, 64, 64, backend="serving_backend:BACKEND", params={}),
        _entry("silu_and_mul", 4, 48, 96, backend="serving_backend:BACKEND", params={})])
    monkeypatch.setenv("TUNEKIT_TABLE", str(path))
    # the hook patches two vLLM classes: restored after this test
    monkeypatch.setattr(VllmConfig, "_set_compile_ranges", VllmConfig._set_compile_ranges)
    monkeypatch.setattr(pass_manager.PostGradPassManager, "configure", pass_manager.PostGradPassManager.configure)
    # vLLM's last post-grad pass rewrites its own _C ops, which a CPU wheel lacks (it names them on
    # entry); this graph holds none of them, so skipping it changes nothing here
    monkeypatch.setattr(pass_manager.FixFunctionalizationPass, "__call__", lambda self, graph: None)
    done, why = vllm_compile.install_compile_ranges()
    assert done and "endpoints 2, 4 " in why, why  # each op's largest M ends a range (gemv's 2, the others' 4)
    ops.load_tables(str(path))
    vllm_compile.RANGE_ROUTES.clear()

    config = VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, backend="inductor", cudagraph_mode="NONE", compile_sizes=[],
        custom_ops=["none"], pass_config=vllm_config.compilation_config.pass_config))
    ranges = config.compilation_config.get_compile_ranges()
    assert [(r.start, r.end) for r in ranges][:2] == [(1, 2), (3, 4)] and ranges[2].start == 5, ranges
    Block = _norm_up_act_block()
    with set_current_vllm_config(config):
        torch.manual_seed(0)
        model = Block(vllm_config=config)
        model.up.weight.data.normal_(0, 0.125)
        xs = {m: torch.randn(m, 64).bfloat16() for m in (3, 7)}
        got = {m: model(x) for m, x in xs.items()}
        routes = dict(vllm_compile.RANGE_ROUTES)
        called = {(op, m) for op, _, m, _ in _impls()}
        # the same block compiled with no table: the graph vLLM compiles without tunekit
        ops.load_tables([])
        plain = Block(vllm_config=config)
        plain.load_state_dict(model.state_dict())
        want = {m: plain(x) for m, x in xs.items()}
    # every compiled piece went through the pass; each range lost the tunekit ops no entry serves in it: the
    # gemv (tabulated at M=2) in [3, 4], every op above the tables
    above = {"rms_norm": 1, "gemv": 1, "silu_and_mul": 1}
    assert routes == {str(ranges[1]): {"gemv": 1}, str(ranges[2]): above}, routes
    assert called >= {("rms_norm", 3), ("silu_and_mul", 3)} and ("gemv", 3) not in called
    assert not {c for c in called if c[1] == 7}
    assert torch.equal(got[7], want[7])  # above the tables: vLLM's own compiled math, bit for bit


def test_an_eager_call_above_the_tables_skips_the_op(plugin, vllm_config, elementwise_table: Path,
                                                     monkeypatch) -> None:
    """Eager, M is known: a covered norm or activation above the table's largest M (4 here) runs
    vLLM's own forward and never enters the tunekit op; within the table it does. The gated norm's
    flattened [T * H, D] rows do not tell M: it counts rows of D against the most an entry serves
    (4 x 128 / 32 = 16 here)."""
    from vllm.config import get_cached_compilation_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm, RMSNormGated

    # custom ops off: vLLM's own forward is its native math (its CUDA kernels are not in this CPU wheel)
    monkeypatch.setattr(vllm_config.compilation_config, "custom_ops", ["none"])
    get_cached_compilation_config.cache_clear()
    try:
        torch.manual_seed(0)
        norm, act = RMSNorm(64, eps=1e-5, dtype=torch.bfloat16), SiluAndMul()
        norm.weight.data.normal_()
        x, r, a = torch.randn(9, 64).bfloat16(), torch.randn(9, 64).bfloat16(), torch.randn(9, 96).bfloat16()
        assert torch.equal(act(a), act.forward_native(a))
        y, s = norm(x.clone(), r.clone())
        y_ref, s_ref = norm.forward_native(x.clone(), r.clone())
        assert torch.equal(y, y_ref) and torch.equal(s, s_ref)
        gated = RMSNormGated(32, eps=1e-6, group_size=None, norm_before_gate=True, dtype=torch.bfloat16,
                             activation="silu")
        gated.weight.data.normal_()
        h, z = torch.randn(20, 32).bfloat16(), torch.randn(20, 32).bfloat16()  # 5 tokens x 4 heads, flattened
        assert torch.equal(gated(h, z), gated.forward_native(h, z))
        assert _impls() == []  # nothing entered a tunekit op
        norm(x[:4])
        act(a[:4])
        gated(h[:16], z[:16])  # 4 tokens x 4 heads: the table's 4 x 128
    finally:
        get_cached_compilation_config.cache_clear()
    assert sorted((op, m) for op, _, m, _ in _impls()) == [("gated_rms_norm", 4), ("rms_norm", 4),
                                                           ("silu_and_mul", 4)]


def test_compile_ranges_hook_is_skipped_where_vllm_lacks_its_pieces(plugin, monkeypatch, tmp_path: Path) -> None:
    from vllm.compilation.passes import pass_manager
    from vllm.config import VllmConfig

    path = _table(tmp_path / "r.json", [_entry("gemv", 8, 96, 64)])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    # a broken table beside a good one: the good one still ends the range (the ops log the broken one)
    monkeypatch.setenv("TUNEKIT_TABLE", f"{broken}{os.pathsep}{path}")
    assert vllm_compile.tables_tops() == {"gemv": 8}
    monkeypatch.setenv("TUNEKIT_TABLE", str(broken))
    assert vllm_compile.install_compile_ranges() == (False, "the named tables hold no entry")
    # an older vLLM without compile ranges: skipped with the reason, nothing patched
    monkeypatch.setenv("TUNEKIT_TABLE", str(path))
    original = pass_manager.PostGradPassManager.configure
    monkeypatch.delattr(VllmConfig, "_set_compile_ranges")
    done, why = vllm_compile.install_compile_ranges()
    assert not done and "_set_compile_ranges" in why and "every range keeps the ops" in why
    assert pass_manager.PostGradPassManager.configure is original
