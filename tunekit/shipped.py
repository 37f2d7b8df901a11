"""The dispatch tables tunekit ships: ``tunekit/tables/<gpu>/<model>.json``, each a table measured on that GPU.

A shipped table is a search's ``table.json`` copied as it was written (``scripts/ship_table.py`` copies it from a
recorded run under ``benchmarks/results/``), with one field added, ``shipped``: the GPU and model, the Ms, the
search command that made it, when, the per-token speedup its run recorded (``report.md``'s per-token table:
a prediction from the interleaved microbenchmarks, per M), and the results folder it came from. Nothing in
it is measured again by shipping it.

Serving reaches them with ``TUNEKIT_TABLE=auto`` (or ``tunekit.patch(model, table="auto")``): every shipped
table, each checked at load on the device (``tunekit.dispatch.auto``: another GPU's stamp is refused, and
each entry's kernel is verified against the fp64 reference; what fails is dropped). ``tunekit search
--seed-from auto`` measures the winners of the ones stamped for the search's GPU first. Serving-safe: no
search extra, no torch at import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: where the shipped tables live (package data); tests point it at a folder of their own
TABLES_DIR = Path(__file__).resolve().parent / "tables"

#: the word ``TUNEKIT_TABLE`` and ``--seed-from`` take for "the shipped tables"
AUTO = "auto"

#: the stamp's fields that name the GPU itself: a table whose fields differ was measured on another GPU
GPU_FIELDS = ("gpu", "arch", "wave_size", "cu_count")


@dataclass(frozen=True)
class Shipped:
    """One shipped table: its file, the table and its ``shipped`` field."""

    path: Path
    table: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.table.get("shipped", {})


def paths(root: Path | None = None) -> list[Path]:
    """Every shipped table file, in a fixed order (GPU folder, then model)."""
    base = TABLES_DIR if root is None else root
    return sorted(base.glob("*/*.json")) if base.is_dir() else []


def is_shipped(path: str | Path) -> bool:
    """Whether ``path`` is one of the shipped tables (checked at load on the device)."""
    try:
        return Path(path).resolve().parent.parent == TABLES_DIR.resolve()
    except OSError:
        return False


def load_all(root: Path | None = None) -> list[Shipped]:
    """Every shipped table, read and validated (``tunekit.table.load``: a broken one raises its one line)."""
    from tunekit import table as table_mod

    return [Shipped(path, table_mod.load(path)) for path in paths(root)]


def gpu_mismatch(table: dict[str, Any], device: dict[str, Any]) -> list[str]:
    """The stamp's GPU fields that differ from ``device`` (a ``DeviceInfo.as_dict()``): empty where the table
    was measured on this GPU model."""
    env = table["environment"]
    here = {"gpu": device["name"], "arch": device["arch"], "wave_size": device["wave_size"],
            "cu_count": device["cu_count"]}
    return [f"{name}: table {env.get(name)!r}, here {here[name]!r}" for name in GPU_FIELDS
            if env.get(name) != here[name]]


def for_device(device: dict[str, Any], root: Path | None = None) -> list[Shipped]:
    """The shipped tables measured on ``device``'s GPU model (the seeds of ``--seed-from auto``)."""
    return [s for s in load_all(root) if not gpu_mismatch(s.table, device)]


def describe(s: Shipped) -> dict[str, Any]:
    """One row of ``tunekit tables``: GPU, model, Ms, when, recorded per-token speedup, source, the file."""
    from tunekit import table as table_mod

    meta = s.meta
    env = s.table["environment"]
    entries = table_mod.entries(s.table, str(s.path))
    ms = sorted({e.m for e in entries})
    return {"gpu": meta.get("gpu", env["gpu"]), "model": meta.get("model"), "ms": meta.get("ms", ms),
            "entries": len(entries), "created": meta.get("created", s.table.get("created")),
            "speedup_per_token": meta.get("speedup_per_token") or {}, "search": meta.get("search"),
            "source": meta.get("source"), "path": str(s.path)}


def dumps(table: dict[str, Any]) -> str:
    from tunekit import table as table_mod

    return json.dumps(table_mod.as_json(table), indent=1, sort_keys=False) + "\n"
