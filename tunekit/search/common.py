"""What the duties of a search share: its configuration, its state, and small helpers on studies.

:mod:`~tunekit.search.studies`, :mod:`~tunekit.search.trials`, :mod:`~tunekit.search.finals` and
:mod:`~tunekit.search.engine` import it; it imports none of them (of the search, only
:mod:`~tunekit.search.liveness`, :mod:`~tunekit.search.fleet` and :mod:`~tunekit.search.worker`, which import
nothing of these).
:class:`Run` is what the worker threads of one search share (one object per search; its lists and dicts
change under ``Run.lock``); :class:`WorkerContext` is one worker: its device process and its liveness.
"""

from __future__ import annotations

import datetime as _dt
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from tunekit.problems.shapes import Problem
from tunekit.search import fleet
from tunekit.search.early_stop import StopRule
from tunekit.search.liveness import Liveness
from tunekit.search.worker import DEFAULT_TIMEOUT_S, Worker


@dataclass
class SearchConfig:
    """What ``tunekit search`` was asked: the problems, backends, budget and run folder (``run_search``'s input)."""

    problems: list[Problem]
    backends: list[str]
    out_dir: Path
    trials: int = 40
    #: when a study may end before ``trials`` (near the measured limit, or a plateau; never before its minimum)
    stop: StopRule = field(default_factory=StopRule)
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
    tp: int | None = None  # --tp the model's problems were sharded for (None: --shape only, as given)
    add: bool = False  # --add: a run folder made for other problems takes these too (the union is searched)
    #: the model's layer groups whose fusion the search decides (``table_fusions.model_groups``; none: an
    #: empty ``fusions`` section, as for a ``--shape`` search)
    fusion_groups: list[Any] = field(default_factory=list)
    #: the peers (``backends.PEERS``) timed in the final re-measure beside the winners (None: every one);
    #: each is built, autotuned and checked per problem, two thirds of a search's time on an H100
    #: (h100-peers-5db322d), so ``tunekit search`` times none unless asked
    peers: tuple[str, ...] | None = None


@dataclass
class StudyStats:
    """The counts of one (problem, backend) study in this search (merged over this process's workers)."""

    problem: Problem
    backend: str
    measured_before: int = 0
    measured_now: int = 0
    ok: int = 0
    failed: int = 0
    invalid: int = 0
    duplicates: int = 0
    best_us: float | None = None
    stopped: str | None = None  # why the study ended before --trials (early_stop.stop_reason), None if it did not


@dataclass
class SearchOutcome:
    """What ``run_search`` returns: the run folder, the study counts, the final rows and the files written."""

    run_dir: Path
    stats: list[StudyStats] = field(default_factory=list)
    final_rows: list[dict[str, Any]] = field(default_factory=list)
    table_path: Path | None = None
    trials_path: Path | None = None
    probe: dict[str, Any] = field(default_factory=dict)
    device: dict[str, Any] = field(default_factory=dict)
    #: workers, GPUs and hosts whose trials the run's studies hold (fleet.participants)
    participants: dict[str, Any] = field(default_factory=dict)
    #: the table's ``fusions`` section (``search.fusion_phase``), None where the run decides none
    fusions: dict[str, Any] | None = None


@dataclass
class WorkerContext:
    """One worker of this process: its device process, liveness and identity."""

    index: int
    slot: fleet.Slot
    worker: Worker
    live: Liveness
    device: dict[str, Any] = field(default_factory=dict)
    #: wall seconds of this worker's phases ("trials", "finals"), for the run's time split
    phase_s: dict[str, float] = field(default_factory=dict)
    #: the final phase's seconds by part: "rotation_s", "time_s" (graphs and interleaved timing), and
    #: "build_s" / "verify_s" per backend (a peer's compile is its build); ``finals.add_spent`` fills it
    final_split: dict[str, Any] = field(default_factory=dict)


