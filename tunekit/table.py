"""Dispatch table: schema, export, load, validate, lookup.

A table maps (op, dtype, n, k, m) to the fastest *verified* candidate that
beat the baseline by at least ``min_gain`` in the same run. It carries
an environment stamp (device, arch, versions, kernel source hash) so that a
table tuned elsewhere is refused rather than silently used.

This module must stay importable without optuna (the serving path loads it).

The baseline a candidate must beat (``build_table``): the *fastest* baseline
row of its problem in the same interleaved re-measure. For GEMV that is the
vendor path (cuBLAS / rocBLAS). For the elementwise ops it is the faster of
the PyTorch eager composition ("vendor") and its Inductor compilation
("inductor", when measured): vLLM runs these ops either eagerly or, by
default, inside torch.compile'd graphs where Inductor fuses them, so a kernel
that only beats eager would replace nothing in a compiled deployment. Entries
record that time as ``baseline_us`` and the speedup over it; ``speedup`` is
recomputed here from the rows, so a table re-exported from final.csv gates
the same way.

Format (``format`` = ``tunekit.dispatch/1``)::

    {"format": "tunekit.dispatch/1", "created": ISO-8601,
     "environment": {"gpu": ..., "arch": ..., "cu_count": ..., "wave_size": ...,
                     "runtime": ..., "torch": ..., "triton": ..., "tunekit": ...,
                     "kernel_hash": {backend: hash}},
     "read_limit_gbps": float,
     "entries": [{"op", "dtype", "m", "n", "k", "backend", "kernel", "params",
                  "time_us", "baseline_us", "speedup", "gbps", "pct_of_limit",
                  "max_abs_err", "err_ratio", "count"}]}
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from pathlib import Path
from typing import Any

from tunekit.errors import UserError

FORMAT = "tunekit.dispatch/1"

_ENTRY_FIELDS: dict[str, tuple[type, ...]] = {
    "op": (str,),
    "dtype": (str,),
    "m": (int,),
    "n": (int,),
    "k": (int,),
    "backend": (str,),
    "kernel": (str,),
    "params": (dict,),
    "time_us": (int, float),
    "baseline_us": (int, float),
    "speedup": (int, float),
    "gbps": (int, float),
}
_ENV_FIELDS = ("gpu", "arch", "cu_count", "wave_size", "runtime", "torch", "triton", "tunekit", "kernel_hash")


class TableError(UserError):
    """An invalid or corrupt dispatch table."""


def tunekit_version() -> str:
    from tunekit import __version__

    return __version__


def environment_stamp(device: dict[str, Any], backends: list[str]) -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from tunekit import backends as registry

    hashes = {}
    for name in backends:
        try:
            hashes[name] = registry.get(name).source_hash()
        except Exception as exc:  # a broken backend must not prevent stamping the others
            hashes[name] = f"unavailable: {exc}"
    return {
        "gpu": device["name"],
        "arch": device["arch"],
        "cu_count": device["cu_count"],
        "wave_size": device["wave_size"],
        "runtime": device["runtime"],
        "torch": torch.__version__,
        "triton": triton_version,
        "tunekit": tunekit_version(),
        "kernel_hash": hashes,
    }


def build_table(
    final_rows: list[dict[str, Any]],
    device: dict[str, Any],
    probe: dict[str, Any],
    min_gain: float,
    backends: list[str],
) -> dict[str, Any]:
    """Pick per problem the fastest re-measured candidate at least ``min_gain`` ahead of the
    fastest baseline (vendor; for elementwise ops also Inductor: see the module docstring)."""
    from tunekit import backends as registry
    from tunekit.shapes import Problem

    def problem_key(row: dict[str, Any]) -> tuple:
        return (row["op"], row["dtype"], int(row["m"]), int(row["n"]), int(row["k"]))

    baseline: dict[tuple, float] = {}
    for row in final_rows:
        if row["backend"] in registry.BASELINES:
            key = problem_key(row)
            baseline[key] = min(baseline.get(key, math.inf), float(row["time_us"]))
    best: dict[tuple, dict[str, Any]] = {}
    for row in final_rows:
        if row["backend"] in registry.BASELINES:
            continue
        key = problem_key(row)
        # rows without a baseline row of their problem keep the engine's figures
        base_us = baseline.get(key, float(row["baseline_us"]))
        row = dict(row, baseline_us=base_us, speedup=base_us / float(row["time_us"]))
        if row["speedup"] < 1.0 + min_gain:
            continue
        if key not in best or row["time_us"] < best[key]["time_us"]:
            best[key] = row
    entries = []
    for (op, dtype, m, n, k), row in sorted(best.items()):
        params = row["params"]
        if isinstance(params, str):
            params = json.loads(params)
        problem = Problem(op, dtype, m, n, k)
        entries.append({
            "op": op, "dtype": dtype, "m": m, "n": n, "k": k,
            "backend": row["backend"],
            "kernel": registry.get(row["backend"]).kernel_name(problem),
            "params": params,
            "time_us": float(row["time_us"]),
            "baseline_us": float(row["baseline_us"]),
            "speedup": float(row["speedup"]),
            "gbps": float(row["gbps"]),
            "pct_of_limit": _num(row.get("pct_of_limit")),
            "max_abs_err": _num(row.get("max_abs_err")),
            "err_ratio": _num(row.get("err_ratio")),
            "count": int(row.get("count") or 1),
            "timing_kind": row.get("timing_kind", "gpu"),
        })
    return {
        "format": FORMAT,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment_stamp(device, backends),
        "read_limit_gbps": probe.get("read_gbps"),
        "min_gain": min_gain,
        "entries": entries,
    }


def _num(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def save(table: dict[str, Any], path: Path) -> Path:
    validate(table, source=str(path))
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(table, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Read and validate a table; TableError (one line) if unreadable or invalid."""
    path = Path(path)
    if not path.is_file():
        raise TableError(f"{path}: no such table file")
    try:
        table = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TableError(f"{path}: corrupt table (not JSON: {exc})") from None
    validate(table, source=str(path))
    return table


