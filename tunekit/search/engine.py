"""One Optuna study per (problem, backend); every trial stored; winners re-measured.

Flow of ``run_search``::

    run folder + storage (SQLite in the folder unless --storage URL)
    worker: describe device, probe the read-bandwidth limit (once per run)
    for each problem, for each backend:
        study (resumed if it exists; trials a dead process left RUNNING marked failed)
        enqueue the default config first
        ask -> skip duplicates / invalid -> worker builds, verifies, times -> tell
    for each problem: top candidates of every backend + the baselines (vendor;
        for elementwise ops also Inductor where it runs) re-measured interleaved
        in one graph session (the ranking that counts); speedups are against the
        faster baseline
    write trials.csv, final.csv, run.json, table.json

"Measured" trials are those the worker evaluated (ok or failed); a resumed
study only adds trials until ``trials`` of them exist, so nothing finished is
measured again. A parameter set already evaluated in the study is never sent
to the worker again: the new trial is told the stored outcome and marked
``duplicate_of``.

Sharing: the run folder is locked for the whole run (``results.RunLock``: a
second search on it is refused). Several searches may share one storage
(``--storage``): SQLite in WAL mode with a busy timeout, and every trial in
flight records its owner (``host:pid``) and Optuna's heartbeat, so a search
fails only the RUNNING trials whose process is gone, never another live
search's.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from tunekit import backends as backend_registry
from tunekit.errors import UserError
from tunekit.problems.shapes import FUSED_GEMV_OPS, Problem
from tunekit.search import fleet
from tunekit.search.liveness import HEARTBEAT_S, STALE_AFTER_S, Liveness, fail_dead_trials, stops_deferred
from tunekit.search.storage import open_storage, storage_url, stored_trials
from tunekit.search.worker import DEFAULT_TIMEOUT_S, Worker

SAMPLERS = ("tpe", "random", "grid")
#: Candidates per backend carried into the interleaved final re-measure.
FINAL_TOP_K = 3
FINAL_REPEATS = 30
#: Stop asking a study for new parameter sets after this many attempts per
#: wanted trial (duplicates and invalid sets are cheap but not free).
MAX_ATTEMPTS_PER_TRIAL = 25


@dataclass
class SearchConfig:
    problems: list[Problem]
    backends: list[str]
    out_dir: Path
    trials: int = 40
    timeout_s: float | None = None  # whole-run budget for the trial phase
    sampler: str = "tpe"
    numerics: str = "bounded"
    storage: str | None = None
    seed: int = 0
    min_gain: float = 0.01
    warm_start: int = 3  # best configs taken from each other study of the op (0: off)
    seed_from: tuple[Path, ...] = ()  # earlier runs' table.json / trials.csv: their winners are measured first
    # tunable -> the values (as text) a study may use, for every backend that has the tunable
    restrict: dict[str, tuple[str, ...]] = field(default_factory=dict)
    trial_timeout_s: float = DEFAULT_TIMEOUT_S
    command: str = ""
    model: str | None = None
    gpus: str | None = None  # --gpus: None (one worker), "all" or "0,1"


@dataclass
class StudyStats:
    problem: Problem
    backend: str
    measured_before: int = 0
    measured_now: int = 0
    ok: int = 0
    failed: int = 0
    invalid: int = 0
    duplicates: int = 0
    best_us: float | None = None


@dataclass
class SearchOutcome:
    run_dir: Path
    stats: list[StudyStats] = field(default_factory=list)
    final_rows: list[dict[str, Any]] = field(default_factory=list)
    table_path: Path | None = None
    trials_path: Path | None = None
    probe: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)
    #: workers, GPUs and hosts whose trials the run's studies hold (fleet.participants)
    participants: dict[str, Any] = field(default_factory=dict)


def study_name(arch: str, problem: Problem, backend: str, numerics: str) -> str:
    return f"{arch}|{problem.key}|{backend}|{numerics}"


def _params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def _make_sampler(name: str, space_domains: dict[str, list[Any]], seed: int) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        # multivariate: the tunables interact (tile size x warps x split).
        # constant_liar: trials in flight in other workers count as bad, so parallel workers spread out
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8, constant_liar=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(space_domains, seed=seed)
    raise UserError(f"unknown sampler {name!r} (choose from {', '.join(SAMPLERS)})")


class _Progress:
    """Thin adapter over rich.progress; silent when not attached to a console."""

    def __init__(self, enabled: bool, log: Callable[[str], None] = print) -> None:
        self._progress = None
        self._log = log
        self._lock = threading.Lock()
        self._tasks: dict[str, Any] = {}
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("{task.fields[best]}"),
            )
            self._progress.start()

    def add(self, description: str, total: int, done: int) -> Any:
        """The task of one study (one line however many workers run its trials)."""
        if self._progress is None:
            return None
        with self._lock:
            if description not in self._tasks:
                self._tasks[description] = self._progress.add_task(description, total=total, completed=done, best="")
            return self._tasks[description]

    def update(self, task: Any, completed: int, best: str = "") -> None:
        if self._progress is not None and task is not None:
            self._progress.update(task, completed=completed, best=best)

    def log(self, message: str) -> None:
        if self._progress is not None:
            self._progress.console.log(message)
        else:
            self._log(message)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def run_search(cfg: SearchConfig, progress: bool = True, log: Callable[[str], None] = print) -> SearchOutcome:
    """Run (or resume) the search described by ``cfg``; see the module docstring.

    Holds the run folder's lock throughout. When the run stops early (Ctrl-C,
    an error), the trials in flight are recorded as interrupted and trials.csv
    is written from the storage before the exception goes on.
    """
    from tunekit.search import results

    if cfg.sampler not in SAMPLERS:
        raise UserError(f"unknown sampler {cfg.sampler!r} (choose from {', '.join(SAMPLERS)})")
    if cfg.trials < 1:
        raise UserError("--trials must be at least 1")
    if not (math.isfinite(cfg.min_gain) and cfg.min_gain >= 0):
        raise UserError(f"--min-gain must be a number >= 0 (got {cfg.min_gain}); 0.01 asks a 1% gain")
    slots = fleet.parse_gpus(cfg.gpus, fleet.visible_gpu_count(), os.environ.get("TRITON_INTERPRET") == "1")
    fleet.heartbeat_settings(HEARTBEAT_S, STALE_AFTER_S)  # a bad setting fails before anything starts
    results.make_run_dir(cfg.out_dir)
    url = storage_url(cfg.out_dir, cfg.storage)
    with results.RunLock(cfg.out_dir, cfg.command):
        storage = open_storage(url)
        results.check_trials_kept(cfg.out_dir, stored_trials(storage), url)
        outcome = SearchOutcome(run_dir=cfg.out_dir)
        run = _Run(cfg=cfg, storage=storage, url=url, outcome=outcome, started=time.monotonic())
        try:
            return _run_locked(run, slots, progress, log)
        except BaseException as exc:
            run.stop.set()
            for ctx in run.contexts:
                ctx.live.fail_current(f"interrupted (the search process stopped: {type(exc).__name__})")
            if outcome.device and outcome.trials_path is None:
                try:  # the finished trials are in the storage; the csv too, where that still works
                    results.write_trials(cfg.out_dir, storage, cfg, outcome.device, outcome.probe)
                except Exception:  # noqa: BLE001 - the stop's own exception is the one to report
                    pass
            raise
        finally:
            for ctx in run.contexts:
                ctx.live.close()


@dataclass
class _WorkerContext:
    """One worker of this process: its device process, liveness and identity."""

    index: int
    slot: fleet.Slot
    worker: Worker
    live: Liveness
    device: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Run:
    """What the workers of one search share (threads of this process)."""

    cfg: SearchConfig
    storage: Any
    url: str
    outcome: SearchOutcome
    started: float
    contexts: list[_WorkerContext] = field(default_factory=list)
    usable: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    stamp: str = ""
    stamp_text: str = ""
    bar: Any = None
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    finals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    opened: dict[tuple[str, str], Any] = field(default_factory=dict)  # (problem key, backend) -> _OpenStudy
    open_locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def device(self) -> dict[str, Any]:
        return self.outcome.device

    @property
    def probe(self) -> dict[str, Any]:
        return self.outcome.probe


def _run_locked(run: _Run, slots: Sequence[fleet.Slot], progress: bool, log: Callable[[str], None]) -> SearchOutcome:
    from tunekit import table as table_mod
    from tunekit.search import results

    cfg, outcome = run.cfg, run.outcome
    out_dir = cfg.out_dir
    host, pid = fleet.host_name(), os.getpid()
    try:
        for index, slot in enumerate(slots):
            worker = Worker(env=slot.env)
            live = Liveness(run.storage, f"{host}:{pid}:{slot.label}")
            run.contexts.append(_WorkerContext(index, slot, worker, live))
        for ctx in run.contexts:
            reply = ctx.worker.call({"kind": "device"})
            if reply["status"] != "ok":
                raise UserError(f"the worker ({ctx.slot.label}) could not start: {reply.get('error')}")
            ctx.device = reply["device"]
        device = run.contexts[0].device
        outcome.device = device
        run.usable = _usable_backends(cfg.backends, device)
        run.stamp, run.stamp_text = fleet.device_stamp(table_mod.environment_stamp(device, run.usable))
        for ctx in run.contexts[1:]:
            stamp, text = fleet.device_stamp(table_mod.environment_stamp(ctx.device, run.usable))
            if stamp != run.stamp:
                first = run.contexts[0].slot.label
                raise UserError(f"--gpus: {ctx.slot.label} is {text}, {first} is {run.stamp_text}: "
                                "one device model per table; run one search per model")
        for ctx in run.contexts:
            ctx.live.stamp = run.stamp
        log(f"device: {device['name']} ({device['arch']}, {device['cu_count']} CUs, "
            f"wave {device['wave_size']}, L2 {device['l2_bytes'] >> 20} MiB); backends: {', '.join(run.usable)}"
            + (f"; {len(slots)} workers ({', '.join(s.label for s in slots)})" if len(slots) > 1 else ""))
        reply = run.contexts[0].worker.call({"kind": "probe"}, timeout=600)
        if reply["status"] != "ok":
            raise UserError(f"bandwidth probe failed: {reply.get('error')}")
        probe = reply["probe"]
        outcome.probe = probe
        if probe["kind"] == "cpu":
            log("timing: CPU interpreter (TRITON_INTERPRET=1): times and GB/s here show that the pipeline "
                "works; they are not bandwidth evidence (no read-bandwidth limit is measured on a CPU)")
        else:
            log(f"read-bandwidth limit: {probe['read_gbps']:.0f} GB/s (copy {probe['copy_gbps']:.0f} GB/s, "
                f"{probe['kind']} timing)")
        results.write_run_json(out_dir, cfg, run.url, device, probe, run.usable)
        run.extra = _extra_baselines(cfg.problems, device, log)

        run.bar = _Progress(progress, log)
        try:
            if len(run.contexts) == 1:
                _worker_main(run, run.contexts[0])  # in this thread: Ctrl-C stays deferred around each ask
            else:
                _run_threads(run)
        finally:
            run.bar.stop()
    finally:
        for ctx in run.contexts:
            ctx.worker.close()

    for problem in cfg.problems:
        outcome.final_rows.extend(run.finals.get(problem.key, []))
    outcome.stats = _merged_stats(outcome.stats)
    names = [study_name(device["arch"], p, b, cfg.numerics) for p in cfg.problems for b in run.usable]
    outcome.participants = fleet.participants(run.storage, names) | {
        "here": {"host": fleet.host_name(), "workers": [ctx.slot.label for ctx in run.contexts]}}
    part = outcome.participants
    log(f"workers: {len(run.contexts)} here ({', '.join(ctx.slot.label for ctx in run.contexts)}); "
        f"the storage's trials of these studies were measured by {part['workers']} worker(s) on "
        f"{part['gpus']} GPU(s) of {part['hosts']} host(s)")
    results.write_run_json(out_dir, cfg, run.url, device, probe, run.usable, participants=outcome.participants)
    outcome.trials_path = results.write_trials(out_dir, run.storage, cfg, device, probe)
    if outcome.trials_path.name != "trials.csv":
        log(f"warning: {out_dir / 'trials.csv'} lists more trials than this storage holds for {device['arch']}; "
            f"kept as it is, this run's trials are in {outcome.trials_path}")
    results.write_final(out_dir, outcome.final_rows)
    table = table_mod.build_table(outcome.final_rows, device, probe, cfg.min_gain, run.usable)
    outcome.table_path = table_mod.save(table, out_dir / "table.json")
    return outcome


def _run_threads(run: _Run) -> None:
    """One thread per worker (each drives its own device process); the first error stops all."""

    def main(ctx: _WorkerContext) -> None:
        try:
            _worker_main(run, ctx)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            with run.lock:
                run.errors.append(exc)
            run.stop.set()

    threads = [threading.Thread(target=main, args=(ctx,), name=f"tunekit-{ctx.slot.label}", daemon=True)
               for ctx in run.contexts]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.2)
    except BaseException:
        run.stop.set()
        for ctx in run.contexts:  # a trial in flight returns at once (its worker is gone)
            ctx.worker.close()
        for thread in threads:
            thread.join(timeout=30)
        raise
    if run.errors:
        raise run.errors[0]


def _worker_main(run: _Run, ctx: _WorkerContext) -> None:
    """Trials of every study that still needs some, then the final re-measures no one has claimed."""
    studies = [(problem, backend) for problem in run.cfg.problems for backend in run.usable]
    _trial_phase(run, ctx, _rotated(studies, ctx.index, len(run.contexts)))
    if not run.stop.is_set():
        _final_phase(run, ctx, _rotated(list(run.cfg.problems), ctx.index, len(run.contexts)))


def _rotated(items: list, index: int, count: int) -> list:
    """Workers start at different places of the queue, so they rarely meet in one study."""
    shift = index * len(items) // max(count, 1)
    return items[shift:] + items[:shift]


def _merged_stats(stats: list[StudyStats]) -> list[StudyStats]:
    """One row per study: the counts of every worker of this process that ran trials in it."""
    merged: dict[tuple, StudyStats] = {}
    for s in stats:
        key = (s.problem.key, s.backend)
        if key not in merged:
            merged[key] = s
            continue
        m = merged[key]
        m.measured_before = min(m.measured_before, s.measured_before)
        for name in ("measured_now", "ok", "failed", "invalid", "duplicates"):
            setattr(m, name, getattr(m, name) + getattr(s, name))
        bests = [b for b in (m.best_us, s.best_us) if b is not None]
        m.best_us = min(bests) if bests else None
    return list(merged.values())


def _trial_phase(run: _Run, ctx: _WorkerContext, studies: list[tuple[Problem, str]]) -> None:
    """Run trials wherever the storage says a study needs some; wait while the rest is in flight elsewhere
    (a worker that dies there has its trial failed by the heartbeat, and the study needs work again)."""
    cfg = run.cfg
    mine: dict[tuple[str, str], _WorkerStudy] = {}
    pending = list(studies)
    while pending and not run.stop.is_set():
        waiting = []
        for index, (problem, backend) in enumerate(pending):
            if run.stop.is_set():
                return
            share = None
            if cfg.timeout_s is not None:
                # split what is left evenly over the studies still to run, so
                # a budget cut never starves the last problems
                remaining = cfg.timeout_s - (time.monotonic() - run.started)
                share = remaining / (len(pending) - index)
            key = (problem.key, backend)
            st = _shared_study(run, problem, backend)
            if key not in mine:
                mine[key] = _WorkerStudy(StudyStats(problem, backend, measured_before=st.stats.measured_before,
                                                    best_us=st.stats.best_us))
                with run.lock:
                    run.outcome.stats.append(mine[key].stats)
            if _run_trials(run, ctx, st, mine[key], share) == "elsewhere":
                waiting.append((problem, backend))
        pending = waiting
        if pending:
            time.sleep(fleet.POLL_S)


def _final_phase(run: _Run, ctx: _WorkerContext, problems: list[Problem]) -> None:
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


def _final_step(run: _Run, ctx: _WorkerContext, problem: Problem) -> list[dict[str, Any]] | None:
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
    for backend in run.usable:  # tuning trials of this problem still in flight elsewhere: they may change the top
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
        study = _retrying(lambda: optuna.create_study(study_name=name, storage=storage, direction="minimize",
                                                      load_if_exists=True))
    with stops_deferred(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        trial = study.ask()
        ctx.live.begin(trial)
    if not fleet.holds_claim(study, trial.number):
        trial.set_user_attr("status", "claim_lost")
        _tell(study, trial, state=TrialState.PRUNED)
        ctx.live.end()
        return None
    rows = _final_remeasure(run, ctx, problem, candidates)
    for key, value in (("rows", rows), ("device", ctx.device), ("probe", run.probe), ("backends", run.usable)):
        trial.set_user_attr(key, json.dumps(value))
    trial.set_user_attr("status", "ok" if rows else "fail")
    trial.set_user_attr("stamp_text", run.stamp_text)
    _tell(study, trial, min((r["time_us"] for r in rows), default=0.0))
    ctx.live.end()
    return rows


def _retrying(action: Callable[[], Any], attempts: int = 5) -> Any:
    """A storage write that another worker may race (creating one study or attribute at once): retry."""
    for attempt in range(attempts):
        try:
            return action()
        except (optuna.exceptions.StorageInternalError, optuna.exceptions.DuplicatedStudyError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _usable_backends(requested: Sequence[str], device: dict[str, Any]) -> list[str]:
    from tunekit.measure.device import DeviceInfo

    info = DeviceInfo(**device)
    usable = []
    for name in requested:
        try:
            backend = backend_registry.get(name)
        except (KeyError, ImportError, AttributeError) as exc:
            raise UserError(f"backend {name!r}: {exc}") from None
        reason = backend.unavailable_reason(info)
        if reason:
            raise UserError(f"backend {name!r} cannot run here: {reason}")
        usable.append(name)
    return usable


def _extra_baselines(problems: Sequence[Problem], device: dict[str, Any], log: Callable[[str], None]) -> list[str]:
    """Baselines besides vendor that join the final re-measure of the problems they serve here."""
    from tunekit.measure.device import DeviceInfo

    info = DeviceInfo(**device)
    usable = []
    for name in backend_registry.BASELINES:
        if name == "vendor":
            continue
        backend = backend_registry.get(name)
        if not any(p.op in backend.ops for p in problems):
            continue
        reason = backend.unavailable_reason(info)
        if reason:
            log(f"{name} baseline: not measured ({reason})")
        else:
            usable.append(name)
    return usable


def _limit_gbps(problem: Problem, probe: dict[str, Any]) -> float | None:
    """The measured bandwidth this op's % of limit refers to (read for GEMV, copy for elementwise)."""
    from tunekit.problems import opspec

    return probe.get(f"{opspec.get(problem.op).limit}_gbps") or None


