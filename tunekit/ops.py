"""Serving the dispatch table: ``torch.library`` custom ops in the ``tunekit`` namespace.

``torch.ops.tunekit.gemv(x, weight, bias=None)`` computes ``F.linear(x, weight,
bias)`` (y[..., N] = x[..., K] @ W[N, K]^T + b). It is functional (returns a new
tensor), has a fake (meta) implementation, so ``torch.compile`` keeps it as one
opaque node, and one implementation for the CUDA (also HIP) and CPU dispatch
keys that chooses, *at run time*, between a tuned kernel from the loaded
dispatch tables and the vendor path.

Call protocol::

    import tunekit.ops as ops                       # registers torch.ops.tunekit.*
    ops.load_tables(["runs/a/table.json"])          # or TUNEKIT_TABLE=a.json:b.json (read at the first call)
    ops.prepare()                                   # optional: build + warm every tabulated kernel (before capture)
    y = torch.ops.tunekit.gemv(x, w, None)          # tuned kernel or vendor path; never raises for tunekit's sake
    ops.dispatch_stats()                            # [{"op", "dtype", "shape", "m", "impl", "calls", ...}]

Choice inside the op (one decision per (op, dtype, M, N, K, device), cached):

1. cheap per-call checks: dtype (bf16/fp16/fp32, x and W alike), W 2-D with
   unit stride along K (padded rows, as vLLM's ROCm weight padding makes, are
   fine), x viewable as [M, K] with unit stride along K, same device, bias
   1-D contiguous of the output dtype; anything else -> vendor path;
2. tables: those of ``TUNEKIT_TABLE`` (``:``-separated, first path wins on a
   duplicate key) whose environment stamp matches the running device and
   software (``tunekit.table.environment_mismatch``; a mismatch is one logged
   warning per table and its entries are ignored);
3. the M rule of ``tunekit.table.lookup``: the exact M, else the smallest
   tabulated M >= m, else the vendor path;
4. build through the entry's backend (``tunekit.backends``): Triton launches
   ``kernels_triton`` with the table's config (on CPU tensors only under
   ``TRITON_INTERPRET=1``); HIP compiles through the run-time compile cache.
   Building happens on the first call that is *not* under CUDA-graph capture
   (or in :func:`prepare`); a capture that meets an unbuilt kernel takes the
   vendor path, counted as ``fallback:not_built_at_capture`` (the graph then
   replays the vendor path for that size).

The vendor path is ``F.linear`` or, once the vLLM plugin set it on ROCm, vLLM's
``torch.ops.vllm.rocm_unquantized_gemm`` (LLMM1 / wvSplitK / hipBLASLt), see
:func:`set_vendor_gemm`. Errors of tunekit's own path (a table that does not
load, a build or launch failure) are logged once and become a counted
fallback; errors the vendor path itself raises (a genuine shape mismatch)
propagate exactly as they would without tunekit.

Dispatch markers: every call is counted by (op, dtype, shape, m, bias,
implementation, counted at). Under CUDA-graph capture Python runs once, at
capture; replays run no Python, so those rows say ``counted_at: "capture"``
and count captures, not executions. ``TUNEKIT_DISPATCH_LOG=path`` writes the
markers as JSON at interpreter exit (``{pid}`` in the path is replaced by the
process id, for multi-process servers).

Elementwise ops (the fused decode ops of ``tunekit.opspec``), same rules::

    torch.ops.tunekit.rms_norm(x, w, eps)                 # w * x / rms(x); gemma_rms_norm: (1 + w)
    torch.ops.tunekit.fused_add_rms_norm(x, r, w, eps)    # -> (norm(x + r), x + r); gemma_fused_add_rms_norm
    torch.ops.tunekit.gated_rms_norm(x, z, w, eps)        # per group of len(w): norm(x) * w * silu(z)
    torch.ops.tunekit.silu_and_mul(x)                     # silu(x[..., :d]) * x[..., d:]
    torch.ops.tunekit.bias_gelu(x, b)                     # gelu_tanh(x + b)

Their table key is (m, n, k) as in ``tunekit.shapes.Problem`` (m = rows, the
leading dims; gated_rms_norm: the leading dims but [heads, head_dim], so
vLLM's [T, H, D] call is m = T, n = H * D, k = D). Each input must view as
[m, row width] with unit stride inside a row; the rows may be strided (HF's
q_norm normalises a q view whose rows are 2 * head_dim apart). Results are
contiguous.
The tuned kernel is ``backend.build(...)(inputs, out[, eps=eps])`` with
``inputs``/``out`` laid out as ``tunekit.opspec`` makes them; a kernel without
an ``eps`` parameter serves only ``eps == DEFAULT_EPS``. Their vendor path is
the kernel an integration installed with :func:`set_vendor_elementwise` (the
vLLM plugin: vLLM's own CUDA / Triton kernels); where none is installed for
the op and device, tunekit's own Triton kernel at the search space's default
config (``search_spaces/<op>.toml``, valid for every M), built and cached per
key as a tuned entry is (``vendor: "tunekit:triton-default"``, see
:func:`_ew_default`); else, or where that cannot serve, the PyTorch math of
vLLM's native implementations (``vllm.ir.ops.rms_norm`` ...), rounding where
those round. Each fallback row's ``vendor`` says which served it, and why the
composition did (:data:`EAGER_VENDORS`).

Adding an op: its schema, run-time impl (on :func:`_resolve` / :func:`_count`,
as :func:`_ew_serve` does) and fake impl in ``ELEMENTWISE_SCHEMAS`` /
``_ELEMENTWISE_IMPLS``; :func:`_register` defines them all.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tunekit import table as table_mod

__all__ = [
    "DEFAULT_VENDOR",
    "EAGER_VENDORS",
    "FALLBACK_REASONS",
    "clear_vendor_elementwise",
    "covers",
    "dispatch_log",
    "dispatch_stats",
    "dtype_name",
    "gemv",
    "load_tables",
    "loaded_tables",
    "prepare",
    "reset_stats",
    "set_vendor_elementwise",
    "set_vendor_gemm",
    "vendor_kernels",
    "write_dispatch_log",
]

logger = logging.getLogger("tunekit.ops")

NAMESPACE = "tunekit"
TABLE_ENV = "TUNEKIT_TABLE"
LOG_ENV = "TUNEKIT_DISPATCH_LOG"
STATS_FORMAT = "tunekit.dispatch_stats/1"

#: torch dtype -> the dtype names of tables (tunekit.shapes.DTYPE_BYTES).
_DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

#: Every reason a call can take the vendor path, with what it means (for reports and docs).
FALLBACK_REASONS: dict[str, str] = {
    "no_table": "no dispatch table loaded (TUNEKIT_TABLE unset, or tunekit.patch/load_tables without tables)",
    "table_error": "a table file could not be read or is invalid (logged once)",
    "env_mismatch": "every loaded table was tuned for another device or software (warned once per table)",
    "no_entry": "no tabulated entry for this (op, dtype, N, K)",
    "m_above_table": "entries exist for (op, dtype, N, K) but none with M >= this call's M",
    "dtype": "dtype not tabulated (bf16/fp16/fp32 only) or x and W differ",
    "strided": "x or W not unit-stride along K (or x not viewable as [M, K])",
    "bias": "bias not a contiguous 1-D tensor of the output dtype and N elements",
    "device": "x and W on different devices, or a device other than CUDA/HIP/CPU",
    "bad_input": "shapes that are not a linear (W not 2-D, K mismatch); the vendor path reports them",
    "empty": "M, N or K is zero",
    "eps": "a norm's eps other than the tuned kernel's fixed one (the kernel takes no eps argument)",
    "interpreter_off": "CPU tensors while TRITON_INTERPRET is not set (Triton runs on GPUs only then)",
    "interpreter_on": "GPU tensors while TRITON_INTERPRET=1 (interpreted kernels take CPU tensors)",
    "backend_unavailable": "the entry's backend cannot run here (logged once with the reason)",
    "config_invalid_at_m": "the entry serving this M (tuned at a larger M) holds a config this M cannot run "
                           "(M_MODE=\"rows\" at M=1); logged once",
    "build_error": "the entry's kernel failed to build (logged once with the error)",
    "not_built_at_capture": "met first under CUDA-graph capture, where kernels are never built: the graph keeps "
                            "the vendor path for this size (call tunekit.ops.prepare() or run a warm-up first)",
    "kernel_error": "the tuned kernel raised at launch (logged once; the key stays on the vendor path)",
}

#: The ``vendor`` of an elementwise fallback served by tunekit's Triton kernel at the op's default config.
DEFAULT_VENDOR = "tunekit:triton-default"

#: The ``vendor`` of a fallback row when tunekit's own PyTorch composition served it (elementwise ops).
EAGER_VENDORS: dict[str, str] = {
    "eager": "tunekit's PyTorch composition of the native math: no integration installed a vendor kernel for "
             "this op and no table serves this device (so no default-config kernel either), or the inputs "
             "failed a per-call check before the lookup",
    "eager:no_vendor_kernel": "an integration looked for a vendor kernel for this op and device and found none, "
                              "and no table serves this device (so no default-config kernel either)",
    "eager:vendor_error": "the installed vendor kernel raised (logged once); the composition served the call",
    "eager:default_unavailable": f"no vendor kernel, and {DEFAULT_VENDOR} cannot run here (the Triton "
                                 "backend's unavailable reason, logged once)",
    "eager:default_dtype": f"no vendor kernel, and {DEFAULT_VENDOR} serves BF16 only (its kernels round to BF16)",
    "eager:default_eps": f"no vendor kernel, and {DEFAULT_VENDOR} is built for DEFAULT_EPS (takes no eps)",
    "eager:default_invalid": "no vendor kernel, and the default config is invalid at this shape (logged once)",
    "eager:default_build_error": f"no vendor kernel, and {DEFAULT_VENDOR} failed to build (logged once)",
    "eager:default_kernel_error": f"no vendor kernel, and {DEFAULT_VENDOR} raised at launch (logged once; the "
                                  "key keeps the composition)",
    "eager:default_not_built_at_capture": f"no vendor kernel, and {DEFAULT_VENDOR} was first needed under "
                                          "CUDA-graph capture, where kernels are never built (the graph keeps "
                                          "the composition; tunekit.ops.prepare(ms=...) or a warm-up builds it)",
}

_CAPTURE_NOTE = (
    "rows with counted_at='capture' were counted once when a CUDA graph was captured; graph replays run "
    "without Python and are not counted, so their calls are captures, not executions"
)


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


@dataclass
class _LoadedTable:
    path: str
    table: dict[str, Any] | None  # None: it failed to load (error holds why)
    error: str | None = None


@dataclass(frozen=True)
class _VendorKernel:
    """An elementwise op's vendor path installed by an integration (:func:`set_vendor_elementwise`)."""

    fn: Callable[..., Any] | None  # None: the integration looked and found no kernel
    name: str  # the marker's ``vendor`` (what served), or why none was found
    device_types: frozenset[str]