def validate(table: Any, source: str = "table") -> None:
    if not isinstance(table, dict):
        raise TableError(f"{source}: a table must be a JSON object")
    if table.get("format") != FORMAT:
        raise TableError(f"{source}: unknown format {table.get('format')!r} (expected {FORMAT!r})")
    env = table.get("environment")
    if not isinstance(env, dict):
        raise TableError(f"{source}: missing environment stamp")
    missing = [f for f in _ENV_FIELDS if f not in env]
    if missing:
        raise TableError(f"{source}: environment stamp lacks {missing}")
    entries = table.get("entries")
    if not isinstance(entries, list):
        raise TableError(f"{source}: 'entries' must be a list")
    seen = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise TableError(f"{source}: entry {i} is not an object")
        for name, types in _ENTRY_FIELDS.items():
            value = entry.get(name)
            if not isinstance(value, types) or isinstance(value, bool):
                raise TableError(f"{source}: entry {i} field {name!r} missing or not {types[0].__name__}")
        for name in ("m", "n", "k"):
            if entry[name] < 1:
                raise TableError(f"{source}: entry {i} has {name}={entry[name]}")
        for name in ("time_us", "baseline_us", "speedup", "gbps"):
            if not math.isfinite(entry[name]) or entry[name] <= 0:
                raise TableError(f"{source}: entry {i} has {name}={entry[name]}")
        key = (entry["op"], entry["dtype"], entry["m"], entry["n"], entry["k"])
        if key in seen:
            raise TableError(f"{source}: duplicate entry for {key}")
        seen.add(key)


def environment_mismatch(table: dict[str, Any], device: dict[str, Any]) -> list[str]:
    """Fields of the stamp that differ from the running device/software."""
    env = table["environment"]
    # the kernel sources of every backend the entries use: a tuned config was
    # verified and timed on those sources, not on whatever the files hold now
    used = sorted({e["backend"] for e in table.get("entries", []) if e.get("backend") in env["kernel_hash"]})
    current = environment_stamp(device, used)
    diffs = []
    for name in ("gpu", "arch", "wave_size", "runtime", "torch", "triton"):
        if env.get(name) != current.get(name):
            diffs.append(f"{name}: table {env.get(name)!r}, here {current.get(name)!r}")
    for backend in used:
        tabled, here = env["kernel_hash"][backend], current["kernel_hash"].get(backend)
        if tabled != here:
            diffs.append(f"{backend} kernel sources: table {tabled!r}, here {here!r}")
    return diffs


def lookup(table: dict[str, Any], op: str, dtype: str, m: int, n: int, k: int) -> dict[str, Any] | None:
    """Entry for the exact M, else the smallest tabulated M >= m, else None (vendor path)."""
    candidates = [
        e for e in table["entries"]
        if e["op"] == op and e["dtype"] == dtype and e["n"] == n and e["k"] == k and e["m"] >= m
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda e: e["m"])
