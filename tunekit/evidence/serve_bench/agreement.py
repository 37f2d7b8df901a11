"""Agreement with vanilla: teacher-forced, judged by ``tunekit.evidence.verdict``; free-running on dummy weights.

Pure (no torch, no vLLM): reads the runner's records. Teacher-forced
(:func:`forced_agreement`, the runner's ``forced`` records): every
process of every arm decodes the same contexts: the prompt followed by
vanilla #0's greedy tokens (``tunekit.evidence.serve_bench.forced``), so
position s of every arm is the next-token distribution after the same
s tokens, whatever the arm would have chosen itself. Per position the
runner keeps the top-K tokens and their logprobs (vLLM's ``logprobs``,
computed before any sampling step). Each arm's figures against vanilla
(greedy tokens, max |Δlogprob| over the top-K, a bucketed KL) are judged by
``tunekit.evidence.verdict.judge``, the one verdict the patched Hugging Face
path uses too: absolute caps measured on real checkpoints, and vanilla's
spread in the same run (vanilla #i against #0, and each vanilla process at
one batch size against itself at the others: vLLM's GEMMs round differently
at another M) past a cap makes the verdict ``inconclusive``, never a pass.
Full-vocabulary logprobs through vLLM's API are one Python object per token
(248k per step for Qwen3.5): the top-K of ``max_logprobs`` is what it affords.

Which weights get a verdict: a checkpoint's (``--model-dir``). On the
synthetic recipe (``--weights realistic``) vanilla processes of a 27B model
differ by more than any cap (1.36 nats), so its teacher-forced figures are
reported as "speed weights: agreement not judged", pointing to the
real-checkpoint verdict. On dummy weights the free-running check below
speaks, as before (it cannot fail for a wrong kernel: every token is a near
tie there).

Free-running (:func:`compare_arms`, the runner's ``agreement`` records; the
verdict on dummy weights). vLLM's dummy loader fills every weight from a
small uniform range with a fixed seed, so all processes hold the same weights
and the next-token distribution is nearly uniform (every logprob near
-ln(vocab)). Greedy tokens are then near ties that a rounding can flip, and
the text means nothing; what is compared is, per request and decode step, the
logprob of the chosen token while the token ids agree, and at the first
step where they differ whether both tokens lie within the tolerance of each
other in both arms (a near tie). Tolerance (``DEFAULT_TOL``): 2^-6 nats, four
BF16 unit roundoffs (u = 2^-8): lp = z_c - logsumexp(z), one BF16 rounding
of the hidden state and one of the logits on each of the two terms, for
unit-scale logits. Deep stacks amplify roundings layer by layer (the chain's
finding), so the vanilla-vs-vanilla gap across processes is reported beside
it as the observed floor; a gap above the tolerance is reported as a failure,
never dropped.

Call protocol::

    row = agreement_row(results_by_arm, batch, tol, weights)  # serve.json's per-batch "agreement", both checks
    doc = forced_agreement(results_by_arm, batch)          # per arm: figures and verdict; the spread; the caps
    doc["tuned"]["verdict"], doc["tuned"]["checks"]      # "fail", {"finite": True, "greedy": True, ..., "kl": False}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from tunekit.evidence.serve_bench import TABLE_ARMS
from tunekit.evidence.verdict import (
    CAPS,
    Caps,
    compare_requests,
    judge,
    near_tie_margin,
    overall,
    position,
    spread_within,
    summarize,
)
from tunekit.evidence.verdict import line as verdict_line

__all__ = ["CAPS", "COMPARED_ARMS", "DEFAULT_TOL", "NOT_JUDGED", "agreement_row", "compare_arms", "compare_requests",
           "compare_sequences", "forced_agreement", "line", "position", "summarize", "verdict"]

#: Logprob tolerance of the free-running check on dummy weights, nats: 4 u_bf16 (module docstring).
DEFAULT_TOL = 2.0 ** -6
#: Arms compared with vanilla, in report order.
COMPARED_ARMS = ("tuned", "folded", "passthrough")
#: What the report says instead of a verdict on the synthetic recipe's weights.
NOT_JUDGED = "speed weights: agreement not judged"


def _row(result: dict[str, Any], batch: int) -> dict[str, Any] | None:
    return next((r for r in result.get("batches", []) if r["batch"] == batch), None)


def _forced(result: dict[str, Any], batch: int) -> list[dict[str, Any]] | None:
    forced = (_row(result, batch) or {}).get("forced")
    return forced["requests"] if forced else None


def _pairs(xs: Sequence[dict[str, Any]], ys: Sequence[dict[str, Any]], batch: int,
           other_batch: int | None = None) -> list[dict[str, Any] | None]:
    """Request by request: process i of xs at ``batch`` against process i of ys (ys #0 where ys has no #i)
    at ``other_batch`` (default: the same batch)."""
    out: list[dict[str, Any] | None] = []
    for i, x in enumerate(xs):
        y = ys[i] if i < len(ys) else (ys[0] if ys else None)
        if y is None:
            continue
        rx, ry = _forced(x, batch), _forced(y, other_batch if other_batch is not None else batch)
        if rx is None or ry is None:
            continue
        out += [compare_requests(b, a) for a, b in zip(rx, ry, strict=False)]
    return out


def _spread_pairs(vanilla: Sequence[dict[str, Any]], batch: int,
                  batches: Sequence[int]) -> tuple[list[Any], list[Any]]:
    """(process pairs: vanilla #i against #0 at ``batch``; batch pairs: each vanilla process at ``batch``
    against itself at every other batch size, on the requests both hold)."""
    processes = _pairs(vanilla[1:], vanilla[:1] * len(vanilla[1:]), batch)
    across = [p for b in batches if b != batch for p in _pairs(vanilla, vanilla, batch, other_batch=b)]
    return processes, across


def forced_agreement(arms: dict[str, list[dict[str, Any]]], batch: int, caps: Caps = CAPS,
                     batches: Sequence[int] | None = None) -> dict[str, Any] | None:
    """Every arm against vanilla at ``batch``, judged by ``verdict.judge`` (module docstring); None without
    forced records. ``batches``: the run's batch sizes (for vanilla's spread across them)."""
    vanilla = arms.get("vanilla", [])
    if not vanilla or _forced(vanilla[0], batch) is None:
        return None
    batches = list(batches) if batches is not None else sorted(
        {r["batch"] for res in vanilla for r in res.get("batches", [])})
    proc_pairs, batch_pairs = _spread_pairs(vanilla, batch, batches)
    near = near_tie_margin(caps)
    spread = {"processes": summarize(proc_pairs, near), "batches": summarize(batch_pairs, near)}
    within, over = spread_within(spread.values(), caps)
    first = _forced(vanilla[0], batch) or []
    doc: dict[str, Any] = {
        "steps": max((len(r["top"]) for r in first), default=0),
        "topk": ((_row(vanilla[0], batch) or {}).get("forced") or {}).get("topk"),
        "caps": caps.as_dict(), "near_tie": near, "spread": spread, "spread_within_caps": within,
        "spread_over_caps": over,
    }
    for arm in COMPARED_ARMS:
        if arm not in arms:
            continue
        s = summarize(_pairs(arms[arm], vanilla, batch), near)
        doc[arm] = None if s is None else {**s, **judge(s, spread.values(), caps)}
    return doc


def verdict(doc: dict[str, Any] | None, arms: Iterable[str]) -> str | None:
    """"pass" / "fail" / "inconclusive" over the served ``arms`` that have figures; None without any."""
    if not doc:
        return None
    return overall(doc[a]["verdict"] for a in arms if doc.get(a))


def line(arm: str, a: dict[str, Any], doc: dict[str, Any], judged: bool = True) -> str:
    """One line of the report for ``arm``'s figures ``a``: the verdict and the three checks against the caps
    (``judged=False``: the figures alone)."""
    return verdict_line(arm, a, doc["caps"], doc.get("topk"), judged)


# ---------------------------------------------------------------------------
# Free-running (dummy weights)
# ---------------------------------------------------------------------------


def _margin(top: list[list[Any]], mine: int, other: int) -> float:
    """lp(mine) - lp(other) in one arm's top-K of a step; inf when ``other`` is not in it."""
    lps = {int(i): float(lp) for i, lp in top}
    if mine not in lps or other not in lps:
        return math.inf
    return lps[mine] - lps[other]


