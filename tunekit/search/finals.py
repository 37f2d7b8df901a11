"""The final re-measure of each problem: its top candidates and baselines timed interleaved, once per storage.

Per problem, the top :data:`FINAL_TOP_K` trials of every backend, vendor and each extra baseline (Inductor)
that implements the op are re-measured interleaved in one graph session (the ranking that counts); the
speedups of the rows are against the faster baseline. The re-measure is claimed through the storage
(:mod:`~tunekit.search.fleet`: a study ``final|...`` keyed by the candidates; the lowest-numbered live trial
holds the claim, under the heartbeat) and its rows are stored there, so it runs once however many workers
and hosts share the storage, and a rerun with no new trials reads it. :func:`final_rows` are the rows of
``final.csv``.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import optuna
from optuna.trial import TrialState

from tunekit import backends as backend_registry
from tunekit.problems.shapes import Problem
from tunekit.search import fleet
from tunekit.search.common import Run, WorkerContext, limit_gbps, retrying, study_name, tell
from tunekit.search.liveness import fail_dead_trials, stops_deferred

#: Candidates per backend carried into the interleaved final re-measure.
FINAL_TOP_K = 3
FINAL_REPEATS = 30


def final_phase(run: Run, ctx: WorkerContext, problems: list[Problem]) -> None:
    """Every problem's final re-measure: claimed and run here, or read once another worker stored it."""
    pending = list(problems)
    while pending and not run.stop.is_set():
        for problem in list(pending):
            if run.stop.is_set():
                return
            rows = _final_step(run, ctx, problem)
            if rows is not None:
                with run.lock:
                    run.finals[problem.key] = rows
                pending.remove(problem)
        if pending:
            time.sleep(fleet.POLL_S)


def final_rows(run: Run) -> list[dict[str, Any]]:
    """The rows of ``final.csv``: every problem's final rows, in the order the problems were asked."""
    return [row for problem in run.cfg.problems for row in run.finals.get(problem.key, [])]


def _final_step(run: Run, ctx: WorkerContext, problem: Problem) -> list[dict[str, Any]] | None:
    """The problem's final rows if stored (or measured now under this worker's claim); None: not yet."""
    cfg, storage = run.cfg, run.storage
    candidates = _final_candidates(run, problem)
    name = fleet.final_study_name(run.device["arch"], problem.key, cfg.numerics, candidates)
    try:  # only read here: a final study is created where it is claimed, so a stale name leaves none behind
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        study = None
    if study is not None:
        fail_dead_trials(study, storage)
        stored = fleet.final_result(study)
        if stored is not None:
            return stored["rows"]
        if study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            return None  # claimed by a live worker
    for backend in run.backends_for(problem):  # tuning trials of this problem still in flight elsewhere: they may change the top
        tuning = optuna.load_study(study_name=study_name(run.device["arch"], problem, backend, cfg.numerics),
                                   storage=storage)
        fail_dead_trials(tuning, storage)
        if tuning.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            return None
    # the candidates were read before that check: a trial told since (its ``measured`` is stored before
    # its state, so another search's trial phase may already be over) changes the top, and claiming
    # ``name`` now would open a second final for this problem next to the one its teller claims
    if fleet.final_study_name(run.device["arch"], problem.key, cfg.numerics, _final_candidates(run, problem)) != name:
        return None
    if study is None:
        study = retrying(lambda: optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                                     load_if_exists=True))
    with stops_deferred(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        trial = study.ask()
        ctx.live.begin(trial)
    if not fleet.holds_claim(study, trial.number):
        trial.set_user_attr("status", "claim_lost")
        tell(study, trial, state=TrialState.PRUNED)
        ctx.live.end()
        return None
    rows = _final_remeasure(run, ctx, problem, candidates)
    for key, value in (("rows", rows), ("device", ctx.device), ("probe", run.probe), ("backends", run.usable)):
        trial.set_user_attr(key, json.dumps(value))
    trial.set_user_attr("status", "ok" if rows else "fail")
    trial.set_user_attr("stamp_text", run.stamp_text)
    tell(study, trial, min((r["time_us"] for r in rows), default=0.0))
    ctx.live.end()
    return rows


def _final_candidates(run: Run, problem: Problem) -> list[dict[str, Any]]:
    """Top candidates of each backend (from the storage) and the baselines.

    Baselines: vendor always; each extra baseline (Inductor) that implements
    the op, as an optional candidate the worker may drop (a failed compile
    costs that baseline, not the re-measure).
    """
    candidates = [{"label": "vendor", "backend": "vendor", "params": {}}]
    for name in run.extra:
        if problem.op in backend_registry.get(name).ops:
            candidates.append({"label": name, "backend": name, "params": {}, "optional": True})
    for backend_name in run.backends_for(problem):
        name = study_name(run.device["arch"], problem, backend_name, run.cfg.numerics)
        study = optuna.load_study(study_name=name, storage=run.storage)
        fixed = backend_registry.get(backend_name).space(problem).fixed
        done = sorted(
            (t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
             if t.user_attrs.get("measured") and t.user_attrs.get("status") == "ok"),
            key=lambda t: (t.value, t.number),
        )
        for rank, trial in enumerate(done[:FINAL_TOP_K]):
            candidates.append({
                "label": f"{backend_name}#{trial.number}", "backend": backend_name,
                "params": dict(fixed) | dict(trial.params), "trial": trial.number, "rank": rank,
                "max_abs_err": trial.user_attrs.get("max_abs_err"), "err_ratio": trial.user_attrs.get("err_ratio"),
            })
    return candidates


def _final_remeasure(run: Run, ctx: WorkerContext, problem: Problem,
                     candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates timed interleaved in one session; ``baseline_us`` and ``speedup`` of every
    row refer to the fastest baseline measured."""
    cfg, bar, probe = run.cfg, run.bar, run.probe
    worker = ctx.worker
    reply = worker.call({"kind": "final", "problem": problem.as_dict(), "candidates": candidates,
                         "repeats": FINAL_REPEATS}, timeout=max(cfg.trial_timeout_s, 300))
    if reply.get("status") != "ok":
        bar.log(f"final re-measure of {problem.key} failed: {reply.get('error')}")
        return []
    timings = reply["timings"]
    for label, error in reply.get("dropped", {}).items():
        bar.log(f"final re-measure of {problem.key}: baseline {label} dropped ({error})")
    measured = [c for c in candidates if c["label"] in timings]
    baselines = [c["label"] for c in measured if c["backend"] in backend_registry.BASELINES]
    base_label = min(baselines, key=lambda label: timings[label]["time_us"])
    base = timings[base_label]
    limit = limit_gbps(problem, probe)
    rows = []
    for cand in measured:
        t = timings[cand["label"]]
        rows.append({
            **problem.as_dict(),
            "names": ";".join(problem.names),
            "label": cand["label"],
            "backend": cand["backend"],
            "trial": cand.get("trial"),
            "params": json.dumps(cand["params"], sort_keys=True),
            "time_us": t["time_us"],
            "time_p25_us": t["time_p25_us"],
            "time_p75_us": t["time_p75_us"],
            "spread": t["spread"],
            "baseline_us": base["time_us"],
            "baseline": base_label,
            "speedup": base["time_us"] / t["time_us"] if t["time_us"] > 0 else 0.0,
            "gbps": t["gbps"],
            "pct_of_limit": 100.0 * t["gbps"] / limit if limit else None,
            "max_abs_err": cand.get("max_abs_err"),
            "err_ratio": cand.get("err_ratio"),
            "timing_kind": t["timing_kind"],
            "numerics": cfg.numerics,
        })
    return rows
