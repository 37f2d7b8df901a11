"""Dispatch markers: every served call counted, and when the counts are written out (the dispatch log).

Call protocol: each op impl counts each call once with what served it
(``tuned:<backend>`` or ``fallback:<reason>``, and the vendor of a
fallback): :func:`count`, or the ``tick()`` of the row's :func:`counter`
that its per-key route keeps (one C call on the hot path); :func:`dispatch_stats` /
:func:`reset_stats` read and clear the counters.

Where ``TUNEKIT_DISPATCH_LOG`` is set, :func:`maybe_register_atexit` (on
``import tunekit.ops`` and on every :func:`~tunekit.dispatch.tables.load_tables`)
schedules the dispatch log's writes: at interpreter exit, at the exit of a
forked ``multiprocessing`` child (:func:`_register_child_exit`), and every
few seconds while the counts change (:func:`_start_flusher`: a process
killed before its exit hooks keeps what the last rewrite saw). Each write
calls ``STATE.log_writer``, the writer ``tunekit.dispatch.log`` installs on
import: the log reports the loaded tables, so this module, which the tables
import, cannot import it.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from tunekit.dispatch.state import LOG_ENV, STATE, CallCounter


def count(op: str, dtype: str, shape: str, m: int, bias: bool, impl: str, capturing: bool,
           vendor: str | None = None, served_m: int | None = None) -> None:
    # vendor: what served a fallback (None for a tuned kernel), so the log shows
    # whether a miss ran the integration's kernel or tunekit's eager composition.
    counter(op, dtype, shape, m, bias, impl, capturing, vendor, served_m).tick()


def counter(op: str, dtype: str, shape: str, m: int, bias: bool, impl: str, capturing: bool,
            vendor: str | None = None, served_m: int | None = None) -> CallCounter:
    """The live counter of one marker row (made once): the op impls' routes keep it and call its
    ``tick()`` per call, so the hot path builds no key or string and takes no lock. ``served_m``: the
    tabulated M whose entry's kernel served the call (:func:`served_m`), None for a fallback."""
    key = (op, dtype, shape, m, bias, impl, "capture" if capturing else "call", vendor, served_m)
    found = STATE.counters.get(key)  # lock-free read (atomic under the GIL)
    if found is None:
        with STATE.lock:
            found = STATE.counters.setdefault(key, CallCounter())
    return found


def count_layer(op: str, dtype: str, shape: str, m: int, impl: str, vendor: str) -> None:
    """Count a decision an integration made for a layer before any tunekit op (the layer kept its own code:
    ``vendor`` names it), as a row with ``counted_at`` ``"layer"``: per call where the layer is called eagerly,
    once per trace where it is compiled."""
    key = (op, dtype, shape, m, False, impl, "layer", vendor, None)
    found = STATE.counters.get(key)
    if found is None:
        with STATE.lock:
            found = STATE.counters.setdefault(key, CallCounter())
    found.tick()


