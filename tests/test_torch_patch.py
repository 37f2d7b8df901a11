"""tunekit.patch / unpatch: nn.Linear and HF norm modules routed through torch.ops.tunekit (CPU tier)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_ops import _entry, compile_capturing, make_table, timed_entry  # tests/ is on sys.path
from torch import nn

import tunekit
from tunekit import ops
from tunekit.integrations import torch_merge, torch_patch

HIDDEN, INTER = 64, 96


class LlamaRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, verbatim (the patch matches the class name)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class TinyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=True)  # Qwen2-style bias
        self.o_proj = nn.Linear(3 * HIDDEN, HIDDEN, bias=False)
        self.up = nn.Linear(HIDDEN, INTER, bias=False)
        self.down = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(self.qkv(self.norm(x)))
        return h + self.down(F.silu(self.up(self.norm(h))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(TinyBlock(), TinyBlock()).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model


# The slow tier (`python -m pytest -q -m slow`, run by .ci/run):
# patched Hugging Face models decoded on the interpreter.
# clean_ops (conftest.py): no table, markers or vendor GEMM leak.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_ops")]


@pytest.fixture
def table(tmp_path: Path) -> Path:
    # Tuned: o_proj (64x192) and down (64x96) at M=4; the rest stays vendor.
    return make_table(tmp_path / "t.json", [_entry("gemv", 4, HIDDEN, 3 * HIDDEN), _entry("gemv", 4, HIDDEN, INTER)])


def test_patch_routes_linears_and_norms_and_unpatch_restores(table: Path) -> None:
    model = _model()
    x = torch.randn(1, 3, HIDDEN).bfloat16()
    with torch.no_grad():
        before = model(x)
        counts = tunekit.patch(model, table=table, only_covered=False)
        assert counts == {"linear": 8, "rms_norm": 2}
        assert tunekit.patch(model) == {}  # already patched: nothing twice
        patched = model(x)
    assert (patched.float() - before.float()).abs().max() < 0.1
    rows = tunekit.dispatch_stats()
    by = {(r["op"], r["shape"], r["impl"]): r["calls"] for r in rows}
    assert by[("gemv", f"{HIDDEN}x{3 * HIDDEN}", "tuned:triton")] == 2
    assert by[("gemv", f"{HIDDEN}x{INTER}", "tuned:triton")] == 2
    assert by[("gemv", f"{3 * HIDDEN}x{HIDDEN}", "fallback:no_entry")] == 2
    assert by[("rms_norm", f"{HIDDEN}x{HIDDEN}", "fallback:no_entry")] == 4
    assert all(r["m"] == 3 for r in rows)
    assert tunekit.unpatch(model) == 10
    assert all("forward" not in m.__dict__ for m in model.modules())
    ops.reset_stats()
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert tunekit.dispatch_stats() == []


def test_by_default_only_the_modules_a_table_covers_are_routed(table: Path) -> None:
    model = _model()
    x = torch.randn(1, 1, HIDDEN).bfloat16()
    with torch.no_grad():
        before = model(x)
        counts = tunekit.patch(model, table=table)
        # o_proj and down have entries; qkv, up and the norms keep their own forward and cost nothing
        assert counts == {"linear": 4, "linear (not in the tables)": 4, "rms_norm (not in the tables)": 2}
        kept = [m for m in model.modules()
                if isinstance(m, (nn.Linear, LlamaRMSNorm)) and "forward" not in m.__dict__]
        assert len(kept) == 6 and {tuple(m.weight.shape) for m in kept if isinstance(m, nn.Linear)} == {
            (3 * HIDDEN, HIDDEN), (INTER, HIDDEN)}
        patched = model(x)
    assert (patched.float() - before.float()).abs().max() < 0.1
    rows = tunekit.dispatch_stats()
    # M=1 is served by the M=4 entries (the smallest tabulated M above); nothing else entered an op
    assert {(r["shape"], r["impl"]) for r in rows} == {(f"{HIDDEN}x{3 * HIDDEN}", "tuned:triton"),
                                                       (f"{HIDDEN}x{INTER}", "tuned:triton")}
    assert tunekit.unpatch(model) == 4


def test_without_a_table_nothing_is_routed() -> None:
    model = _model()
    assert tunekit.patch(model) == {"linear (not in the tables)": 8, "rms_norm (not in the tables)": 2}
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert tunekit.unpatch(model) == 0


def test_calls_that_need_autograd_keep_the_original_path(table: Path) -> None:
    model = _model()
    tunekit.patch(model, table=table)
    x = torch.randn(1, 1, HIDDEN).bfloat16()
    model(x).float().sum().backward()  # grad mode, parameters require grad: no tunekit op (no backward)
    assert tunekit.dispatch_stats() == []
    assert model[0].o_proj.weight.grad is not None


def test_an_existing_instance_forward_is_restored() -> None:
    lin = nn.Linear(8, 4)
    hooked = lin.forward  # what accelerate-style hooks leave as an instance attribute
    lin.forward = lambda x: hooked(x) * 2
    previous = lin.__dict__["forward"]
    tunekit.patch(lin, only_covered=False)
    assert lin.__dict__["forward"] is not previous
    tunekit.unpatch(lin)
    assert lin.__dict__["forward"] is previous


def test_patch_with_an_unreadable_table_raises_at_set_up_with_one_message(
        tmp_path: Path, table: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A missing table raises once, naming it, with nothing logged besides; the tables served before stay."""
    from tunekit import ops
    from tunekit.table import TableError

    ops.load_tables(str(table))
    missing = tmp_path / "missing.json"
    with caplog.at_level(logging.DEBUG, logger="tunekit"), pytest.raises(TableError, match="missing.json"):
        tunekit.patch(_model(), table=missing)
    assert not [r for r in caplog.records if "missing.json" in r.getMessage()]
    assert [row["path"] for row in ops.loaded_tables()] == [str(table)]


