"""The Optuna storage of a search: its URL, opening it, and the retry of a trial whose worker died.

SQLite in the run folder unless ``--storage URL``: a SQLite file is checked first (an empty or corrupt one is
refused, not recreated), put in WAL mode and opened with a busy timeout, so several searches may share it;
PostgreSQL (searches on several hosts) through psycopg 3, ``postgres://`` taken as ``postgresql://``. The
heartbeat is on (:mod:`~tunekit.search.liveness` records it), and a trial whose worker died has its parameters
asked again (:data:`MAX_RETRY` times). A storage or run folder that fails mid-run (a server stopped, a full disk,
a size limit, a place no longer writable) becomes one line naming the cause and the fix (:func:`fault`).
"""

from __future__ import annotations

import errno
import logging
import os
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


def _not_a_query_fallback(record: logging.LogRecord) -> bool:
    """Optuna's RDB storage logs "Caught an error from sqlalchemy ... Falling back to a slower alternative"
    (with the whole SQL statement) for any OperationalError of its trials query, meant for SQLite's limit on
    IN variables. A lost database server raises one there too, and the search's own one line names that
    fault; where the fallback works, nothing was wrong. So the warning is dropped."""
    return not record.getMessage().startswith("Caught an error from sqlalchemy")


def open_storage(url: str) -> optuna.storages.RDBStorage:
    """The Optuna storage at ``url``, with the heartbeat on; a SQLite file is checked first
    (an empty or corrupt one is refused, not recreated) and put in WAL mode."""
    from tunekit.search import results

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("optuna.storages._rdb.storage").addFilter(_not_a_query_fallback)  # added once
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
    raise UserError(f"cannot open storage {fleet.redact(url)}: {_open_error(error)}") from None


def _open_error(error: Exception | None) -> str:
    """Why a storage did not open, in one line: the driver's own first line (SQLAlchemy appends a
    "Background on this error" line), for a missing or wrong password where to give it, for a refused
    connection how to start the server."""
    cause = getattr(error, "orig", None) or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    text = lines[0] if lines else type(cause).__name__
    if "no password supplied" in text or "password authentication failed" in text:
        text += ("; give the password in the URL (postgresql://USER:PASSWORD@HOST/DB) or in the PGPASSWORD "
                 "environment variable")
    elif "Connection refused" in text or "No such file or directory" in text:
        text += "; is the server running there? (Debian: service postgresql start; docs/search.md)"
    elif isinstance(cause, TypeError) and "bytes-like" in text:
        # psycopg hands SQLAlchemy bytes from a SQL_ASCII database (initdb without a UTF-8 locale)
        text = ("the database's encoding is SQL_ASCII, which psycopg returns as bytes: create the database with "
                "createdb -E UTF8 -T template0 (or the cluster with initdb -E UTF8 --locale=C.UTF-8)")
    return text


def stored_trials(storage: optuna.storages.BaseStorage) -> int:
    return sum(s.n_trials for s in optuna.get_all_study_summaries(storage, include_best_trial=False))


# ------------------------------------------------------------------ a storage or run folder lost mid-run
#: errno values of a file system that is full, of a file size limit, and of a place that can no longer be written.
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_DENIED_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
#: Words of the database drivers' messages, per cause (SQLite's, PostgreSQL's / psycopg's).
_FULL_WORDS = ("database or disk is full", "no space left", "disk full", "could not extend file")
_DENIED_WORDS = ("readonly database", "read-only", "unable to open database file", "permission denied",
                 "operation not permitted")
_GONE_WORDS = ("connection refused", "server closed the connection", "terminating connection", "connection failed",
               "the connection is closed", "could not connect", "connection is lost", "no connection to the server",
               "database system is shutting down", "database system is starting up")
