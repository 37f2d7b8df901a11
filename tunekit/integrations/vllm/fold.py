"""Fold a vLLM model's decoder norms into the linears that read them, after its weights load, each fold
checked on those weights first.

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

Which norms: every norm child of a decoder layer (an item of an ``nn.ModuleList`` with one, whatever its
class) whose output only linears read, as the layer's forward shows (``tunekit.integrations.fold_graph``:
a dataflow analysis of the forward's source, down through the modules it calls), each of them a plain
unquantized linear whose GEMM goes through tunekit's route, and whose fold the tables decided for: their
``fusions`` section, where the search timed the folded GEMVs against the norm plus the GEMVs they replace
at every M (tables without it: their M=1 entries, as before). Not folded, with the reason counted
(:func:`survey`): a norm whose consumers may carry LoRA adapters (an adapter reads the normed input), a
quantized consumer, and every reason the finder gives (a residual add or another norm reads the output,
as Gemma's post-attention and post-feedforward norms; a non-linear; a module without source; ...).

Checked before kept: the folded weights are computed aside and
``rms_gemv`` on them, through the kernels the tables serve, is compared
with the unfolded sequence on the layer's own weights and seeded
activations with outlier channels, under the search's BF16 bound
(``tunekit.integrations.fold_check``). A norm whose check fails is left
as it was (weights untouched, norm unfolded) and reported with its worst
error and the bound. On by default; ``TUNEKIT_FOLD_NORMS=0`` turns it off.
Weights written after loading (a reload, an RL refit) are folded again by
``tunekit.integrations.vllm.refold``.

Call protocol::

    plans, skipped = survey(model, honours, lora=False)  # [FoldPlan], [(norm name, op, reason)]
    counts = fold_model(model, honours, report=report)    # {"gemma_rms_norm folded": 128, ...}; fills report
    weights = folded_weights(op, gain, consumers)         # W diag(g) per consumer, rounded once

``honours(module)``: whether the module's forward (a norm) or GEMM (a
linear) is tunekit's route, which reads the marks ``marks.FOLDED`` /
``marks.FOLD_EPS`` (``tunekit.integrations.vllm.marks``).
A module vLLM runs itself would ignore them: it is never folded.

No vLLM import: the plan reads module classes and attributes only, so the
main test tier checks it with stand-in modules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tunekit.integrations.fold_check import CheckResult, check_norm_fold, fold_scale
from tunekit.integrations.fold_graph import decoder_layers, norm_readers
from tunekit.integrations.vllm.marks import FOLD_EPS, FOLDED, sibling_groups
from tunekit.problems import oprecords

__all__ = ["LORA", "QUANTIZED", "ZERO_SCALE", "FoldPlan", "FoldReport", "check_fold", "commit", "fold_model",
           "fold_plan", "folded_norm_forward", "folded_weights", "survey", "zero_columns"]

#: vLLM norm class name -> the tunekit op of its convention (a tunekit subclass keeps its base's name
#: after "Tunekit").
_NORM_OPS = {"RMSNorm": "rms_norm", "GemmaRMSNorm": "gemma_rms_norm"}

#: Why a decoder norm was not folded (the counts' and the log's words).
LORA = "LoRA"
QUANTIZED = "quantized consumer"


@dataclass
class FoldPlan:
    """One norm that can fold: its module path, op (convention), eps and consumers (with their paths)."""

    name: str
    norm: nn.Module
    op: str
    eps: float
    consumers: list[nn.Module]
    consumer_names: list[str]
    #: channels whose scale is (near) 0, and each consumer's raw columns there (set at commit): a fold
    #: multiplies them away, a later write of the gain alone needs them back (``refold``)
    zero_channels: torch.Tensor | None = None
    zero_columns: list[torch.Tensor] = field(default_factory=list)


@dataclass
class FoldReport:
    """What a fold pass did: the norms folded, those kept unfolded by their check (with its worst element),
    those not folded and why, how many norms were checked and the seconds the checks took, and each norm
    group's decision line (whether the tables say fuse it, and why)."""

    folded: list[FoldPlan] = field(default_factory=list)
    failed: list[tuple[str, str, CheckResult]] = field(default_factory=list)
    not_folded: list[tuple[str, str, str]] = field(default_factory=list)
    checked: int = 0
    seconds: float = 0.0
    #: one line per norm group: fused or not and why (the tables' measured decision, with its margin)
    decisions: list[str] = field(default_factory=list)