@dataclass
class _OpenStudy:
    """A study opened by one worker: its sampler, pruned domains and counts (opened once per worker)."""

    study: optuna.Study
    name: str
    backend: Any
    fixed: dict[str, Any]
    distributions: dict[str, CategoricalDistribution]
    wanted: int
    stats: StudyStats  # as opened: what the storage held before this search
    task: Any
    emptied: list[str]


@dataclass
class _WorkerStudy:
    """One worker's share of a study: its counts and how many parameter sets it asked."""

    stats: StudyStats
    attempts: int = 0


def _shared_study(run: _Run, problem: Problem, backend_name: str) -> _OpenStudy:
    """The study opened once per search (domain pruning, warm start); the workers of this process
    share its Study object, whose sampler then sees every worker's asks, as Optuna's n_jobs does."""
    key = (problem.key, backend_name)
    with run.lock:
        lock = run.open_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in run.opened:
            run.opened[key] = _open_study(run, problem, backend_name)
        return run.opened[key]


def _open_study(run: _Run, problem: Problem, backend_name: str) -> _OpenStudy:
    cfg, storage, device, bar = run.cfg, run.storage, run.device, run.bar
    backend = backend_registry.get(backend_name)
    space = backend.space(problem)
    stats = StudyStats(problem=problem, backend=backend_name)
    name = study_name(device["arch"], problem, backend_name, cfg.numerics)
    domains = _prune_domains(backend, problem, space.domains, space.fixed)
    # Tunables with no effect on this device are pinned, so one kernel is not
    # measured under several names (REDUCE_DPP only changes AMD code).
    pinned_for = getattr(backend, "pinned_params", None)
    pinned: dict[str, Any] = {}
    if pinned_for is not None:
        from tunekit.measure.device import DeviceInfo

        for key, value in pinned_for(DeviceInfo(**device)).items():
            if key in domains and value in domains[key]:
                domains[key] = [value]
                pinned[key] = value
    emptied = []
    for key, allowed in cfg.restrict.items():  # --restrict: the user narrows the space
        if key in domains:
            domains[key] = [v for v in domains[key] if str(v) in allowed]
            if not domains[key]:
                emptied.append(f"{key}={','.join(allowed)}")
    sampler = _make_sampler(cfg.sampler, domains, cfg.seed)
    study = _retrying(lambda: optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                                  direction="minimize", load_if_exists=True))
    fleet.check_study_stamp(study, run.stamp, run.stamp_text, run.url)
    for key, value in (("problem", problem.as_dict()), ("backend", backend_name), ("numerics", cfg.numerics)):
        if study.user_attrs.get(key) != value:
            _retrying(lambda key=key, value=value: study.set_user_attr(key, value))
    source = backend.source_hash()
    previous_source = study.user_attrs.get("source_hash")
    if previous_source and previous_source != source:
        # resuming keeps finished trials as measured; say so when they timed other kernel sources
        bar.log(f"warning: {name}: the {backend_name} kernel sources changed since this study's "
                f"trials ran ({previous_source} -> {source}); they are kept, not re-measured "
                "(use a new --out to start over)")
    if previous_source != source:
        _retrying(lambda: study.set_user_attr("source_hash", source))
    fail_dead_trials(study, storage)
    # an emptied domain: no distribution (Optuna refuses one without choices), no trial
    distributions = {} if emptied else {k: CategoricalDistribution(v) for k, v in domains.items()}
    wanted = cfg.trials if domains else 1
    measured = len(_trial_index(study, "")[0])
    stats.measured_before = measured
    opened = _OpenStudy(study, name, backend, dict(space.fixed), distributions, wanted, stats,
                        bar.add(f"{problem.op} m{problem.m} {problem.n}x{problem.k} {backend_name}", wanted,
                                min(measured, wanted)), emptied)
    if emptied:
        # the study exists (the final re-measure reads it) but gets no new trial
        bar.log(f"{name}: --restrict {' '.join(emptied)} leaves no valid value for this problem; no new trials")
        stats.best_us = _best_us(study)
        return opened
    if not study.get_trials(deepcopy=False):
        default = dict(space.fixed) | dict(space.default)
        reason = backend.invalid_reason(problem, default)
        if reason is None and all(space.default.get(k) in v for k, v in domains.items()):
            study.enqueue_trial(space.default)
        else:
            # a plugin's default may not fit every shape; the sampler starts without it
            bar.log(f"{name}: the default config is not valid here ({reason or 'outside the pruned domains'}); "
                    "not enqueued")
        # A seed recorded before a tunable existed takes its default, or, where
        # pinning or --restrict left the default out, the first value allowed:
        # `--restrict NEW=1 --seed-from old/trials.csv` re-measures old winners with NEW=1.
        # A pinned tunable is the same kernel at any value here: a seed recorded
        # with another value (REDUCE_DPP=1 from before pinning) is that kernel.
        fill = {k: (v if v in domains.get(k, [v]) else domains[k][0]) for k, v in space.default.items()}
        for params in _seeds_from_files(cfg.seed_from, backend_name, problem, domains, fill, pinned):
            study.enqueue_trial(params)
        for params in _warm_start(storage, name, backend_name, problem, domains, fill, cfg.warm_start, pinned):
            study.enqueue_trial(params)
    return opened