@dataclass(frozen=True)
class _DefaultKernel:
    """The default-config kernel of one (op, dtype, m, n, k, device), or why there is none."""

    kernel: Callable[..., None] | None
    #: None with a kernel; with none, the EAGER_VENDORS key saying why, or None where the default path
    #: does not apply at all (no table serves the device: the vendor of an untouched fallback)
    why: str | None = None
    takes_eps: bool = False


class _State:
    """Process-wide serving state; every mutation under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.tables: list[_LoadedTable] | None = None  # None: not loaded yet (TUNEKIT_TABLE read lazily)
        #: device key ("cuda:0", "cpu") -> (merged table of the matching tables, verdict)
        self.device_tables: dict[str, tuple[dict[str, Any] | None, str | None]] = {}
        #: (op, dtype, m, n, k, device key) -> _Choice
        self.choices: dict[tuple, _Choice] = {}
        #: gated_rms_norm (dtype, m, n, k, device key) -> the (m, n) rows it is served as
        self.gated_layouts: dict[tuple, tuple[int, int]] = {}
        #: built kernels by (backend, op, dtype, build M, n, k, params, device): one HIP build serves all M <= MAX_M
        self.built: dict[tuple, Callable[..., None]] = {}
        #: (op, dtype, shape, m, bias, impl, counted_at) -> calls
        self.stats: dict[tuple, int] = {}
        self.logged: set[str] = set()
        self.vendor_gemm: Callable[..., torch.Tensor] | None = None
        self.vendor_gemm_name = "F.linear"
        #: elementwise op -> the kernel an integration installed as its vendor path
        self.vendor_ew: dict[str, _VendorKernel] = {}
        #: (op, dtype, n, k, device) -> covers(); cleared with the tables
        self.covers: dict[tuple, bool] = {}
        #: (op, dtype, m, n, k, device key) -> the default-config kernel serving fallbacks that have no
        #: vendor kernel (or why none does); cleared with the tables
        self.defaults: dict[tuple, _DefaultKernel] = {}
        self.atexit_registered = False


_STATE = _State()


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name of a torch dtype ("bf16", "fp16", "fp32"), else torch's own name."""
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _log_once(key: str, level: int, message: str, *args: Any) -> None:
    with _STATE.lock:
        if key in _STATE.logged:
            return
        _STATE.logged.add(key)
    logger.log(level, message, *args)


def load_tables(paths: str | os.PathLike | Sequence[str | os.PathLike] | None) -> list[dict[str, Any]]:
    """Serve ``paths`` (a list, or one ``:``-separated string); ``None`` reads ``TUNEKIT_TABLE`` again.

    Replaces the tables loaded before and forgets every cached decision (the
    dispatch markers are kept). A table that cannot be loaded is logged once
    and served as absent (``fallback:table_error``); this function itself
    never raises. Returns :func:`loaded_tables`.
    """
    if paths is None:
        paths = os.environ.get(TABLE_ENV, "")
    if isinstance(paths, (str, os.PathLike)):
        parts = [p for p in str(paths).split(os.pathsep) if p.strip()]
    else:
        parts = [str(p) for p in paths]
    loaded = []
    for path in parts:
        try:
            loaded.append(_LoadedTable(path, table_mod.load(path)))
        except Exception as exc:  # serving never raises: a broken table is a vendor path + one log line
            loaded.append(_LoadedTable(path, None, str(exc)))
            _log_once(f"table-error:{path}", logging.ERROR, "tunekit: table %s not used: %s", path, exc)
    with _STATE.lock:
        _STATE.tables = loaded
        _STATE.device_tables.clear()
        _STATE.choices.clear()
        _STATE.gated_layouts.clear()
        _STATE.built.clear()
        _STATE.covers.clear()
        _STATE.defaults.clear()
    _maybe_register_atexit()
    return loaded_tables()


