"""The agreement verdict, one function for every path: teacher-forced figures of an arm against vanilla, judged
against absolute caps; vanilla's own spread, measured in the same run, says whether the run can judge at all.

Pure (no torch): reads teacher-forced records, the same format from vLLM (``serve_bench.forced``, top-K
logprobs per position) and from a patched Hugging Face model (``check_serving.forced_hf``). Per position
(:func:`position`) against vanilla's record of the same context:

* **greedy token**: the argmax equal to vanilla's, or a *near tie* (each run prefers its own token by at most
  ``2 x`` the logprob cap: a correct arm moves each logprob by at most the cap, so the gap between two tokens
  by at most twice that); any other mismatch is *hard*;
* **max |Δlogprob|** over the top-K tokens both runs list (a token only one lists adds the bound it must
  exceed: its logprob minus the other run's K-th);
* **KL(vanilla || arm)** over the tokens both top-K lists hold plus one bucket for the rest of the
  vocabulary (merging never raises a KL: a lower bound of the full-vocabulary KL, tight when the bucket is
  small; ``top_mass_min`` says how much the lists cover).

:func:`judge` gives one of three verdicts:

* ``inconclusive`` where vanilla's spread (vanilla against itself: another process, another batch size, the
  same tokens through another GEMM shape) exceeds a cap on any figure: the run cannot tell a kernel's error
  from its own noise, so it never passes (nor fails: the synthetic 27B weights differed by 1.36 nats
  between two vanilla processes, where any threshold relative to that spread passes anything);
* ``fail`` where the arm exceeds a cap (max |Δlogprob|, KL) or has a hard mismatch;
* ``pass`` otherwise. Without a spread (one process, one batch size) the caps alone judge.

The caps are absolute, per activation dtype (:data:`CAPS_BY_DTYPE`), and come from measurement on the two real
checkpoints (``tunekit real-weights``) on the CPU, teacher-forced (docs/evidence.md, "The agreement verdict"). In
BF16 a correct table (another summation order; tunekit's norm and fused add, which round where vLLM's CUDA
kernels do, not where Hugging Face's or vLLM's native math do; the fold's W diag(g) rounded to BF16) moves max
|Δlogprob| by up to 0.39 nats and the KL by up to 0.018 (SmolLM2 through tunekit.patch and through vLLM's
layers; Gemma 3: 0.24, 0.003), as far as vanilla's own spread across GEMM shapes (0.23-0.25 nats): logits of
16-64 carry BF16 steps of 0.125-0.25 nats, and 18-30 layers amplify every rounding. The BF16 caps (0.55 nats,
KL 0.03) sit 1.4x / 1.7x above that; a dropped K block in one layer (0.70-0.96 nats) or a dropped residual
(6.9-16.5 nats) is past them, by its logprobs (a dropped K block's KL, 0.010-0.033, overlaps a correct
table's), while one norm gain 1% off in one layer, one layer accumulating in BF16 or one misfolded channel
(0.19-0.44 nats) is inside BF16's own noise on these models: no cap separates them from a correct table there.
In fp32 (the same checkpoints upcast) a correct table moves the figures by at most 2.5e-5 nats and 3e-11 KL;
the fp32 caps (1e-3 nats, KL 1e-6) are 40x above that, and each of those four defects is 13x or more past them.

Call protocol::

    pos = position(vanilla_top, arm_top)                      # one position's figures
    pair = compare_requests(vanilla_request, arm_request)     # one request, position by position
    s = summarize(pairs, near_tie_margin(CAPS))               # totals over requests
    doc = judge(s, [spread_summary, ...], CAPS)               # {"verdict": "pass" | "fail" | "inconclusive", ...}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: The smallest bucket mass the KL reads: logprobs come rounded to fp32, so a sum of K probabilities is good to
#: about K x 1e-7.
_TAIL_EPS = 1e-5


@dataclass(frozen=True)
class Caps:
    """What a correct BF16 kernel may change, at most, in a teacher-forced position (module docstring)."""

    #: max |Δlogprob| over the top-K, nats
    logprob: float = 0.55
    #: max per-position KL(vanilla || arm), nats
    kl: float = 0.03
    #: share of positions whose greedy token differs beyond a near tie
    hard_share: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


#: The caps per activation dtype of the model (docs/evidence.md, "The agreement verdict", says how they were
#: measured). fp16 is not measured: it takes bf16's, which are wider than its three more mantissa bits need.
CAPS_BY_DTYPE: dict[str, Caps] = {
    "bf16": Caps(logprob=0.55, kl=0.03),
    "fp16": Caps(logprob=0.55, kl=0.03),
    "fp32": Caps(logprob=1e-3, kl=1e-6),
}
#: The caps of a BF16 model: what serve-bench (BF16 engines) judges with.
CAPS = CAPS_BY_DTYPE["bf16"]


def caps_for(dtype: str) -> Caps:
    """The caps of a model computing in ``dtype`` ("bf16", "fp16", "fp32"); bf16's for any other."""
    return CAPS_BY_DTYPE.get(dtype, CAPS)


