"""Files of a run folder, written with pandas; read back by export/show/compare.

    RUN/optuna.db     every trial (default storage; --storage URL elsewhere)
    RUN/run.json      command, device, environment stamp, bandwidth probe
    RUN/trials.csv    one row per trial of every study: params, status, error,
                      times, GB/s, % of limit, error vs reference
    RUN/final.csv     interleaved re-measure: top candidates + vendor baseline
                      (read from final.csv.gz where a recorded run keeps it compressed)
    RUN/table.json    the dispatch table
    RUN/.lock         held (fcntl.flock) by the search writing the folder: pid, host, start, command

Nothing here destroys data: a search holds the folder's lock, a missing or
corrupt database is refused rather than recreated, and trials.csv is never
replaced by a file holding fewer trials.
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import socket
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd

from tunekit.errors import UserError
from tunekit.search.figures import trial_figures


def make_run_dir(path: Path) -> None:
    """Create the run folder (``--out``), or say in one line why it cannot be one."""
    if path.exists() and not path.is_dir():
        raise UserError(f"--out {path}: exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {path}: cannot create the run folder ({exc.strerror})") from None
    check_writable_dir(path, "the run folder")


def check_writable_dir(path: Path, what: str) -> None:
    """A UserError unless a file can be created in ``path``. Tried for real: as root,
    permission bits say nothing (a read-only mount or an immutable folder still refuses)."""
    if not path.is_dir():
        raise UserError(f"{path}: no such folder ({what})")
    try:
        fd, name = tempfile.mkstemp(dir=path, prefix=".tunekit-write-check-")
    except OSError as exc:
        raise UserError(f"cannot write in {path} ({exc.strerror}): {what} must be writable") from None
    os.close(fd)
    os.unlink(name)


class RunLock:
    """The exclusive lock of a run folder, held by one search from start to end.

    ``fcntl.flock`` on ``RUN/.lock``: the kernel drops it when the holder exits,
    however it dies, so a killed search never leaves a stale lock. The holder
    writes its pid, host, start time and command in the file, for the error a
    second search on the same folder gets. The file is never removed (removing
    it would let two processes lock two different files of one name).
    """

    def __init__(self, run_dir: Path, command: str = "") -> None:
        self.path = Path(run_dir) / ".lock"
        self.command = command
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise UserError(f"cannot write in the run folder {self.path.parent} ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe_holder(os.pread(fd, 65536, 0))
            os.close(fd)
            raise UserError(f"{self.path.parent} is in use by another search ({holder}); wait for it to "
                            "finish, or give this one another --out") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            os.ftruncate(self._fd, 0)  # no holder any more: a stale description would mislead
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _describe_holder(raw: bytes) -> str:
    try:
        info = json.loads(raw.decode())
        return (f"pid {info['pid']} on {info['host']}, started {info['started']}: "
                f"{info.get('command') or '(command not recorded)'}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "a process that has not written its details yet"


def sqlite_path(url: str) -> Path | None:
    """The database file of a ``sqlite:///`` URL; None for another database or an in-memory one."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return None
    name = url[len(prefix):].split("?", 1)[0]
    return None if name in ("", ":memory:") else Path(name)


#: A database file still empty this long after it was seen is not one being created.
_EMPTY_DB_WAIT_S = 3.0


def prepare_sqlite_file(path: Path) -> None:
    """Refuse a database file that exists but cannot hold the trials it should; put it in WAL mode.

    An empty file would be taken by SQLite as a new empty database, and a
    corrupt one fails deep inside Optuna: either way the run would go on
    without its trials. A file is empty only for the moment another process
    creates it (searches sharing one --storage), hence the short wait. WAL
    (persistent in the file) lets searches sharing it read while one writes.
    """
    if not path.exists():
        try:
            con = sqlite3.connect(path, timeout=60)
            try:
                con.execute("PRAGMA journal_mode=WAL")  # writes the header: the file is never seen empty
            finally:
                con.close()
        except sqlite3.Error as exc:
            raise UserError(f"cannot create the database {path} ({exc})") from None
        return
    deadline = time.monotonic() + _EMPTY_DB_WAIT_S
    while path.stat().st_size == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    if path.stat().st_size == 0:
        raise UserError(f"{path} is empty (0 bytes): the trials it held are gone. Restore it from a backup, or "
                        "move it away (and trials.csv with it) to start over")
    try:
        con = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=60)
        try:
            check = con.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check[0] if check else 'no answer'}")
            con.execute("PRAGMA journal_mode=WAL")
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise UserError(f"{path} is not a readable SQLite database ({exc}): restore it from a backup, or move it "
                        "away to start over") from None