def loaded_tables() -> list[dict[str, Any]]:
    """The tables being served: path, entries, load error and, per device seen so far, the stamp verdict."""
    tables = _tables()
    out = []
    for lt in tables:
        row: dict[str, Any] = {"path": lt.path, "entries": len(lt.table["entries"]) if lt.table else 0}
        if lt.error:
            row["error"] = lt.error
        out.append(row)
    with _STATE.lock:
        verdicts = {dev: verdict for dev, (_, verdict) in _STATE.device_tables.items()}
    if verdicts:
        for row in out:
            row["devices"] = verdicts
    return out


def _tables() -> list[_LoadedTable]:
    with _STATE.lock:
        if _STATE.tables is not None:
            return _STATE.tables
    load_tables(None)
    with _STATE.lock:
        return _STATE.tables or []


def _device_info(device: torch.device) -> Any:
    """DeviceInfo for a tensor's device, or a fallback reason (str) when tuned kernels cannot run on it."""
    from tunekit.device import detect, interpret_mode

    if device.type == "cpu":
        # detect() describes the CPU exactly when the interpreter is on (or no GPU exists).
        return detect() if interpret_mode() else "interpreter_off"
    if device.type == "cuda":
        if interpret_mode():
            return "interpreter_on"
        return detect(device.index if device.index is not None else torch.cuda.current_device())
    return "device"


def _tables_for(device: torch.device, dev_key: str) -> tuple[dict[str, Any] | None, str | None]:
    """(merged table of the loaded tables whose stamp matches ``device``, reason if none)."""
    with _STATE.lock:
        cached = _STATE.device_tables.get(dev_key)
    if cached is not None:
        return cached
    tables = _tables()
    usable = [lt for lt in tables if lt.table is not None]
    result: tuple[dict[str, Any] | None, str | None]
    if not tables:
        result = (None, "no_table")
    elif not usable:
        result = (None, "table_error")
    else:
        info = _device_info(device)
        if isinstance(info, str):
            result = (None, info)
        else:
            entries: list[dict[str, Any]] = []
            seen: set[tuple] = set()
            matched = 0
            for lt in usable:
                diffs = table_mod.environment_mismatch(lt.table, info.as_dict())
                if diffs:
                    _log_once(
                        f"mismatch:{lt.path}:{dev_key}", logging.WARNING,
                        "tunekit: table %s was tuned for another environment, vendor path for its shapes on %s: %s",
                        lt.path, dev_key, "; ".join(diffs),
                    )
                    continue
                matched += 1
                for entry in lt.table["entries"]:
                    key = (entry["op"], entry["dtype"], entry["m"], entry["n"], entry["k"])
                    if key not in seen:  # the first path given wins a duplicate key
                        seen.add(key)
                        entries.append(entry)
            merged = {"entries": entries, "device": info}
            result = (merged, None) if matched else (None, "env_mismatch")
    with _STATE.lock:
        _STATE.device_tables[dev_key] = result
    return result


# ---------------------------------------------------------------------------
# Decisions and markers
# ---------------------------------------------------------------------------


@dataclass
class _Choice:
    """What serves one (op, dtype, m, n, k, device): a built kernel, or the vendor path and why."""

    impl: str  # "tuned:<backend>" or "fallback:<reason>"
    kernel: Callable[..., None] | None = None
    entry: dict[str, Any] | None = None
    #: the built kernel takes ``eps=`` (the norms); without it only DEFAULT_EPS is served tuned
    takes_eps: bool = False


def _count(op: str, dtype: str, shape: str, m: int, bias: bool, impl: str, capturing: bool,
           vendor: str | None = None) -> None:
    # vendor: what served a fallback (None for a tuned kernel), so the log shows
    # whether a miss ran the integration's kernel or tunekit's eager composition.
    key = (op, dtype, shape, m, bias, impl, "capture" if capturing else "call", vendor)
    with _STATE.lock:
        _STATE.stats[key] = _STATE.stats.get(key, 0) + 1


def _resolve(op: str, dtype: str, m: int, n: int, k: int, device: torch.device, capturing: bool) -> _Choice:
    """Look up, build and cache the choice for one key (slow path: once per key)."""
    dev_key = str(device)
    key = (op, dtype, m, n, k, dev_key)
    with _STATE.lock:
        choice = _STATE.choices.get(key)
    if choice is not None:
        return choice
    merged, reason = _tables_for(device, dev_key)
    if merged is None:
        choice = _Choice(f"fallback:{reason}")
    else:
        entry = table_mod.lookup(merged, op, dtype, m, n, k)
        if entry is None:
            tabulated = any(
                e["op"] == op and e["dtype"] == dtype and e["n"] == n and e["k"] == k for e in merged["entries"]
            )
            choice = _Choice("fallback:m_above_table" if tabulated else "fallback:no_entry")
        elif capturing:
            # Never compile or load a module inside a capture: the graph keeps
            # the vendor path for this size; the next eager call builds it.
            return _Choice("fallback:not_built_at_capture", entry=entry)
        else:
            choice = _build(op, dtype, m, n, k, entry, merged["device"])
    with _STATE.lock:
        _STATE.choices.setdefault(key, choice)
        return _STATE.choices[key]


def _build(op: str, dtype: str, m: int, n: int, k: int, entry: dict[str, Any], device: Any) -> _Choice:
    from tunekit import backends
    from tunekit.shapes import Problem

    name = entry["backend"]
    try:
        backend = backends.get(name)
        why = backend.unavailable_reason(device)
        if why:
            _log_once(f"unavailable:{name}:{device.arch}", logging.WARNING,
                      "tunekit: backend %s unavailable here (%s); vendor path for its entries", name, why)
            return _Choice("fallback:backend_unavailable", entry=entry)
        # HIP kernels are built for M up to MAX_M = the tabulated M (one build
        # serves every smaller M); Triton's config is checked for the real M.
        build_m = entry["m"] if (name == "hip" and op == "gemv") else m
        invalid = None
        if build_m != entry["m"] and hasattr(backend, "invalid_reason"):
            invalid = backend.invalid_reason(Problem(op, dtype, build_m, n, k), entry["params"])
            if invalid is not None and backend.invalid_reason(
                    Problem(op, dtype, entry["m"], n, k), entry["params"]) is not None:
                invalid = None  # invalid at its own M too: a broken entry, left to the build to report
        if invalid is not None:
            # an entry tuned at a larger M may use a config the smaller M cannot run
            # (M_MODE="rows" at M=1): a reasoned fallback, not a build error
            _log_once(f"invalid:{op}:{dtype}:{m}:{n}:{k}:{name}", logging.INFO,
                      "tunekit: %s %s M=%d N=%d K=%d: the M=%d entry's %s config does not run at this M (%s); "
                      "vendor path", op, dtype, m, n, k, entry["m"], name, invalid)
            return _Choice("fallback:config_invalid_at_m", entry=entry)
        build_key = (name, op, dtype, build_m, n, k, json.dumps(entry["params"], sort_keys=True), device.torch_device)
        with _STATE.lock:
            kernel = _STATE.built.get(build_key)
        if kernel is None:
            kernel = backend.build(Problem(op, dtype, build_m, n, k), entry["params"], device)
            with _STATE.lock:
                _STATE.built[build_key] = kernel
        takes_eps = _takes_eps(kernel)
    except Exception as exc:  # a table entry that does not build is a fallback, never an error
        _log_once(f"build:{op}:{dtype}:{m}:{n}:{k}:{name}", logging.WARNING,
                  "tunekit: %s %s M=%d N=%d K=%d: %s kernel did not build (%s); vendor path",
                  op, dtype, m, n, k, name, exc)
        return _Choice("fallback:build_error", entry=entry)
    return _Choice(f"tuned:{name}", kernel=kernel, entry=entry, takes_eps=takes_eps)