def compare_sequences(a: dict[str, Any], b: dict[str, Any], tol: float) -> dict[str, Any]:
    """Chosen-token logprobs of two runs of one request, step by step while the ids agree; at the first
    differing id, whether the two tokens are within ``tol`` of each other in both runs (a near tie)."""
    steps = min(len(a["token_ids"]), len(b["token_ids"]))
    gap, diverged, margin = 0.0, None, None
    compared = 0
    for s in range(steps):
        ta, tb = a["token_ids"][s], b["token_ids"][s]
        if ta != tb:
            diverged = s
            ma = _margin(a["top"][s], ta, tb) if s < len(a["top"]) else math.inf
            mb = _margin(b["top"][s], tb, ta) if s < len(b["top"]) else math.inf
            margin = max(ma, mb)
            break
        la, lb = a["logprobs"][s] if s < len(a["logprobs"]) else None, b["logprobs"][s] if s < len(
            b["logprobs"]) else None
        if la is not None and lb is not None:
            gap = max(gap, abs(float(la) - float(lb)))
        compared += 1
    ok = gap <= tol and (diverged is None or (margin is not None and margin <= tol))
    return {"steps_compared": compared, "ids_equal": diverged is None, "first_divergence": diverged,
            "divergence_margin": None if margin is None or math.isinf(margin) else margin,
            "max_abs_logprob_diff": gap, "ok": ok}


