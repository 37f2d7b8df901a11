"""``TUNEKIT_TABLE=auto``: the shipped tables, each checked at load on this device; what passes is served.

A shipped table (``tunekit.shipped``) was measured on one GPU model with the software of its day. At load
(:func:`check`, from ``dispatch.tables``' reader, once per load of the tables):

1. **the stamp**: a table whose GPU fields (name, architecture, wave size, SM count) differ from this device
   is refused whole: its configs were chosen by timings on another GPU;
2. **every entry**: the load check every served table gets (``dispatch.load_check.entry_failure``): built by
   its backend and run at every M it serves, on unit-scale and on outlier inputs, several calls, each
   against the op's fp64 reference. An entry that does not build, whose backend cannot run here, or that
   fails the check is dropped; the rest are served.

A table stamped for this GPU with other software (torch, Triton, the kernel sources: the stamp's other
fields) is served by its checked entries with the stamp's software fields set to this host's (serving's
stamp check would refuse it otherwise), and the line says so: each kept entry is correct here, its speed is
the one measured with the recorded software. The fusions section is kept as measured; a fold is checked on
the model's own weights where it is made (``tunekit.patch``'s fold check, the vLLM plugin's).

One line (:data:`LAST`, logged at INFO where all was kept, else WARNING) says what was used and what was
dropped and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tunekit import shipped
from tunekit import table as table_mod
from tunekit.dispatch import load_check
from tunekit.dispatch.state import logger

#: the one line of the last check (what was used, what was dropped and why)
LAST: list[str] = []


def _device() -> Any:
    import torch

    from tunekit.measure.device import detect, interpret_mode

    if interpret_mode() or not torch.cuda.is_available():
        return detect()
    return detect(torch.cuda.current_device())


def check(loaded: list[tuple[str, dict[str, Any]]],
          log: Callable[[int, str], None] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """The shipped ``loaded`` tables ((path, table)) that serve on this device, each with the entries that
    passed their check here; logs the one line (kept in :data:`LAST`) on ``tunekit.ops``, or hands it to
    ``log(level, line)`` (an integration that logs it where its users read: the vLLM plugin)."""
    info = _device()
    device = info.as_dict()
    here = table_mod.environment_stamp(device, [])
    used, notes, worst = [], [], logging.INFO
    for path, table in loaded:
        name = shipped.describe(shipped.Shipped(path, table))
        label = f"{name['gpu']}/{name['model'] or path}"
        foreign = shipped.gpu_mismatch(table, device)
        if foreign:
            notes.append(f"refused {label}: measured on another GPU ({'; '.join(foreign)})")
            continue
        kept, dropped, every = [], [], table_mod.entries(table, path)
        for entry in every:
            why = load_check.entry_failure(entry, load_check.served_ms(every, entry), info)
            if why is None:
                kept.append(entry)
            else:
                dropped.append(f"{load_check.label(entry)}: {why}")
        software = table_mod.environment_mismatch(table, device)  # its GPU fields match: checked above
        served = dict(table, entries=kept)
        if software:
            # each kept entry was checked here; the stamp now names this host's software, so serving's stamp
            # check (dispatch.index) takes it, and the line says the timings were taken with other software
            hashes = table_mod.environment_stamp(device, sorted({e.backend for e in kept}))["kernel_hash"]
            served["environment"] = dict(table["environment"], runtime=here["runtime"], torch=here["torch"],
                                         triton=here["triton"],
                                         kernel_hash=dict(table["environment"]["kernel_hash"], **hashes))
        note = f"used {label}: {len(kept)} of {len(every)} entries passed their check on {info.name}"
        if software:
            note += f" (timed with other software: {'; '.join(software)})"
        if dropped:
            worst = logging.WARNING
            note += f"; dropped {len(dropped)}: {'; '.join(dropped)}"
        notes.append(note)
        used.append((path, served))
    if not used:
        worst = logging.WARNING
        notes.append("nothing served from them (the stock path serves every call)")
    line = f"tunekit: {shipped.AUTO} tables on {info.name}: " + " | ".join(notes)
    LAST[:] = [line]
    if log is None:
        logger.log(worst, "%s", line)
    else:
        log(worst, line)
    return used