def test_patched_model_compiles_to_opaque_tunekit_nodes(table: Path) -> None:
    model = _model()
    tunekit.patch(model, table=table, only_covered=False)
    compiled, graphs = compile_capturing(model)
    x = torch.randn(1, 4, HIDDEN).bfloat16()
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("tunekit.gemv") for t in targets) == 8
    assert sum(t.startswith("tunekit.rms_norm") for t in targets) == 4
    torch._dynamo.reset()


def test_linear_shapes_lists_what_to_tune() -> None:
    rows = torch_patch.linear_shapes(_model())
    assert [(r["n"], r["k"], r["count"]) for r in rows][:2] == [(HIDDEN, 3 * HIDDEN, 2), (3 * HIDDEN, HIDDEN, 2)]
    assert {r["dtype"] for r in rows} == {"bf16"}


# ----------------------------------------------------------------------------- real Hugging Face classes
# (the tests marked needs("hf"): the hf extra, transformers)


def _tiny_qwen3_5(vocab: int = 128, intermediate: int = INTER):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.needs("hf")
def test_hugging_face_qwen3_5_patched_gives_the_same_logits_and_tokens(tmp_path: Path) -> None:
    model = _tiny_qwen3_5()
    with torch.no_grad():  # zero-centred norm weights are all zero at init: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    # A table for the lm_head and the down projections (HF's own, unmerged shapes), M = 1.
    shapes = {(r["n"], r["k"]) for r in torch_patch.linear_shapes(model)}
    assert (128, HIDDEN) in shapes and (HIDDEN, INTER) in shapes
    path = make_table(tmp_path / "hf.json", [_entry("gemv", 1, 128, HIDDEN), _entry("gemv", 1, HIDDEN, INTER)])
    ids = torch.tensor([[3, 17, 42, 5, 99]])
    with torch.no_grad():
        ref = model(ids).logits
        counts = tunekit.patch(model, table=path, only_covered=False, merge_siblings=False)  # every linear apart
        assert counts["linear"] == len([m for m in model.modules() if isinstance(m, nn.Linear)])
        assert counts["gemma_rms_norm"] >= 5 and counts["gated_rms_norm"] == 1
        out = model(ids).logits
        step = model(ids[:, -1:]).logits  # a decode-like M=1 call: hits the M=1 entries
    assert (out.float() - ref.float()).abs().max() < 0.05
    assert torch.equal(out.argmax(-1), ref.argmax(-1))
    impls = {(r["op"], r["shape"], r["m"]): r["impl"] for r in tunekit.dispatch_stats()}
    assert impls[("gemv", f"128x{HIDDEN}", 1)] == "tuned:triton"
    assert impls[("gemv", f"{HIDDEN}x{INTER}", 1)] == "tuned:triton"
    assert impls[("gemv", f"128x{HIDDEN}", 5)] == "fallback:m_above_table"
    assert any(op == "gated_rms_norm" for op, _, _ in impls)
    assert step.shape == (1, 1, 128)
    tunekit.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


