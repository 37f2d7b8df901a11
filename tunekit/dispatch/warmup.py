"""Warm-up before CUDA-graph capture: build and run once every kernel a table serves on a device.

Call protocol: ``prepare(device, ms=capture sizes)`` after the tables are
loaded and before any capture (``torch.ops.tunekit`` must be registered:
``import tunekit.ops``). It goes through the ops themselves, so the decision
cache and the built kernels it leaves are exactly what serving uses; the
dispatch markers it adds are put back afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tunekit.dispatch.state import DEFAULT_EPS, STATE
from tunekit.dispatch.tables import tables_for
from tunekit.dispatch.vendors import has_vendor_kernel
from tunekit.problems import oprecords


def _gemv_family(op: str) -> bool:
    """Served like the GEMV (its record's kind): its fallback is the vendor GEMM."""
    record = oprecords.RECORDS.get(op)
    return record is not None and record.kind in ("gemv", "fused_gemv")


def _takes_eps(op: str) -> bool:
    """Its schema (the op record's) ends in an eps argument."""
    record = oprecords.RECORDS.get(op)
    return record is not None and record.schema is not None and "float eps)" in record.schema


def prepare(device: torch.device | str | None = None, ms: Iterable[int] | None = None) -> dict[str, Any]:
    """Build and run once every tabulated kernel for ``device``, so that no build happens under capture.

    For each (op, dtype, N, K) of the matching tables it calls the op at
    every M its entries serve under the lookup rule (1 up to the largest
    tabulated M) when that range is at most 64 wide, else at the tabulated
    Ms; or at ``ms`` when given (pass the CUDA-graph capture sizes). For an
    elementwise op with no vendor kernel installed for ``device``, the given
    ``ms`` above the table are called too (also where the vendor path takes
    several launches: the default kernel serves first), which builds the default-config
    kernels serving those fallbacks (:func:`~tunekit.dispatch.elementwise_fallback._ew_default`), so captured graphs
    hold them instead of the composition. Each M is
    launched once because decisions are cached per M and Triton specialises
    on M's block size. Inputs come from ``tunekit.problems.opspec`` (random, nothing is
    checked here: verification happened at search time). Must not be called
    while a CUDA graph is being captured. Never raises; returns
    ``{"device", "keys", "tuned", "default", "fallback": {impl: count}, "errors": [...]}``
    (``default``: keys whose fallback the default-config kernel serves; ``fallback``: the other
    keys the table does not serve).
    """
    summary: dict[str, Any] = {"device": str(device), "keys": 0, "tuned": 0, "default": 0, "fallback": {},
                               "errors": []}
    try:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        summary["device"] = str(device)
        index, reason = tables_for(device, str(device))
    except Exception as exc:
        summary["errors"].append(f"{type(exc).__name__}: {exc}")
        return summary
    if index is None:
        summary["fallback"][f"fallback:{reason}"] = 1
        return summary
    from tunekit.problems import opspec
    from tunekit.problems.shapes import Problem

    wanted = None if ms is None else sorted({int(m) for m in ms})
    by_shape = {key: list(index.ms(*key)) for key in index.keys()}
    gen = torch.Generator(device=device).manual_seed(0)
    # Warm-up calls are not service calls: the markers are put back afterwards.
    with STATE.lock:
        saved_stats = dict(STATE.stats)
    for (op, dtype, n, k), tab_ms in sorted(by_shape.items()):
        top = max(tab_ms)
        if wanted is not None:
            # the GEMV family's fallback is the vendor GEMM, never a default-config kernel
            above = not _gemv_family(op) and not has_vendor_kernel(op, device)
            served = [m for m in wanted if m <= top or above]
        else:
            served = list(range(1, top + 1)) if top <= 64 else sorted(set(tab_ms))
        for m in served:
            try:
                inputs = opspec.get(op).make_inputs(Problem(op, dtype, m, n, k), device, gen)
                fn = getattr(torch.ops.tunekit, op)
                fn(*inputs, DEFAULT_EPS) if _takes_eps(op) else fn(*inputs)
            except Exception as exc:
                summary["errors"].append(f"{op} {dtype} m={m} n={n} k={k}: {type(exc).__name__}: {exc}")
                continue
            key = (op, dtype, m, n, k, str(device))
            if op == "gated_rms_norm":  # served in the layout elementwise._gated_layout chose
                m_rows, n_rows = STATE.gated_layouts.get((dtype, m, n, k, str(device)), (m, n))
                key = (op, dtype, m_rows, n_rows, k, str(device))
            choice = STATE.choices.get(key)
            impl = choice.impl if choice else "fallback:unknown"
            default = STATE.defaults.get(key)
            summary["keys"] += 1
            if impl.startswith("tuned:"):
                summary["tuned"] += 1
            elif default is not None and default.kernel is not None:
                summary["default"] += 1
            else:
                summary["fallback"][impl] = summary["fallback"].get(impl, 0) + 1
    with STATE.lock:
        STATE.stats = saved_stats
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return summary

