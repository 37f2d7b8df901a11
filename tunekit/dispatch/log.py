"""The dispatch log: the JSON document ``TUNEKIT_DISPATCH_LOG`` names, and its writer.

Call protocol: :func:`dispatch_log` is the document (the loaded tables, the
markers, the vendor paths and what each fallback name means);
:func:`write_dispatch_log` writes it. Importing this module installs the
writer as ``STATE.log_writer``, which the write schedule of
``tunekit.dispatch.markers`` calls (at exit, in forked children, every few
seconds while the counts change).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from tunekit.dispatch.markers import dispatch_stats
from tunekit.dispatch.state import (
    CAPTURE_NOTE,
    DEFAULT_VENDOR,
    EAGER_VENDORS,
    FALLBACK_REASONS,
    LOG_ENV,
    STATE,
    STATS_FORMAT,
    logger,
)
from tunekit.dispatch.tables import loaded_tables
from tunekit.dispatch.vendors import vendor_kernels


def dispatch_log() -> dict[str, Any]:
    """The JSON document ``TUNEKIT_DISPATCH_LOG`` writes: tables, markers and the capture note."""
    return {
        "format": STATS_FORMAT,
        "pid": os.getpid(),
        "tables": loaded_tables(),
        "note": CAPTURE_NOTE,
        "fallback_reasons": FALLBACK_REASONS,
        "vendors": vendor_kernels(),
        "eager_vendors": EAGER_VENDORS,
        "default_vendor": {DEFAULT_VENDOR: "tunekit's Triton kernel at the config of the table's nearest-M Triton "
                                           "entry for the shape, else the op's default config (valid for every M), "
                                           "serving an elementwise fallback that has no vendor kernel first"},
        "calls": dispatch_stats(),
    }


def write_dispatch_log(path: str | os.PathLike | None = None) -> Path | None:
    """Write :func:`dispatch_log` to ``path`` (default: ``TUNEKIT_DISPATCH_LOG``); ``{pid}`` is expanded.

    Returns the path written, or None when no path is set or writing failed
    (logged: this runs at interpreter exit, where raising helps nobody).
    """
    target = str(path) if path is not None else os.environ.get(LOG_ENV, "")
    if not target:
        return None
    out = Path(target.replace("{pid}", str(os.getpid())))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # one temporary file per writer (the flusher thread and an exit hook may write at once): each
        # writes a whole document, and the atomic replace leaves one of them, never a mix
        tmp = out.with_name(out.name + f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(dispatch_log(), indent=2, default=str) + "\n")
        os.replace(tmp, out)
    except Exception as exc:
        logger.error("tunekit: could not write the dispatch log %s: %s", out, exc)
        return None
    return out


STATE.log_writer = write_dispatch_log
