"""``patch(fold_norms=True)``, the default: a Hugging Face decoder norm folded into the linears that read it,
each fold checked on the model's own weights first.

The norm's weight goes into each consumer's weight (W diag(g), or diag(1 + g) for a zero-centred norm),
the norm passes its input on, and each consumer runs ``tunekit::rms_gemv``, which computes 1/rms itself.
Before a fold is kept, ``rms_gemv`` on the folded weights (through the kernels the tables serve) is
compared with the unfolded sequence on the original weights, on seeded activations with outlier
channels, under the search's BF16 bound (``tunekit.integrations.fold_check``); a norm that fails stays
unfolded and is logged with its worst error and the bound. Which norms: every norm child of a decoder
layer (an item of an ``nn.ModuleList``, whatever its class) whose output only ``nn.Linear`` modules read,
as the layer's forward shows (``tunekit.integrations.fold_graph``). Not folded, with the reason counted: a
consumer with a LoRA adapter (it reads the normed input), a quantized consumer, and the finder's reasons
(Gemma's post-attention and post-feedforward norms go into a residual add; a non-linear reads it ...).

The originals stay on the consumers (``unpatch`` puts them back), and the folded model keeps to them for
its weights' traffic: ``state_dict()`` gives the original weights (a saved patched model is an unfolded
checkpoint), and ``load_state_dict`` writes into the originals, then folds and checks again.

Call protocol::

    folded = fold_norms(model, counts)   # in patch(): folds what pays and passes; counts what it did
    fold_shapes(model)                   # the (N, K) a table needs rms_gemv entries for
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tunekit.integrations.fold_check import CheckResult, check_norm_fold, fold_scale, tables_hold
from tunekit.integrations.fold_graph import decoder_layers, norm_readers
from tunekit.integrations.torch_routes import (
    _ROUTE,
    _SAVED,
    _TRACING,
    ELEMENTWISE_ROUTES,
    _eps,
    _needs_autograd,
    _set_forward,
)
from tunekit.problems import oprecords

logger = logging.getLogger("tunekit")

#: Attribute holding a folded linear's original weight Parameter (``unpatch`` puts it back).
_FOLD_SAVED = "_tunekit_unfolded_weight"
#: Attribute holding the hook handles a fold added to a module (``unpatch`` removes them).
_FOLD_HOOKS = "_tunekit_fold_hooks"
#: Attribute of the patched model: its folds, (norm, op, consumers), for ``load_state_dict``'s refold.
_FOLDS = "_tunekit_folds"


def _folded_norm_forward(hidden_states: torch.Tensor) -> torch.Tensor:
    """A norm folded into its consumers: x passes on; each consumer computes 1/rms itself."""
    return hidden_states


def _folded_linear_forward(module: nn.Linear, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A consumer of a folded norm: ``rms_gemv`` on its input and its folded weight W diag(g')."""
    from tunekit.ops import impl, unweighted_rms_norm

    rms_gemv_impl = impl("rms_gemv")
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


def _norm_op(module: nn.Module) -> str | None:
    op = ELEMENTWISE_ROUTES.get(type(module).__name__)
    # a plain norm (one with a fused-add form): what a fold takes into the GEMVs that read it
    return op if op is not None and oprecords.get(op).with_residual is not None else None


def _is_norm(module: nn.Module) -> bool:
    """A norm for the finder: one ``patch`` folds, or any other ``*Norm`` (a reader that refuses a fold)."""
    return _norm_op(module) is not None or type(module).__name__.endswith("Norm")


def _is_linear(module: nn.Module) -> bool:
    """Where the finder stops and takes a reader: an ``nn.Linear`` or an adapter wrapping one (LoRA)."""
    return isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Module)


def _why_not(consumers: list[nn.Module]) -> str | None:
    """Why a norm whose readers are all linears cannot fold (counted), or None."""
    for c in consumers:
        if isinstance(getattr(c, "base_layer", None), nn.Module) or "lora" in type(c).__module__.lower():
            return "LoRA (an adapter reads the normed input)"
        weight = getattr(c, "weight", None)
        module = type(c).__module__.lower()
        if (isinstance(weight, torch.Tensor) and not weight.is_floating_point()) or any(
                q in module for q in ("bitsandbytes", "quant", "awq", "gptq")):
            return f"quantized consumer ({type(c).__name__})"
    return None