def _trial_index(study: optuna.Study, me: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params key -> first measured trial, params key -> lowest-numbered trial of another worker in flight)."""
    seen: dict[str, Any] = {}
    inflight: dict[str, Any] = {}
    for trial in study.get_trials(deepcopy=False):
        if trial.user_attrs.get("measured"):
            seen.setdefault(_params_key(trial.params), trial)
        elif trial.state == TrialState.RUNNING and trial.params and trial.user_attrs.get("worker") != me:
            inflight.setdefault(_params_key(trial.params), trial)
    return seen, {k: t for k, t in inflight.items() if k not in seen}


def _enqueue_unmeasured_grid(study: optuna.Study, st: _OpenStudy, seen: dict[str, Any],
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
    if math.prod(len(c) for c in choices) > _PRUNE_LIMIT:
        return False
    missing = []
    for values in itertools.product(*choices):
        params = dict(zip(names, values, strict=True))
        key = _params_key(params)
        if key not in seen and key not in inflight and st.backend.invalid_reason(
                st.stats.problem, st.fixed | params) is None:
            missing.append(params)
    for params in missing:
        study.enqueue_trial(params)
    return bool(missing)


def _run_trials(run: _Run, ctx: _WorkerContext, st: _OpenStudy, mine: _WorkerStudy,
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
            seen, inflight = _trial_index(study, live.worker)
            measured = len(seen)
            if measured >= st.wanted or study.user_attrs.get("exhausted"):
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
                    _retrying(lambda: study.set_user_attr("exhausted", True))
                    return "done"
                return "elsewhere"
            mine.attempts += 1
            with stops_deferred(), warnings.catch_warnings():
                # ask/tell, not optimize(): the heartbeat is tunekit's (liveness.Liveness)
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
                trial = study.ask(st.distributions)
                live.begin(trial)
            params = st.fixed | dict(trial.params)
            key = _params_key(trial.params)
            seen, inflight = _trial_index(study, live.worker)
            if key in seen or (key in inflight and inflight[key].number < trial.number):
                # measured already, or being measured by another worker that asked first
                previous = seen.get(key) or inflight[key]
                trial.set_user_attr("status", "duplicate")
                trial.set_user_attr("duplicate_of", previous.number)
                stats.duplicates += 1
                if previous.state == TrialState.COMPLETE:
                    _tell(study, trial, previous.value)
                else:
                    _tell(study, trial, state=TrialState.PRUNED)
                continue
            reason = st.backend.invalid_reason(problem, params)
            if reason:
                # PRUNED (not FAIL): TPE then ranks the point as bad and steers away.
                trial.set_user_attr("status", "invalid")
                trial.set_user_attr("error", reason)
                _tell(study, trial, state=TrialState.PRUNED)
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
            _store_reply(trial, reply, _limit_gbps(problem, run.probe))
            if reply.get("status") == "ok":
                _tell(study, trial, reply["time_us"])
                stats.ok += 1
            else:
                _tell(study, trial, state=TrialState.FAIL)
                stats.failed += 1
            best = _best_us(study)
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
                stats.best_us = _best_us(study)


#: Largest search space whose valid points are enumerated to prune domains.
_PRUNE_LIMIT = 300_000
#: Random points tried before that enumeration (it is skipped once all values are seen valid).
_PRUNE_SAMPLES = 3000
#: Up to this many values unseen after those points, each is enumerated alone (with an early exit).
_PRUNE_PER_VALUE = 3


def _prune_domains(backend, problem: Problem, domains: dict[str, list[Any]],
                   fixed: dict[str, Any]) -> dict[str, list[Any]]:
    """Drop the values of each parameter that no valid config of ``problem`` uses.

    Small problems make most of the space invalid (BLOCK_K = 8192 at K = 128):
    without pruning a sampler spends its attempts on them (each is cheap but
    the budget of attempts is finite). The predicate is pure Python, so the
    whole product is enumerated when it is small enough.
    """
    import itertools

    names = list(domains)
    size = 1
    for name in names:
        size *= len(domains[name])
    if not names or size > _PRUNE_LIMIT:
        return dict(domains)
    import random

    used: dict[str, set] = {name: set() for name in names}
    wanted = sum(len(domains[n]) for n in names)

    def mark(values: tuple) -> None:
        params = dict(fixed) | dict(zip(names, values, strict=True))
        if backend.invalid_reason(problem, params) is None:
            for name, value in zip(names, values, strict=True):
                used[name].add(repr(value))

    # Random points first: on most shapes every value is soon seen in a valid
    # config and nothing can be pruned (the full product costs ~1.5 s per GEMV
    # study, a large share of a short budget); only otherwise enumerate it all.
    rng = random.Random(0)
    for _ in range(_PRUNE_SAMPLES):
        mark(tuple(rng.choice(domains[n]) for n in names))
        if sum(map(len, used.values())) == wanted:
            return dict(domains)
    unseen = wanted - sum(map(len, used.values()))
    if unseen > _PRUNE_PER_VALUE:
        # many values never valid (a small shape): one pass over the product is cheaper
        for values in itertools.product(*(domains[n] for n in names)):
            mark(values)
        names_left: list[str] = []
    else:
        names_left = names
    # Each value not seen yet: enumerate the configs holding it, up to the first valid one.
    for i, name in enumerate(names_left):
        for value in domains[name]:
            if repr(value) in used[name]:
                continue
            others = [domains[n] if j != i else [value] for j, n in enumerate(names)]
            for values in itertools.product(*others):
                mark(values)
                if repr(value) in used[name]:
                    break
    if not any(used.values()):
        return dict(domains)  # nothing valid: let the trials record why
    return {name: [v for v in domains[name] if repr(v) in used[name]] for name in names}


def _tell(study: optuna.Study, trial: optuna.Trial, value: float | None = None,
          state: TrialState | None = None) -> None:
    """study.tell, tolerating GridSampler's stop() request outside optimize().

    GridSampler asks the study to stop from after_trial once the grid is
    exhausted, which raises under ask/tell; the trial is stored regardless
    (Optuna writes it in a ``finally``) and the loop checks exhaustion itself.
    """
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as exc:
        if "Study.stop" not in str(exc):
            raise


#: (storage, study name) -> (trial count when read, its best verified params, best first).
_BEST_CACHE: dict[tuple[int, str], tuple[int, list[dict[str, Any]]]] = {}


def _best_params(storage, summary: optuna.study.StudySummary, count: int) -> list[dict[str, Any]]:
    """The ``count`` fastest verified configs of a study, read once per trial count: late
    studies of a long run would otherwise reload every earlier study from the storage."""
    key = (id(storage), summary.study_name)
    cached = _BEST_CACHE.get(key)
    if cached is None or cached[0] != summary.n_trials or len(cached[1]) < count:
        other = optuna.load_study(study_name=summary.study_name, storage=storage)
        done = sorted((t for t in other.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                       if t.user_attrs.get("status") == "ok"), key=lambda t: t.value)
        cached = (summary.n_trials, [dict(t.params) for t in done[:max(count, 8)]])
        _BEST_CACHE[key] = cached
    return cached[1][:count]


def _warm_start(storage, name: str, backend: str, problem: Problem, domains: dict[str, list[Any]],
                default: dict[str, Any], per_study: int, pinned: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The best verified configs of the other studies of this op and backend in the storage.

    Good GEMV configs transfer between shapes (on the H200 the M=1 winners of
    all seven Qwen3.5-27B shapes came from a few small tiles), so each new
    study first measures them: a prior for TPE and a floor for short budgets.
    """
    if per_study <= 0:
        return []
    seeds: list[dict[str, Any]] = []
    keys: set[str] = set()
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        attrs = summary.user_attrs
        if summary.study_name == name or attrs.get("backend") != backend:
            continue
        if attrs.get("problem", {}).get("op") != problem.op:
            continue
        for trial_params in _best_params(storage, summary, per_study):
            # a parameter added to the space after that trial ran takes its
            # default, which keeps the kernel the trial measured
            params = {k: v for k, v in (default | trial_params | (pinned or {})).items() if k in domains}
            if set(params) != set(domains) or any(params[k] not in domains[k] for k in domains):
                continue
            key = _params_key(params)
            if key not in keys:
                keys.add(key)
                seeds.append(params)
    return seeds


