"""The decision cache: which kernel serves one (op, dtype, M, N, K, device), decided once.

Call protocol (the op impls' slow path): read ``STATE.choices`` lock-free
for the key; on a miss, :func:`resolve` looks the key up in the merged
table of the device (``tunekit.table.serving_lookup``'s M rule: the entry at
M, else the smallest tabulated M above; an M between two entries, M = 3 with
entries at 2 and 4, takes the next entry above whose config runs at that M,
``tunekit.table.invalid_at_m``, passing over one that cannot), builds the
entry's kernel through its backend and caches the :class:`~tunekit.dispatch.state.Choice` (a built kernel, whose
``entry.m`` the markers record as ``served_m``, or ``fallback:<reason>``). Under CUDA-graph capture
(:func:`is_capturing`) nothing is built and the fallback is not cached. A fused op (``rms_gemv``,
``gemv_add``) at a tabulated M where its layer group chose the unfused path (the fusions section's
``fused_m``, ``TableIndex.fused_at``) is ``fallback:unfused_at_m``: the op's unfused sequence serves. A
kernel that raises at launch, or that the canary catches, is marked broken
(:func:`mark_broken`): the key serves the vendor path from then on. Never raises for a table entry's
sake: a build failure is a logged, reasoned fallback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from tunekit import table as table_mod
from tunekit.dispatch.state import STATE, Choice, log_once
from tunekit.dispatch.tables import largest_m, tables_for
from tunekit.table import Entry


def resolve(op: str, dtype: str, m: int, n: int, k: int, device: torch.device, capturing: bool) -> Choice:
    """Look up, build and cache the choice for one key (slow path: once per key)."""
    dev_key = str(device)
    key = (op, dtype, m, n, k, dev_key)
    with STATE.lock:
        choice = STATE.choices.get(key)
    if choice is not None:
        return choice
    index, reason = tables_for(device, dev_key)
    if index is None:
        choice = Choice(f"fallback:{reason}")
    else:
        entry = index.lookup(op, dtype, m, n, k)
        if entry is None:
            if index.ms(op, dtype, n, k):
                choice = Choice("fallback:m_above_table")
            elif (op, dtype, n, k) in index.other_tp:
                choice = Choice("fallback:tp_mismatch")  # held by a table of another TP size only
            else:
                choice = Choice("fallback:no_entry")
        elif index.fused_at(op, dtype, entry.m, n, k) is False:
            # the layer group measured its unfused path faster at the M this entry serves: the op runs the
            # unit-gain norm + GEMV (or GEMV + add) on the same folded weights here, the fused kernel elsewhere
            choice = Choice("fallback:unfused_at_m", entry=entry)
        elif capturing:
            # Never compile or load a module inside a capture: the graph keeps
            # the vendor path for this size; the next eager call builds it.
            return Choice("fallback:not_built_at_capture", entry=entry)
        else:
            # the entries at M or above, smallest M first (``entry`` the first): the first whose config
            # runs at this M serves it; none does: the last one's reasoned fallback (config_invalid_at_m)
            for candidate in (e for e in index.entries_of(op, dtype, n, k) if e.m >= m):
                choice = _build(op, dtype, m, n, k, candidate, index.device)
                if choice.impl != "fallback:config_invalid_at_m":
                    break
    with STATE.lock:
        STATE.choices.setdefault(key, choice)
        return STATE.choices[key]


def _build(op: str, dtype: str, m: int, n: int, k: int, entry: Entry, device: Any) -> Choice:
    from tunekit import backends
    from tunekit.backends import base
    from tunekit.problems.shapes import Problem

    name = entry.backend
    params = dict(entry.params)  # a plain dict for the backends and the build key's JSON (the entry's is a view)
    try:
        backend = backends.get(name)
        why = backend.unavailable_reason(device)
        if why:
            log_once(f"unavailable:{name}:{device.arch}", logging.WARNING,
                      "tunekit: backend %s unavailable here (%s); vendor path for its entries", name, why)
            return Choice("fallback:backend_unavailable", entry=entry)
        # Never build what the kernel's own predicate refuses (a hostile or hand-edited table: params of
        # the wrong names or types, or past the predicate's edge), whatever the backend's build checks.
        refused = table_mod.params_problem(_Served(backend) if hasattr(backend, "serving_space") else backend,
                                           name, Problem(op, dtype, entry.m, n, k), params, need_space=False)
        if refused is not None:
            raise ValueError(refused)
        build_m = base.build_m(backend, op, m, entry.m)
        # the one test of whether an entry runs at this M, shared with the predictions (table.serving_lookup)
        invalid = table_mod.invalid_at_m(entry, m)
        if invalid is not None:
            # an entry tuned at a larger M may use a config the smaller M cannot run
            # (M_MODE="rows" at M=1): a reasoned fallback, not a build error
            log_once(f"invalid:{op}:{dtype}:{m}:{n}:{k}:{name}", logging.INFO,
                      "tunekit: %s %s M=%d N=%d K=%d: the M=%d entry's %s config does not run at this M (%s); "
                      "vendor path", op, dtype, m, n, k, entry.m, name, invalid)
            return Choice("fallback:config_invalid_at_m", entry=entry)
        build_key = (name, op, dtype, build_m, n, k, json.dumps(params, sort_keys=True), device.torch_device)
        with STATE.lock:
            kernel = STATE.built.get(build_key)
        if kernel is None:
            kernel = backend.build(Problem(op, dtype, build_m, n, k), params, device)
            with STATE.lock:
                STATE.built[build_key] = kernel
        takes_eps = kernel_takes_eps(kernel)
    except Exception as exc:  # a table entry that does not build is a fallback, never an error
        log_once(f"build:{op}:{dtype}:{m}:{n}:{k}:{name}", logging.WARNING,
                  "tunekit: %s %s M=%d N=%d K=%d: %s kernel did not build (%s); vendor path",
                  op, dtype, m, n, k, name, exc)
        return Choice("fallback:build_error", entry=entry)
    return Choice(f"tuned:{name}", kernel=kernel, entry=entry, takes_eps=takes_eps)


class _Served:
    """A backend as serving checks an entry: the names and types of its ``serving_space`` (the kernel's own,
    no search-time file), then its kernel's predicate."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def space(self, problem: Any) -> Any:
        return self.backend.serving_space(problem)

    def invalid_reason(self, problem: Any, params: dict[str, Any]) -> str | None:
        return self.backend.invalid_reason(problem, params)