@pytest.mark.needs("hf")
def test_hugging_face_llama_norms_are_routed() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        ref = model(ids).logits
        assert tunekit.patch(model, only_covered=False, merge_siblings=False) == {"linear": 8, "rms_norm": 3}
        assert torch.equal(model(ids).logits, ref)  # vendor paths (no table): the same math, same bits
    assert {r["impl"] for r in tunekit.dispatch_stats()} == {"fallback:no_table"}


def _fold_table(tmp_path: Path, model: nn.Module, fold_us: float, norm_op: str, backend: str = "triton") -> Path:
    """M=1 entries for every folded-consumer shape (rms_gemv at ``fold_us``, the GEMV at 1.0 us) and the
    norm (1.0 us): the fold pays where ``fold_us`` < 1.0 + the norm's share. ``backend``: rms_gemv's."""
    rows = [timed_entry(norm_op, HIDDEN, HIDDEN, 1.0)]
    for n, k in torch_patch.fold_shapes(model):
        rows += [dict(timed_entry("rms_gemv", n, k, fold_us), backend=backend), timed_entry("gemv", n, k, 1.0)]
    return make_table(tmp_path / f"fold-{fold_us}-{backend.replace(':', '-')}.json", rows)


@pytest.mark.needs("hf")
def test_hugging_face_qwen3_5_with_folded_norms_gives_the_same_logits_and_unpatch_restores(tmp_path: Path) -> None:
    model = _tiny_qwen3_5()
    with torch.no_grad():  # zero-centred norm weights are all zero at init: make (1 + g) count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    # layer 1: q / k / v; both: gate / up (q_proj 128 (with its gate), k / v 32; gate / up INTER). Layer 0's
    # Gated DeltaNet masks its normed input (apply_mask_to_padding_states) before its projections read it: not
    # a linear reader, so that norm stays a norm
    assert torch_patch.fold_shapes(model) == sorted({(32, HIDDEN), (128, HIDDEN), (INTER, HIDDEN)})
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[3, 17, 42, 5, 99]])
    with torch.no_grad():
        ref = model(ids).logits
        ref_step = model(ids[:, -1:]).logits
        counts = tunekit.patch(model, table=_fold_table(tmp_path, model, 0.9, "gemma_rms_norm"), fold_norms=True)
        assert counts["gemma_rms_norm folded"] == 3 and counts["rms_gemv"] == 3 + 2 * 2
        assert counts["gemma_rms_norm (not folded: read by a non-linear)"] == 1
        out = model(ids).logits
        step = model(ids[:, -1:]).logits  # M=1: the tuned rms_gemv kernels
    assert (out.float() - ref.float()).abs().max() < 0.05 and torch.equal(out.argmax(-1), ref.argmax(-1))
    assert (step.float() - ref_step.float()).abs().max() < 0.05
    rows = [r for r in tunekit.dispatch_stats() if r["op"] == "rms_gemv"]
    assert {r["impl"] for r in rows if r["m"] == 1} == {"tuned:triton"}
    assert {r["impl"] for r in rows if r["m"] == 5} == {"fallback:m_above_table"}  # prefill: norm + vendor GEMM
    # of the hidden-width norms only the final one and layer 0's input norm run: the 3 others are folded
    (norms,) = [r for r in tunekit.dispatch_stats() if r["op"] == "gemma_rms_norm" and r["shape"] == "64x64"
                and r["m"] == 1]
    assert norms["calls"] == 2
    tunekit.unpatch(model)
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    # a twin over the same parameters (check-serving's unpatched model) keeps its weights while one is folded
    from tunekit.evidence.check_serving.hf_decode import shared_copy

    twin = shared_copy(model)
    with torch.no_grad():
        assert tunekit.patch(twin, fold_norms=True)["gemma_rms_norm folded"] == 3  # the table is still loaded
        assert torch.equal(model(ids).logits, ref)
    tunekit.unpatch(twin)


