"""The Optuna storage of a search: its URL, opening it, and the retry of a trial whose worker died.

SQLite in the run folder unless ``--storage URL``: a SQLite file is checked first (an empty or corrupt one is
refused, not recreated), put in WAL mode and opened with a busy timeout, so several searches may share it;
PostgreSQL (searches on several hosts) through psycopg 3, ``postgres://`` taken as ``postgresql://``. The
heartbeat is on (:mod:`~tunekit.search.liveness` records it), and a trial whose worker died has its parameters
asked again (:data:`MAX_RETRY` times).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from tunekit.errors import UserError
from tunekit.search import fleet
from tunekit.search.liveness import HEARTBEAT_S, STALE_AFTER_S


def storage_url(out_dir: Path, storage: str | None) -> str:
    return storage or f"sqlite:///{(out_dir / 'optuna.db').resolve()}"


#: Times the parameters of a trial whose worker died are asked again (Optuna's retry callback).
MAX_RETRY = 2


def _retry_callback() -> Callable[[optuna.Study, optuna.trial.FrozenTrial], None]:
    """The storage's callback for a trial failed because its worker died (Optuna calls it from
    ``fail_stale_trials``; ``_fail_interrupted`` for a dead process on this host): its parameters are
    enqueued again, so another worker picks its work up.

    Optuna's own RetryHeartbeatStaleTrialCallback copies the trial's user attributes into the
    retry; here they are tunekit's results (``measured``, times), so the retry starts clean and
    keeps only Optuna's retry bookkeeping. A trial whose reply was stored before its worker died
    (``measured``) is not retried: its outcome is in the storage.
    """

    def retry(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if trial.user_attrs.get("measured") or not trial.params:
            return
        history = [*trial.system_attrs.get("retry_history", []), trial.number]
        if len(history) > MAX_RETRY:
            return
        study.add_trial(optuna.create_trial(
            state=TrialState.WAITING, params=trial.params, distributions=trial.distributions,
            system_attrs={"failed_trial": history[0], "retry_history": history},
            user_attrs={"retry_of": trial.number}))

    return retry


def _retry_kwarg() -> dict[str, Any]:
    """RDBStorage's retry argument under its name in this Optuna (heartbeat_stale_trial_callback since 4.9)."""
    import inspect

    params = inspect.signature(optuna.storages.RDBStorage.__init__).parameters
    name = "heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in params else "failed_trial_callback"
    return {name: _retry_callback()}


#: What to install for a PostgreSQL storage, in the one line that says a driver is missing.
POSTGRES_DRIVER_HINT = "pip install 'psycopg[binary]' (tunekit's postgres extra: pip install -e '.[postgres]')"


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def postgres_driver(url: str) -> str:
    """A PostgreSQL URL as SQLAlchemy opens it; any other URL unchanged.

    ``postgres://`` (libpq's and most hosting services' spelling) becomes ``postgresql://``, which is the only
    one SQLAlchemy knows. A bare scheme gets the driver tunekit installs (psycopg 3, the ``postgres`` extra),
    else psycopg2 where only that one is installed: SQLAlchemy's default driver for the bare scheme differs
    between its versions. A URL naming its driver keeps it. Raises :class:`UserError` (one line saying what to
    install) when the driver the URL needs is not installed.
    """
    if url.startswith(("postgres://", "postgres+")):
        url = "postgresql" + url[len("postgres"):]
    scheme, sep, rest = url.partition("://")
    if not sep or not (scheme == "postgresql" or scheme.startswith("postgresql+")):
        return url
    driver = scheme.partition("+")[2]
    if not driver:
        if _has_module("psycopg"):
            return "postgresql+psycopg://" + rest
        if _has_module("psycopg2"):
            return "postgresql+psycopg2://" + rest
        raise UserError(f"storage {fleet.redact(url)}: no PostgreSQL driver is installed: {POSTGRES_DRIVER_HINT}")
    if driver in ("psycopg", "psycopg2") and not _has_module(driver):
        raise UserError(f"storage {fleet.redact(url)}: the {driver} driver it names is not installed: "
                        f"{POSTGRES_DRIVER_HINT}" if driver == "psycopg" else
                        f"storage {fleet.redact(url)}: the psycopg2 driver it names is not installed: pip install "
                        "psycopg2-binary, or name tunekit's driver: postgresql+psycopg://")
    return url


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """The Optuna storage at ``url``, with the heartbeat on; a SQLite file is checked first
    (an empty or corrupt one is refused, not recreated) and put in WAL mode."""
    from tunekit.search import results

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    kwargs: dict[str, Any] = {}
    db = results.sqlite_path(url)
    if db is not None:
        results.prepare_sqlite_file(db)
        # wait for another search's write instead of failing with "database is locked"
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}
    url = postgres_driver(url)
    error: Exception | None = None
    for _ in range(3):  # two searches creating the tables of a new shared database at once: one retries
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                interval, grace = fleet.heartbeat_settings(HEARTBEAT_S, STALE_AFTER_S)
                return optuna.storages.RDBStorage(url, heartbeat_interval=interval, grace_period=grace,
                                                  **_retry_kwarg(), **kwargs)
        except Exception as exc:  # bad URL, unreachable DB, missing driver
            error = exc
            time.sleep(0.5)
    raise UserError(f"cannot open storage {fleet.redact(url)}: {error}") from None


def stored_trials(storage: optuna.storages.BaseStorage) -> int:
    return sum(s.n_trials for s in optuna.get_all_study_summaries(storage, include_best_trial=False))
