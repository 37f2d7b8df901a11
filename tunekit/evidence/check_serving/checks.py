"""The report of an evidence run (one line per check) and the environment stamp written with it."""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]

#: Fallback reasons of a model call that mean a broken serving path (FAIL), not merely an uncovered shape.
BROKEN_REASONS = ("table_error", "env_mismatch", "backend_unavailable", "build_error", "kernel_error",
                  "canary_mismatch", "tp_mismatch", "not_built_at_capture", "interpreter_off", "interpreter_on",
                  "device", "dtype", "bad_input")

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


class Report:
    """One line per check (``STATUS name: detail``, printed as it happens), kept for the JSON."""

    def __init__(self, log: Callable[[str], None] = print) -> None:
        self.checks: list[dict[str, Any]] = []
        self.log = log

    def add(self, status: str, name: str, detail: str = "", **data: Any) -> None:
        self.log(f"{status} {name}: {detail}" if detail else f"{status} {name}")
        self.checks.append({"status": status, "check": name, "detail": detail, **data})

    def info(self, text: str) -> None:
        self.log(f"INFO {text}")

    def count(self, status: str) -> int:
        return sum(1 for c in self.checks if c["status"] == status)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def as_tuple(y: Outputs) -> tuple[torch.Tensor, ...]:
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


def bitwise_equal(a: Outputs, b: Outputs) -> bool:
    ta, tb = as_tuple(a), as_tuple(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ta, tb, strict=True)
    )


def impl_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Dispatch marker rows -> {impl (" (at capture)" when counted at capture): calls}."""
    out: dict[str, int] = {}
    for row in rows:
        key = row["impl"] + (" (at capture)" if row.get("counted_at") == "capture" else "")
        out[key] = out.get(key, 0) + row["calls"]
    return out


def fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "no calls counted"


def pick_device(arg: str | None = None) -> torch.device:
    """``arg``, else CUDA if available and not interpreting (TRITON_INTERPRET=1), else the CPU."""
    if arg:
        device = torch.device(arg)
    elif torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def environment(device: torch.device) -> dict[str, Any]:
    """Python / torch / triton / transformers versions, the GPU, tunekit's device record, the git commit."""
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "device": str(device), "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    for name in ("triton", "transformers"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:
            env[name] = f"unavailable: {exc}"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["hip"] = getattr(torch.version, "hip", None)
    try:
        from tunekit.measure.device import detect

        env["tunekit_device"] = detect().as_dict()
    except Exception as exc:
        env["tunekit_device"] = f"unavailable: {exc}"
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                           timeout=10).stdout.strip() or None
        env["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True,
                                               text=True, timeout=10).stdout.strip())
    except Exception:
        env["git_commit"] = None
    return env
