"""Agreement with vanilla: teacher-forced, three ways against vanilla's own spread; free-running on dummy weights.

Pure (no torch, no vLLM): reads the runner's records. Teacher-forced
(:func:`forced_agreement`, the runner's ``forced`` records): every
process of every arm decodes the same contexts: the prompt followed by
vanilla #0's greedy tokens (``tunekit.evidence.serve_bench.forced``), so
position s of every arm is the next-token distribution after the same
s tokens, whatever the arm would have chosen itself. Per position the
runner keeps the top-K tokens and their logprobs (vLLM's ``logprobs``,
computed before any sampling step). Compared with vanilla, per batch size:

* **greedy tokens**: the share of positions whose argmax equals vanilla's,
  the first step where one differs, and the *hard* mismatches among them:
  those that are no near tie (a near tie: the two tokens within the
  logprob threshold of each other in both runs);
* **max |Δlogprob|** over the top-K tokens both runs list (a token only one
  run lists adds the bound it must exceed: its logprob minus the other
  run's K-th);
* **KL(vanilla || arm)** per position over the tokens both top-K lists hold
  plus one bucket for the rest of the vocabulary. Merging tokens into a
  bucket never raises a KL, so this is a lower bound of the
  full-vocabulary KL, tight when the bucket holds little mass
  (``top_mass_min`` says how much the lists cover). Full-vocabulary
  logprobs through vLLM's API are one Python object per token (248k per
  step for Qwen3.5): the top-K of ``max_logprobs`` is what it affords.

The spread: the same figures between vanilla processes (#i against #0)
and between vanilla's answers to the same request at two batch sizes
(vLLM's GEMMs round differently at another M; a served request meets that
every time its batch changes). Processes on one GPU usually agree bit for
bit, so the batch spread is what gives rounding a scale. A check passes
when the arm is within max(``factor`` x spread, floor): floors ``tol``
(2^-6 nats: four BF16 roundoffs) for |Δlogprob|, ``tol^2 / 2`` for the KL
(a logit error of ``tol`` spread over the distribution, to second order),
and no hard mismatch unless vanilla has them too.

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
    doc = forced_agreement(results_by_arm, batch, tol)    # per arm: figures, checks, ok; the spread; thresholds
    doc["tuned"]["ok"], doc["tuned"]["checks"]          # {"greedy": True, "logprob": True, "kl": False}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from tunekit.evidence.serve_bench import TABLE_ARMS

#: Logprob tolerance of both checks' floor, nats: 4 u_bf16 (module docstring).
DEFAULT_TOL = 2.0 ** -6
#: An arm passes within this many times vanilla's spread (or the floor, if larger).
SPREAD_FACTOR = 2.0
#: Arms compared with vanilla, in report order.
COMPARED_ARMS = ("tuned", "folded", "passthrough")
#: The smallest bucket mass the KL reads: logprobs come rounded to fp32, so a sum of K probabilities is good to
#: about K x 1e-7.
_TAIL_EPS = 1e-5


def kl_floor(tol: float) -> float:
    """The KL floor for a logprob tolerance ``tol``: KL ~ Var(logit error) / 2 to second order."""
    return tol * tol / 2.0


def _probs(top: Sequence[Sequence[Any]]) -> dict[int, float]:
    return {int(i): float(lp) for i, lp in top}


def _argmax(lps: dict[int, float]) -> int | None:
    return max(lps, key=lambda i: lps[i]) if lps else None


def position(ref_top: Sequence[Sequence[Any]], top: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """One teacher-forced position: argmaxes, max |Δlogprob| (with the bounds of tokens one list lacks),
    the bucketed KL(ref || other) and the mass of ref's distribution on the shared tokens."""
    p, q = _probs(ref_top), _probs(top)
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
            "ref_mass": mass_p, "p": p, "q": q}


def _margins(pos: dict[str, Any]) -> float:
    """A mismatch's margin: how far each run prefers its own token over the other's (the larger); inf where a
    run does not list the other's token."""
    a, b, p, q = pos["argmax_ref"], pos["argmax"], pos["p"], pos["q"]
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
            "ref_mass_min": min((p["ref_mass"] for p in positions), default=None)}


def _row(result: dict[str, Any], batch: int) -> dict[str, Any] | None:
    return next((r for r in result.get("batches", []) if r["batch"] == batch), None)


