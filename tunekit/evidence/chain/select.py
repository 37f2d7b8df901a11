"""The fused families ``tuned_fused`` keeps, checked by timing the chain as a whole: standalone times can
mislead in a chain, so each family is left out in turn and dropped where leaving it out is faster.

Call protocol: ``check_fusions(chain, families, ...)`` on a GPU (it rebinds ``tuned_fused`` per candidate
and times it against ``tuned``); :func:`select_fusions` is the choice itself, on any ``ratio`` function;
``excluding(fused, excluded)`` is the lookup ``Chain.build`` then binds with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tunekit.evidence.chain.steps import FusedLookup, Step
from tunekit.evidence.chain.timing import measure
from tunekit.evidence.chain.variants import Chain

#: Selection timings of the fused-family check: short (the chain's replays spread ~0.1%), and the
#: margin by which leaving a family out must beat keeping it (a fraction of the step time).
SELECT_ITERS, SELECT_REPEATS, SELECT_MARGIN = 10, 5, 0.002


def select_fusions(families: Sequence[str], ratio: Callable[[frozenset[str]], float],
                   margin: float = SELECT_MARGIN) -> tuple[frozenset[str], list[dict[str, Any]]]:
    """The fused families to leave out, chosen by measurement, and the trace of what was measured.

    ``ratio(excluded)`` times the chain's ``tuned_fused`` with the ``excluded`` families unfused against
    ``tuned`` in the same run (time over time). Backward elimination from what the standalone prices chose:
    each round leaves out each remaining family in turn and drops the one whose absence is fastest, if
    that beats the current ratio by more than ``margin``. If the final ratio is not below 1 (fusing is not
    faster than ``tuned``), every family is left out."""
    excluded: frozenset[str] = frozenset()
    current = ratio(excluded)
    trace = [{"excluded": [], "ratio": current}]
    while len(excluded) < len(families):
        trials = {f: ratio(excluded | {f}) for f in families if f not in excluded}
        trace += [{"excluded": sorted(excluded | {f}), "ratio": r} for f, r in trials.items()]
        best = min(trials, key=lambda f: trials[f])
        if trials[best] >= current - margin:
            break
        excluded, current = excluded | {best}, trials[best]
    if current >= 1.0:
        excluded = frozenset(families)
    return excluded, trace


def excluding(fused: FusedLookup, excluded: frozenset[str]) -> FusedLookup:
    """``fused`` with the ``excluded`` fused ops unserved (the chain binds those steps as ``tuned`` does)."""
    def lookup(op: str, n: int, k: int, replaced: list[Step], added: list[Step]) -> Callable[..., None] | None:
        return None if op in excluded else fused(op, n, k, replaced, added)

    return lookup


def check_fusions(chain: Chain, families: list[str], fns: dict[str, Callable[..., None]],
                  served: Callable[[Step], bool], fused: FusedLookup, m: int, report: dict[str, Any],
                  log: Callable[[str], None]) -> frozenset[str]:
    """:func:`select_fusions` on the GPU: each candidate bound as ``tuned_fused`` and timed against ``tuned``
    (short timings); the trace goes into ``report["fusion_check"]``. Returns the families to leave out."""
    def ratio(excluded: frozenset[str]) -> float:
        chain.build("tuned_fused", fns, served, excluding(fused, excluded))
        if not chain.fused["tuned_fused"]:
            return 1.0  # nothing left to fuse: tuned_fused is tuned
        tuned, candidate = measure(chain, ["tuned", "tuned_fused"], SELECT_ITERS, SELECT_REPEATS)
        value = candidate.step_us / tuned.step_us
        log(f"M={m} fusion check: {', '.join(sorted(excluded)) or 'nothing'} left out: tuned_fused / tuned "
            f"{value:.4f}")
        return value

    excluded, trace = select_fusions(families, ratio)
    report.setdefault("fusion_check", []).append({"m": m, "families": families, "excluded": sorted(excluded),
                                                  "trace": trace})
    log(f"M={m} fusion check: fused families {', '.join(f for f in families if f not in excluded) or 'none'}"
        + (f"; left out {', '.join(sorted(excluded))}" if excluded else ""))
    return excluded