@dataclass
class Run:
    """What the workers of one search share (threads of this process)."""

    cfg: SearchConfig
    storage: Any
    url: str
    outcome: SearchOutcome
    started: float
    #: the same moment as a local ISO time, as Optuna stamps a trial's start (the trials this invocation ran
    #: start after it: tunekit.evidence.time_split)
    started_at: str = field(default_factory=lambda: _dt.datetime.now().isoformat())
    contexts: list[WorkerContext] = field(default_factory=list)
    usable: list[str] = field(default_factory=list)
    stamp: str = ""
    stamp_text: str = ""
    bar: Any = None
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[BaseException] = field(default_factory=list)
    finals: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    opened: dict[tuple[str, str], Any] = field(default_factory=dict)  # (problem key, backend) -> OpenStudy
    open_locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def backends_for(self, problem: Problem) -> list[str]:
        """The usable tuned backends that implement ``problem.op``: one study each (HIP has no ``gemv_add``)."""
        from tunekit import backends as backend_registry

        return [name for name in self.usable if problem.op in backend_registry.get(name).ops]

    @property
    def device(self) -> dict[str, Any]:
        return self.outcome.device

    @property
    def probe(self) -> dict[str, Any]:
        return self.outcome.probe


def study_name(arch: str, problem: Problem, backend: str, numerics: str) -> str:
    return f"{arch}|{problem.key}|{backend}|{numerics}"


def params_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


def trial_index(study: optuna.Study, me: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params key -> first measured trial, params key -> lowest-numbered trial of another worker in flight)."""
    seen: dict[str, Any] = {}
    inflight: dict[str, Any] = {}
    for trial in study.get_trials(deepcopy=False):
        # an enqueued trial's whole config is known from the moment it is popped (Optuna's "fixed_params"), while
        # its params are stored one commit at a time: keyed by those, a copy popped by another search at the
        # same moment is seen in flight with its config, not as a partial one (three searches sharing a storage
        # each enqueue the default, and one ran it twice)
        params = trial.system_attrs.get("fixed_params") or trial.params
        if trial.user_attrs.get("measured"):
            seen.setdefault(params_key(trial.params), trial)
        elif trial.state == TrialState.RUNNING and params and trial.user_attrs.get("worker") != me:
            inflight.setdefault(params_key(params), trial)
    return seen, {k: t for k, t in inflight.items() if k not in seen}


def best_us(study: optuna.Study) -> float | None:
    done = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.user_attrs.get("measured")]
    return min(done) if done else None


def tell(study: optuna.Study, trial: optuna.Trial, value: float | None = None,
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


def retrying(action: Callable[[], Any], attempts: int = 5) -> Any:
    """A storage write that another worker may race (creating one study or attribute at once): retry."""
    for attempt in range(attempts):
        try:
            return action()
        except (optuna.exceptions.StorageInternalError, optuna.exceptions.DuplicatedStudyError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def limit_gbps(problem: Problem, probe: dict[str, Any]) -> float | None:
    """The measured bandwidth this op's % of limit refers to (read for GEMV, copy for elementwise); None on
    the CPU interpreter (probe kind "cpu"), whose timings are no bandwidth evidence: no ``pct_of_limit`` is
    stored there and no study stops "near the limit" (``early_stop``)."""
    from tunekit.problems import opspec

    if probe.get("kind") == "cpu":
        return None
    return probe.get(f"{opspec.get(problem.op).limit}_gbps") or None


def raise_limit(run: Run, problem: Problem, gbps: float | None, what: str) -> None:
    """Make the limit a measured upper bound: a verified candidate (or baseline) that moves its bytes faster
    than the probe's best streaming kernel raises the limit of its kind (read or copy) to its own rate,
    recorded as ``<kind>_raised_by`` with the probe's figure as ``<kind>_probe_gbps``. So no trial and no
    re-measured row reads above 100% of the limit the run reports. Nothing on the CPU interpreter."""
    from tunekit.problems import opspec

    limit = limit_gbps(problem, run.probe)
    if limit is None or not gbps or gbps <= limit:
        return
    kind = opspec.get(problem.op).limit
    with run.lock:
        probe = run.probe
        if gbps > (probe.get(f"{kind}_gbps") or 0.0):
            probe.setdefault(f"{kind}_probe_gbps", probe.get(f"{kind}_gbps"))
            probe[f"{kind}_gbps"] = gbps
            probe[f"{kind}_raised_by"] = what
