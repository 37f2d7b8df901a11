"""The model check's pure judging and arithmetic: logits against a tolerance the model sets itself, greedy
tokens and their near ties, the same-run timing ratios, the dispatch markers by kind.

No torch at import (``compare_logits`` reads tensors it is given; the timing and dispatch parts take plain
numbers and rows), so recorded ``serving_check.json`` figures are recomputed from here
(``timing_summary(doc["model"]["timing"]["times_ms"])``). The criteria are the module docstring's of
``tunekit.evidence.check_serving.model_check``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

#: The four timed variants, in this order; ratios are read between them (see timing_summary).
VARIANTS = ("eager_unpatched", "eager_patched", "graphed_unpatched", "graphed_patched")
#: name -> (numerator variant, denominator variant): a ratio > 1 means the denominator is faster.
RATIOS = {
    "patched_speedup_eager": ("eager_unpatched", "eager_patched"),
    "patched_speedup_graphed": ("graphed_unpatched", "graphed_patched"),
    "graph_speedup_unpatched": ("eager_unpatched", "graphed_unpatched"),
    "graph_speedup_patched": ("eager_patched", "graphed_patched"),
    "graphed_patched_vs_eager_unpatched": ("eager_unpatched", "graphed_patched"),
}


def compare_logits(base: dict[str, Any], other: dict[str, Any], fp32: dict[str, Any] | None,
                   tol_factor: float, rel_tol_fallback: float) -> dict[str, Any]:
    """Per-step and overall distances of ``other``'s logits from ``base``'s (and both from ``fp32``'s).

    ``base`` / ``other`` / ``fp32``: {"logits": [tensor per step], "tokens": [int per step]}. Returns the
    steps, the tolerance and ``ok`` (the logits criterion of the module docstring); flips are judged apart.
    """
    steps = []
    sq = {"diff": 0.0, "vendor": 0.0, "tuned": 0.0}  # sums of squares over every step and logit
    count = 0
    for i, (u, p) in enumerate(zip(base["logits"], other["logits"], strict=True)):
        d = float((p - u).abs().max())
        std = float(u.std())
        top = u.topk(2).values
        row: dict[str, Any] = {"step": i, "max_abs_diff": d, "logit_std": std,
                               "rel_to_std": d / std if std else math.inf, "top2_gap": float(top[0] - top[1]),
                               "token_unpatched": base["tokens"][i], "token_patched": other["tokens"][i]}
        sq["diff"] += float((p - u).double().pow(2).sum())
        if fp32 is not None:
            f = fp32["logits"][i]
            row["err_vendor_vs_fp32"] = float((u - f).abs().max())
            row["err_tuned_vs_fp32"] = float((p - f).abs().max())
            sq["vendor"] += float((u - f).double().pow(2).sum())
            sq["tuned"] += float((p - f).double().pow(2).sum())
        count += u.numel()
        steps.append(row)
    max_diff = max(r["max_abs_diff"] for r in steps)
    max_rel = max(r["rel_to_std"] for r in steps)
    rms = {name: math.sqrt(total / count) for name, total in sq.items()}
    result: dict[str, Any] = {"steps": steps, "max_abs_diff": max_diff, "max_rel_to_std": max_rel,
                              "rms_diff": rms["diff"]}
    if fp32 is not None:
        e_vendor = max(r["err_vendor_vs_fp32"] for r in steps)
        tol = (tol_factor + 1.0) * e_vendor
        rms_ratio = rms["tuned"] / rms["vendor"] if rms["vendor"] else (1.0 if not rms["tuned"] else math.inf)
        result.update(err_vendor_vs_fp32=e_vendor, err_tuned_vs_fp32=max(r["err_tuned_vs_fp32"] for r in steps),
                      rms_vendor_vs_fp32=rms["vendor"], rms_tuned_vs_fp32=rms["tuned"], rms_ratio=rms_ratio,
                      tol_abs=tol, tol_factor=tol_factor, ok=max_diff <= tol and rms_ratio <= tol_factor,
                      criterion="max|variant - unpatched| <= (factor + 1) * max|unpatched - fp32| and "
                                "rms|variant - fp32| <= factor * rms|unpatched - fp32| (all steps, all logits)")
    else:
        result.update(tol_abs=rel_tol_fallback * min(r["logit_std"] for r in steps), ok=max_rel <= rel_tol_fallback,
                      criterion=f"no fp32 reference: max|diff| / std <= {rel_tol_fallback}")
    return result


def judge_flips(steps: list[dict[str, Any]], tol: float) -> list[dict[str, Any]]:
    """The steps whose greedy tokens differ, each marked ``near_tie`` (allowed) or not (a failure).

    A near tie: the unpatched top-2 gap is at most twice the step's measured logit error (a flip moves
    two logits), and that error is within ``tol``.
    """
    flips = []
    for r in steps:
        if r["token_unpatched"] == r["token_patched"]:
            continue
        r["near_tie"] = r["top2_gap"] <= 2.0 * r["max_abs_diff"] and r["max_abs_diff"] <= tol
        r["gap_below_measured_error"] = r["top2_gap"] < r["max_abs_diff"]
        flips.append(r)
    return flips


def tokens_verdict(steps: list[dict[str, Any]], tol: float) -> dict[str, Any]:
    """Greedy-token agreement: how many steps agree, which differ, and whether every difference is a near tie."""
    flips = judge_flips(steps, tol)
    return {"steps": len(steps), "agree": len(steps) - len(flips), "tokens_equal": not flips,
            "differing_steps": [r["step"] for r in flips], "ok": all(r["near_tie"] for r in flips)}


def _median_spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def timing_summary(times: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Medians per variant and same-run ratios from :func:`~tunekit.evidence.check_serving.hf_decode.time_interleaved`.

    ``times``: {variant: [[ms per step] per round]}, all variants the same number of rounds. A variant's
    median is over all its steps; a ratio (:data:`RATIOS`: numerator / denominator, > 1 when the
    denominator is faster) is the median over rounds of the ratio of the two variants' medians in that
    round, with the rounds' min and max as its spread. Ratios whose variants were not timed are left out.
    """
    rounds = {len(rows) for rows in times.values()}
    if len(rounds) > 1:
        raise ValueError(f"variants timed over different numbers of rounds: {sorted(rounds)}")
    out: dict[str, Any] = {"variants": {}, "ratios": {}}
    for name, rows in times.items():
        flat = [t for row in rows for t in row]
        if not flat:
            raise ValueError(f"variant {name} has no timed steps")
        out["variants"][name] = {"median_ms": statistics.median(flat), "min_ms": min(flat), "max_ms": max(flat),
                                 "steps": len(flat), "rounds": len(rows),
                                 "round_medians_ms": [statistics.median(row) for row in rows]}
    for ratio, (num, den) in RATIOS.items():
        if num in times and den in times:
            per_round = [statistics.median(a) / statistics.median(b)
                         for a, b in zip(times[num], times[den], strict=True)]
            out["ratios"][ratio] = {"numerator": num, "denominator": den, **_median_spread(per_round),
                                    "per_round": per_round}
    return out