def _forced(result: dict[str, Any], batch: int) -> list[dict[str, Any]] | None:
    forced = (_row(result, batch) or {}).get("forced")
    return forced["requests"] if forced else None


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
            "top_mass_min": min(masses) if masses else None}


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


def forced_agreement(arms: dict[str, list[dict[str, Any]]], batch: int, tol: float,
                     batches: Sequence[int] | None = None, factor: float = SPREAD_FACTOR) -> dict[str, Any] | None:
    """The three checks of every arm against vanilla at ``batch`` (module docstring); None without forced
    records. ``batches``: the run's batch sizes (for vanilla's spread across them)."""
    vanilla = arms.get("vanilla", [])
    if not vanilla or _forced(vanilla[0], batch) is None:
        return None
    batches = list(batches) if batches is not None else sorted(
        {r["batch"] for res in vanilla for r in res.get("batches", [])})
    proc_pairs, batch_pairs = _spread_pairs(vanilla, batch, batches)
    loose = [summarize(proc_pairs), summarize(batch_pairs)]
    spread_lp = max((s["max_abs_logprob_diff"] for s in loose if s), default=0.0)
    spread_kl = max((s["kl_max"] for s in loose if s), default=0.0)
    lp_thr = max(factor * spread_lp, tol)
    kl_thr = max(factor * spread_kl, kl_floor(tol))
    spread = {"processes": summarize(proc_pairs, lp_thr), "batches": summarize(batch_pairs, lp_thr)}
    hard_thr = factor * max((s["hard_share"] for s in spread.values() if s), default=0.0)
    first = _forced(vanilla[0], batch) or []
    doc: dict[str, Any] = {
        "steps": max((len(r["top"]) for r in first), default=0),
        "topk": ((_row(vanilla[0], batch) or {}).get("forced") or {}).get("topk"),
        "factor": factor, "floors": {"logprob": tol, "kl": kl_floor(tol)},
        "thresholds": {"logprob": lp_thr, "kl": kl_thr, "hard_share": hard_thr}, "spread": spread,
    }
    for arm in COMPARED_ARMS:
        if arm not in arms:
            continue
        s = summarize(_pairs(arms[arm], vanilla, batch), lp_thr)
        if s is None:
            doc[arm] = None
            continue
        checks = {"greedy": s["hard_share"] <= hard_thr, "logprob": s["max_abs_logprob_diff"] <= lp_thr,
                  "kl": s["kl_max"] <= kl_thr}
        doc[arm] = {**s, "checks": checks, "ok": all(checks.values()) and not s["not_comparable"]}
    return doc


def verdict(doc: dict[str, Any] | None, arms: Iterable[str]) -> str | None:
    """"pass" / "fail" over the served ``arms`` that have figures; None without any."""
    if not doc:
        return None
    judged = [doc[a] for a in arms if doc.get(a)]
    if not judged:
        return None
    return "pass" if all(a["ok"] for a in judged) else "fail"


def line(arm: str, a: dict[str, Any], doc: dict[str, Any]) -> str:
    """One line of the report for ``arm``'s figures ``a``: the three checks against their thresholds."""
    t = doc["thresholds"]
    first = "none" if a["first_divergence"] is None else f"step {a['first_divergence']}"
    mass = "" if a.get("top_mass_min") is None else f", top-{doc.get('topk')} mass >= {a['top_mass_min']:.3f}"
    return (f"{arm}: greedy {a['equal_share']:.1%} equal over {a['positions']} positions (first divergence "
            f"{first}, {a['hard_mismatches']} beyond a near tie) {_ok(a['checks']['greedy'])}; max |dlogprob| "
            f"{a['max_abs_logprob_diff']:.3g} <= {t['logprob']:.3g} {_ok(a['checks']['logprob'])}; KL max "
            f"{a['kl_max']:.3g} (mean {a['kl_mean']:.3g}) <= {t['kl']:.3g}{mass} {_ok(a['checks']['kl'])}")


def _ok(flag: bool) -> str:
    return "pass" if flag else "FAIL"


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
    one (``forced``). The verdict is the teacher-forced check's where the weights mean something (realistic, a
    checkpoint) and it has figures, else the free-running one's; ``judged_by`` says which."""
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
    out["forced"] = forced_agreement(arms, batch, tol, batches)
    out["judged_by"] = "free-running logprobs"
    judged = verdict(out["forced"], TABLE_ARMS) if weights != "dummy" else None
    if judged is not None:
        out["verdict"], out["judged_by"] = judged, "teacher-forced"
    return out
