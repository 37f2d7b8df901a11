"""``patch(fold_norms=True)``: a Hugging Face decoder norm folded into the linears that read it.

The norm's weight goes into each consumer's weight (W diag(g), or diag(1 + g) for a zero-centred norm),
the norm passes its input on, and each consumer runs ``tunekit::rms_gemv``, which computes 1/rms itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tunekit.integrations.torch_routes import _ROUTE, _TRACING, ELEMENTWISE_ROUTES, _eps, _needs_autograd, _set_forward

#: Decoder-layer class name -> (norm attribute, the linears that read its output), from the layer's
#: forward in transformers' modeling code: ``patch(fold_norms=True)`` folds a norm only into all of
#: them (a path a layer lacks, such as self_attn in a linear-attention layer, is skipped). HF adds
#: the residual itself, so each of these norms is a plain one.
_LLAMA_LIKE = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))


FOLDABLE_LAYERS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "LlamaDecoderLayer": _LLAMA_LIKE,
    "MistralDecoderLayer": _LLAMA_LIKE,
    "Qwen2DecoderLayer": _LLAMA_LIKE,
    "Qwen3DecoderLayer": _LLAMA_LIKE,
    # full attention (self_attn) or Gated DeltaNet (linear_attn: its four input projections)
    "Qwen3_5DecoderLayer": (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "linear_attn.in_proj_qkv",
                             "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a")),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))),
}


#: Attribute holding a folded linear's original weight Parameter (``unpatch`` puts it back).
_FOLD_SAVED = "_tunekit_unfolded_weight"


def _folded_norm_forward(hidden_states: torch.Tensor) -> torch.Tensor:
    """A norm folded into its consumers: x passes on; each consumer computes 1/rms itself."""
    return hidden_states


def _folded_linear_forward(module: nn.Linear, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A consumer of a folded norm: ``rms_gemv`` on its input and its folded weight W diag(g')."""
    from tunekit.dispatch.fused_gemv import rms_gemv_impl, unweighted_rms_norm

    traced = torch.ops.tunekit.rms_gemv
    (is_compiling, is_tracing), plain, grad_enabled = _TRACING, torch.Tensor, torch.is_grad_enabled

    def forward(input: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if grad_enabled() and _needs_autograd(input, weight):
            return F.linear(unweighted_rms_norm(input, eps), weight)
        if type(input) is plain and not is_compiling() and not is_tracing():
            return rms_gemv_impl(input, weight, eps)
        return traced(input, weight, eps)

    return forward


def _fold_plan(model: nn.Module) -> list[tuple[nn.Module, str, list[nn.Linear]]]:
    """(norm, its op, its consumers) for every norm of a ``FOLDABLE_LAYERS`` layer that can be folded:
    a plain or zero-centred RMSNorm whose consumers are all bias-free linears of its dtype and width."""
    plan = []
    for layer in model.modules():
        for norm_name, paths in FOLDABLE_LAYERS.get(type(layer).__name__, ()):
            norm = getattr(layer, norm_name, None)
            op = ELEMENTWISE_ROUTES.get(type(norm).__name__)
            if op not in ("rms_norm", "gemma_rms_norm") or getattr(norm, _ROUTE, None):
                continue
            consumers = [layer.get_submodule(p) for p in paths if _has_submodule(layer, p)]
            weight = norm.weight
            if not consumers or any(
                    not isinstance(c, nn.Linear) or c.bias is not None or getattr(c, _ROUTE, None)
                    or c.weight.dtype != weight.dtype or c.weight.shape[1] != weight.shape[0]
                    or c.weight.device != weight.device for c in consumers):
                continue
            plan.append((norm, op, consumers))
    return plan


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _fold_pays(op: str, norm: nn.Module, consumers: list[nn.Linear]) -> bool:
    """Whether the tables' M=1 entries say the folded consumers beat the tuned norm and GEMVs (a step
    no table serves counts 0 us, so the vendor part is never the fold's excuse)."""
    from tunekit.dispatch.fused_gemv import fold_pays

    return fold_pays((op,), norm.weight, [tuple(c.weight.shape) for c in consumers])


def _fold(norm: nn.Module, op: str, consumers: list[nn.Linear]) -> None:
    """Fold ``norm``'s weight into each consumer's (W diag(g), Gemma diag(1 + g), rounded once to the
    weight's dtype) and route the norm to the identity and the consumers to ``rms_gemv``.

    The folded weight is a new Parameter on the consumer (the original one is kept for ``unpatch``, so
    a module tree sharing the original parameters, as ``tunekit check-serving``'s unpatched twin, is
    untouched): the consumers' weights take twice their memory while patched."""
    g = norm.weight.detach().float()
    scale = 1.0 + g if op == "gemma_rms_norm" else g
    eps = _eps(norm)
    for c in consumers:
        original = c.weight
        object.__setattr__(c, _FOLD_SAVED, original)
        c.weight = nn.Parameter((original.detach().float() * scale).to(original.dtype), requires_grad=False)
        _set_forward(c, "rms_gemv", _folded_linear_forward(c, eps))
    _set_forward(norm, f"{op} folded", _folded_norm_forward)


def fold_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The (N, K) of every linear ``patch(fold_norms=True)`` could serve with ``rms_gemv`` (what a
    table needs ``--shape rms_gemv:NxK`` entries for), sorted and unique."""
    return sorted({tuple(c.weight.shape) for _, _, consumers in _fold_plan(model) for c in consumers})
