"""Files of a run folder, written with pandas; read back by export/show/compare.

    RUN/optuna.db     every trial (default storage; --storage URL elsewhere)
    RUN/run.json      command, device, environment stamp, bandwidth probe
    RUN/trials.csv    one row per trial of every study: params, status, error,
                      times, GB/s, % of limit, error vs reference
    RUN/final.csv     interleaved re-measure: top candidates + vendor baseline
    RUN/table.json    the dispatch table
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from tunekit.errors import UserError


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_run_json(out_dir: Path, cfg, storage_url: str, device: dict, probe: dict, backends: list[str]) -> Path:
    from tunekit import table

    data = {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": cfg.command,
        "model": cfg.model,
        "storage": storage_url,
        "backends": backends,
        "numerics": cfg.numerics,
        "sampler": cfg.sampler,
        "trials": cfg.trials,
        "min_gain": cfg.min_gain,
        "problems": [p.as_dict() for p in cfg.problems],
        "device": device,
        "probe": probe,
        "environment": table.environment_stamp(device, backends),
    }
    path = out_dir / "run.json"
    _atomic_write_text(path, json.dumps(data, indent=2))
    return path


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
                "params": json.dumps(trial.params, sort_keys=True),
            }
            row.update({f"p_{k}": v for k, v in trial.params.items()})
            row.update({k: v for k, v in trial.user_attrs.items() if k != "build_log"})
            rows.append(row)
    return pd.DataFrame(rows)


def write_trials(out_dir: Path, storage, cfg, device: dict, probe: dict) -> Path:
    frame = trials_frame(storage, study_prefix=f"{device['arch']}|")
    path = out_dir / "trials.csv"
    frame.to_csv(path.with_suffix(".csv.tmp"), index=False)
    os.replace(path.with_suffix(".csv.tmp"), path)
    return path


def write_final(out_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """Merge this run's final re-measure into final.csv (one block per problem)."""
    path = out_dir / "final.csv"
    new = pd.DataFrame(rows)
    if path.is_file() and path.stat().st_size > 0:
        old = pd.read_csv(path)
        if not new.empty:
            keys = {(r["op"], r["dtype"], r["m"], r["n"], r["k"]) for r in rows}
            keep = [tuple(x) not in keys for x in old[["op", "dtype", "m", "n", "k"]].itertuples(index=False)]
            old = old[keep]
        new = pd.concat([old, new], ignore_index=True) if not new.empty else old
    new.to_csv(path.with_suffix(".csv.tmp"), index=False)
    os.replace(path.with_suffix(".csv.tmp"), path)
    return path


def read_final(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "final.csv"
    if not path.is_file():
        raise UserError(f"{run_dir} has no final.csv: the search did not reach its final re-measure")
    frame = pd.read_csv(path)
    frame = frame.astype(object).where(frame.notna(), None)
    return frame.to_dict("records")
