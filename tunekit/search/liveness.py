"""Which trials in flight are alive: the owner and heartbeat of this process's trials, and failing those of
processes that are gone.

Every asked trial records its owner (``host:pid``) and worker (``host:pid:slot``) as user attributes and gets
Optuna's heartbeat from a thread (:class:`Liveness`), so a search opening a study can tell a trial a dead
process left RUNNING (:func:`fail_dead_trials`: recorded failed, status ``interrupted``, its parameters asked
again through the storage's retry callback) from one another live search sharing the storage is measuring
(left alone). No stop falls between the ask of a trial and the record of its owner: a stop signal is only
recorded, and raised where the search checks (:mod:`~tunekit.search.stops`). Imports nothing of the search but
:mod:`~tunekit.search.fleet`.
"""

from __future__ import annotations

import os
import threading
import warnings

import optuna
from optuna.trial import TrialState

from tunekit.search import fleet

#: Seconds between the heartbeats of a trial in flight, and the silence after which a
#: search sharing the storage from another host may fail it (Optuna's heartbeat:
#: RDBStorage(heartbeat_interval, grace_period) and storages.fail_stale_trials).
HEARTBEAT_S = 10
STALE_AFTER_S = 60


class Liveness:
    """The trial this process has in flight: its owner and Optuna's heartbeat for it.

    Every asked trial records its owner (``host:pid``) as a user attribute and
    gets a heartbeat every HEARTBEAT_S from a thread, so a search opening a
    study can tell a trial a dead process left RUNNING (failed as interrupted,
    ``fail_dead_trials``) from one another live search sharing the storage is
    measuring (left alone). ``fail_current`` records this process's own trial
    in flight as interrupted when the run stops.
    """

    def __init__(self, storage, worker: str) -> None:
        self.storage = storage
        self.owner = f"{fleet.host_name()}:{os.getpid()}"
        self.worker = worker  # host:pid:slot
        self.stamp = ""  # the device stamp, once the worker has described its device
        self.interval = getattr(storage, "heartbeat_interval", None) or HEARTBEAT_S
        self._trial_id: int | None = None
        self._study: optuna.Study | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="tunekit-heartbeat", daemon=True)
        self._thread.start()

    def begin(self, trial: optuna.Trial) -> None:
        trial.set_user_attr("owner", self.owner)
        trial.set_user_attr("worker", self.worker)
        if self.stamp:
            trial.set_user_attr("stamp", self.stamp)
        with self._lock:
            self._trial_id = trial._trial_id
            self._study = trial.study
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(trial._trial_id)
        self.storage.record_heartbeat(trial._trial_id)

    def end(self) -> None:
        with self._lock:
            trial_id, self._trial_id = self._trial_id, None
        if trial_id is not None:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(trial_id)

    def fail_current(self, error: str) -> None:
        with self._lock:
            trial_id, self._trial_id, study = self._trial_id, None, self._study
        if trial_id is not None:
            _fail_interrupted(self.storage, study, trial_id, error)
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(trial_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                trial_id = self._trial_id
            if trial_id is not None:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception:  # noqa: BLE001 - a busy database: the next beat is in HEARTBEAT_S
                    pass


#: Trials this process's workers have in flight (several threads with --gpus): never "dead" to this process.
_IN_FLIGHT: set[int] = set()
_IN_FLIGHT_LOCK = threading.Lock()


def _fail_interrupted(storage, study: optuna.Study, trial_id: int,
                      error: str = "interrupted (the search process stopped)") -> None:
    """Record a RUNNING trial that will never finish as failed, status ``interrupted``."""
    try:
        if storage.get_trial(trial_id).state != TrialState.RUNNING:
            return
        storage.set_trial_user_attr(trial_id, "status", "interrupted")
        storage.set_trial_user_attr(trial_id, "error", error)
        storage.set_trial_state_values(trial_id, TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:
        return  # another search sharing the storage recorded it first
    getter = getattr(storage, "get_heartbeat_stale_trial_callback", None) or getattr(
        storage, "get_failed_trial_callback", lambda: None)
    retry = getter()
    if retry is not None:  # as Optuna does for a stale heartbeat: its parameters are asked again
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            retry(study, storage.get_trial(trial_id))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def fail_dead_trials(study: optuna.Study, storage) -> None:
    """Trials left RUNNING by a process that is gone never finish: record them as failed.

    A RUNNING trial may also be in flight in another search sharing the
    storage; it is failed only when its owner is a dead process on this host
    (or this very process, whose trials are all told by now: a reused pid), or,
    for an owner elsewhere, when Optuna's heartbeat has been silent for
    STALE_AFTER_S. A trial without an owner (recorded before owners were, or
    asked a moment ago by another search) only once it is that old.
    """
    import datetime as _dt

    host, now = fleet.host_name(), _dt.datetime.now()
    grace = getattr(storage, "grace_period", None) or STALE_AFTER_S
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get("owner")
        if owner is None:
            started = trial.datetime_start
            if started is not None and (now - started).total_seconds() < grace:
                continue
        else:
            owner_host, _, pid = str(owner).rpartition(":")
            if owner_host != host or not pid.isdigit():
                continue  # elsewhere: the heartbeat decides, below
            if int(pid) == os.getpid():
                with _IN_FLIGHT_LOCK:
                    if trial._trial_id in _IN_FLIGHT:
                        continue  # another worker thread of this search is measuring it
            elif _pid_alive(int(pid)):
                continue
        _fail_interrupted(storage, study, trial._trial_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)
