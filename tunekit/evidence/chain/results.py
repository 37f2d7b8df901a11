"""What a variant's run gives: its time, its steps by kind, and its logits against vendor's and against
the fp32 chain's; the saving the tables' standalone figures predict; the log line of a result.

Call protocol: ``compare_eager(chain, variants)`` without a GPU (no timing); ``tunekit.evidence.chain.timing``
makes the same results with times.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tunekit.evidence.chain.steps import Step
from tunekit.evidence.chain.variants import Chain
from tunekit.table import Entry, saving_us


@dataclass
class VariantResult:
    """One variant of a chain at one M: its step time (NaN untimed), its steps by kind, its logits' distances."""

    variant: str
    step_us: float  # median over repeats of the mean replay time
    spread: float  # (p75 - p25) / median over repeats
    tuned_steps: int
    vendor_steps: int
    max_abs_diff: float | None = None  # vs the vendor variant's logits
    rel_diff: float | None = None  # max_abs_diff / std(vendor logits)
    rms_err_fp32: float | None = None  # rms |logits - the fp32 chain's logits| (vendor's is the BF16 noise floor)
    fused_steps: int = 0  # steps served by a fused kernel (tuned_fused): two or three per kernel
    fused_kernels: int = 0
    #: with ``profile_replays``: one replay read as serve-bench reads a served step (per launch shape and
    #: predecessor: ``tunekit.evidence.serve_bench.profile.launch_totals``), divided by the replays profiled
    by_launch: dict[str, dict[str, float]] | None = None


def variant_result(variant: str, times: list[float], kinds: list[str], logits: torch.Tensor,
                   base: torch.Tensor | None, ref: torch.Tensor, fused_kernels: int = 0) -> VariantResult:
    """The result of ``variant`` from its replay ``times`` (us; none: untimed), its steps' ``kinds`` and its
    ``logits`` against vendor's (``base``, None without a vendor variant) and the fp32 chain's (``ref``)."""
    med = statistics.median(times) if times else float("nan")
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [med, med, med]
    diff = rel = None
    if base is not None:
        diff = float((logits - base).abs().max())
        std = float(base.std())
        rel = diff / std if std > 0 else None
    rms = float((logits - ref.float()).pow(2).mean().sqrt())
    return VariantResult(variant, med, (q[2] - q[0]) / med if times else float("nan"),
                         kinds.count("tuned"), kinds.count("vendor"), diff, rel, rms, kinds.count("fused"),
                         fused_kernels)


def predicted_saving_us(chain: Chain, entry_for: Callable[[Step], Entry], variant: str) -> float:
    """Sum over the steps the bound ``variant`` serves tuned, and its fused kernels, of (baseline -
    tuned) standalone time, from the table entries: what the microbenchmarks predict the step saves
    (a fused entry's baseline is the unfused eager sequence it replaces)."""
    total = 0.0
    tuned = [step for step, kind in zip(chain.steps, chain.kinds[variant], strict=True) if kind == "tuned"]
    # bound because a table entry serves each (a retyped plain norm: its entry was required for the fusion)
    for step in tuned + chain.fused.get(variant, []) + chain.retyped.get(variant, []):
        entry = entry_for(step)
        total += saving_us(entry)
    return total


def compare_eager(chain: Chain, variants: Sequence[str]) -> list[VariantResult]:
    """Without a GPU: run each bound variant once eagerly and compare its logits with vendor's (no timing)."""
    logits = {v: chain.forward(v).float().clone() for v in variants}
    base = logits.get("vendor")
    ref = chain.forward_fp32()
    return [variant_result(v, [], chain.kinds[v], logits[v], base, ref, len(chain.fused.get(v, ()))) for v in variants]


def result_line(row: dict[str, Any], timed: bool) -> str:
    """The log line of one row of chain.json (``timed``: with its time, speedup and savings)."""
    text = f"M={row['m']} {row['variant']:<11} tuned calls {row['tuned_steps']:>4}"
    if row.get("fused_kernels"):
        text += f" + {row['fused_kernels']} fused kernels ({row['fused_steps']} calls)"
    if timed:
        text += (f"  {row['step_us'] / 1000:.3f} ms/step (spread {row['spread']:.1%})  x{row['speedup']:.4f}"
                 f"  saving {row['measured_saving_us']:.0f} us, predicted {row['predicted_saving_us']:.0f} us")
    if row.get("rel_diff") is not None:
        text += f"  max |logits - vendor| {row['max_abs_diff']:.3g} ({row['rel_diff']:.2%} of their std)"
    text += f"  rms |logits - fp32| {row['rms_err_fp32']:.3g}"
    return text
