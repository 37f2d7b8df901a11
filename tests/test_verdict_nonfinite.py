"""Issue 59 item 2: a NaN or Inf fails by itself, and a NaN never reads as agreement.

Before, ``verdict.position`` dropped a NaN logprob of the arm (``max(0.0, nan)`` is 0.0, ``nan > cap`` is
False): a NaN at a position whose greedy token survived read 0.0 nats and passed, and a NaN in vanilla's own
spread made the verdict pass instead of inconclusive.
"""

from __future__ import annotations

import math

import pytest

from tunekit.evidence.verdict import CAPS, compare_requests, judge, line, summarize


def _record(tops: list[list[list[float]]]) -> dict:
    return {"forced": [7] * len(tops), "top": tops}


REF = _record([[[7, -0.1], [3, -2.5], [5, -4.0]]] * 3)


def _arm(value: float, where: int = 1) -> dict:
    """Vanilla's record with one logprob of the second position replaced by ``value`` (the greedy token's kept)."""
    tops = [[list(t) for t in pos] for pos in REF["top"]]
    tops[1][where][1] = value
    return _record(tops)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_logprob_fails_as_non_finite_where_the_greedy_token_survives(value: float) -> None:
    figures = summarize([compare_requests(REF, _arm(value))])
    assert figures["nonfinite"] == 1
    assert figures["max_abs_logprob_diff"] == math.inf and figures["kl_max"] == math.inf  # never 0.0
    doc = judge(figures)
    assert doc["verdict"] == "fail" and not doc["checks"]["finite"] and doc["why"].startswith("non-finite: 1 NaN")
    assert "max |dlogprob| inf" in line("tuned", {**figures, **doc}, CAPS.as_dict())


def test_the_same_record_passes_and_a_nan_in_vanillas_spread_is_inconclusive() -> None:
    same = summarize([compare_requests(REF, _arm(-2.5))])
    assert same["nonfinite"] == 0 and same["max_abs_logprob_diff"] == 0.0
    assert judge(same)["verdict"] == "pass"
    nan_spread = dict(same, max_abs_logprob_diff=math.nan)
    doc = judge(same, [nan_spread])
    assert doc["verdict"] == "inconclusive" and "max |dlogprob| nan" in doc["why"]
    spread_of_nan_arm = summarize([compare_requests(REF, _arm(math.nan))])
    assert judge(same, [spread_of_nan_arm])["verdict"] == "inconclusive"