def _fold_survey(model: nn.Module) -> tuple[list[tuple[str, nn.Module, str, list[nn.Linear]]],
                                            list[tuple[str, str, str]]]:
    """(path, norm, its op, its consumers) for every decoder norm that can be folded (a plain or zero-centred
    RMSNorm not yet routed whose readers, as ``fold_graph`` finds them, are all bias-free linears of its dtype
    and width), and (path, op, reason) for the decoder norms with no safe fold."""
    plans, skipped = [], []
    for layer_name, layer, norm_names in decoder_layers(model, lambda m: _norm_op(m) is not None):
        prefix = f"{layer_name}."
        names = [n for n in norm_names if not getattr(getattr(layer, n), _ROUTE, None)]
        found = norm_readers(layer, names, _is_linear, _is_norm)
        for norm_name in names:
            norm, readers = getattr(layer, norm_name), found[norm_name]
            op = _norm_op(norm)
            consumers = [layer.get_submodule(p) for p in readers.readers]
            why = readers.reason or _why_not(consumers)
            if why is not None:
                skipped.append((prefix + norm_name, op, why))
                continue
            weight = norm.weight
            if any(not isinstance(c, nn.Linear) or c.bias is not None or getattr(c, _ROUTE, None)
                   or c.weight.dtype != weight.dtype or c.weight.shape[1] != weight.shape[0]
                   or c.weight.device != weight.device for c in consumers):
                continue
            plans.append((prefix + norm_name, norm, op, consumers))
    return plans, skipped


def _fold_plan(model: nn.Module) -> list[tuple[nn.Module, str, list[nn.Linear]]]:
    """(norm, its op, its consumers) for every norm :func:`_fold_survey` finds foldable."""
    return [(norm, op, consumers) for _, norm, op, consumers in _fold_survey(model)[0]]


def _fold_pays(op: str, norm: nn.Module, consumers: list[nn.Linear]) -> tuple[bool, str]:
    """(whether to fold, the count's reason if not): the served tables' measured decision for the group
    (``tunekit.ops.fold_decision``), else the older rule on their M=1 entries; each group's line is logged
    once per load of the tables."""
    from tunekit.ops import fold_decision

    decision = fold_decision(op, norm.weight, [tuple(c.weight.shape) for c in consumers])
    if decision.notice:
        logger.info("tunekit.patch: %s", decision.notice)
    if decision.first:
        logger.info("tunekit.patch: %s", decision.line)
    return decision.fuse, ("not fused per the table" if decision.source == "table"
                           else "fold not in the tables or not paying")


@torch.no_grad()
def _folded(norm: nn.Module, op: str, raws: list[torch.Tensor]) -> tuple[list[torch.Tensor], CheckResult]:
    """The folded weights (W diag(g), Gemma diag(1 + g), in fp32, rounded once to the weight's dtype) and the
    worst of their checks against the unfolded sequence on ``raws``."""
    scale = fold_scale(norm.weight, op)
    weights = [(w.detach().float() * scale).to(w.dtype) for w in raws]
    worst: CheckResult | None = None
    for raw, folded in zip(raws, weights, strict=True):
        result = check_norm_fold(op, norm.weight.detach(), _eps(norm), raw.detach(), folded)
        worst = result if worst is None else worst.worst(result)
    assert worst is not None
    return weights, worst


def _fold(norm: nn.Module, op: str, consumers: list[nn.Linear], weights: list[torch.Tensor]) -> None:
    """Route the norm to the identity and the consumers to ``rms_gemv`` on their folded weights.

    The folded weight is a new Parameter on the consumer (the original one is kept for ``unpatch``, so
    a module tree sharing the original parameters, as ``tunekit check-serving``'s unpatched twin, is
    untouched): the consumers' weights take twice their memory while patched."""
    eps = _eps(norm)
    for c, w in zip(consumers, weights, strict=True):
        object.__setattr__(c, _FOLD_SAVED, c.weight)
        c.weight = nn.Parameter(w, requires_grad=False)
        object.__setattr__(c, _FOLD_HOOKS, [c.register_state_dict_post_hook(_original_in_state_dict)])
        _set_forward(c, "rms_gemv", _folded_linear_forward(c, eps))
    _set_forward(norm, f"{op} folded", _folded_norm_forward)


def _original_in_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A folded consumer's ``state_dict`` holds its original weight: a saved patched model is unfolded."""
    original = module.__dict__.get(_FOLD_SAVED)
    if original is not None and prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = original.detach()


