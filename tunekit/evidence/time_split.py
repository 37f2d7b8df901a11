"""Where a search's wall time went: per backend the workers' compile, verify and timing seconds, and the rest.

Reads RUN/time.json (the last search's phases: set-up, each worker's trial and final phases, the fusion
phase; ``tunekit.search.results.write_time``) and RUN/trials.csv (per trial: ``wall_s``, the worker call as
the search waited it; ``compile_s``, build and first launch; ``verify_s``; ``time_s``). Only trials that
started during that search count (a resumed run's earlier trials are not its time).

Call protocol: ``split_table(run_dir)`` -> (header, rows) or None where the run has no time.json (a run
written before it, or one stopped before its files); ``read_time(run_dir)`` -> the phases or None.
``tunekit compare`` prints the table and puts it into report.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PARTS = ("compile_s", "verify_s", "time_s")


def _seconds(frame, column: str) -> float:
    import pandas as pd

    return float(pd.to_numeric(frame[column], errors="coerce").fillna(0.0).sum()) if column in frame else 0.0


def read_time(run_dir: Path) -> dict[str, Any] | None:
    from tunekit.search.results import TIME_FILE  # here: that module loads pandas, the summary's import must not

    path = Path(run_dir) / TIME_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _final_rows(workers: list[dict[str, Any]], row) -> list[list[str]]:
    """The final re-measure's rows: per backend its build and check, the inputs, the graphs and timing, and the
    rest (claims, storage); one row for a time.json written before the split was recorded."""
    finals = sum(w.get("finals", 0.0) for w in workers)
    splits = [w["final_split"] for w in workers if w.get("final_split")]
    if not splits:
        return [row("final re-measure (build, verify and time every candidate and peer)", "", [0.0, 0.0, 0.0, finals])]
    problems = sum(s.get("problems", 0) for s in splits)
    backends = sorted({b for s in splits for part in ("build_s", "verify_s") for b in s.get(part, {})})
    rows, counted = [], 0.0
    for backend in backends:
        build = sum(s.get("build_s", {}).get(backend, 0.0) for s in splits)
        check = sum(s.get("verify_s", {}).get(backend, 0.0) for s in splits)
        counted += build + check
        rows.append(row(f"final re-measure: {backend} (build, first call, check)", "", [build, check, 0.0, 0.0]))
    for part, label, column in (("rotation_s", "inputs and memory release", 3), ("time_s", "graphs and timing", 2)):
        seconds = sum(s.get(part, 0.0) for s in splits)
        counted += seconds
        values = [0.0, 0.0, 0.0, 0.0]
        values[column] = seconds
        rows.append(row(f"final re-measure: {label}", "", values))
    rows.append(row(f"final re-measure: the rest (claims, storage; {problems} problems)", "",
                    [0.0, 0.0, 0.0, max(finals - counted, 0.0)]))
    return rows


def split_table(run_dir: Path) -> tuple[list[str], list[list[str]]] | None:
    """Header and rows: each backend's compile / verify / time / other seconds in the worker, then the
    search process's own share of the trial phase, the final re-measure, the fusion phase and the set-up."""
    phases = read_time(run_dir)
    if phases is None:
        return None
    import pandas as pd  # here: compare's module is imported by the end-of-search summary, which reads no csv

    # trials.csv, or trials.csv.gz where a recorded run keeps it compressed
    found = [p for p in (Path(run_dir) / "trials.csv", Path(run_dir) / "trials.csv.gz") if p.is_file()]
    frame = pd.read_csv(found[0]) if found and found[0].stat().st_size else pd.DataFrame()
    if not frame.empty and "started" in frame and phases.get("started"):
        frame = frame[frame["started"].astype(str) >= str(phases["started"])]
    if not frame.empty and "measured" in frame:  # the others never reached a worker (duplicates, pruned)
        frame = frame[frame["measured"].astype(str) == "True"]
    workers = phases.get("workers", [])
    worker_s = sum(w.get("trials", 0.0) + w.get("finals", 0.0) for w in workers)
    budget = worker_s + phases.get("setup_s", 0.0) + phases.get("fusion_s", 0.0)

    def row(part: str, trials: str, values: list[float]) -> list[str]:
        total = sum(values)
        return [part, trials, *(f"{v:.1f}" for v in values), f"{total:.1f}",
                f"{100.0 * total / budget:.1f}%" if budget > 0 else "-"]

    rows = []
    calls = 0.0
    if not frame.empty and "backend" in frame:
        for backend, group in frame.groupby("backend", sort=True):
            parts = [_seconds(group, c) for c in PARTS]
            wall = _seconds(group, "wall_s")
            calls += wall
            rows.append(row(f"{backend}: worker", str(len(group)), [*parts, max(wall - sum(parts), 0.0)]))
    trial_phase = sum(w.get("trials", 0.0) for w in workers)
    rows.append(row("search process in the trial phase (sampling, storage, seeds, waiting)", "",
                    [0.0, 0.0, 0.0, max(trial_phase - calls, 0.0)]))
    rows += _final_rows(workers, row)
    rows.append(row("fusion phase", "", [0.0, 0.0, 0.0, phases.get("fusion_s", 0.0)]))
    rows.append(row("set-up (worker start, device, bandwidth probe)", "", [0.0, 0.0, 0.0, phases.get("setup_s", 0.0)]))
    head = ["part", "trials", "compile s", "verify s", "time s", "other s", "total s",
            f"share of {budget:.0f} worker-s" if len(workers) > 1 else f"share of {budget:.0f} s"]
    return head, rows