@pytest.mark.needs("hf")
def test_a_fold_that_does_not_pay_is_left_alone(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    assert torch_patch.fold_shapes(model) == [(32, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN)]
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        ref = model(ids).logits
        # 1.5 us per folded GEMV against 1.0 + the norm's 1.0 shared: q/k/v 4.5 >= 4.0, gate/up 3.0 >= 3.0
        counts = tunekit.patch(model, table=_fold_table(tmp_path, model, 1.5, "rms_norm"), fold_norms=True)
        assert counts["rms_norm (fold not in the tables or not paying)"] == 2 and "rms_gemv" not in counts
        assert counts["rms_norm"] == 3  # the two decoder norms routed as plain norms instead, and the final one
        out = model(ids).logits
    assert (out.float() - ref.float()).abs().max() < 0.05
    tunekit.unpatch(model)
    # and where it pays, Llama's plain-weight norms fold too (W diag(g))
    with torch.no_grad():
        counts = tunekit.patch(model, table=_fold_table(tmp_path, model, 0.9, "rms_norm"), fold_norms=True)
        assert counts["rms_norm folded"] == 2 and counts["rms_gemv"] == 5
        out = model(ids).logits
    assert (out.float() - ref.float()).abs().max() < 0.05 and torch.equal(out.argmax(-1), ref.argmax(-1))


# ----------------------------------------------------------------------------- merged sibling linears

MERGE_INTER = 80


def _qwen3_5_with_norms() -> nn.Module:
    # every merged shape distinct from each other and from the unmerged ones (lm_head 120, MLP 2 x 80)
    model = _tiny_qwen3_5(vocab=120, intermediate=MERGE_INTER)
    with torch.no_grad():  # zero-centred norm weights are all zero at init: make them count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def _merged_table(tmp_path: Path, model: nn.Module, merged_us: float = 1.0, apart_us: float | None = None) -> Path:
    """M=1 entries for every merged shape (at ``merged_us``) and, with ``apart_us``, for each sibling's own shape,
    each against a 10 us baseline (so that the table keeps them)."""
    def entry(n: int, k: int, time_us: float) -> dict:
        return dict(timed_entry("gemv", n, k, time_us), baseline_us=10.0, speedup=10.0 / time_us)

    rows = [entry(n, k, merged_us) for n, k in torch_patch.merged_shapes(model)]
    if apart_us is not None:
        apart = {tuple(c.weight.shape) for _, linears in torch_merge._merge_plan(model) for c in linears}
        rows += [entry(n, k, apart_us) for n, k in sorted(apart)]
    return make_table(tmp_path / f"merged-{merged_us}-{apart_us}.json", rows)


@pytest.mark.needs("hf")
def test_hugging_face_qwen3_5_merged_siblings_run_vllms_shapes_once_per_group(tmp_path: Path) -> None:
    model = _qwen3_5_with_norms()
    # layer 0 (Gated DeltaNet): qkv 96 + z 32 -> 128, b 2 + a 2 -> 4; layer 1: q 128 + k 32 + v 32 -> 192;
    # both MLPs: gate + up -> 2 * MERGE_INTER
    merged = torch_patch.merged_shapes(model)
    assert merged == sorted({(128, HIDDEN), (4, HIDDEN), (192, HIDDEN), (2 * MERGE_INTER, HIDDEN)})
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[3, 17, 42, 5, 99]])
    with torch.no_grad():
        ref = model(ids).logits
        ref_step = model(ids[:, -1:]).logits
        counts = tunekit.patch(model, table=_merged_table(tmp_path, model))  # merge_siblings: the default
        assert counts["linear merged"] == 4 + 3 + 2 * 2  # every sibling of the five groups
        tunekit.dispatch_stats(reset=True)
        out = model(ids).logits
        step = model(ids[:, -1:]).logits  # M=1: the tuned kernels of the merged shapes
    assert (out.float() - ref.float()).abs().max() < 0.05 and torch.equal(out.argmax(-1), ref.argmax(-1))
    assert (step.float() - ref_step.float()).abs().max() < 0.05
    rows = {(r["shape"], r["m"]): r for r in tunekit.dispatch_stats() if r["op"] == "gemv"}
    for n, k in merged:
        calls = 2 if n == 2 * MERGE_INTER else 1  # the MLP group runs in both layers; one GEMV per group and forward
        assert rows[(f"{n}x{k}", 1)]["impl"] == "tuned:triton" and rows[(f"{n}x{k}", 1)]["calls"] == calls
        assert rows[(f"{n}x{k}", 5)]["calls"] == calls
    # no sibling ran a GEMV of its own shape
    assert not {(96, HIDDEN), (32, HIDDEN), (2, HIDDEN), (MERGE_INTER, HIDDEN)} & {
        tuple(int(v) for v in shape.split("x")) for shape, _ in rows}
    # each group dropped its output once every sibling had taken its slice
    groups = {id(g): g for g in (getattr(c, torch_merge._MERGED, None) for c in model.modules()) if g is not None}
    assert len(groups) == 5 and all(g.input is None and g.output is None for g in groups.values())
    assert "linear" not in counts  # the table holds only the merged shapes: nothing else is routed
    stacked = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert tunekit.unpatch(model) == 4 + 3 + 2 * 2
    # the same values in storage of their own again (nothing shared between linears), and the stock forwards
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(storages)) == len(storages) and len(stacked) < len(storages)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def _llama(layers: int = 1) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.needs("hf")
def test_a_merged_sibling_called_alone_out_of_order_or_on_a_changed_input_gets_its_own_rows(tmp_path: Path) -> None:
    model = _llama()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        tunekit.patch(model, only_covered=False, merge_siblings=True)
        x = torch.randn(1, 3, HIDDEN).bfloat16()
        expect = {p: F.linear(x, getattr(attn, p).weight) for p in ("q_proj", "k_proj", "v_proj")}
        assert torch.equal(attn.v_proj(x), expect["v_proj"])  # out of order: v first
        assert torch.equal(attn.q_proj(x), expect["q_proj"])
        y = torch.randn(1, 3, HIDDEN).bfloat16()
        assert torch.equal(attn.k_proj(y), F.linear(y, attn.k_proj.weight))  # another input while x's is kept
        assert torch.equal(attn.k_proj(x), expect["k_proj"])
        x.mul_(2.0)  # changed in place: the kept output is stale and must not be served
        assert torch.equal(attn.q_proj(x), F.linear(x, attn.q_proj.weight))
        assert torch.equal(attn.k_proj(x), F.linear(x, attn.k_proj.weight))
    # under inference mode (no version counters): the group's one GEMV still serves all three
    names = ("q_proj", "k_proj", "v_proj")
    with torch.inference_mode():
        tunekit.dispatch_stats(reset=True)
        z = torch.randn(1, 3, HIDDEN).bfloat16()
        got = [getattr(attn, p)(z) for p in names]
        stats = tunekit.dispatch_stats()
        assert all(torch.equal(g, F.linear(z, getattr(attn, p).weight)) for g, p in zip(got, names, strict=True))
    assert [(r["shape"], r["calls"]) for r in stats] == [(f"{2 * HIDDEN}x{HIDDEN}", 1)]
    # a group whose siblings differ (one with a bias) is not merged
    model = _llama()
    mlp = model.model.layers[0].mlp
    mlp.up_proj.bias = nn.Parameter(torch.zeros(INTER, dtype=torch.bfloat16))
    assert [label for label, _ in torch_merge._merge_plan(model)] == ["model.layers.0.self_attn.q_proj+k_proj+v_proj"]


