"""The trials of one worker thread: ask, skip duplicates and invalid sets, run in the worker, tell.

"Measured" trials are those the worker evaluated (ok or failed); a resumed study only adds trials until
``trials`` of them exist, so nothing finished is measured again. A parameter set already evaluated in the
study is never sent to the worker again: the new trial is told the stored outcome and marked
``duplicate_of``; one in flight in another worker that asked it first is skipped the same way. An invalid
set (the kernel's Python predicate) is told PRUNED, so TPE steers away. The worker's reply is stored as the
trial's user attributes. Each worker walks the studies from its own starting point and runs trials wherever
the storage holds fewer than ``--trials`` measured ones; where the rest are in flight in other workers it
comes back later (one of them may die). The studies are opened through :mod:`~tunekit.search.studies`.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from tunekit.problems.shapes import Problem
from tunekit.search import fleet
from tunekit.search.common import (
    Run,
    StudyStats,
    WorkerContext,
    best_us,
    limit_gbps,
    params_key,
    raise_limit,
    retrying,
    tell,
    trial_index,
)
from tunekit.search.early_stop import stop_reason
from tunekit.search.figures import MEASURE_ATTR
from tunekit.search.liveness import fail_dead_trials
from tunekit.search.stops import STOPS
from tunekit.search.studies import PRUNE_LIMIT, OpenStudy, shared_study

#: Stop asking a study for new parameter sets after this many attempts per
#: wanted trial (duplicates and invalid sets are cheap but not free).
MAX_ATTEMPTS_PER_TRIAL = 25


@dataclass
class _WorkerStudy:
    """One worker's share of a study: its counts and how many parameter sets it asked."""

    stats: StudyStats
    attempts: int = 0


def trial_phase(run: Run, ctx: WorkerContext, studies: list[tuple[Problem, str]]) -> None:
    """Run trials wherever the storage says a study needs some; wait while the rest is in flight elsewhere
    (a worker that dies there has its trial failed by the heartbeat, and the study needs work again)."""
    cfg = run.cfg
    mine: dict[tuple[str, str], _WorkerStudy] = {}
    pending = list(studies)
    while pending and not run.stop.is_set():
        waiting = []
        for index, (problem, backend) in enumerate(pending):
            STOPS.check()
            if run.stop.is_set():
                return
            share = None
            if cfg.timeout_s is not None:
                # split what is left evenly over the studies still to run, so
                # a budget cut never starves the last problems
                remaining = cfg.timeout_s - (time.monotonic() - run.started)
                share = remaining / (len(pending) - index)
            key = (problem.key, backend)
            st = shared_study(run, problem, backend)
            if key not in mine:
                mine[key] = _WorkerStudy(StudyStats(problem, backend, measured_before=st.stats.measured_before,
                                                    best_us=st.stats.best_us))
                with run.lock:
                    run.outcome.stats.append(mine[key].stats)
            if _run_trials(run, ctx, st, mine[key], share) == "elsewhere":
                waiting.append((problem, backend))
            elif not run.stop.is_set():
                run.bar.finish(st.task)  # its progress line, also when it stops short (exhausted, --timeout)
        pending = waiting
        if pending:
            STOPS.sleep(fleet.POLL_S)