def group_stats(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Dispatch marker rows -> {"op shape m=M": {impl: calls}} (impl suffixed " (at capture)" if so)."""
    out: dict[str, dict[str, int]] = {}
    for row in rows:
        key = f"{row['op']} {row['shape']} m={row['m']}"
        slot = out.setdefault(key, {})
        impl = row["impl"] + (" (at capture)" if row.get("counted_at") == "capture" else "")
        slot[impl] = slot.get(impl, 0) + row["calls"]
    return out


def classify_dispatch(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Tuned calls, all calls, and the broken paths (fallback reasons of :data:`BROKEN_REASONS`)."""
    from tunekit.evidence.check_serving.checks import BROKEN_REASONS

    grouped = group_stats(rows)
    tuned = total = 0
    broken, uncovered, vendor = [], [], []
    for key, slot in sorted(grouped.items()):
        for impl, calls in slot.items():
            total += calls
            base = impl.removesuffix(" (at capture)")
            if base.startswith("tuned:"):
                tuned += calls
                continue
            reason = base.split(":", 1)[1] if ":" in base else base
            if reason in BROKEN_REASONS:
                broken.append(f"{key}: {impl} x{calls}")
            elif reason in ("no_entry", "m_above_table"):
                uncovered.append(f"{key}: {impl} x{calls}")
            else:
                vendor.append(f"{key}: {impl} x{calls}")
    return {"grouped": grouped, "tuned_calls": tuned, "calls": total, "broken": broken, "uncovered": uncovered,
            "vendor": vendor}