def _add(counts: dict[str, int], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + n


def fold_norms(model: nn.Module, counts: dict[str, int]) -> int:
    """Fold each norm :func:`_fold_survey` finds whose fold the tables decide for (their measured ``fusions``
    decision, else the older rule on their M=1 entries) and whose check passes; count what was folded
    (``"<op> folded"``, ``"rms_gemv"`` per consumer), not fused per the table, not paying (older tables), kept
    unfolded by its check and not folded and why. Returns how many folded; the model's ``load_state_dict`` then
    refolds. Where no table serving the model's device holds an ``rms_gemv`` entry, nothing is considered (nor
    counted)."""
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)
    if weight is None or not tables_hold("rms_gemv", str(weight.device)):
        return 0  # no table holds a fold: none is considered (nor counted)
    plans, skipped = _fold_survey(model)
    for _, op, why in skipped:
        _add(counts, f"{op} (not folded: {why.split(' (')[0]})")
    for why in sorted({why for *_, why in skipped}):
        names = [name for name, _, w in skipped if w == why]
        logger.info("tunekit.patch: %d decoder norm(s) not folded: %s (%s)", len(names), why, ", ".join(names[:3]))
    folds, checked, start = [], 0, time.perf_counter()
    for name, norm, op, consumers in plans:
        pays, why = _fold_pays(op, norm, consumers)
        if not pays:
            _add(counts, f"{op} ({why})")
            continue
        weights, result = _folded(norm, op, [c.weight for c in consumers])
        checked += 1
        if not result.ok:
            _add(counts, f"{op} (kept unfolded: failed the check)")
            logger.warning("tunekit.patch: %s (%s) kept unfolded: rms_gemv on its folded weights failed the check "
                           "against the unfolded sequence: %s", name, op, result.describe())
            continue
        _fold(norm, op, consumers, weights)
        folds.append((name, norm, op, consumers))
        _add(counts, f"{op} folded")
        _add(counts, "rms_gemv", len(consumers))
    if checked:
        logger.info("tunekit.patch: fold checks took %.2f s over %d norm(s) (%d kept unfolded)",
                    time.perf_counter() - start, checked, checked - len(folds))
    if folds:
        object.__setattr__(model, _FOLDS, model.__dict__.get(_FOLDS, []) + folds)
        if _FOLD_HOOKS not in model.__dict__:
            object.__setattr__(model, _FOLD_HOOKS, [model.register_load_state_dict_pre_hook(_unfold_for_load),
                                                    model.register_load_state_dict_post_hook(_refold_after_load)])
    return len(folds)


def _unfold_for_load(module: nn.Module, *args: Any) -> None:
    """Before ``load_state_dict`` writes: each folded consumer holds its original Parameter again."""
    for _, _, _, consumers in module.__dict__.get(_FOLDS, []):
        for c in consumers:
            original = c.__dict__.get(_FOLD_SAVED)
            if original is not None:
                c.weight = original


def _refold_after_load(module: nn.Module, incompatible_keys: Any) -> None:
    """After ``load_state_dict``: each fold made again from what was written, checked; a failing one unfolded."""
    kept = []
    for name, norm, op, consumers in module.__dict__.get(_FOLDS, []):
        weights, result = _folded(norm, op, [c.__dict__[_FOLD_SAVED] for c in consumers])
        if result.ok:
            for c, w in zip(consumers, weights, strict=True):
                c.weight = nn.Parameter(w, requires_grad=False)
            kept.append((name, norm, op, consumers))
            continue
        logger.warning("tunekit.patch: %s (%s) unfolded after load_state_dict: rms_gemv on its new folded weights "
                       "failed the check: %s", name, op, result.describe())
        for m in (norm, *consumers):
            unroute(m)
    object.__setattr__(module, _FOLDS, kept)


def unroute(module: nn.Module) -> None:
    """A routed module back to its own forward and weight (what ``unpatch`` does for each module it changed)."""
    kind, previous = module.__dict__.pop(_SAVED, ("class", None))
    if kind == "instance":
        module.forward = previous
    else:
        module.__dict__.pop("forward", None)
    original = module.__dict__.pop(_FOLD_SAVED, None)
    if original is not None:
        module.weight = original
    for handle in module.__dict__.pop(_FOLD_HOOKS, []):
        handle.remove()
    module.__dict__.pop(_ROUTE, None)


def fold_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The (N, K) of every linear ``patch(fold_norms=True)`` could serve with ``rms_gemv`` (what a
    table needs ``--shape rms_gemv:NxK`` entries for), sorted and unique."""
    return sorted({tuple(c.weight.shape) for _, _, consumers in _fold_plan(model) for c in consumers})
