"""The final re-measure of each problem: its top candidates and baselines timed interleaved, once per storage.

Per problem, the top :data:`FINAL_TOP_K` trials of every backend, vendor and every peer (each other
baseline of ``tunekit.backends.BASELINES``: Inductor, vLLM's skinny GEMM, FlashInfer ...) that can run the
problem here are re-measured interleaved in one graph session, same rotation and graphs (the ranking that
counts); the speedups of the rows are against the stock path (``backends.STOCK``: what serves without an
entry; a peer is reported, not a bar). Every row of a problem carries its peer
record (column ``peers``, JSON: peer -> ``"ok"`` or the one-line reason it was not timed: it cannot be
loaded, ``unavailable_reason(device)``, no kernel for the op, ``invalid_reason(problem, {})``, or its build
failed in the worker), so a peer missing from a report is never a silent omission; final.csv files written
before the record have no such column. The re-measure is claimed through the storage
(:mod:`~tunekit.search.fleet`: a study ``final|...`` keyed by the candidates; the lowest-numbered live trial
holds the claim, under the heartbeat) and its rows are stored there, so it runs once however many workers
and hosts share the storage, and a rerun with no new trials reads it. :func:`final_rows` are the rows of
``final.csv``.
"""

from __future__ import annotations

import functools
import json
import warnings
from collections.abc import Collection
from typing import Any

import optuna
from optuna.trial import TrialState

from tunekit import backends as backend_registry
from tunekit.problems.shapes import Problem
from tunekit.search import fleet
from tunekit.search.common import Run, WorkerContext, limit_gbps, raise_limit, retrying, study_name, tell
from tunekit.search.figures import trial_figure
from tunekit.search.liveness import fail_dead_trials
from tunekit.search.stops import STOPS

#: Candidates per backend carried into the interleaved final re-measure.
FINAL_TOP_K = 3
FINAL_REPEATS = 30
#: The column of final.csv holding a problem's peer record (read by ``tunekit.evidence.comparison``).
PEERS_COLUMN = "peers"
#: Longest reason kept in a peer record (one line).
REASON_CHARS = 300


def peer_names() -> tuple[str, ...]:
    """The peers: every baseline other than vendor, in ``BASELINES`` order."""
    return tuple(name for name in backend_registry.BASELINES if name != "vendor")


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 3] + "..."


@functools.lru_cache(maxsize=64)
def _peer_here(name: str, device_json: str) -> tuple[str | None, tuple[str, ...]]:
    """(why peer ``name`` cannot run on this device or None, the ops it implements); asked once per device."""
    from tunekit.measure.device import DeviceInfo

    try:
        backend = backend_registry.get(name)
        ops = tuple(backend.ops)
    except Exception as exc:  # noqa: BLE001 - a peer's package or module that will not load: its reason
        return _one_line(f"cannot be loaded here ({type(exc).__name__}: {exc})"), ()
    try:
        why = backend.unavailable_reason(DeviceInfo(**json.loads(device_json)))
    except Exception as exc:  # noqa: BLE001 - a peer that fails to answer is unavailable, with what it raised
        return _one_line(f"unavailable here (asking raised {type(exc).__name__}: {exc})"), ops
    return (None if why is None else _one_line(f"unavailable here: {why}")), ops


#: Why a peer the search was not asked to time has no figure (``peer_arms``).
NOT_ASKED = "not asked: tunekit search --peers all (or a list) times it beside the winners"


def peer_asked(name: str, asked: Collection[str] | None) -> bool:
    """Whether the search times baseline ``name``: every one where ``asked`` is None (``--peers all``), else the
    peers named; Inductor, a stock baseline and the bar for the elementwise ops, always."""
    return asked is None or name in asked or name in backend_registry.STOCK