def compare_arms(xs: Sequence[dict[str, Any]], ys: Sequence[dict[str, Any]], batch: int,
                 tol: float, same_arm: bool = False) -> dict[str, Any] | None:
    """Every request of process i of arm X against process i of arm Y (``same_arm``: process i against
    process i + 1, the run-to-run floor)."""
    pairs = list(zip(xs[1:], xs[:-1], strict=False)) if same_arm else list(zip(xs, ys, strict=False))
    results = []
    for x, y in pairs:
        rx, ry = _row(x, batch), _row(y, batch)
        if not rx or not ry or "agreement" not in rx or "agreement" not in ry:
            continue
        for qa, qb in zip(rx["agreement"]["requests"], ry["agreement"]["requests"], strict=False):
            results.append(compare_sequences(qa, qb, tol))
    if not results:
        return None
    return {
        "pairs": len(pairs), "sequences": len(results),
        "ids_equal": sum(r["ids_equal"] for r in results),
        "max_abs_logprob_diff": max(r["max_abs_logprob_diff"] for r in results),
        "near_ties": sum(1 for r in results if not r["ids_equal"] and r["ok"]),
        "failed": sum(1 for r in results if not r["ok"]),
        "first_divergence": min((r["first_divergence"] for r in results if r["first_divergence"] is not None),
                                default=None),
        "ok": all(r["ok"] for r in results),
    }


def agreement_row(arms: dict[str, list[dict[str, Any]]], batch: int, tol: float, weights: str = "dummy",
                  batches: Sequence[int] | None = None) -> dict[str, Any]:
    """``serve.json``'s agreement at ``batch``: the free-running check (``X_vs_vanilla``) and the teacher-forced
    one (``forced``). The verdict: on a checkpoint's weights the teacher-forced one's (pass / fail /
    inconclusive) where it has figures; on the synthetic recipe none (``NOT_JUDGED``: its vanilla processes
    disagree past every cap); on dummy weights the free-running one's. ``judged_by`` says which."""
    vanilla = arms.get("vanilla", [])
    out: dict[str, Any] = {"tolerance": tol}
    first = _row(vanilla[0], batch) if vanilla else None
    if first and "agreement" in first:
        out["steps"] = first["agreement"]["steps"]
    out["vanilla_vs_vanilla"] = compare_arms(vanilla, vanilla, batch, tol, same_arm=True)
    for arm in (*TABLE_ARMS, "passthrough"):
        if arm in arms:
            out[f"{arm}_vs_vanilla"] = compare_arms(arms[arm], vanilla, batch, tol)
    served = [out[f"{arm}_vs_vanilla"] for arm in TABLE_ARMS if f"{arm}_vs_vanilla" in out]
    out["verdict"] = "n/a" if not served else ("pass" if all(c["ok"] for c in served) else "fail")
    out["forced"] = forced_agreement(arms, batch, batches=batches)
    out["judged_by"] = "free-running logprobs"
    if weights == "realistic":
        out["verdict"], out["judged_by"] = "not judged", NOT_JUDGED
        return out
    judged = verdict(out["forced"], TABLE_ARMS) if weights != "dummy" else None
    if judged is not None:
        out["verdict"], out["judged_by"] = judged, "teacher-forced"
    return out
