"""Small M up to 16 on a GPU: a short search of a model's GEMVs at M = 2, 4, 8, 16 and the per-token ratio
over the vendor BLAS (cuBLAS) per M, standalone (issue 49's bar: at least 1.10x at every M).

    python benchmarks/probes/small_m16.py --out $OUT               # Qwen3.5-27B, ~5 minutes on an H100

It runs, in this checkout (the last small-M run, benchmarks/results/h100-small-m-gemv-3fc28cd, did the same
at M = 1, 2, 4, 8)::

    python -m tunekit search --model MODEL --ops gemv --m 2,4,8,16 --trials T --timeout S --no-progress --out OUT/run
    python -m tunekit compare OUT/run

and writes OUT/small_m16.json and OUT/small_m16.md: per M the GEMV calls per token, vendor and tuned ms per
token, their ratio, the floor (the run's measured read limit) and the share of it each reaches, and whether the
ratio meets --bar. The search's own files stay in OUT/run (trials.csv, final.csv, table.json, report.md,
compare_tokens.csv). On the CPU (TRITON_INTERPRET=1) ``--shape 48x64 --trials 1`` runs the whole path on a
tiny problem: its timings are the interpreter's, never evidence. Exit status 0 when every M meets the bar, 1
when one does not, 2 on an error.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    with log.open("a") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"error: {cmd[3]} exited with {done.returncode}; see {log}")


def _number(text: str) -> float | None:
    try:
        return float(text.split()[0].rstrip("%"))
    except (ValueError, IndexError):
        return None


def per_m(tokens_csv: Path, bar: float) -> list[dict]:
    """compare_tokens.csv (``tunekit compare``'s per-token table) -> one record per M."""
    rows = []
    with tokens_csv.open() as f:
        for row in csv.DictReader(f):
            vendor, tuned = float(row["vendor ms"]), float(row["tuned ms"])
            calls = next(v for k, v in row.items() if k.endswith("calls"))
            floor = _number(row.get("floor ms", "-"))
            rows.append({"m": int(row["M"]), "calls": float(calls), "vendor_ms": vendor, "tuned_ms": tuned,
                         "ratio": vendor / tuned, "floor_ms": floor,
                         "vendor_of_limit": floor / vendor if floor else None,
                         "tuned_of_limit": floor / tuned if floor else None, "meets_bar": vendor / tuned >= bar})
    return rows


def markdown(rows: list[dict], args: argparse.Namespace, device: str) -> str:
    lines = [f"# GEMVs at M = {args.m} per token over the vendor BLAS ({args.model or ', '.join(args.shape)})", "",
             f"Device: {device}. Search: {args.trials} trials per study, --timeout {args.timeout:g} s. Bar: "
             f"{args.bar:.2f}x at every M.", "",
             "| M | GEMV calls | vendor ms | tuned ms | per token | % of limit vendor / tuned | meets bar |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        share = ("-" if r["floor_ms"] is None else
                 f"{100 * r['vendor_of_limit']:.1f}% / {100 * r['tuned_of_limit']:.1f}%")
        lines.append(f"| {r['m']} | {r['calls']:g} | {r['vendor_ms']:.3f} | {r['tuned_ms']:.3f} | "
                     f"**{r['ratio']:.3f}x** | {share} | {'yes' if r['meets_bar'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "small_m16_out")),
                        help="output folder (default: $OUT)")
    parser.add_argument("--model", default="qwen3.5-27b", help="built-in model (default: qwen3.5-27b)")
    parser.add_argument("--shape", action="append", default=[],
                        help="NxK instead of the model (repeatable): the CPU smoke run")
    parser.add_argument("--m", default="2,4,8,16", help="batch sizes (default: 2,4,8,16)")
    parser.add_argument("--trials", type=int, default=8, help="trials per study (default: 8)")
    parser.add_argument("--timeout", type=float, default=180.0,
                        help="seconds for the search's trial phase (default 180; the finals and builds add ~90)")
    parser.add_argument("--bar", type=float, default=1.10, help="per-token ratio every M must reach (default 1.10)")
    args = parser.parse_args(argv)
    if args.shape:
        args.model = None
    args.out.mkdir(parents=True, exist_ok=True)
    run, log = args.out / "run", args.out / "small_m16.log"
    py = sys.executable
    what = ["--model", args.model] if args.model else [a for s in args.shape for a in ("--shape", s)]
    _run([py, "-m", "tunekit", "search", *what, "--ops", "gemv", "--m", args.m, "--trials", str(args.trials),
          "--timeout", str(args.timeout), "--no-progress", "--out", str(run)], log)
    _run([py, "-m", "tunekit", "compare", str(run)], log)
    rows = per_m(run / "compare_tokens.csv", args.bar)
    device = json.loads((run / "run.json").read_text()).get("device", {})
    device_text = device.get("name", "?") if isinstance(device, dict) else str(device)
    (args.out / "small_m16.json").write_text(json.dumps({"model": args.model, "shapes": args.shape, "m": args.m,
                                                         "trials": args.trials, "timeout_s": args.timeout,
                                                         "bar": args.bar, "device": device, "per_m": rows},
                                                        indent=2) + "\n")
    text = markdown(rows, args, device_text)
    (args.out / "small_m16.md").write_text(text)
    print(text)
    return 0 if rows and all(r["meets_bar"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