def folded_norm_forward(x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """A folded norm's forward: x itself, or the residual sum as both outputs (each consumer
    normalises it in its GEMV). The add stays a plain op, for the graph pass to fuse."""
    if residual is None:
        return x
    summed = x + residual
    return summed, summed


def _norm_op(norm: Any) -> str | None:
    if not isinstance(norm, nn.Module):
        return None
    return _NORM_OPS.get(type(norm).__name__.removeprefix("Tunekit"))


def _is_norm(module: nn.Module) -> bool:
    """A norm for the finder: one tunekit folds, or any other ``*Norm`` (a reader that refuses a fold)."""
    return _norm_op(module) is not None or type(module).__name__.endswith("Norm")


def _is_linear(module: nn.Module) -> bool:
    """Where the finder stops and takes a reader: a vLLM linear (any ``LinearBase``) or a LoRA wrapper."""
    return (any(c.__name__ == "LinearBase" for c in type(module).__mro__)
            or isinstance(getattr(module, "base_layer", None), nn.Module))


def _is_lora(c: nn.Module) -> bool:
    return "LoRA" in type(c).__name__ or isinstance(getattr(c, "base_layer", None), nn.Module)


def _foldable_linear(c: nn.Module, norm_weight: torch.Tensor, honours: Callable[[nn.Module], bool]) -> bool:
    weight = getattr(c, "weight", None)
    quant = getattr(c, "quant_method", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype == norm_weight.dtype
            and weight.shape[1] == norm_weight.shape[0] and weight.device == norm_weight.device
            and type(quant).__name__ == "UnquantizedLinearMethod" and not getattr(c, FOLD_EPS, None)
            and honours(c))


def _norm_ok(norm: nn.Module, honours: Callable[[nn.Module], bool]) -> bool:
    """A weighted RMSNorm (plain or Gemma) not yet folded whose forward is tunekit's route."""
    weight = getattr(norm, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 1 and not getattr(norm, FOLDED, False)
            and getattr(norm, "has_weight", True) and getattr(norm, "variance_size_override", None) is None
            and honours(norm))


def _why_not(consumers: list[nn.Module], lora: bool) -> str | None:
    """Why a norm whose readers are all linears cannot fold (a reason to count), or None."""
    if lora or any(_is_lora(c) for c in consumers):
        return f"{LORA} (an adapter would read the normed input)"
    quantized = [type(getattr(c, "quant_method", None)).__name__ for c in consumers
                 if getattr(c, "quant_method", None) is not None
                 and type(c.quant_method).__name__ != "UnquantizedLinearMethod"]
    if quantized:
        return f"{QUANTIZED} ({quantized[0]})"
    return None


def survey(model: nn.Module, honours: Callable[[nn.Module], bool], lora: bool = False
           ) -> tuple[list[FoldPlan], list[tuple[str, str, str]]]:
    """The norms that can fold (:class:`FoldPlan`, consumers all foldable linears: plain, unquantized, of
    the norm's dtype, width and device, routed by tunekit), and those with no safe fold, as (norm path,
    op, reason): LoRA (``lora``: the engine runs adapters, or a consumer is LoRA-wrapped), a quantized
    consumer, or the finder's reason (``fold_graph``). Norms tunekit does not route are neither."""
    plans, skipped = [], []
    for layer_name, layer, norm_names in decoder_layers(model, lambda m: _norm_op(m) is not None):
        prefix = f"{layer_name}."
        routed = [n for n in norm_names if _norm_ok(getattr(layer, n), honours)]
        found = norm_readers(layer, routed, _is_linear, _is_norm)
        for norm_name in routed:
            norm, readers = getattr(layer, norm_name), found[norm_name]
            op = _norm_op(norm)
            assert op is not None
            consumers = [layer.get_submodule(p) for p in readers.readers]
            why = readers.reason or _why_not(consumers, lora)
            if why is not None:
                skipped.append((prefix + norm_name, op, why))
                continue
            if not all(_foldable_linear(c, norm.weight, honours) for c in consumers):
                continue
            plans.append(FoldPlan(prefix + norm_name, norm, op, float(norm.variance_epsilon), consumers,
                                  [prefix + p for p in readers.readers]))
    return plans, skipped


def fold_plan(model: nn.Module, honours: Callable[[nn.Module], bool]) -> list[tuple[nn.Module, str, float,
                                                                                         list[nn.Module]]]:
    """(norm, its op, eps, consumers) for every norm :func:`survey` finds foldable."""
    return [(p.norm, p.op, p.eps, p.consumers) for p in survey(model, honours)[0]]


def _fold_decision(op: str, norm: nn.Module, consumers: list[nn.Module], joined: bool = False) -> Any:
    """Whether to fold: the served tables' measured decision for the group (``tunekit.ops.fold_decision``:
    the search timed ``rms_gemv`` on the consumers against the norm plus their GEMVs at every M), else, for
    tables without one, the older rule on their M=1 entries: the norm priced in its fused-add form where the
    tables hold it (every decoder norm but the first layer's runs as one), else its plain form, a step no
    table serves at 0 us, the residual add the fold leaves at 0 (the previous GEMV's epilogue takes it where a
    table holds ``gemv_add``). ``joined``: the consumers are sibling linears the merge step lays out as one
    weight, so their folded GEMV is one ``rms_gemv`` on the joined rows (``tunekit.integrations.vllm.merge``).
    """
    from tunekit.ops import fold_decision

    fused_add = oprecords.get(op).with_residual
    return fold_decision(op, norm.weight, [tuple(c.weight.shape) for c in consumers], joined, (fused_add, op))


@torch.no_grad()
def folded_weights(op: str, gain: torch.Tensor, consumers: list[nn.Module]) -> list[torch.Tensor]:
    """Each consumer's weight times the norm's scale (g; Gemma 1 + g) along K, in fp32, rounded once: new
    tensors, the consumers untouched."""
    scale = fold_scale(gain, op)
    return [(c.weight.detach().float() * scale).to(c.weight.dtype) for c in consumers]


def check_fold(plan: FoldPlan, weights: list[torch.Tensor], joined: bool = False,
               raws: list[torch.Tensor] | None = None) -> CheckResult:
    """The worst of ``rms_gemv`` on each folded weight against the unfolded sequence on its consumer's
    weight (``raws``: the weights folded, default the consumers' own; ``fold_check.check_norm_fold``), and,
    ``joined``, on the weights joined as the merge step lays them out where the tables hold that shape."""
    from tunekit.ops import covers, dtype_name

    gain = plan.norm.weight.detach()
    raws = raws if raws is not None else [c.weight.detach() for c in plan.consumers]
    pairs = list(zip(raws, weights, strict=True))
    if joined and len(pairs) > 1:
        raw = torch.cat([r for r, _ in pairs])
        if covers("rms_gemv", dtype_name(raw.dtype), raw.shape[0], raw.shape[1], str(raw.device)):
            pairs.append((raw, torch.cat([w for _, w in pairs])))
    worst: CheckResult | None = None
    for raw, folded in pairs:
        result = check_norm_fold(plan.op, gain, plan.eps, raw, folded)
        worst = result if worst is None else worst.worst(result)
    assert worst is not None
    return worst


#: a scale below this multiplies a BF16 weight into zero or subnormals: its raw column is kept aside
ZERO_SCALE = 2.0**-100


def zero_columns(op: str, gain: torch.Tensor, raws: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The channels whose fold scale is (near) 0 and each raw weight's columns there (copies, few: a norm
    has at most a handful of dead channels)."""
    scale = fold_scale(gain, op)
    channels = torch.nonzero(scale.abs() < ZERO_SCALE).flatten()
    return channels, [w[:, channels].clone() for w in raws]


@torch.no_grad()
def commit(plan: FoldPlan, weights: list[torch.Tensor]) -> None:
    """Write the folded weights into the consumers (in place: a compiled graph keeps its tensors) and mark
    both sides."""
    plan.zero_channels, plan.zero_columns = zero_columns(plan.op, plan.norm.weight,
                                                         [c.weight.detach() for c in plan.consumers])
    for c, w in zip(plan.consumers, weights, strict=True):
        c.weight.data.copy_(w)
        setattr(c, FOLD_EPS, plan.eps)
    setattr(plan.norm, FOLDED, True)


def _add(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def fold_model(model: nn.Module, honours: Callable[[nn.Module], bool], join_siblings: bool = False,
               lora: bool = False, report: FoldReport | None = None) -> dict[str, int]:
    """Fold every norm :func:`survey` finds that the tables say pays and whose check passes.

    ``join_siblings``: consumers that form a sibling group (``marks.SIBLING_LINEARS``) are priced
    as one ``rms_gemv`` on their joined rows, as the merge step that runs next serves them, and checked
    so too. ``lora``: the engine runs LoRA adapters (nothing folds). ``report`` is filled with what was
    folded, kept unfolded and why, and each group's decision line. Returns counts: ``"<op> folded"``,
    ``"<op> (not fused per the table)"`` (its measured decision), ``"<op> (fold not in the tables or not
    paying)"`` (tables without one: their M=1 entries), ``"<op> (kept unfolded: failed the check)"`` and
    ``"<op> (not folded: <reason>)"``."""
    report = report if report is not None else FoldReport()
    groups = {tuple(map(id, linears)) for _, linears in sibling_groups(model)} if join_siblings else set()
    counts: dict[str, int] = {}
    plans, skipped = survey(model, honours, lora)
    for name, op, why in skipped:
        _add(counts, f"{op} (not folded: {why.split(' (')[0]})")
        report.not_folded.append((name, op, why))
    for plan in plans:
        joined = tuple(map(id, plan.consumers)) in groups
        decision = _fold_decision(plan.op, plan.norm, plan.consumers, joined)
        if decision.notice:
            report.decisions.append(decision.notice)
        if decision.first:
            report.decisions.append(decision.line)
        if not decision.fuse:
            _add(counts, f"{plan.op} (not fused per the table)" if decision.source == "table"
                 else f"{plan.op} (fold not in the tables or not paying)")
            continue
        start = time.perf_counter()
        weights = folded_weights(plan.op, plan.norm.weight, plan.consumers)
        result = check_fold(plan, weights, joined)
        report.checked += 1
        report.seconds += time.perf_counter() - start
        if not result.ok:
            _add(counts, f"{plan.op} (kept unfolded: failed the check)")
            report.failed.append((plan.name, plan.op, result))
            continue
        commit(plan, weights)
        report.folded.append(plan)
        _add(counts, f"{plan.op} folded")
    return counts