def _run_trials(run: Run, ctx: WorkerContext, st: OpenStudy, mine: _WorkerStudy,
                remaining_s: float | None) -> str:
    """Trials of one study until the storage holds ``wanted`` measured ones: "done", or "elsewhere" when
    the rest are in flight in other workers (the caller comes back: one of them may die)."""
    if st.emptied:
        return "done"
    study, stats, live, bar = st.study, mine.stats, ctx.live, run.bar
    problem = stats.problem
    fail_dead_trials(study, run.storage)
    deadline = None if remaining_s is None else time.monotonic() + max(remaining_s, 0.0)
    stopping = False
    try:
        while not run.stop.is_set():
            live.end()  # the previous trial is told
            STOPS.check()  # between two trials: none in flight
            seen, inflight = trial_index(study, live.worker)
            measured = len(seen)
            if measured >= st.wanted or study.user_attrs.get("exhausted"):
                return "done"
            reason = stop_reason(seen.values(), run.cfg.stop)
            if reason is not None:
                _record_stop(run, st, stats, reason)
                return "done"
            if measured + len(inflight) >= st.wanted:
                return "elsewhere"
            if deadline is not None and time.monotonic() > deadline:
                bar.log(f"--timeout reached: {st.name} stops at {measured} measured trials")
                return "done"
            waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            grid_done = isinstance(study.sampler, optuna.samplers.GridSampler) and study.sampler.is_exhausted(study)
            if grid_done and not waiting and _enqueue_unmeasured_grid(study, st, seen, inflight):
                continue
            if not waiting and (mine.attempts >= st.wanted * MAX_ATTEMPTS_PER_TRIAL or grid_done):
                if not inflight:  # nothing new left to ask: no worker needs to come back
                    retrying(lambda: study.set_user_attr("exhausted", True))
                    return "done"
                return "elsewhere"
            mine.attempts += 1
            # no stop is raised between the ask and the record of the owner (a stop signal is only recorded,
            # stops.STOPS): a trial is never left RUNNING without an owner
            with warnings.catch_warnings():
                # ask/tell, not optimize(): the heartbeat is tunekit's (liveness.Liveness)
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
                trial = study.ask(st.distributions)
                live.begin(trial)
            params = st.fixed | dict(trial.params)
            key = params_key(trial.params)
            seen, inflight = trial_index(study, live.worker)
            if key in seen or (key in inflight and inflight[key].number < trial.number):
                # measured already, or being measured by another worker that asked first
                previous = seen.get(key) or inflight[key]
                trial.set_user_attr("status", "duplicate")
                trial.set_user_attr("duplicate_of", previous.number)
                stats.duplicates += 1
                if previous.state == TrialState.COMPLETE:
                    tell(study, trial, previous.value)
                else:
                    tell(study, trial, state=TrialState.PRUNED)
                continue
            reason = st.backend.invalid_reason(problem, params)
            if reason:
                # PRUNED (not FAIL): TPE then ranks the point as bad and steers away.
                trial.set_user_attr("status", "invalid")
                trial.set_user_attr("error", reason)
                tell(study, trial, state=TrialState.PRUNED)
                stats.invalid += 1
                continue
            reply = ctx.worker.call(
                {"kind": "trial", "problem": problem.as_dict(), "backend": stats.backend, "params": params,
                 "numerics": run.cfg.numerics, "seed": run.cfg.seed * 100003 + trial.number},
                timeout=run.cfg.trial_timeout_s,
            )
            if run.stop.is_set() and reply.get("status") == "crash":
                # the run is stopping and closed this worker (not the candidate's fault): the trial
                # stays with the liveness, which run_search records as interrupted
                stopping = True
                return "done"
            stats.measured_now += 1
            if reply.get("status") == "ok":
                raise_limit(run, problem, reply.get("gbps"), f"{stats.backend} trial {trial.number} on {problem.key}")
            _store_reply(trial, reply, limit_gbps(problem, run.probe))
            if reply.get("status") == "ok":
                tell(study, trial, reply["time_us"])
                stats.ok += 1
            else:
                tell(study, trial, state=TrialState.FAIL)
                stats.failed += 1
            best = best_us(study)
            stats.best_us = best
            bar.update(st.task, completed=min(measured + 1, st.wanted), best=f"best {best:.2f} us" if best else "")
        return "done"
    except BaseException:
        # a stop (Ctrl-C, an error) with a trial in flight: it stays with the liveness, so that
        # run_search records it as interrupted before the exception goes on
        stopping = True
        raise
    finally:
        if not stopping:
            live.end()
            if stats.best_us is None:
                stats.best_us = best_us(study)


def _record_stop(run: Run, st: OpenStudy, stats: StudyStats, reason: str) -> None:
    """The study ends before ``--trials``: its reason on the study (``stopped``, the same for every worker that
    sees it: it is read from the stored trials) and in this search's counts; one log line per study."""
    stats.stopped = reason
    if st.study.user_attrs.get("stopped") != reason:
        retrying(lambda: st.study.set_user_attr("stopped", reason))
        run.bar.log(f"{st.name}: stopped early, {reason}")


def _enqueue_unmeasured_grid(study: optuna.Study, st: OpenStudy, seen: dict[str, Any],
                             inflight: dict[str, Any]) -> bool:
    """Enqueue the grid points no trial measured; True if there were any.

    Optuna's GridSampler counts a grid point visited once a trial holding it
    finished, and numbers the first grid points by trial number; with workers
    sharing a study, enqueued seeds and retried trials take some of those
    numbers and a duplicate-in-flight skip finishes a point someone else was
    measuring. So "exhausted" may leave points unmeasured: the grid is done
    only when every point is measured.
    """
    import itertools

    names = sorted(st.distributions)
    choices = [st.distributions[n].choices for n in names]
    if math.prod(len(c) for c in choices) > PRUNE_LIMIT:
        return False
    missing = []
    for values in itertools.product(*choices):
        params = dict(zip(names, values, strict=True))
        key = params_key(params)
        if key not in seen and key not in inflight and st.backend.invalid_reason(
                st.stats.problem, st.fixed | params) is None:
            missing.append(params)
    for params in missing:
        study.enqueue_trial(params)
    return bool(missing)


def _store_reply(trial: optuna.Trial, reply: dict[str, Any], limit_gbps: float | None) -> None:
    """The worker's reply as three attributes: its figures in one (``MEASURE_ATTR``), then its status, then
    ``measured``, the mark every reader of a measured trial looks for, last."""
    figures: dict[str, Any] = {"error": str(reply.get("error", ""))[:2000]}
    for key in ("wall_s", "compile_s", "verify_s", "time_s", "rtc_compile_s", "rtc_cache_hit", "max_abs_err",
                "err_ratio", "time_us",
                "time_min_us", "time_p25_us", "time_p75_us", "spread", "repeats", "launches", "copies",
                "timing_kind", "gbps"):
        value = reply.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            figures[key] = value
    if reply.get("build_log"):
        figures["build_log"] = reply["build_log"]
    if reply.get("gbps") and limit_gbps:
        figures["pct_of_limit"] = 100.0 * reply["gbps"] / limit_gbps
    trial.set_user_attr(MEASURE_ATTR, figures)
    trial.set_user_attr("status", reply.get("status", "fail"))
    trial.set_user_attr("measured", True)