#: Seeds one study takes from --seed-from files: of the op itself, its siblings (same kernel) and,
#: for a fused GEMV family, the GEMV, taken in turn; within each, the same problem first, then the
#: same M, then any M (nearest shapes first).
SEEDS_FROM_FILES = 8


def read_seed_records(path: Path) -> list[dict[str, Any]]:
    """(op, backend, m, n, k, params, time_us) records of the verified configs in a
    dispatch table (``table.json``) or a trials table (``trials.csv`` / ``.parquet``)."""
    if not path.is_file():
        raise UserError(f"--seed-from {path}: no such file")
    if path.stat().st_size == 0:
        raise UserError(f"--seed-from {path}: the file is empty")
    if path.suffix == ".json":
        from tunekit import table as table_mod

        return [dict(e) for e in table_mod.load(path)["entries"]]
    import pandas as pd

    from tunekit.search import results

    needed = ("op", "backend", "m", "n", "k", "params", "status", "time_us")
    if path.suffix == ".parquet":
        try:
            frame = pd.read_parquet(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors have no common base worth naming
            raise UserError(f"--seed-from {path}: not a readable parquet file ({exc})") from None
        missing = sorted(set(needed) - set(frame.columns))
        if missing:
            raise UserError(f"--seed-from {path}: not a trials table (columns {missing} missing)")
    else:
        try:
            frame = results.read_csv(path, "trials table", needed)
        except UserError as exc:
            raise UserError(f"--seed-from {exc}") from None
    frame = frame[frame["status"] == "ok"]
    try:
        return [{"op": r.op, "backend": r.backend, "m": int(r.m), "n": int(r.n), "k": int(r.k),
                 "params": json.loads(r.params), "time_us": float(r.time_us)} for r in frame.itertuples()]
    except (TypeError, ValueError) as exc:  # ValueError covers a params cell that is not JSON
        raise UserError(f"--seed-from {path}: a verified trial's row is malformed ({exc})") from None


def _seeds_from_files(paths: Sequence[Path], backend: str, problem: Problem, domains: dict[str, list[Any]],
                      default: dict[str, Any], pinned: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Configs of earlier runs (``--seed-from``) for this study, best-first per nearness.

    ``default`` fills tunables a record lacks; ``pinned`` overrides what a record says for them."""
    if not paths:
        return []
    # Records of the op itself, of its siblings (the ops that read the same search-space file: one
    # kernel, the weight convention or the residual differ) and, for a fused GEMV family, of the GEMV
    # (its tile tunables have the same names, and (m, n, k) the same meaning): ranks 0, 1, 2.
    from search_spaces import FILES

    stem = FILES.get(problem.op, problem.op)
    rank = {op: 1 for op, s in FILES.items() if s == stem} | {stem: 1}
    if problem.op in FUSED_GEMV_OPS:
        rank["gemv"] = 2
    rank[problem.op] = 0
    records = [r for path in paths for r in read_seed_records(Path(path))
               if r["op"] in rank and r["backend"] == backend]

    def nearness(r: dict[str, Any]) -> tuple:
        same_shape = (r["n"], r["k"]) == (problem.n, problem.k)
        return (rank[r["op"]], not (same_shape and r["m"] == problem.m), r["m"] != problem.m, not same_shape,
                abs(math.log(r["n"] * r["k"]) - math.log(problem.n * problem.k)), abs(r["m"] - problem.m),
                r["time_us"])

    # One queue per rank, nearest first, taken in turn: a fused op's many own records (an earlier
    # search of it) must not crowd out the GEMV's winners, whose tile configs may be better ones
    # the earlier search never reached.
    queues: list[list[dict[str, Any]]] = []
    for level in sorted(set(rank.values())):
        queue = sorted((r for r in records if rank[r["op"]] == level), key=nearness)
        if queue:
            queues.append(queue)
    seeds: list[dict[str, Any]] = []
    keys = {_params_key({k: v for k, v in default.items() if k in domains})}
    while queues and len(seeds) < SEEDS_FROM_FILES:
        for queue in list(queues):
            while queue:
                record = queue.pop(0)
                params = {k: v for k, v in (default | record["params"] | (pinned or {})).items() if k in domains}
                if set(params) != set(domains) or any(params[k] not in domains[k] for k in domains):
                    continue  # recorded with a space that no longer holds it
                key = _params_key(params)
                if key not in keys:
                    keys.add(key)
                    seeds.append(params)
                    break
            if not queue:
                queues.remove(queue)
            if len(seeds) == SEEDS_FROM_FILES:
                break
    return seeds


def _best_us(study: optuna.Study) -> float | None:
    done = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("measured")]
    return min(done) if done else None


def _store_reply(trial: optuna.Trial, reply: dict[str, Any], limit_gbps: float | None) -> None:
    trial.set_user_attr("measured", True)
    status = reply.get("status", "fail")
    trial.set_user_attr("status", status)
    trial.set_user_attr("error", str(reply.get("error", ""))[:2000])
    for key in ("compile_s", "rtc_compile_s", "rtc_cache_hit", "max_abs_err", "err_ratio", "time_us",
                "time_min_us", "time_p25_us", "time_p75_us", "spread", "repeats", "launches", "copies",
                "timing_kind", "gbps"):
        value = reply.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            trial.set_user_attr(key, value)
    if reply.get("build_log"):
        trial.set_user_attr("build_log", reply["build_log"])
    if reply.get("gbps") and limit_gbps:
        trial.set_user_attr("pct_of_limit", 100.0 * reply["gbps"] / limit_gbps)


def _final_candidates(run: _Run, problem: Problem) -> list[dict[str, Any]]:
    """Top candidates of each backend (from the storage) and the baselines.

    Baselines: vendor always; each extra baseline (Inductor) that implements
    the op, as an optional candidate the worker may drop (a failed compile
    costs that baseline, not the re-measure).
    """
    candidates = [{"label": "vendor", "backend": "vendor", "params": {}}]
    for name in run.extra:
        if problem.op in backend_registry.get(name).ops:
            candidates.append({"label": name, "backend": name, "params": {}, "optional": True})
    for backend_name in run.usable:
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


def _final_remeasure(run: _Run, ctx: _WorkerContext, problem: Problem,
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
    limit = _limit_gbps(problem, probe)
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