def kernel_takes_eps(kernel: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False
    return "eps" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def mark_broken(op: str, dtype: str, m: int, n: int, k: int, device: torch.device, exc: BaseException) -> str:
    """Put one key on the vendor path for good after its tuned kernel raised (or the canary caught it:
    ``tunekit.dispatch.canary``), logged once per key; returns the fallback's ``impl`` for the call's marker."""
    from tunekit.dispatch.canary import CanaryMismatch

    if isinstance(exc, CanaryMismatch):
        impl = "fallback:canary_mismatch"
        log_once(f"kernel:{op}:{dtype}:{m}:{n}:{k}:{device}", logging.WARNING,
                  "tunekit: %s %s M=%d N=%d K=%d: the canary found the tuned kernel wrong (%s); vendor path "
                  "from now on", op, dtype, m, n, k, exc)
    else:
        impl = "fallback:kernel_error"
        log_once(f"kernel:{op}:{dtype}:{m}:{n}:{k}:{device}", logging.WARNING,
                  "tunekit: %s %s M=%d N=%d K=%d: tuned kernel raised %s: %s; vendor path from now on",
                  op, dtype, m, n, k, type(exc).__name__, exc)
    with STATE.lock:
        STATE.choices[(op, dtype, m, n, k, str(device))] = Choice(impl)
        STATE.epoch += 1
    return impl


def refuse(op: str, dtype: str, n: int, k: int, device: str) -> int:
    """Serve (op, dtype, N, K) on ``device`` by the op's fallback at every M up to the tables' largest, from
    now on (until tables are loaded again): for a kernel that failed a check on real weights where the
    graph calling it can no longer change. Its marker rows read ``fallback:kernel_error``. Returns that M."""
    top = largest_m(op, dtype, n, k, device) or 0
    with STATE.lock:
        for m in range(1, top + 1):
            STATE.choices[(op, dtype, m, n, k, device)] = Choice("fallback:kernel_error")
        STATE.epoch += 1
    return top


#: torch.cuda.is_current_stream_capturing without its Python wrapper (per call on the hot path)
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def is_capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and _stream_capturing()