@pytest.mark.needs("hf")
def test_merging_that_does_not_pay_or_is_not_covered_is_left_alone(tmp_path: Path) -> None:
    model = _llama()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        ref = model(ids).logits
        # 3.5 us merged against 1.0 us per sibling: q/k/v 3.5 > 3.0 stays apart, gate/up 3.5 > 2.0 too
        counts = tunekit.patch(model, table=_merged_table(tmp_path, model, 3.5, 1.0), merge_siblings=True)
        assert counts["linear (merge not in the tables or not paying)"] == 2 and "linear merged" not in counts
        assert counts["linear"] == 6  # the five siblings on their own entries, and o_proj (q_proj's shape)
        tunekit.unpatch(model)
        # 2.5 us: q/k/v pays (2.5 <= 3.0), gate/up does not (2.5 > 2.0)
        counts = tunekit.patch(model, table=_merged_table(tmp_path, model, 2.5, 1.0), merge_siblings=True)
        assert counts["linear merged"] == 3 and counts["linear (merge not in the tables or not paying)"] == 1
        out = model(ids).logits
        tunekit.unpatch(model)
        # no entry for the merged shapes: nothing is merged, unless every module is routed anyway
        counts = tunekit.patch(model, table=make_table(tmp_path / "none.json", [timed_entry("gemv", 96, HIDDEN)]),
                               merge_siblings=True)
        assert counts["linear (merge not in the tables or not paying)"] == 2
        tunekit.unpatch(model)
        assert tunekit.patch(model, only_covered=False, merge_siblings=True)["linear merged"] == 5
    assert (out.float() - ref.float()).abs().max() < 0.05 and torch.equal(out.argmax(-1), ref.argmax(-1))