def _takes_eps(kernel: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False
    return "eps" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _mark_broken(op: str, dtype: str, m: int, n: int, k: int, device: torch.device, exc: BaseException) -> None:
    _log_once(f"kernel:{op}:{dtype}:{m}:{n}:{k}:{device}", logging.WARNING,
              "tunekit: %s %s M=%d N=%d K=%d: tuned kernel raised %s: %s; vendor path from now on",
              op, dtype, m, n, k, type(exc).__name__, exc)
    with _STATE.lock:
        _STATE.choices[(op, dtype, m, n, k, str(device))] = _Choice("fallback:kernel_error")


def _serving_table(device: str) -> dict[str, Any] | None:
    """The merged table that serves ``device``, or None (no usable table, or any error: never raises)."""
    try:
        merged, _ = _tables_for(torch.device(device), str(torch.device(device)))
    except Exception:
        return None
    return merged


def covers(op: str, dtype: str, n: int, k: int, device: str) -> bool:
    """True if a table serving ``device`` has an entry for (op, dtype, N, K) at some M. Never raises.

    For integrations that decide per layer (static: no M) whether to enter a
    tunekit op at all, where the op's vendor path would differ from theirs.
    Cached per key until the tables change: an eager integration asks on
    every call, and the scan is over every entry.
    """
    key = (op, dtype, n, k, device)
    hit = _STATE.covers.get(key)  # lock-free read (atomic under the GIL), as for the choices
    if hit is not None:
        return hit
    with _STATE.lock:
        tables = _STATE.tables
    merged = _serving_table(device)
    found = merged is not None and any(
        e["op"] == op and e["dtype"] == dtype and e["n"] == n and e["k"] == k for e in merged["entries"])
    with _STATE.lock:
        if tables is not None and _STATE.tables is tables:  # not cached across a load_tables in between
            _STATE.covers[key] = found
    return found


def served_entry(op: str, dtype: str, m: int, n: int, k: int, device: str) -> dict[str, Any] | None:
    """The table entry that serves (op, dtype, M, N, K) on ``device`` (the lookup rule of the ops:
    exact M, else the smallest tabulated larger M), or None for the vendor path. Never raises.

    For callers that choose per call site between a tunekit op and their own
    (faster than the op's fallback) path, such as ``tunekit.chain``.
    """
    merged = _serving_table(device)
    return None if merged is None else table_mod.lookup(merged, op, dtype, m, n, k)


def dispatch_stats(reset: bool = False) -> list[dict[str, Any]]:
    """Every call counted so far: one row per (op, dtype, shape, m, bias, impl, counted_at, vendor).

    ``shape`` is ``"NxK"`` for gemv; ``impl`` is ``"tuned:<backend>"`` or
    ``"fallback:<reason>"`` (see :data:`FALLBACK_REASONS`); ``vendor`` is None
    for a tuned kernel, else what served the fallback (``"F.linear"``, a kernel
    an integration installed such as ``"torch.ops._C.rms_norm"``,
    :data:`DEFAULT_VENDOR`, or one of :data:`EAGER_VENDORS`); ``counted_at`` is
    ``"call"`` or ``"capture"`` (CUDA-graph capture: counted once per capture,
    replays are not counted because Python does not run; such rows carry a
    ``note`` saying so). ``reset=True`` clears the counters after reading.
    """
    with _STATE.lock:
        items = sorted(_STATE.stats.items(), key=lambda kv: tuple(str(v) for v in kv[0]))
        if reset:
            _STATE.stats.clear()
    rows = []
    for (op, dtype, shape, m, bias, impl, counted_at, vendor), calls in items:
        row: dict[str, Any] = {"op": op, "dtype": dtype, "shape": shape, "m": m, "bias": bias, "impl": impl,
                               "vendor": vendor, "calls": calls, "counted_at": counted_at}
        if counted_at == "capture":
            row["note"] = "counted at capture: CUDA-graph replays run without Python and are not counted"
        rows.append(row)
    return rows


def reset_stats() -> None:
    """Forget the dispatch markers (not the tables or the built kernels)."""
    with _STATE.lock:
        _STATE.stats.clear()


def dispatch_log() -> dict[str, Any]:
    """The JSON document ``TUNEKIT_DISPATCH_LOG`` writes: tables, markers and the capture note."""
    return {
        "format": STATS_FORMAT,
        "pid": os.getpid(),
        "tables": loaded_tables(),
        "note": _CAPTURE_NOTE,
        "fallback_reasons": FALLBACK_REASONS,
        "vendors": vendor_kernels(),
        "eager_vendors": EAGER_VENDORS,
        "default_vendor": {DEFAULT_VENDOR: "tunekit's Triton kernel at the op's default config (valid for every "
                                           "M), serving an elementwise fallback that has no vendor kernel"},
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
        tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dispatch_log(), indent=2, default=str) + "\n")
        os.replace(tmp, out)
    except Exception as exc:
        logger.error("tunekit: could not write the dispatch log %s: %s", out, exc)
        return None
    return out


def _maybe_register_atexit() -> None:
    with _STATE.lock:
        if _STATE.atexit_registered or not os.environ.get(LOG_ENV):
            return
        _STATE.atexit_registered = True
    atexit.register(write_dispatch_log)


# ---------------------------------------------------------------------------
# gemv
# ---------------------------------------------------------------------------


def set_vendor_gemm(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None,
                    name: str = "custom") -> None:
    """Use ``fn(x, weight, bias)`` as the vendor path for GPU tensors (None: ``F.linear``).

    The vLLM plugin sets vLLM's ``torch.ops.vllm.rocm_unquantized_gemm`` on
    ROCm, so that shapes the table does not cover keep vLLM's skinny GEMMs
    (LLMM1 / wvSplitK). CPU tensors always use ``F.linear``. ``name`` is the
    markers' ``vendor`` for the calls it serves.
    """
    with _STATE.lock:
        _STATE.vendor_gemm = fn
        _STATE.vendor_gemm_name = "F.linear" if fn is None else name


def set_vendor_elementwise(op: str, fn: Callable[..., Any] | None, name: str,
                           device_types: Iterable[str] = ("cuda",)) -> None:
    """Serve the fallbacks of elementwise ``op`` with ``fn`` on tensors of ``device_types``.

    ``fn`` takes the op's arguments (``rms_norm``: x, weight, eps; the fused
    adds: x, residual, weight, eps; ``gated_rms_norm``: x, z, weight, eps;
    ``silu_and_mul``: x) and returns what the op returns, without modifying
    its inputs. It serves every call the lookup sends to the vendor path (no
    table entry, M above the table, eps, capture before build, ...) once the
    per-call input checks passed; inputs that failed them keep the PyTorch
    composition. The vLLM plugin installs vLLM's own kernels here, so that a
    covered layer at an M the table lacks runs what vLLM would have run
    instead of several eager launches. ``fn=None`` records that an integration
    looked and found none (``name`` says why): those fallbacks are served as
    with nothing installed, by the op's default-config Triton kernel where a
    table serves the device (markers: ``tunekit:triton-default``, see
    :func:`_ew_default`), else by the composition (``eager:no_vendor_kernel``).
    ``name`` is the markers' ``vendor``.
    """
    if op not in ELEMENTWISE_SCHEMAS:
        raise ValueError(f"unknown elementwise op {op!r}; one of {sorted(ELEMENTWISE_SCHEMAS)}")
    with _STATE.lock:
        _STATE.vendor_ew[op] = _VendorKernel(fn, name, frozenset(device_types))