def peer_arms(problem: Problem, device: dict[str, Any],
              asked: Collection[str] | None = None) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The peers that join ``problem``'s final re-measure, as optional candidates (a failed build costs that
    peer, not the re-measure), and why each other peer does not: {peer: one-line reason}. ``asked``: the
    peers of ``backends.PEERS`` the search times (None: all); Inductor, a stock baseline and the bar for the
    elementwise ops, is always timed."""
    candidates: list[dict[str, Any]] = []
    left_out: dict[str, str] = {}
    for name in peer_names():
        if not peer_asked(name, asked):
            left_out[name] = NOT_ASKED
            continue
        why, ops = _peer_here(name, json.dumps(device, sort_keys=True, default=str))
        if ops and problem.op not in ops:  # the op first: true on any device
            why = f"no {name} kernel for op {problem.op}"
        if why is None:
            try:
                invalid = backend_registry.get(name).invalid_reason(problem, {})
            except Exception as exc:  # noqa: BLE001 - recorded, never a traceback
                invalid = f"the shape check raised {type(exc).__name__}: {exc}"
            why = None if invalid is None else _one_line(f"shape unsupported: {invalid}")
        if why is None:
            candidates.append({"label": name, "backend": name, "params": {}, "optional": True})
        else:
            left_out[name] = why
    return candidates, left_out


def peer_record(candidates: list[dict[str, Any]], timings: dict[str, Any], dropped: dict[str, str],
                left_out: dict[str, str]) -> dict[str, str]:
    """Every peer's outcome in one re-measure: "ok" (timed), or why not (left out before, dropped by the
    worker, or no time returned)."""
    record = dict(left_out)
    for cand in candidates:
        if cand["backend"] not in peer_names():
            continue
        label = cand["label"]
        if label in timings:
            record[label] = "ok"
        elif label in dropped:
            record[label] = _one_line(f"dropped in the worker (build, first call or verification): {dropped[label]}")
        else:
            record[label] = "not timed (the worker returned no time for it)"
    return {name: record[name] for name in peer_names() if name in record}


def final_phase(run: Run, ctx: WorkerContext, problems: list[Problem]) -> None:
    """Every problem's final re-measure: claimed and run here, or read once another worker stored it."""
    pending = list(problems)
    while pending and not run.stop.is_set():
        for problem in list(pending):
            STOPS.check()
            if run.stop.is_set():
                return
            rows = _final_step(run, ctx, problem)
            if rows is not None:
                with run.lock:
                    run.finals[problem.key] = rows
                pending.remove(problem)
        if pending:
            STOPS.sleep(fleet.POLL_S)


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
    # tuning trials of this problem still in flight elsewhere: they may change the top
    for backend in run.backends_for(problem):
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
    with warnings.catch_warnings():  # the claim and its owner as one step (no stop is raised in between)
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

    Baselines: vendor always; each peer that can run the problem here (``peer_arms``), as an optional
    candidate the worker may drop (a failed compile costs that peer, not the re-measure).
    """
    candidates = [{"label": "vendor", "backend": "vendor", "params": {}}]
    candidates += peer_arms(problem, run.device, run.cfg.peers)[0]
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
                "max_abs_err": trial_figure(trial, "max_abs_err"), "err_ratio": trial_figure(trial, "err_ratio"),
            })
    return candidates


def add_spent(split: dict[str, Any], candidates: list[dict[str, Any]], spent: dict[str, Any] | None) -> None:
    """Add one re-measure's seconds (the worker's ``spent``: per candidate label) to ``split``, per backend."""
    if not spent:
        return
    backend_of = {c["label"]: c["backend"] for c in candidates}
    split["problems"] = split.get("problems", 0) + 1
    for part in ("rotation_s", "time_s"):
        split[part] = split.get(part, 0.0) + float(spent.get(part, 0.0))
    for part in ("build_s", "verify_s"):
        per_backend = split.setdefault(part, {})
        for label, seconds in spent.get(part, {}).items():
            backend = backend_of.get(label, label)
            per_backend[backend] = per_backend.get(backend, 0.0) + float(seconds)


def _final_remeasure(run: Run, ctx: WorkerContext, problem: Problem,
                     candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The candidates timed interleaved in one session; ``baseline_us`` and ``speedup`` of every
    row refer to the fastest stock baseline measured (vendor; Inductor where timed)."""
    cfg, bar, probe = run.cfg, run.bar, run.probe
    worker = ctx.worker
    reply = worker.call({"kind": "final", "problem": problem.as_dict(), "candidates": candidates,
                         "repeats": FINAL_REPEATS}, timeout=max(cfg.trial_timeout_s, 300))
    if reply.get("status") != "ok":
        bar.log(f"final re-measure of {problem.key} failed: {reply.get('error')}")
        return []
    timings = reply["timings"]
    add_spent(ctx.final_split, candidates, reply.get("spent"))
    for label, error in reply.get("dropped", {}).items():
        bar.log(f"final re-measure of {problem.key}: baseline {label} dropped ({error})")
    measured = [c for c in candidates if c["label"] in timings]
    # speedups in final.csv are over the stock path (what serves without an entry), as the table gates
    baselines = [c["label"] for c in measured if c["backend"] in backend_registry.STOCK]
    base_label = min(baselines, key=lambda label: timings[label]["time_us"])
    base = timings[base_label]
    for label, t in timings.items():  # the re-measure's rates count too: the limit stays an upper bound
        raise_limit(run, problem, t.get("gbps"), f"{label} in the final re-measure of {problem.key}")
    limit = limit_gbps(problem, probe)
    left_out = peer_arms(problem, run.device, run.cfg.peers)[1]
    peers = json.dumps(peer_record(candidates, timings, reply.get("dropped", {}), left_out), sort_keys=True)
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
            PEERS_COLUMN: peers,
        })
    return rows