def served_m(choice: Any) -> int | None:
    """The tabulated M a tuned choice's kernel was taken from (a call at M = 3 served by the M = 4 entry:
    4); None where no tuned kernel serves (a fallback)."""
    if choice.impl.startswith("tuned:") and choice.entry is not None:
        return choice.entry.m
    return None


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Calls made inside are not service calls (a check on real weights, a warm-up): the dispatch markers
    are put back as they were afterwards."""
    with STATE.lock:
        saved = dict(STATE.stats)
    try:
        yield
    finally:
        with STATE.lock:
            STATE.stats = saved


def dispatch_stats(reset: bool = False) -> list[dict[str, Any]]:
    """Every call counted so far: one row per (op, dtype, shape, m, bias, impl, counted_at, vendor, served_m).

    ``shape`` is ``"NxK"`` for gemv; ``impl`` is ``"tuned:<backend>"`` or
    ``"fallback:<reason>"`` (see :data:`FALLBACK_REASONS`); ``vendor`` is None
    for a tuned kernel, else what served the fallback (``"F.linear"``, a kernel
    an integration installed such as ``"torch.ops._C.rms_norm"``,
    :data:`DEFAULT_VENDOR`, or one of :data:`EAGER_VENDORS`); ``counted_at`` is
    ``"call"`` or ``"capture"`` (CUDA-graph capture: counted once per capture,
    replays are not counted because Python does not run; such rows carry a
    ``note`` saying so), or ``"layer"`` (:func:`count_layer`: a layer an
    integration kept on its own code, with the reason); ``served_m`` is the tabulated M whose entry served
    a tuned call (``m`` itself, or the next tabulated M above it whose config runs at ``m``), None for a
    fallback. ``reset=True`` clears the counters after reading.
    """
    with STATE.lock:
        items = sorted(STATE.stats.items(), key=lambda kv: tuple(str(v) for v in kv[0]))
        if reset:
            STATE.stats.clear()
    rows = []
    for (op, dtype, shape, m, bias, impl, counted_at, vendor, served), calls in items:
        row: dict[str, Any] = {"op": op, "dtype": dtype, "shape": shape, "m": m, "bias": bias, "impl": impl,
                               "vendor": vendor, "calls": calls, "counted_at": counted_at, "served_m": served}
        if counted_at == "capture":
            row["note"] = "counted at capture: CUDA-graph replays run without Python and are not counted"
        rows.append(row)
    return rows


def reset_stats() -> None:
    """Forget the dispatch markers (not the tables or the built kernels)."""
    with STATE.lock:
        STATE.stats.clear()


def _write_log() -> Any:
    """Write the dispatch log with the installed writer (``tunekit.dispatch.log.write_dispatch_log``): the
    path written, or None (none written, or no writer installed)."""
    writer = STATE.log_writer
    return None if writer is None else writer()


#: seconds between rewrites of the dispatch log while a process runs (``TUNEKIT_DISPATCH_LOG_INTERVAL``)
INTERVAL_ENV = "TUNEKIT_DISPATCH_LOG_INTERVAL"
DEFAULT_INTERVAL_S = 5.0


def maybe_register_atexit() -> None:
    """Once per process, where ``TUNEKIT_DISPATCH_LOG`` is set: write the log at exit, and rewrite it
    every few seconds while the counts change (:func:`_start_flusher`)."""
    with STATE.lock:
        if STATE.atexit_registered or not os.environ.get(LOG_ENV):
            return
        STATE.atexit_registered = True
    atexit.register(_write_log)
    _start_flusher()


def _start_flusher() -> None:
    """Rewrite the log from a daemon thread whenever the counts changed since the last write.

    A process may be killed before any exit hook runs: a stopping ``vllm
    serve`` sends SIGTERM to its engine core (the process that runs the
    model) while the core tears down, with the core's handlers already
    reset. What the last rewrite saw survives; exit hooks add the rest where
    they run. Rewrites happen only on change, so a decode running from CUDA
    graphs (no Python, no counts) writes nothing.
    """
    try:
        interval = float(os.environ.get(INTERVAL_ENV) or DEFAULT_INTERVAL_S)
    except ValueError:
        interval = DEFAULT_INTERVAL_S
    if interval <= 0:
        return

    def flush() -> None:
        written: dict | None = None
        while True:
            time.sleep(interval)
            with STATE.lock:
                now = dict(STATE.stats)
            if now != written and _write_log() is not None:
                written = now

    threading.Thread(target=flush, name="tunekit-dispatch-log", daemon=True).start()


class _ForkHook:
    """The owner of the after-fork hook (``multiprocessing.util.register_after_fork`` keeps it weakly)."""


def _register_child_exit(_owner: _ForkHook) -> None:
    """In a forked ``multiprocessing`` child: the child's own log, rewritten while it runs and at its exit.

    Such a child (vLLM's engine core, forked from the API server that loaded
    the plugin) inherits the registration flag but not the flusher thread,
    and leaves through ``os._exit``, which skips ``atexit``; its clean exit
    path runs ``multiprocessing``'s finalizers instead.
    """
    if STATE.atexit_registered:
        multiprocessing.util.Finalize(None, _write_log, exitpriority=0)
        _start_flusher()


_FORK_HOOK = _ForkHook()
multiprocessing.util.register_after_fork(_FORK_HOOK, _register_child_exit)