def clear_vendor_elementwise() -> None:
    """Forget every vendor kernel :func:`set_vendor_elementwise` installed (the composition serves again)."""
    with _STATE.lock:
        _STATE.vendor_ew.clear()


def vendor_kernels() -> dict[str, Any]:
    """What serves each op's fallbacks: gemv's vendor and, per elementwise op, the installed kernel."""
    with _STATE.lock:
        out: dict[str, Any] = {"gemv": {"name": _STATE.vendor_gemm_name if _STATE.vendor_gemm else "F.linear",
                                        "device_types": ["cuda"] if _STATE.vendor_gemm else ["cuda", "cpu"]}}
        for op, vk in sorted(_STATE.vendor_ew.items()):
            out[op] = {"name": vk.name if vk.fn is not None else "eager:no_vendor_kernel",
                       "device_types": sorted(vk.device_types) if vk.fn is not None else [],
                       **({} if vk.fn is not None else {"why": vk.name})}
    return out


def _gemv_vendor_name(x: torch.Tensor) -> str:
    return _STATE.vendor_gemm_name if _STATE.vendor_gemm is not None and x.is_cuda else "F.linear"


def _vendor_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    fn = _STATE.vendor_gemm
    out = fn(x, weight, bias) if fn is not None and x.is_cuda else F.linear(x, weight, bias)
    # The fake impl promises a contiguous result (compilers plan with it).
    return out if out.is_contiguous() else out.contiguous()