_RESUME = "then rerun the same command to resume: the trials stored so far are kept"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception it was raised from or during (cause first, then context)."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _detail(exc: BaseException) -> str:
    """The driver's own words, first line only, without SQLAlchemy's "(Background on this error ...)" tail."""
    inner = getattr(exc, "orig", None) or exc
    lines = str(getattr(inner, "strerror", None) or inner).strip().splitlines()
    line = lines[0] if lines else type(exc).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def _os_fault(error: OSError, path: object) -> UserError:
    """The line for a write the file system refused: full, over the size limit, or not permitted."""
    if error.errno in _FULL_ERRNOS:
        return UserError(f"{path}: the disk is full ({_detail(error)}): free space on its file system, {_RESUME}")
    if error.errno == errno.EFBIG:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else f"{limit} bytes"
        return UserError(f"{path}: a file reached the size limit ({_detail(error)}; this process's ulimit -f: "
                         f"{shown}): raise the limit (ulimit -f unlimited) or free space, {_RESUME}")
    return UserError(f"{path} can no longer be written ({_detail(error)}): give write access back (chmod, "
                     f"chattr -i, a read-write mount), {_RESUME}")


def _try_write(folder: Path) -> OSError | None:
    """What a real write in ``folder`` meets now (None: it works): tells SQLite's bare "disk I/O error"
    apart (a full disk, a size limit, a folder made read-only). 64 KiB, beyond a small size limit."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".tunekit-write-check-")
    except OSError as exc:
        return exc
    try:
        left = 65536
        while left > 0:  # a size limit cuts one write short; the next one fails
            left -= os.write(fd, b"\0" * left)
        return None
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except OSError:
            pass


def fault(exc: BaseException, url: str, out_dir: Path) -> UserError | None:
    """The one-line error for a storage or run folder that failed mid-run, or None for another exception.

    Causes, told from the exception chain (Optuna's StorageInternalError wraps SQLAlchemy's error, which
    wraps the driver's; a file write raises OSError): a full file system (ENOSPC, EDQUOT; SQLite's "database
    or disk is full"), a file size limit (EFBIG), a place that can no longer be written (EACCES, EPERM,
    EROFS; SQLite's "readonly database"), a database server that stopped answering (a connection refused or
    closed). Where SQLite says only "disk I/O error", a real write beside its file tells which. The line
    names the cause and the fix, and says that the stored trials are kept and that rerunning the same
    command resumes: the storage commits each trial on its own, so what it held before the fault is all
    there; the next run fails the trial that was in flight (its owner is gone) and asks its config again
    unless its result was stored.
    """
    import sqlalchemy.exc

    from tunekit.search import results

    for item in _chain(exc):
        if isinstance(item, OSError) and item.errno in _FULL_ERRNOS | _DENIED_ERRNOS | {errno.EFBIG}:
            return _os_fault(item, item.filename or out_dir)
    where = fleet.redact(url)
    db = results.sqlite_path(url)
    for item in _chain(exc):
        if not isinstance(item, (sqlalchemy.exc.DBAPIError, optuna.exceptions.StorageInternalError)) \
                and type(item).__module__.split(".")[0] not in ("sqlite3", "psycopg", "psycopg2"):
            continue
        if isinstance(item, optuna.exceptions.StorageInternalError) and item.__cause__ is not None:
            continue  # Optuna's words ("e.g. exceeding max length") are a guess: the cause says what happened
        text = _detail(item)
        low = text.lower()
        if db is not None and not any(word in low for word in _FULL_WORDS):
            found = _try_write(db.parent)
            if found is not None:
                return _os_fault(found, db.parent)
        if any(word in low for word in _FULL_WORDS):
            return UserError(f"storage {where}: the disk is full ({text}): free space on "
                             f"{'the file system of ' + str(db) if db else 'the database server'}, {_RESUME}")
        if any(word in low for word in _DENIED_WORDS):
            return UserError(f"storage {where} can no longer be written ({text}): give write access back to "
                             f"{str(db) + ' and its folder' if db else 'the database user'} (chmod, chattr -i, "
                             f"a read-write mount), {_RESUME}")
        if db is None and (any(word in low for word in _GONE_WORDS)
                           or isinstance(item, (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError))):
            return UserError(f"storage {where} stopped answering mid-run ({text}): start the database server "
                             f"again (or mend the network to it), {_RESUME}")
        if isinstance(item, sqlalchemy.exc.OperationalError):
            return UserError(f"storage {where} failed mid-run ({text}): check its disk and file, {_RESUME}")
    return None
