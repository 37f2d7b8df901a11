"""Fold a vLLM model's decoder norms into the linears that read them, once, after its weights load.

A decode step of Qwen3.5-27B launches 128 decoder norms, each a separate
~2 us kernel between two GEMVs. Folded, a norm costs no launch at all:

* each consumer's weight becomes W diag(g) (Gemma's zero-centred norms:
  W diag(1 + g)), computed in fp32 and rounded once, in place;
* the consumer computes ``rms_gemv(x, W', eps)``: 1/rms(x) from the x tiles
  the GEMV loads anyway (``tunekit.dispatch.fused_gemv``), tuned where the
  tables hold it, else the unweighted norm then vLLM's own GEMM;
* the norm passes x on (plain form) or returns the residual sum twice
  (fused add form: ``(x + residual, x + residual)``). That add is left in
  the graph as a plain ``aten.add``; the compile-range pass of
  ``tunekit.integrations.vllm.compile`` moves it into the previous output
  projection's epilogue (``graph_routes.fuse_residual_adds``: ``gemv_add``)
  where a table holds that op, so a layer's two norms cost no launch.

Which norms: those of a decoder layer whose class :data:`FOLDABLE_LAYERS`
names, with every linear that reads the norm's output listed there (read
from the layer's forward in vLLM 0.26 and 0.33: a norm whose output reaches
anything else is never folded), each of them a plain unquantized linear
whose GEMM goes through tunekit's route, and whose folded GEMVs the tables'
M=1 entries say beat the tuned norm plus the GEMVs they replace.

Opt-in (``TUNEKIT_FOLD_NORMS=1``): a folded model holds rescaled weights, so
anything that writes weights again after loading (``reload_weights``, RL
weight refits, LoRA on a folded projection) would put unfolded weights
behind a norm that no longer applies g. Those uses keep the default.

Call protocol::

    plan = fold_plan(model, honours)    # [(norm, op, eps, [consumers])]; honours(module) -> bool
    counts = fold_model(model, honours)  # {"gemma_rms_norm folded": 128, ...}: folds what pays

``honours(module)``: whether the module's forward (a norm) or GEMM (a
linear) is tunekit's route, which reads the marks ``marks.FOLDED`` /
``marks.FOLD_EPS`` (``tunekit.integrations.vllm.marks``).
A module vLLM runs itself would ignore them: it is never folded.

No vLLM import: the plan reads module classes and attributes only, so the
main test tier checks it with stand-in modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tunekit.integrations.vllm.marks import FOLD_EPS, FOLDED, sibling_groups

__all__ = ["FOLDABLE_LAYERS", "fold_model", "fold_plan", "folded_norm_forward"]

#: vLLM decoder-layer class name -> (norm attribute, alternatives of consumer paths). The first
#: alternative whose first path the layer has is the norm's consumer set, and every path in it must
#: be there: full attention reads the norm with ``self_attn.qkv_proj``, Qwen3.5's Gated DeltaNet with
#: ``in_proj_qkvz`` and ``in_proj_ba``. A layer without any (a MoE block in place of ``mlp``, LoRA's
#: split projections) keeps that norm. From each class's ``forward`` in vLLM 0.26.0 and 0.33.0.
_ATTENTION = ("input_layernorm", (("self_attn.qkv_proj",),))
_MLP = ("post_attention_layernorm", (("mlp.gate_up_proj",),))
FOLDABLE_LAYERS: dict[str, tuple[tuple[str, tuple[tuple[str, ...], ...]], ...]] = {
    "LlamaDecoderLayer": (_ATTENTION, _MLP),
    "Qwen2DecoderLayer": (_ATTENTION, _MLP),
    "Qwen3DecoderLayer": (_ATTENTION, _MLP),
    "Qwen3_5DecoderLayer": (
        ("input_layernorm", (("self_attn.qkv_proj",), ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"))),
        _MLP),
}

#: vLLM norm class name -> the tunekit op of its convention (a tunekit subclass keeps its base's name
#: after "Tunekit").
_NORM_OPS = {"RMSNorm": "rms_norm", "GemmaRMSNorm": "gemma_rms_norm"}


def folded_norm_forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """A folded norm's forward: x itself, or the residual sum as both outputs (each consumer
    normalises it in its GEMV). The add stays a plain op, for the graph pass to fuse."""
    if residual is None:
        return x
    summed = x + residual
    return summed, summed


def _norm_op(norm: nn.Module) -> str | None:
    name = type(norm).__name__
    return _NORM_OPS.get(name.removeprefix("Tunekit"))


def _consumers(layer: nn.Module, alternatives: tuple[tuple[str, ...], ...]) -> list[nn.Module] | None:
    for paths in alternatives:
        try:
            layer.get_submodule(paths[0])
        except AttributeError:
            continue
        try:
            return [layer.get_submodule(p) for p in paths]
        except AttributeError:
            return None  # a partial set: some reader of the norm is unknown
    return None


def _foldable_linear(c: nn.Module, norm_weight: torch.Tensor, honours: Callable[[nn.Module], bool]) -> bool:
    weight = getattr(c, "weight", None)
    quant = getattr(c, "quant_method", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == norm_weight.dtype
            and weight.shape[1] == norm_weight.shape[0] and weight.device == norm_weight.device
            and type(quant).__name__ == "UnquantizedLinearMethod" and not getattr(c, FOLD_EPS, None)
            and honours(c))


def fold_plan(model: nn.Module, honours: Callable[[nn.Module], bool]) -> list[tuple[nn.Module, str, float,
                                                                                         list[nn.Module]]]:
    """(norm, its op, eps, consumers) for every norm of a :data:`FOLDABLE_LAYERS` layer that can fold:
    a weighted RMSNorm (plain or Gemma) not yet folded whose forward ``honours`` the fold, with
    consumers that are all plain unquantized linears whose GEMM ``honours`` it."""
    plan = []
    for layer in model.modules():
        for norm_name, alternatives in FOLDABLE_LAYERS.get(type(layer).__name__, ()):
            norm = getattr(layer, norm_name, None)
            op = _norm_op(norm) if norm is not None else None
            weight = getattr(norm, "weight", None)
            if (op is None or getattr(norm, FOLDED, False) or not isinstance(weight, torch.Tensor)
                    or not honours(norm) or weight.dim() != 1 or not getattr(norm, "has_weight", True)
                    or getattr(norm, "variance_size_override", None) is not None):
                continue
            consumers = _consumers(layer, alternatives)
            if not consumers or not all(_foldable_linear(c, weight, honours) for c in consumers):
                continue
            plan.append((norm, op, float(norm.variance_epsilon), consumers))
    return plan


def _fold_pays(op: str, norm: nn.Module, consumers: list[nn.Module], joined: bool = False) -> bool:
    """Whether the tables' M=1 entries say the folded GEMVs beat the tuned norm plus the GEMVs.

    The norm is priced in its fused-add form where the tables hold it (every decoder norm but the
    first layer's runs as one), else its plain form; a step no table serves counts 0 us, so the
    vendor part is never the fold's excuse. The residual add the fold leaves is priced 0 here: it
    goes into the previous GEMV's epilogue where a table holds ``gemv_add``. ``joined``: the consumers
    are sibling linears the merge step lays out as one weight, so their folded GEMV is one ``rms_gemv``
    on the joined rows (``tunekit.integrations.vllm.merge``).
    """
    from tunekit.dispatch.fused_gemv import fold_pays

    fused_add = "gemma_fused_add_rms_norm" if op == "gemma_rms_norm" else "fused_add_rms_norm"
    return fold_pays((fused_add, op), norm.weight, [tuple(c.weight.shape) for c in consumers], joined)


@torch.no_grad()
def _fold(norm: nn.Module, op: str, eps: float, consumers: list[nn.Module]) -> None:
    g = norm.weight.detach().float()
    scale = 1.0 + g if op == "gemma_rms_norm" else g
    # every folded weight first, then the commit: nothing is half-folded if one of them fails
    folded = [(c.weight.detach().float() * scale).to(c.weight.dtype) for c in consumers]
    for c, w in zip(consumers, folded, strict=True):
        c.weight.data.copy_(w)
        setattr(c, FOLD_EPS, eps)
    setattr(norm, FOLDED, True)


def fold_model(model: nn.Module, honours: Callable[[nn.Module], bool], join_siblings: bool = False) -> dict[str, int]:
    """Fold every norm of ``model`` that :func:`fold_plan` finds and the tables say pays.

    ``join_siblings``: consumers that form a sibling group (``marks.SIBLING_LINEARS``) are priced
    as one ``rms_gemv`` on their joined rows, as the merge step that runs next serves them.
    Returns counts: ``"<op> folded"`` and ``"<op> (fold not in the tables or not paying)"``."""
    groups = {tuple(map(id, linears)) for _, linears in sibling_groups(model)} if join_siblings else set()
    counts: dict[str, int] = {}
    for norm, op, eps, consumers in fold_plan(model, honours):
        pays = _fold_pays(op, norm, consumers, tuple(map(id, consumers)) in groups)
        if pays:
            _fold(norm, op, eps, consumers)
        key = f"{op} folded" if pays else f"{op} (fold not in the tables or not paying)"
        counts[key] = counts.get(key, 0) + 1
    return counts