def _gemv_precheck(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Per-call checks that need no table: None if the tuned path may serve the call, else the reason.

    Written for the hot path (every linear of every step runs it in eager
    mode): each tensor attribute is read once.
    """
    wshape, xshape = weight.shape, x.shape
    if len(wshape) != 2 or not xshape or xshape[-1] != wshape[1]:
        return "bad_input"
    xdtype, device = x.dtype, x.device
    if xdtype not in _DTYPE_NAMES or weight.dtype != xdtype:
        return "dtype"
    if weight.device != device or device.type not in ("cuda", "cpu"):
        return "device"
    n, k = wshape
    if n == 0 or k == 0 or x.numel() == 0:
        return "empty"
    ws0, ws1 = weight.stride()
    if (k > 1 and (ws1 != 1 or x.stride(-1) != 1)) or ws0 < k:
        return "strided"
    if bias is not None and (
        bias.dim() != 1 or bias.shape[0] != n or bias.dtype != xdtype or bias.device != device
        or not bias.is_contiguous()
    ):
        return "bias"
    return None


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _gemv_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA/HIP and CPU kernel of ``tunekit::gemv``: tuned kernel or vendor path, counted."""
    capturing = _capturing(x)
    has_bias = bias is not None
    dtype = dtype_name(x.dtype)
    wshape = weight.shape
    shape = f"{wshape[0]}x{wshape[1]}" if len(wshape) == 2 else "x".join(map(str, wshape))
    reason = _gemv_precheck(x, weight, bias)
    k = x.shape[-1] if x.dim() else 0
    m = x.numel() // k if k else 0
    x2 = None
    if reason is None:
        try:
            x2 = x.view(m, k)
        except RuntimeError:  # leading dims not flattenable without a copy
            reason = "strided"
    if reason is not None:
        _count("gemv", dtype, shape, m, has_bias, f"fallback:{reason}", capturing, _gemv_vendor_name(x))
        return _vendor_gemv(x, weight, bias)
    n = wshape[0]
    # Lock-free read of the decision cache (a dict read is atomic under the GIL);
    # _resolve takes the lock only to fill it.
    choice = _STATE.choices.get(("gemv", dtype, m, n, k, str(x.device))) or _resolve(
        "gemv", dtype, m, n, k, x.device, capturing)
    if choice.kernel is None:
        _count("gemv", dtype, shape, m, has_bias, choice.impl, capturing, _gemv_vendor_name(x))
        return _vendor_gemv(x, weight, bias)
    try:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        choice.kernel((x2, weight), out)
        if bias is not None:
            # A separate add (one small elementwise launch): the tables time
            # the GEMV alone; a fused bias epilogue is not a tuned family yet.
            out.add_(bias)
    except Exception as exc:  # the serving path never raises for tunekit's sake
        _mark_broken("gemv", dtype, m, n, k, x.device, exc)
        _count("gemv", dtype, shape, m, has_bias, "fallback:kernel_error", capturing, _gemv_vendor_name(x))
        return _vendor_gemv(x, weight, bias)
    _count("gemv", dtype, shape, m, has_bias, choice.impl, capturing)
    return out.view(*x.shape[:-1], n)


def _gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.tunekit.gemv(x, weight, bias)``: ``F.linear`` served from the dispatch tables."""
    return torch.ops.tunekit.gemv(x, weight, bias)


# ---------------------------------------------------------------------------
# Elementwise ops (rms_norm & co.)
# ---------------------------------------------------------------------------

def _built_eps() -> float:
    from tunekit import opspec

    return float(getattr(opspec, "EPS", 1e-6))


#: The epsilon the elementwise kernels are built with when they take no ``eps=``
#: argument (``tunekit.opspec.EPS``, what the backends pass): a norm with
#: another epsilon (Llama-3.1: 1e-5) takes the vendor path, ``fallback:eps``.
DEFAULT_EPS = _built_eps()

#: Elementwise ops and their schemas. Table keys (m, n, k) as in tunekit.shapes.Problem:
#: rows m = all leading dims; norms n = k = row length; gated_rms_norm n = G*K, k = len(w);
#: silu_and_mul k = 2n; bias_gelu k = n.
ELEMENTWISE_SCHEMAS: dict[str, str] = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "gemma_rms_norm": "gemma_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "fused_add_rms_norm": "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    "gemma_fused_add_rms_norm":
        "gemma_fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
    "gated_rms_norm": "gated_rms_norm(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor",
    "silu_and_mul": "silu_and_mul(Tensor x) -> Tensor",
    "bias_gelu": "bias_gelu(Tensor x, Tensor bias) -> Tensor",
}


# Vendor paths: the PyTorch math of vLLM's native implementations
# (vllm.ir.ops.rms_norm / fused_add_rms_norm, GemmaRMSNorm.forward_native,
# RMSNormGated.forward_static with norm_before_gate=True, SiluAndMul.forward_native),
# rounding where they round.


def _vendor_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    w = weight.float() + 1.0 if gemma else weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(w.dtype) * w).to(x.dtype)


def _vendor_fused_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float() + 1.0 if gemma else weight
    s = x.float() + residual.float()
    residual_out = s.to(x.dtype)
    s = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (s.to(w.dtype) * w).to(x.dtype), residual_out


def _vendor_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = weight.shape[0]
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // k, k)
    normed = (g * torch.rsqrt(g.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).reshape(x.shape)
    return (normed * F.silu(z.float())).to(x.dtype)


def _vendor_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _vendor_bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")


def _ew_serve(
    op: str,
    tensors: tuple[torch.Tensor, ...],
    weight: torch.Tensor | None,
    mnk: tuple[int, int, int],
    eps: float | None,
    make_out: Callable[[int, int, torch.Tensor], Any],
    kernel_inputs: Callable[[int, int], tuple[torch.Tensor, ...]],
    vendor: Callable[[], Any],
    finish: Callable[[Any], Any],
    vendor_args: tuple[Any, ...] = (),
) -> Any:
    """Shared body of the elementwise ops: checks, lookup, tuned launch or vendor path, marker.

    ``vendor`` is the PyTorch composition; ``vendor_args`` the op's arguments
    for an installed vendor kernel (:func:`set_vendor_elementwise`), which
    serves the lookup's fallbacks in its place; without one, the op's
    default-config kernel does where it can (:func:`_ew_vendor`).
    """
    x = tensors[0]
    capturing = _capturing(x)
    dtype = dtype_name(x.dtype)
    m, n, k = mnk
    shape = f"{n}x{k}"
    reason = None
    if dtype not in _DTYPE_NAMES.values() or any(t.dtype != x.dtype for t in tensors):
        reason = "dtype"
    elif weight is not None and (weight.dtype != x.dtype or weight.dim() != 1 or not weight.is_contiguous()):
        reason = "dtype" if weight.dtype != x.dtype else "strided"
    elif any(t.device != x.device for t in (*tensors, *(() if weight is None else (weight,)))) or \
            x.device.type not in ("cuda", "cpu"):
        reason = "device"
    elif m == 0 or n == 0 or k == 0:
        reason = "empty"
    else:
        # Rows may be strided (HF's q_norm gets every other head_dim slice of q):
        # the kernels take a row stride. Each tensor must view as [m, width]
        # rows with unit stride inside a row; anything else is the vendor's.
        inputs = _row_views(kernel_inputs, m, n)
        if inputs is None:
            reason = "strided"
    if reason is not None:
        # inputs a vendor kernel may not take either (odd strides, dtypes, devices): the composition
        _count(op, dtype, shape, m, False, f"fallback:{reason}", capturing, "eager")
        return _dense(vendor())
    choice = _resolve(op, dtype, m, n, k, x.device, capturing)
    if choice.kernel is not None and eps is not None and not choice.takes_eps and eps != DEFAULT_EPS:
        choice = _Choice("fallback:eps")
    if choice.kernel is None:
        out, served_by = _ew_vendor(op, x.device, vendor_args, vendor, lambda: _ew_default(
            op, dtype, m, n, k, x, capturing, inputs, make_out, finish, eps))
        _count(op, dtype, shape, m, False, choice.impl, capturing, served_by)
        return _dense(out)
    try:
        out = _launch_ew(choice.kernel, choice.takes_eps, inputs, make_out(m, n, x), eps)
    except Exception as exc:  # the serving path never raises for tunekit's sake
        _mark_broken(op, dtype, m, n, k, x.device, exc)
        out, served_by = _ew_vendor(op, x.device, vendor_args, vendor, lambda: _ew_default(
            op, dtype, m, n, k, x, capturing, inputs, make_out, finish, eps))
        _count(op, dtype, shape, m, False, "fallback:kernel_error", capturing, served_by)
        return _dense(out)
    _count(op, dtype, shape, m, False, choice.impl, capturing)
    return finish(out)


def _launch_ew(kernel: Callable[..., None], takes_eps: bool, inputs: tuple[torch.Tensor, ...], out: Any,
               eps: float | None) -> Any:
    """Run a built elementwise kernel into ``out`` (eps passed only to kernels that take it); returns ``out``."""
    if takes_eps and eps is not None:
        kernel(inputs, out, eps=eps)
    else:
        kernel(inputs, out)
    return out


def _ew_vendor(op: str, device: torch.device, args: tuple[Any, ...], eager: Callable[[], Any],
               default: Callable[[], tuple[Any, str | None]] | None = None) -> tuple[Any, str]:
    """(result, what served it) for a call the lookup sent to the vendor path.

    In this order: the installed vendor kernel when there is one for this
    device (the one kernel the integration would have run: preferred, it is
    what the engine runs without tunekit); else ``default`` (tunekit's
    default-config kernel, :func:`_ew_default`: one launch where the
    composition is several); else the PyTorch composition, with the reason
    in the vendor name. A vendor kernel that raises is logged once and the
    composition serves: the serving path never raises for tunekit's sake.
    """
    vk = _STATE.vendor_ew.get(op)  # lock-free read (atomic under the GIL): hot path
    if vk is not None and vk.fn is not None and device.type in vk.device_types:
        try:
            return vk.fn(*args), vk.name
        except Exception as exc:
            _log_once(f"vendor:{op}:{vk.name}", logging.WARNING,
                      "tunekit: %s: vendor kernel %s raised %s: %s; PyTorch composition instead",
                      op, vk.name, type(exc).__name__, exc)
            return eager(), "eager:vendor_error"
    if default is not None:
        out, why = default()
        if why is None and out is not None:
            return out, DEFAULT_VENDOR
        if why is not None:
            return eager(), why
    return eager(), "eager" if vk is None else "eager:no_vendor_kernel"


#: The backend whose default config serves fallbacks without a vendor kernel.
_DEFAULT_BACKEND = "triton"


def _ew_default(op: str, dtype: str, m: int, n: int, k: int, x: torch.Tensor, capturing: bool,
                inputs: tuple[torch.Tensor, ...], make_out: Callable[[int, int, torch.Tensor], Any],
                finish: Callable[[Any], Any], eps: float | None) -> tuple[Any, str | None]:
    """Serve a fallback that has no vendor kernel with tunekit's Triton kernel at the op's default config.

    The default config (``search_spaces/<op>.toml``'s ``default``, with its
    ``fixed`` numerics switches, as the search enqueues it first) is valid
    for every M, so it serves any M the table lacks in one launch, where the
    composition takes several. Its numerics are those of the tuned kernels
    of the family (``VLLM_ROUNDING=1``): within the op's BF16 error bound of
    the fp64 reference (``OpSpec.error_bound``, what ``tunekit.verify``
    checks every tuned candidate against), and so within that bound of the
    composition's result too, not bit-equal to it.

    Built once per (op, dtype, M, N, K, device), like a tuned entry, and
    cached; never built under CUDA-graph capture (the composition serves,
    ``eager:default_not_built_at_capture``, and the next eager call builds
    it; :func:`prepare` builds it for the Ms it is given). Returns
    ``(result, None)`` when it served, ``(None, why)`` with an
    :data:`EAGER_VENDORS` key when it could not, ``(None, None)`` where it
    does not apply (no table serves this device). Never raises.
    """
    device = x.device
    key = (op, dtype, m, n, k, str(device))
    dk = _STATE.defaults.get(key)  # lock-free read (atomic under the GIL): hot path
    if dk is None:
        if capturing:
            # Never compile or load a module inside a capture (as for tuned entries); not cached,
            # so the next eager call builds it.
            merged, _ = _tables_for(device, str(device))
            return None, (None if merged is None else "eager:default_not_built_at_capture")
        dk = _build_default(op, dtype, m, n, k, device)
        with _STATE.lock:
            dk = _STATE.defaults.setdefault(key, dk)
    if dk.kernel is None:
        return None, dk.why
    if eps is not None and not dk.takes_eps and eps != DEFAULT_EPS:
        return None, "eager:default_eps"
    try:
        out = _launch_ew(dk.kernel, dk.takes_eps, inputs, make_out(m, n, x), eps)
    except Exception as exc:  # the serving path never raises for tunekit's sake
        _log_once(f"default-kernel:{op}:{dtype}:{m}:{n}:{k}:{device}", logging.WARNING,
                  "tunekit: %s %s M=%d N=%d K=%d: default-config kernel raised %s: %s; PyTorch composition "
                  "from now on", op, dtype, m, n, k, type(exc).__name__, exc)
        with _STATE.lock:
            _STATE.defaults[key] = _DefaultKernel(None, "eager:default_kernel_error")
        return None, "eager:default_kernel_error"
    return finish(out), None


def _build_default(op: str, dtype: str, m: int, n: int, k: int, device: torch.device) -> _DefaultKernel:
    """Build the default-config kernel of one key (slow path: once per key). Never raises."""
    merged, _ = _tables_for(device, str(device))
    if merged is None:
        # No table serves this device (none loaded, or tuned for another one, or Triton's
        # interpreter mode does not match the tensors): tunekit is not serving here at all.
        return _DefaultKernel(None)
    if dtype != "bf16":
        return _DefaultKernel(None, "eager:default_dtype")
    from tunekit import backends
    from tunekit.shapes import Problem

    info = merged["device"]
    name = _DEFAULT_BACKEND
    try:
        backend = backends.get(name)
        why = backend.unavailable_reason(info) if op in backend.ops else f"no {name} kernel for {op}"
        if why:
            _log_once(f"default-unavailable:{name}:{op}:{info.arch}", logging.WARNING,
                      "tunekit: %s: no vendor kernel and backend %s unavailable here (%s); PyTorch composition "
                      "for its fallbacks", op, name, why)
            return _DefaultKernel(None, "eager:default_unavailable")
        problem = Problem(op, dtype, m, n, k)
        space = backend.space(problem)
        params = dict(space.fixed) | dict(space.default)  # as the search enqueues the default
        invalid = backend.invalid_reason(problem, params)
        if invalid is not None:
            _log_once(f"default-invalid:{op}:{dtype}:{m}:{n}:{k}", logging.WARNING,
                      "tunekit: %s %s M=%d N=%d K=%d: the default %s config does not run here (%s); PyTorch "
                      "composition", op, dtype, m, n, k, name, invalid)
            return _DefaultKernel(None, "eager:default_invalid")
        build_key = (name, op, dtype, m, n, k, json.dumps(params, sort_keys=True), info.torch_device)
        with _STATE.lock:
            kernel = _STATE.built.get(build_key)
        if kernel is None:
            kernel = backend.build(problem, params, info)
            with _STATE.lock:
                _STATE.built[build_key] = kernel
        return _DefaultKernel(kernel, takes_eps=_takes_eps(kernel))
    except Exception as exc:  # a kernel that does not build is the composition, never an error
        _log_once(f"default-build:{op}:{dtype}:{m}:{n}:{k}", logging.WARNING,
                  "tunekit: %s %s M=%d N=%d K=%d: default-config %s kernel did not build (%s); PyTorch "
                  "composition", op, dtype, m, n, k, name, exc)
        return _DefaultKernel(None, "eager:default_build_error")


def _has_vendor_kernel(op: str, device: torch.device) -> bool:
    """True if an integration installed a vendor kernel for elementwise ``op`` on ``device``'s type."""
    vk = _STATE.vendor_ew.get(op)
    return vk is not None and vk.fn is not None and device.type in vk.device_types


def _row_views(kernel_inputs: Callable[[int, int], tuple[torch.Tensor, ...]], m: int,
               n: int) -> tuple[torch.Tensor, ...] | None:
    """The kernel's [rows, width] views of the inputs, or None if some input has no such view
    (rows not evenly strided, or a stride inside a row)."""
    try:
        views = kernel_inputs(m, n)
    except RuntimeError:  # .view() of a layout that needs a copy
        return None
    for t in views:
        if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            return None
    return views


def _dense(out: Any) -> Any:
    """Contiguous result(s), as the fake impls promise (a non-contiguous input keeps its strides in eager math)."""
    if isinstance(out, tuple):
        return tuple(t if t.is_contiguous() else t.contiguous() for t in out)
    return out if out.is_contiguous() else out.contiguous()


def _rows(x: torch.Tensor, width: int) -> int:
    return x.numel() // width if width else 0


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    op = "gemma_rms_norm" if gemma else "rms_norm"
    n = x.shape[-1] if x.dim() else 0
    m = _rows(x, n)
    if weight.dim() != 1 or weight.shape[0] != n:
        _count(op, dtype_name(x.dtype), f"{n}x{n}", m, False, "fallback:bad_input", _capturing(x), "eager")
        return _dense(_vendor_rms_norm(x, weight, eps, gemma))
    return _ew_serve(
        op, (x,), weight, (m, n, n), eps,
        make_out=lambda m, n, x: torch.empty((m, n), dtype=x.dtype, device=x.device),
        kernel_inputs=lambda m, n: (x.view(m, n), weight),
        vendor=lambda: _vendor_rms_norm(x, weight, eps, gemma),
        finish=lambda out: out.view(x.shape),
        vendor_args=(x, weight, eps),
    )


def _fused_add_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    op = "gemma_fused_add_rms_norm" if gemma else "fused_add_rms_norm"
    n = x.shape[-1] if x.dim() else 0
    m = _rows(x, n)
    if weight.dim() != 1 or weight.shape[0] != n or residual.shape != x.shape:
        _count(op, dtype_name(x.dtype), f"{n}x{n}", m, False, "fallback:bad_input", _capturing(x), "eager")
        return _dense(_vendor_fused_add(x, residual, weight, eps, gemma))

    def make_out(m: int, n: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty((m, n), dtype=x.dtype, device=x.device),
                torch.empty((m, n), dtype=x.dtype, device=x.device))

    return _ew_serve(
        op, (x, residual), weight, (m, n, n), eps, make_out=make_out,
        kernel_inputs=lambda m, n: (x.view(m, n), residual.view(m, n), weight),
        vendor=lambda: _vendor_fused_add(x, residual, weight, eps, gemma),
        finish=lambda out: (out[0].view(x.shape), out[1].view(x.shape)),
        vendor_args=(x, residual, weight, eps),
    )


def _gated_impl(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Rows are the leading dims but the last two: vLLM's Qwen3.5 passes
    # [tokens, heads, head_dim], the table's problem is m = tokens, n = heads * head_dim.
    k = weight.shape[0] if weight.dim() == 1 else 0
    n = x.shape[-1] * (x.shape[-2] if x.dim() >= 3 else 1) if x.dim() else 0
    m = _rows(x, n)
    if k == 0 or z.shape != x.shape or x.shape[-1] % k:
        _count("gated_rms_norm", dtype_name(x.dtype), f"{n}x{k}", m, False, "fallback:bad_input", _capturing(x),
               "eager")
        return _dense(_vendor_gated(x, z, weight, eps))
    if m and n:
        m, n = _gated_layout(dtype_name(x.dtype), m, n, k, x.device)
    return _ew_serve(
        "gated_rms_norm", (x, z), weight, (m, n, k), eps,
        make_out=lambda m, n, x: torch.empty((m, n), dtype=x.dtype, device=x.device),
        kernel_inputs=lambda m, n: (x.view(m, n), z.view(m, n), weight),
        vendor=lambda: _vendor_gated(x, z, weight, eps),
        finish=lambda out: out.view(x.shape),
        vendor_args=(x, z, weight, eps),
    )


def _gated_layout(dtype: str, m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """The [rows, width] a gated_rms_norm call of m x n is served as (cached per key).

    The norm works per group of k, so how groups are cut into rows does not
    change the result: when the table holds no entry for (m, n) it may hold
    one for the same groups as [m * n / n', n']. Hugging Face passes
    [tokens * heads, head_dim] where vLLM (whose layout ``tunekit search
    --model`` tunes) passes [tokens, heads * head_dim].
    """
    key = (dtype, m, n, k, str(device))
    with _STATE.lock:
        layout = _STATE.gated_layouts.get(key)
    if layout is not None:
        return layout
    layout = (m, n)
    merged, _ = _tables_for(device, str(device))
    if merged is not None and table_mod.lookup(merged, "gated_rms_norm", dtype, m, n, k) is None:
        widths = sorted({e["n"] for e in merged["entries"]
                         if e["op"] == "gated_rms_norm" and e["dtype"] == dtype and e["k"] == k and e["n"] != n
                         and e["n"] % k == 0 and (m * n) % e["n"] == 0})
        for width in widths:
            if table_mod.lookup(merged, "gated_rms_norm", dtype, m * n // width, width, k) is not None:
                layout = (m * n // width, width)
                break
    with _STATE.lock:
        _STATE.gated_layouts.setdefault(key, layout)
        return _STATE.gated_layouts[key]


def _silu_and_mul_impl(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1] if x.dim() else 0
    n = k // 2
    m = _rows(x, k)
    if k % 2:
        _count("silu_and_mul", dtype_name(x.dtype), f"{n}x{k}", m, False, "fallback:bad_input", _capturing(x),
               "eager")
        return _dense(_vendor_silu_and_mul(x))
    return _ew_serve(
        "silu_and_mul", (x,), None, (m, n, k), None,
        make_out=lambda m, n, x: torch.empty((m, n), dtype=x.dtype, device=x.device),
        kernel_inputs=lambda m, n: (x.view(m, 2 * n),),
        vendor=lambda: _vendor_silu_and_mul(x),
        finish=lambda out: out.view(*x.shape[:-1], n),
        vendor_args=(x,),
    )


def _bias_gelu_impl(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] if x.dim() else 0
    m = _rows(x, n)
    if bias.dim() != 1 or bias.shape[0] != n:
        _count("bias_gelu", dtype_name(x.dtype), f"{n}x{n}", m, False, "fallback:bad_input", _capturing(x),
               "eager")
        return _dense(_vendor_bias_gelu(x, bias))
    return _ew_serve(
        "bias_gelu", (x,), bias, (m, n, n), None,
        make_out=lambda m, n, x: torch.empty((m, n), dtype=x.dtype, device=x.device),
        kernel_inputs=lambda m, n: (x.view(m, n), bias),
        vendor=lambda: _vendor_bias_gelu(x, bias),
        finish=lambda out: out.view(x.shape),
        vendor_args=(x, bias),
    )


def _fake_like(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_pair(x: torch.Tensor, residual: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def _fake_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


#: op -> (run-time impl for the CUDA and CPU keys, fake impl).
_ELEMENTWISE_IMPLS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "rms_norm": (lambda x, w, eps: _rms_norm_impl(x, w, eps, False), _fake_like),
    "gemma_rms_norm": (lambda x, w, eps: _rms_norm_impl(x, w, eps, True), _fake_like),
    "fused_add_rms_norm": (lambda x, r, w, eps: _fused_add_impl(x, r, w, eps, False), _fake_pair),
    "gemma_fused_add_rms_norm": (lambda x, r, w, eps: _fused_add_impl(x, r, w, eps, True), _fake_pair),
    "gated_rms_norm": (_gated_impl, _fake_like),
    "silu_and_mul": (_silu_and_mul_impl, _fake_silu_and_mul),
    "bias_gelu": (_bias_gelu_impl, _fake_like),
}


# ---------------------------------------------------------------------------
# Warm-up before capture
# ---------------------------------------------------------------------------


def prepare(device: torch.device | str | None = None, ms: Iterable[int] | None = None) -> dict[str, Any]:
    """Build and run once every tabulated kernel for ``device``, so that no build happens under capture.

    For each (op, dtype, N, K) of the matching tables it calls the op at
    every M its entries serve under the lookup rule (1 up to the largest
    tabulated M) when that range is at most 64 wide, else at the tabulated
    Ms; or at ``ms`` when given (pass the CUDA-graph capture sizes). For an
    elementwise op with no vendor kernel installed for ``device``, the given
    ``ms`` above the table are called too, which builds the default-config
    kernels serving those fallbacks (:func:`_ew_default`), so captured graphs
    hold them instead of the composition. Each M is
    launched once because decisions are cached per M and Triton specialises
    on M's block size. Inputs come from ``tunekit.opspec`` (random, nothing is
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
        merged, reason = _tables_for(device, str(device))
    except Exception as exc:
        summary["errors"].append(f"{type(exc).__name__}: {exc}")
        return summary
    if merged is None:
        summary["fallback"][f"fallback:{reason}"] = 1
        return summary
    from tunekit import opspec
    from tunekit.shapes import Problem

    wanted = None if ms is None else sorted({int(m) for m in ms})
    by_shape: dict[tuple, list[int]] = {}
    for e in merged["entries"]:
        by_shape.setdefault((e["op"], e["dtype"], e["n"], e["k"]), []).append(e["m"])
    gen = torch.Generator(device=device).manual_seed(0)
    # Warm-up calls are not service calls: the markers are put back afterwards.
    with _STATE.lock:
        saved_stats = dict(_STATE.stats)
    for (op, dtype, n, k), tab_ms in sorted(by_shape.items()):
        top = max(tab_ms)
        if wanted is not None:
            above = op != "gemv" and not _has_vendor_kernel(op, device)
            served = [m for m in wanted if m <= top or above]
        else:
            served = list(range(1, top + 1)) if top <= 64 else sorted(set(tab_ms))
        for m in served:
            try:
                inputs = opspec.get(op).make_inputs(Problem(op, dtype, m, n, k), device, gen)
                fn = getattr(torch.ops.tunekit, op)
                fn(*inputs) if op in ("gemv", "silu_and_mul", "bias_gelu") else fn(*inputs, DEFAULT_EPS)
            except Exception as exc:
                summary["errors"].append(f"{op} {dtype} m={m} n={n} k={k}: {type(exc).__name__}: {exc}")
                continue
            key = (op, dtype, m, n, k, str(device))
            if op == "gated_rms_norm":  # served in the layout _gated_layout chose
                m_rows, n_rows = _STATE.gated_layouts.get((dtype, m, n, k, str(device)), (m, n))
                key = (op, dtype, m_rows, n_rows, k, str(device))
            choice = _STATE.choices.get(key)
            impl = choice.impl if choice else "fallback:unknown"
            default = _STATE.defaults.get(key)
            summary["keys"] += 1
            if impl.startswith("tuned:"):
                summary["tuned"] += 1
            elif default is not None and default.kernel is not None:
                summary["default"] += 1
            else:
                summary["fallback"][impl] = summary["fallback"].get(impl, 0) + 1
    with _STATE.lock:
        _STATE.stats = saved_stats
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return summary


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------

_LIB: torch.library.Library | None = None


def _register() -> None:
    """Define ``tunekit::gemv`` and the elementwise ops once per process (a reload reuses them)."""
    global _LIB
    try:
        torch.ops.tunekit.gemv  # noqa: B018 - already defined (e.g. the module was reloaded)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    impls: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
        "gemv": ("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", _gemv_impl, _gemv_fake),
    }
    for op, (impl, fake) in _ELEMENTWISE_IMPLS.items():
        impls[op] = (ELEMENTWISE_SCHEMAS[op], impl, fake)
    for op, (schema, impl, fake) in impls.items():
        lib.define(schema)
        # One Python kernel for both device keys: the choice (tuned or vendor)
        # is made inside, at run time, so traced graphs hold a single opaque
        # node and never branch on M in Python.
        lib.impl(op, impl, "CUDA")
        lib.impl(op, impl, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{op}", fake, lib=lib)
    _LIB = lib


_register()
_maybe_register_atexit()