@pytest.mark.needs("hf")
def test_merged_siblings_compile_to_one_gemv_per_group_without_recompiling(tmp_path: Path) -> None:
    model = _llama(layers=2)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        ref = model(ids).logits
        tunekit.patch(model, only_covered=False, merge_siblings=True)
    compiled, graphs = compile_capturing(model)
    with torch.no_grad():
        first = compiled(ids).logits
        again = compiled(torch.tensor([[4, 5, 6]])).logits
    assert torch.equal(first, ref) and not torch.equal(again, ref)
    assert len(graphs) == 1  # the groups' bookkeeping leaves nothing to guard on between calls
    gemvs = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function" and "tunekit.gemv" in str(n.target)]
    # per layer: qkv, o_proj, gate_up, down_proj; and the lm_head
    assert len(gemvs) == 2 * 4 + 1
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the fold by default, checked


def _llama_with_gains(seed: int = 0) -> nn.Module:
    """A one-layer HF Llama whose decoder norms have checkpoint-like gains: most near 1, some above 10, some
    near 0, one 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers.0." in name and name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape))
                p[:4] = torch.tensor([12.0, 25.0, 1e-3, 0.0])
    return model


def _logits_err(model: nn.Module, ids: torch.Tensor, ref: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(ids).logits.float() - ref).abs().max().item()


def _fp32_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    import copy

    with torch.no_grad():
        return copy.deepcopy(model).float()(ids).logits


@pytest.mark.needs("hf")
def test_folding_is_the_default_and_passes_its_check_under_realistic_gains(tmp_path: Path) -> None:
    model = _llama_with_gains()
    ids = torch.tensor([[1, 2, 3]])
    ref = _fp32_logits(model, ids)
    floor = _logits_err(model, ids, ref)
    counts = tunekit.patch(model, table=_fold_table(tmp_path, model, 0.9, "rms_norm"))  # no fold_norms: the default
    assert counts["rms_norm folded"] == 2 and counts["rms_gemv"] == 5
    assert not [k for k in counts if "kept unfolded" in k or "not folded" in k]
    # within twice the unpatched model's error, plus one BF16 ulp of the largest logit
    assert _logits_err(model, ids, ref) <= 2 * floor + 2**-7 * ref.abs().max().item()
    tunekit.unpatch(model)
    # the switch: nothing folds
    counts = tunekit.patch(model, fold_norms=False)
    assert "rms_norm folded" not in counts and "rms_gemv" not in counts


@pytest.mark.needs("hf")
def test_a_broken_rms_gemv_kernel_is_caught_and_the_norms_stay_norms(tmp_path: Path, caplog) -> None:
    model = _llama_with_gains()
    ids = torch.tensor([[1, 2, 3]])
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    table = _fold_table(tmp_path, model, 0.9, "rms_norm", backend="fault_backend:WRONG")
    with caplog.at_level("WARNING", logger="tunekit"):
        counts = tunekit.patch(model, table=table)
    assert counts["rms_norm (kept unfolded: failed the check)"] == 2 and "rms_gemv" not in counts
    assert counts["rms_norm"] == 3  # the two decoder norms run as norms, and the final one
    assert "model.layers.0.input_layernorm (rms_norm) kept unfolded" in caplog.text and "bound" in caplog.text
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    with torch.no_grad():
        out = model(ids).logits
    assert not [r for r in tunekit.dispatch_stats() if r["op"] == "rms_gemv"]
    tunekit.unpatch(model)
    tunekit.patch(model, fold_norms=False)
    with torch.no_grad():
        assert torch.equal(out, model(ids).logits)  # exactly the unfolded patched model


@pytest.mark.needs("hf")
def test_state_dict_is_unfolded_and_load_state_dict_folds_again(tmp_path: Path) -> None:
    model, other = _llama_with_gains(0), _llama_with_gains(1)
    ids = torch.tensor([[4, 5, 6]])
    original = {k: v.clone() for k, v in model.state_dict().items()}
    assert tunekit.patch(model, table=_fold_table(tmp_path, model, 0.9, "rms_norm"))["rms_norm folded"] == 2
    saved = model.state_dict()
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in original)
    # another checkpoint written into the patched model: folded and checked again
    new = other.state_dict()
    model.load_state_dict(new)
    ref = _fp32_logits(other, ids)
    assert _logits_err(model, ids, ref) <= 2 * _logits_err(other, ids, ref) + 2**-7 * ref.abs().max().item()
    q = model.model.layers[0].self_attn.q_proj
    g = new["model.layers.0.input_layernorm.weight"].float()
    assert torch.equal(q.weight, (new["model.layers.0.self_attn.q_proj.weight"].float() * g).bfloat16())
    tunekit.unpatch(model)
    assert all(torch.equal(v, new[k]) for k, v in model.state_dict().items())


@pytest.mark.needs("hf")
def test_norms_with_an_adapter_or_a_quantized_reader_are_not_folded(tmp_path: Path) -> None:
    class LoraLinear(nn.Module):  # peft's shape: the adapted linear as base_layer
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base_layer = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x)

    model = _llama_with_gains()
    table = _fold_table(tmp_path, model, 0.9, "rms_norm")
    layer = model.model.layers[0]
    layer.mlp.up_proj = LoraLinear(layer.mlp.up_proj)
    q = layer.self_attn.q_proj
    q.weight = nn.Parameter(torch.zeros(q.weight.shape, dtype=torch.int8), requires_grad=False)
    counts = tunekit.patch(model, table=table)
    assert counts["rms_norm (not folded: LoRA)"] == 1 and counts["rms_norm (not folded: quantized consumer)"] == 1
    assert "rms_norm folded" not in counts