VERDICTS = ("pass", "fail", "inconclusive")


def near_tie_margin(caps: Caps = CAPS) -> float:
    """The largest preference of a run for its own token that still counts as a near tie: 2 x the logprob cap."""
    return 2.0 * caps.logprob


def _probs(top: Sequence[Sequence[Any]]) -> dict[int, float]:
    return {int(i): float(lp) for i, lp in top}


def _argmax(lps: dict[int, float]) -> int | None:
    return max(lps, key=lambda i: lps[i]) if lps else None


def position(ref_top: Sequence[Sequence[Any]], top: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """One teacher-forced position: argmaxes, max |Δlogprob| (with the bounds of tokens one list lacks),
    the bucketed KL(ref || other) and the mass of ref's distribution on the shared tokens."""
    p, q = _probs(ref_top), _probs(top)
    # a NaN or Inf logprob of the arm where vanilla's is finite is a defect of its own: every comparison
    # below would drop it (max(0.0, nan) is 0.0), so the figures read infinite and the count says why
    nonfinite = sum(1 for i, v in q.items() if not math.isfinite(v) and math.isfinite(p.get(i, 0.0)))
    if nonfinite:
        return {"argmax_ref": _argmax(p), "argmax": None, "max_abs_logprob_diff": math.inf, "kl": math.inf,
                "ref_mass": sum(math.exp(v) for v in p.values()), "p": p, "q": q, "nonfinite": nonfinite}
    shared = set(p) & set(q)
    gap = max((abs(p[i] - q[i]) for i in shared), default=0.0)
    for mine, other in ((p, q), (q, p)):
        if len(other) and len(mine) > len(shared):
            floor = min(other.values())
            gap = max(gap, max((mine[i] - floor for i in set(mine) - shared), default=0.0))
    mass_p = sum(math.exp(p[i]) for i in shared)
    mass_q = sum(math.exp(q[i]) for i in shared)
    kl = sum(math.exp(p[i]) * (p[i] - q[i]) for i in shared)
    tail_p, tail_q = 1.0 - mass_p, 1.0 - mass_q
    if tail_p > _TAIL_EPS:  # below it, 1 - sum is rounding, and so would the term be
        kl += tail_p * (math.log(tail_p) - math.log(max(tail_q, _TAIL_EPS)))
    return {"argmax_ref": _argmax(p), "argmax": _argmax(q), "max_abs_logprob_diff": gap, "kl": max(0.0, kl),
            "ref_mass": mass_p, "p": p, "q": q, "nonfinite": 0}


def _margins(pos: dict[str, Any]) -> float:
    """A mismatch's margin: how far each run prefers its own token over the other's (the larger); inf where a
    run does not list the other's token."""
    a, b, p, q = pos["argmax_ref"], pos["argmax"], pos["p"], pos["q"]
    if pos.get("nonfinite"):
        return math.inf
    ma = p[a] - p[b] if a in p and b in p else math.inf
    mb = q[b] - q[a] if a in q and b in q else math.inf
    return max(ma, mb)


def compare_requests(ref: dict[str, Any], other: dict[str, Any]) -> dict[str, Any] | None:
    """Two forced records of one request, position by position; None unless both decoded the same forced
    tokens (other contexts: nothing to compare)."""
    if list(ref.get("forced") or []) != list(other.get("forced") or []) or not ref.get("forced"):
        return None
    steps = min(len(ref["top"]), len(other["top"]))
    positions = [position(ref["top"][s], other["top"][s]) for s in range(steps)]
    mismatches = [(s, _margins(p)) for s, p in enumerate(positions) if p["argmax_ref"] != p["argmax"]]
    return {"steps": steps, "equal": steps - len(mismatches),
            "first_divergence": mismatches[0][0] if mismatches else None,
            "mismatch_margins": [m for _, m in mismatches],
            "max_abs_logprob_diff": max((p["max_abs_logprob_diff"] for p in positions), default=0.0),
            "kl_max": max((p["kl"] for p in positions), default=0.0),
            "kl_sum": sum(p["kl"] for p in positions),
            "nonfinite": sum(p["nonfinite"] for p in positions),
            "ref_mass_min": min((p["ref_mass"] for p in positions), default=None)}


def summarize(pairs: Iterable[dict[str, Any] | None], lp_threshold: float | None = None) -> dict[str, Any] | None:
    """Totals of :func:`compare_requests` results (None entries: not comparable, counted apart). Hard
    mismatches: margins above ``lp_threshold`` (all of them without one)."""
    pairs = list(pairs)
    done = [p for p in pairs if p is not None]
    if not done:
        return None
    positions = sum(p["steps"] for p in done)
    margins = [m for p in done for m in p["mismatch_margins"]]
    hard = sum(1 for m in margins if lp_threshold is None or m > lp_threshold)
    masses = [p["ref_mass_min"] for p in done if p["ref_mass_min"] is not None]
    return {"sequences": len(done), "not_comparable": len(pairs) - len(done), "positions": positions,
            "equal_share": sum(p["equal"] for p in done) / positions if positions else None,
            "first_divergence": min((p["first_divergence"] for p in done if p["first_divergence"] is not None),
                                    default=None),
            "mismatches": len(margins), "hard_mismatches": hard,
            "hard_share": hard / positions if positions else 0.0,
            "max_abs_logprob_diff": max(p["max_abs_logprob_diff"] for p in done),
            "kl_max": max(p["kl_max"] for p in done),
            "kl_mean": sum(p["kl_sum"] for p in done) / positions if positions else 0.0,
            "nonfinite": sum(p.get("nonfinite", 0) for p in done),
            "top_mass_min": min(masses) if masses else None}


def _checks(s: dict[str, Any], caps: Caps) -> dict[str, bool]:
    return {"finite": not s.get("nonfinite"), "greedy": s["hard_share"] <= caps.hard_share,
            "logprob": s["max_abs_logprob_diff"] <= caps.logprob, "kl": s["kl_max"] <= caps.kl}


def spread_within(spread: Iterable[dict[str, Any] | None], caps: Caps = CAPS) -> tuple[bool | None, list[str]]:
    """(whether every measured spread is within the caps, None where none was measured; the figures past them)."""
    measured = [s for s in spread if s]
    if not measured:
        return None, []
    over = [f"{name} {s[key]:.3g} > {limit:.3g}" for s in measured
            for name, key, limit in (("max |dlogprob|", "max_abs_logprob_diff", caps.logprob),
                                     ("KL", "kl_max", caps.kl), ("hard share", "hard_share", caps.hard_share))
            if not s[key] <= limit]  # a NaN figure is past its cap, never within it
    return not over, over


def judge(arm: dict[str, Any] | None, spread: Iterable[dict[str, Any] | None] = (),
          caps: Caps = CAPS) -> dict[str, Any]:
    """The verdict on one arm's :func:`summarize` figures (module docstring): ``{"verdict", "checks", "ok",
    "why"}``; ``ok`` is True only for ``pass``."""
    if arm is None:
        return {"verdict": "inconclusive", "checks": None, "ok": False, "why": "no comparable positions"}
    checks = _checks(arm, caps)
    within, over = spread_within(spread, caps)
    if within is False:
        verdict, why = "inconclusive", "vanilla's own spread is past the caps (" + "; ".join(over) + ")"
    elif arm.get("not_comparable"):
        verdict, why = "inconclusive", f"{arm['not_comparable']} requests decoded other tokens than vanilla's"
    elif all(checks.values()):
        verdict = "pass"
        why = "within the caps" + (" (no spread measured: the caps alone)" if within is None else "")
    elif not checks["finite"]:
        verdict, why = "fail", f"non-finite: {arm['nonfinite']} NaN or Inf logprobs where vanilla's are finite"
    else:
        verdict, why = "fail", "past the caps: " + ", ".join(k for k, ok in checks.items() if not ok)
    return {"verdict": verdict, "checks": checks, "ok": verdict == "pass", "why": why}


def overall(verdicts: Iterable[str | None]) -> str | None:
    """One verdict over several arms: fail if any fails, else inconclusive if any is, else pass; None if none."""
    got = [v for v in verdicts if v]
    if not got:
        return None
    return "fail" if "fail" in got else ("inconclusive" if "inconclusive" in got else "pass")


def line(arm: str, a: dict[str, Any], caps: dict[str, float], topk: int | None = None, judged: bool = True) -> str:
    """One report line for ``arm``'s judged figures ``a`` (:func:`summarize` + :func:`judge`); ``judged=False``:
    the figures alone, with no pass / FAIL word (weights on which no verdict can be trusted)."""
    first = "none" if a["first_divergence"] is None else f"step {a['first_divergence']}"
    mass = "" if a.get("top_mass_min") is None else f", top-{topk} mass >= {a['top_mass_min']:.3f}"
    checks = a.get("checks") or {}

    def ok(key: str) -> str:
        if not judged:
            return ""
        return f" <= {caps[key]:.3g} " + ("pass" if checks.get(key) else "FAIL") if key in caps else (
            " pass" if checks.get(key) else " FAIL")

    head = (f"{arm}: {'pass' if a['verdict'] == 'pass' else a['verdict'].upper()} ({a['why']}): " if judged
            else f"{arm} (not judged): ")
    return (f"{head}greedy {a['equal_share']:.1%} equal over {a['positions']} positions (first divergence {first}, "
            f"{a['hard_mismatches']} beyond a near tie){ok('greedy')}; max |dlogprob| "
            f"{a['max_abs_logprob_diff']:.3g}{ok('logprob')}; KL max {a['kl_max']:.3g} (mean {a['kl_mean']:.3g})"
            f"{ok('kl')}{mass}")