def csv_rows(path: Path) -> int:
    """Rows of a CSV file (quoted newlines inside a field count once); 0 if it does not exist."""
    if not path.is_file():
        return 0
    with path.open(newline="") as handle:
        return max(sum(1 for _ in csv.reader(handle)) - 1, 0)


def check_trials_kept(out_dir: Path, stored: int, url: str) -> None:
    """Refuse a storage holding fewer trials than ``RUN/trials.csv`` lists: its trials were
    lost or it is another database, and this run's trials.csv would drop the missing ones."""
    listed = csv_rows(out_dir / "trials.csv")
    if listed > stored:
        raise UserError(f"{out_dir / 'trials.csv'} lists {listed} trials but the storage {url} holds {stored}: "
                        "restore the database the run used, or move trials.csv away to start over")


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(text))


def _atomic_write(path: Path, write) -> None:
    """``write(tmp)`` then rename over ``path``: a reader sees the old file or the new one; a write that
    fails (a full disk) removes its temporary file, never leaving a partial one behind."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


#: The temporary files a run writes in its folder before renaming them into place.
_TEMP_PATTERNS = ("trials*.csv.tmp", "final.csv.tmp", "run.json.tmp", "table.json.tmp", "fusions.json.tmp")


def remove_temp_files(out_dir: Path) -> None:
    """Remove the temporary files a stopped run may have left (its folder is locked: they are its own);
    called when a search stops on a fault, for the writes that do not clean up after themselves."""
    for pattern in _TEMP_PATTERNS:
        for path in Path(out_dir).glob(pattern):
            try:
                path.unlink()
            except OSError:  # a folder that can no longer be written: nothing more to do
                pass


def write_run_json(out_dir: Path, cfg, storage_url: str, device: dict, probe: dict, backends: list[str],
                   participants: dict | None = None) -> Path:
    """RUN/run.json; ``participants`` (written when the run ends): the workers, GPUs and hosts whose
    trials the run's studies hold, and this process's own workers."""
    from tunekit import table
    from tunekit.search.fleet import redact

    data = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        "model": cfg.model,
        "storage": redact(storage_url),
        "backends": backends,
        "numerics": cfg.numerics,
        "sampler": cfg.sampler,
        "trials": cfg.trials,
        "min_gain": cfg.min_gain,
        "problems": [p.as_dict() for p in cfg.problems],
        "device": device,
        "probe": probe,
        "environment": table.environment_stamp(device, backends),
        "gpus": getattr(cfg, "gpus", None),
        "tp": getattr(cfg, "tp", None),
    }
    if participants is not None:
        data["participants"] = participants
    path = out_dir / "run.json"
    _atomic_write_text(path, json.dumps(data, indent=2))
    return path


def folder_problems(out_dir: Path, problems: list, add: bool) -> list:
    """The problems a search on ``out_dir`` runs: ``problems``, where the folder's run.json records the same
    set (or records none: a new folder, or one whose first run stopped before writing it); with ``add``,
    the folder's problems and then the new ones (run.json then records the union). Another set without
    ``add`` is refused in one line: two commands' studies mixed in one folder, and run.json overwritten,
    would leave a table and a summary that answer neither command."""
    from tunekit.problems.shapes import Problem

    path = Path(out_dir) / "run.json"
    try:
        doc = json.loads(path.read_text())
        recorded = doc.get("problems")
        stored = [Problem(p["op"], p["dtype"], int(p["m"]), int(p["n"]), int(p["k"]), int(p.get("count", 1)),
                          tuple(p.get("names", ()))) for p in recorded]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return list(problems)  # no readable record: nothing to compare with (run.json is written anew)
    asked = {p.key for p in problems}
    held = {p.key for p in stored}
    if asked == held:
        return list(problems)
    new = [p for p in problems if p.key not in held]
    if add:
        return stored + new
    command = doc.get("command") or ""
    missing = len(held - asked)
    raise UserError(
        f"--out {out_dir} was made for {len(held)} problem(s)" + (f" by `{command}`" if command else "")
        + f"; this command asks {len(asked)}, {len(new)} of them not in the folder"
        + (f", and leaves out {missing} of the folder's" if missing else "")
        + ": give another --out, or --add to search the folder's problems and these together "
        "(run.json and the table then cover both)")


def read_run_json(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "run.json"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a tunekit run folder (no run.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: corrupt run file ({exc.msg} at line {exc.lineno})") from None


def trials_frame(storage, study_prefix: str | None = None) -> pd.DataFrame:
    """All trials of all studies in ``storage`` as one table (negative results included)."""
    import optuna


    rows = []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if study_prefix and not summary.study_name.startswith(study_prefix):
            continue
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        problem = study.user_attrs.get("problem", {})
        for trial in study.get_trials(deepcopy=False):
            row = {
                "study": summary.study_name,
                "backend": study.user_attrs.get("backend"),
                "op": problem.get("op"),
                "dtype": problem.get("dtype"),
                "m": problem.get("m"),
                "n": problem.get("n"),
                "k": problem.get("k"),
                "trial": trial.number,
                "state": trial.state.name,
                "started": trial.datetime_start.isoformat() if trial.datetime_start else None,
                "params": json.dumps(trial.params, sort_keys=True),
            }
            row.update({f"p_{k}": v for k, v in trial.params.items()})
            row.update({k: v for k, v in trial_figures(trial.user_attrs).items() if k != "build_log"})
            rows.append(row)
    return pd.DataFrame(rows)


def write_trials(out_dir: Path, storage, cfg, device: dict, probe: dict) -> Path:
    """Write RUN/trials.csv; where that file lists more trials than this storage holds for the
    device (another database, or another device's studies), write beside it instead: the
    returned path is then ``trials-<UTC time>.csv``."""
    frame = trials_frame(storage, study_prefix=f"{device['arch']}|")
    path = out_dir / "trials.csv"
    if csv_rows(path) > len(frame):
        stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        path = out_dir / f"trials-{stamp}.csv"
    _atomic_write(path, lambda tmp: frame.to_csv(tmp, index=False))
    return path


#: RUN/time.json: the last search's wall time by phase (read by tunekit.evidence.time_split).
TIME_FILE = "time.json"


def write_time(out_dir: Path, phases: dict[str, Any]) -> Path:
    """Write RUN/time.json: the search's wall seconds, its set-up (device, probe), fusion phase, and each
    worker's trial and final phases. Per trial, the worker's split (compile, verify, time) is in trials.csv."""
    path = out_dir / TIME_FILE
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(phases, indent=1, sort_keys=True)))
    return path


def write_final(out_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """Merge this run's final re-measure into final.csv (one block per problem)."""
    path = out_dir / "final.csv"
    new = pd.DataFrame(rows)
    if path.is_file() and path.stat().st_size > 0:
        try:
            old = read_csv(path, "re-measure table", FINAL_COLUMNS)
        except UserError:
            # unreadable: kept beside the new one, never overwritten
            stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            os.replace(path, path.with_name(f"final-unreadable-{stamp}.csv"))
            old = pd.DataFrame()
        if not new.empty and not old.empty:
            keys = {(r["op"], r["dtype"], r["m"], r["n"], r["k"]) for r in rows}
            keep = [tuple(x) not in keys for x in old[["op", "dtype", "m", "n", "k"]].itertuples(index=False)]
            old = old[keep]
        new = pd.concat([old, new], ignore_index=True) if not new.empty else old
    _atomic_write(path, lambda tmp: new.to_csv(tmp, index=False))
    return path


#: Columns without which final.csv cannot be read back (export, compare).
FINAL_COLUMNS = ("op", "dtype", "m", "n", "k", "backend", "time_us")


def read_csv(path: Path, what: str, columns: tuple[str, ...] = ()) -> pd.DataFrame:
    """A CSV file the run wrote, or a UserError (one line) saying why it cannot be read.
    An empty file (no columns: what a frame without rows writes) is an empty frame."""
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame(columns=list(columns))
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path}: not a readable {what} ({' '.join(str(exc).split())})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the {what} ({exc.strerror})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserError(f"{path}: not a {what} (columns {missing} missing)")
    return frame


def final_path(run_dir: Path) -> Path:
    """RUN/final.csv, or RUN/final.csv.gz where only that exists: the recorded runs under
    benchmarks/results keep their re-measure gzipped (pandas reads either)."""
    path = Path(run_dir) / "final.csv"
    packed = path.with_name("final.csv.gz")
    return packed if not path.is_file() and packed.is_file() else path


def read_final(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of RUN/final.csv (or its gzipped copy, see ``final_path``); [] for an empty file (no
    re-measure produced a row)."""
    path = final_path(run_dir)
    if not path.is_file():
        raise UserError(f"{run_dir} has no final.csv: the search did not reach its final re-measure")
    frame = read_csv(path, "re-measure table (final.csv)", FINAL_COLUMNS)
    frame = frame.astype(object).where(frame.notna(), None)
    return frame.to_dict("records")
