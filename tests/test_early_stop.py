"""Early stopping: a study ends near the measured limit or on a plateau, never before its minimum of trials."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from tunekit.errors import UserError
from tunekit.problems.shapes import Problem
from tunekit.search import finals
from tunekit.search.early_stop import StopRule, stop_reason

REPO = Path(__file__).resolve().parents[1]
DIST = {"COST": CategoricalDistribution(list(range(100)))}


def _trials(times: list[float | None], pct: float | None = None) -> list:
    """Measured trials in order: a time is a verified trial (at ``pct`` of the limit), None a failed one."""
    study = optuna.create_study()
    for i, t in enumerate(times):
        attrs = {"measured": True, "status": "ok" if t is not None else "fail"}
        if t is not None and pct is not None:
            attrs["pct_of_limit"] = pct
        study.add_trial(create_trial(params={"COST": i}, distributions=DIST, value=t, user_attrs=attrs,
                                     state=TrialState.COMPLETE if t is not None else TrialState.FAIL))
    return study.get_trials(deepcopy=False)


def test_near_the_limit_stops_at_the_minimum_never_before() -> None:
    rule = StopRule(min_trials=12, near_limit=0.02, patience=0)
    at_limit = [10.0] * 12
    assert stop_reason(_trials(at_limit[:11], pct=99.0), rule) is None  # one short of the minimum
    reason = stop_reason(_trials(at_limit, pct=99.0), rule)
    assert reason is not None and reason.startswith("near the limit") and "99.0%" in reason
    # 97.9% is outside a 2% margin; the rule off never fires
    assert stop_reason(_trials(at_limit, pct=97.9), rule) is None
    assert stop_reason(_trials(at_limit, pct=99.0), StopRule(min_trials=12, near_limit=0, patience=0)) is None


def test_a_plateau_stops_after_patience_trials_without_a_gain() -> None:
    rule = StopRule(min_trials=4, near_limit=0.02, patience=3, min_gain=0.01)
    # 10 -> 8 is a gain; 7.95 (0.6%) is not; a failure is not; no limit recorded (the CPU): only the plateau
    times = [10.0, 8.0, 7.95, None, 9.0]
    assert stop_reason(_trials(times[:4]), rule) is None  # 2 trials since the last gain
    reason = stop_reason(_trials(times), rule)
    assert reason is not None and reason.startswith("plateau") and "last 3 trials" in reason and "7.95" in reason
    # a real gain resets the count
    assert stop_reason(_trials(times + [7.0]), rule) is None
    # never before the minimum, however flat
    assert stop_reason(_trials([5.0] * 5), StopRule(min_trials=6, patience=1)) is None
    assert stop_reason(_trials([5.0] * 6), StopRule(min_trials=6, patience=1)) is not None


def test_nothing_verified_never_stops_and_bad_settings_are_one_line() -> None:
    assert stop_reason(_trials([None] * 30), StopRule(min_trials=2, patience=2)) is None
    for rule, text in ((StopRule(min_trials=0), "--min-trials"), (StopRule(near_limit=1.0), "--stop-near-limit"),
                       (StopRule(patience=-1), "--stop-patience"), (StopRule(min_gain=-0.1), "--stop-gain")):
        with pytest.raises(UserError, match=text):
            rule.check()


@pytest.mark.slow  # a search on the interpreter: the slow tier
def test_a_search_with_the_fixed_cost_backend_stops_on_its_plateau_where_the_rule_says(tmp_path, monkeypatch) -> None:
    from tunekit.search.engine import SearchConfig, run_search

    monkeypatch.setenv("TUNEKIT_TEST_BUILD_S", "0.05")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests")]))
    rule = StopRule(min_trials=3, near_limit=0.02, patience=2, min_gain=0.01)
    with mock.patch.object(finals, "FINAL_REPEATS", 1):
        outcome = run_search(SearchConfig(problems=[Problem("gemv", "bf16", 1, 8, 64)],
                                          backends=["fixed_time_backend:FIXED"], out_dir=tmp_path / "run", trials=8,
                                          sampler="grid", warm_start=0, stop=rule), progress=False, log=lambda s: None)
    storage = f"sqlite:///{tmp_path / 'run' / 'optuna.db'}"
    (summary,) = [s for s in optuna.get_all_study_summaries(storage)
                  if s.user_attrs.get("backend") == "fixed_time_backend:FIXED"]
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    measured = sorted((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("measured")),
                      key=lambda t: t.number)
    # COST=k sleeps k x 12 ms: each trial's gain is far from the 1% margin, so the order decides the stop
    assert rule.min_trials <= len(measured) < 8
    assert stop_reason(measured, rule) is not None  # it stopped where the rule holds ...
    assert stop_reason(measured[:-1], rule) is None  # ... and not a trial later than it first did
    stopped = study.user_attrs["stopped"]
    assert stopped.startswith("plateau") and [s.stopped for s in outcome.stats] == [stopped]


def test_the_cpu_interpreter_has_no_limit_to_stop_near() -> None:
    """The probe's figures on the CPU are interpreter timings: no limit, so no pct_of_limit and no early stop."""
    from tunekit.search.common import limit_gbps

    problem = Problem(op="gemv", dtype="bf16", m=1, n=96, k=256)
    assert limit_gbps(problem, {"kind": "cpu", "read_gbps": 4.4, "copy_gbps": 2.0}) is None
    assert limit_gbps(problem, {"kind": "cuda_graph", "read_gbps": 3171.0}) == 3171.0
