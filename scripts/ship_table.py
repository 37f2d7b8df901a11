#!/usr/bin/env python3
"""Copy a recorded search's table into the shipped set (tunekit/tables/<gpu>/<model>.json), with its provenance.

    python scripts/ship_table.py benchmarks/results/h200-serve-qwen35-27b-a831b66/table

RUN is a folder holding a search's table.json, run.json (the command, the model, the device) and report.md (the
per-token table whose "s (tuned)" column is the speedup recorded per M). The table is copied as written, with
one field added, "shipped" (tunekit.shipped): every figure in it is read from RUN, none is computed here; a
figure RUN lacks is left null. A campaign plan rebuilds the shipped set by running this on its runs' folders.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tunekit import shipped  # noqa: E402
from tunekit import table as table_mod  # noqa: E402
from tunekit.errors import UserError  # noqa: E402


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def per_token_speedups(report: Path) -> dict[str, float]:
    """M -> the "s (tuned)" of report.md's per-token table (the first table under "## Per token")."""
    if not report.is_file():
        return {}
    lines = report.read_text().splitlines()
    try:
        start = lines.index("## Per token")
    except ValueError:
        return {}
    header: list[str] | None = None
    out: dict[str, float] = {}
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if header is not None and out:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(cells[0]) <= {"-"}:
            continue
        if "M" in header and "s (tuned)" in header:
            out[cells[header.index("M")]] = float(cells[header.index("s (tuned)")])
    return out


def ship(run: Path, root: Path) -> Path:
    table_path, run_json = run / "table.json", run / "run.json"
    for path in (table_path, run_json):
        if not path.is_file():
            raise UserError(f"{run}: no {path.name} (a search's run folder holds table.json and run.json)")
    table = table_mod.load(table_path)
    meta_run = json.loads(run_json.read_text())
    model = meta_run.get("model")
    if not model:
        raise UserError(f"{run_json}: records no model (a --shape search): only a model's tables are shipped")
    if table["environment"].get("gpu") != meta_run.get("device", {}).get("name"):
        raise UserError(f"{run}: table.json is stamped for {table['environment'].get('gpu')!r}, run.json's device "
                        f"is {meta_run.get('device', {}).get('name')!r}: not one run")
    try:
        source = str(run.resolve().relative_to(REPO))
    except ValueError:
        source = str(run)
    table["shipped"] = {
        "gpu": table["environment"]["gpu"], "model": model, "ms": sorted({e.m for e in table_mod.entries(table)}),
        "search": meta_run.get("command"), "created": table.get("created"),
        "speedup_per_token": per_token_speedups(run / "report.md"), "source": source,
    }
    out = root / slug(table["environment"]["gpu"]) / f"{slug(model)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(shipped.dumps(table))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (table.json, run.json, report.md)")
    parser.add_argument("--root", type=Path, default=shipped.TABLES_DIR, help="the shipped set's folder")
    args = parser.parse_args(argv)
    try:
        for run in args.runs:
            print(f"{run} -> {ship(run, args.root)}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
