"""The load check: every entry of every served table run on this device, at every M it serves, before it serves.

A table's entries passed the search's check (``tunekit.measure.verify``) at their own M, on unit-scale random
inputs, in the process that timed them. What serving asks of them is more: the entry tabulated at M = 4 also
serves M = 3 (``TableIndex.lookup``: the smallest tabulated M at or above the call's), real activations carry
outlier channels of 10^3-10^4 (SmolLM2's down_proj inputs reach 2826), and a kernel is called many times. So,
once per table load and device (``dispatch.tables.tables_for``, before the index that serves is built), for
each entry of each table, whatever path named it:

* every M it serves: from the table's next smaller tabulated M of the same (op, dtype, N, K), exclusive, to
  its own, inclusive, each built the way serving builds it (``dispatch.decisions``: a HIP GEMV once at its
  own M; an M its config cannot run, ``table.invalid_at_m``, is served by another path and skipped);
* on two sets of inputs: the op's unit-scale randoms, and the same with :data:`OUTLIER_CHANNELS` of the
  activation's columns scaled to a largest magnitude of :data:`MAGNITUDE` (:func:`outlier_inputs`);
* :data:`CALLS` calls each (``verify.repeated_calls``): every call's output written, finite where the
  reference is, within the op's bound of the fp64 reference.

An entry that fails anywhere is dropped (its calls take the next entry above, else the stock path), named with
the M, the inputs and the call. One line says what was checked, what it cost and what was dropped. The shipped
tables (``auto``) get the same check inside ``dispatch.auto``, which also refuses a foreign GPU's.

Cost (the line's): on an H100, 51 ms an entry for a Qwen3.5-27B table with Triton's cache warm, 258 ms on a
fresh machine (``benchmarks/results/h100-chain-pdl-loadcheck-f9e2499``). On the CPU interpreter every call is
interpreted Python, so there it is opt-in (:data:`ENV`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tunekit.table import Entry

#: the largest activation magnitude checked: real decode activations reach 10^3-10^4 in a few channels
MAGNITUDE = 1.0e4
#: how many of the activation's columns carry outliers (at least one)
OUTLIER_CHANNELS = 1 / 64
#: calls per M and input set: a kernel that goes wrong after its first call, or its second, is caught
CALLS = 3
#: ``TUNEKIT_LOAD_CHECK``: unset or "auto" checks on GPUs only (on the CPU interpreter every call of a
#: table's kernel is interpreted Python: development, not serving); "1" everywhere; "0" nowhere
ENV = "TUNEKIT_LOAD_CHECK"
#: the line of the last check (what was checked, its cost, what was dropped)
LAST: list[str] = []


def enabled(info: Any) -> bool:
    """Whether tables are load-checked on the device ``info`` describes (:data:`ENV`)."""
    import logging
    import os

    from tunekit.dispatch.state import log_once

    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):  # serving never raises: a typo checks as the default does
        log_once(f"load-check-env:{value}", logging.WARNING, "tunekit: %s=%r is not auto, 0 or 1: read as auto",
                 ENV, value)
        value = "auto"
    return value == "1" or (value == "auto" and bool(info.is_gpu))


def served_ms(entries: Sequence[Entry], entry: Entry) -> tuple[int, ...]:
    """The Ms at which ``entry`` serves among ``entries`` (one table's): above the next smaller tabulated M of
    its (op, dtype, N, K), up to its own, less those its config cannot run (``table.invalid_at_m``)."""
    from tunekit import table as table_mod

    key = entry.shape_key
    below = [e.m for e in entries if e.shape_key == key and e.m < entry.m]
    low = max(below, default=0)
    return tuple(m for m in range(low + 1, entry.m + 1) if table_mod.invalid_at_m(entry, m) is None)


def label(entry: Entry) -> str:
    """``gemv m4 96x5120 triton``: an entry as the check's line names it."""
    return f"{entry.op} m{entry.m} {entry.n}x{entry.k} {entry.backend}"


def outlier_inputs(inputs: tuple[Any, ...], gen: Any, magnitude: float = MAGNITUDE) -> tuple[Any, ...]:
    """``inputs`` with a few columns of the first (the activation of every op: x of a GEMV, of a norm, gate_up
    of SiLU-and-mul) scaled so that its largest magnitude is ``magnitude``; the weights and the rest as given."""
    import torch

    x = inputs[0]
    cols = x.shape[-1]
    picked = torch.randperm(cols, generator=gen, device=gen.device)[:max(1, int(cols * OUTLIER_CHANNELS))]
    wide = x.float()
    peak = wide[..., picked].abs().amax().clamp_min(1e-30)
    wide[..., picked] *= magnitude / peak
    return (wide.to(x.dtype), *inputs[1:])


def entry_failure(entry: Entry, ms: Sequence[int], info: Any) -> str | None:
    """Why ``entry`` cannot serve at the Ms ``ms`` on this device (``info``: its ``DeviceInfo``), None where
    it serves every one of them correctly: its backend, its build, or the first failing call."""
    import torch

    from tunekit import backends
    from tunekit.backends import base
    from tunekit.measure import verify
    from tunekit.problems import opspec
    from tunekit.problems.shapes import Problem

    op, dtype, n, k = entry.shape_key
    device = torch.device(info.torch_device)
    try:
        backend = backends.get(entry.backend)
        reason = backend.unavailable_reason(info)
        if reason:
            return f"backend {entry.backend} cannot run here ({reason})"
        spec = opspec.get(op)
        built: dict[int, Any] = {}
        for m in ms:
            build_m = base.build_m(backend, op, m, entry.m)
            if build_m not in built:
                built[build_m] = backend.build(Problem(op, dtype, build_m, n, k), dict(entry.params), info)
            problem = Problem(op, dtype, m, n, k)
            gen = torch.Generator(device=device).manual_seed(m)
            unit = spec.make_inputs(problem, device, gen)
            for label, inputs in (("unit-scale", unit), (f"|x| up to {MAGNITUDE:.0e}", outlier_inputs(unit, gen))):
                why = verify.repeated_calls(built[build_m], spec, problem, inputs, device, CALLS)
                if why is not None:
                    return f"M={m}, {label} inputs, {why}"
    except Exception as exc:  # noqa: BLE001 - any failure of an entry drops it, with its reason
        return f"M={ms[0] if ms else entry.m}: {type(exc).__name__}: {exc}"
    return None


def check(tables: Sequence[tuple[str, dict[str, Any]]], info: Any) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """``tables`` ((path, table)) with every entry that fails :func:`entry_failure` at one of its served Ms
    dropped, and how many were; the one line saying what was checked, its cost and what was dropped goes to
    :data:`LAST`. ``info``: the device's ``DeviceInfo``. A table keeps its other sections (fusions, stamp)."""
    from tunekit import table as table_mod

    start = time.perf_counter()
    out, dropped, checked, calls = [], [], 0, 0
    for path, table in tables:
        kept, every = [], table_mod.entries(table, path)
        for entry in every:
            ms = served_ms(every, entry)
            why = entry_failure(entry, ms, info) if ms else None
            checked += 1
            calls += 2 * CALLS * len(ms)
            if why is None:
                kept.append(entry)
            else:
                dropped.append(f"{path}: {label(entry)}: {why}")
        out.append((path, dict(table, entries=kept) if len(kept) != len(every) else table))
    took = time.perf_counter() - start
    line = (f"tunekit: load check on {info.name}: {checked} entries at every M they serve, {calls} calls "
            f"({took:.2f} s, {1000 * took / max(checked, 1):.0f} ms an entry)")
    line += f"; dropped {len(dropped)}: {'; '.join(dropped)}" if dropped else "; all passed"
    LAST[:] = [line]
    return out, len(dropped)
