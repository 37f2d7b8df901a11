"""TPOT two ways: the difference of two generates, and decode time from per-token timestamps.

The difference method, (t(tokens) - t(1)) / (tokens - 1), takes its 1-token
generate from a separate call: a first token slower in one call than in
the other (a host stall, a collection, a late compile) moves it. The
timestamps need no second call: :class:`TokenClock` notes when each
request's new tokens reach the engine's output processor during the long
generate itself (vLLM v1's ``LLMEngine.output_processor.process_outputs``,
called once per engine step with the step's new token ids per request), and
a request's decode TPOT is (last token - first token) / (tokens - 1), vLLM's
own definition (``RequestOutput.metrics``, which the offline engine does not
fill without stats logging). The report flags a batch size where the two
figures differ by more than :data:`DISAGREE` (2%).

The clock is on during every timed generate, both lengths, so its cost
(one Python call per engine step) cancels in the difference method too.

Call protocol::

    with TokenClock(llm) as clock:           # no-op (record() -> None) where this vLLM has no output processor
        llm.generate(...)
    clock.record()                           # {"steps", "requests", "tokens", "tpot_ms"} | None
    stamps_ms(rows_records)                  # median over timed generates
    compare(difference_ms, stamps_ms)        # {"ratio", "disagree"}
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from typing import Any

#: The two TPOT figures of a batch size may differ by this share before the report flags it.
DISAGREE = 0.02


class InstanceHook:
    """A context manager that wraps ``METHOD`` of one vLLM object (``_target``) on the instance with
    ``_wrapped``, which calls ``_orig``, and restores the class's method on exit. No such object or method:
    nothing is wrapped and ``_orig`` stays None (the subclass's ``record()`` says so)."""

    METHOD = ""

    def __init__(self, target: Any) -> None:
        self._target = target
        self._orig: Any = None

    def _wrapped(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def __enter__(self) -> InstanceHook:
        if self._target is not None and callable(getattr(self._target, self.METHOD, None)):
            self._orig = getattr(self._target, self.METHOD)
            setattr(self._target, self.METHOD, self._wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._orig is not None:
            try:
                delattr(self._target, self.METHOD)  # the class's method again
            except AttributeError:
                setattr(self._target, self.METHOD, self._orig)


class TokenClock(InstanceHook):
    """Per-request token arrival times during one ``generate`` (module docstring): wraps the output
    processor's ``process_outputs`` on the instance and restores it on exit."""

    METHOD = "process_outputs"

    def __init__(self, llm: Any) -> None:
        super().__init__(getattr(getattr(llm, "llm_engine", None), "output_processor", None))
        self.steps = 0
        self.per: dict[Any, list[float]] = {}

    def _wrapped(self, outputs: Any, *args: Any, **kwargs: Any) -> Any:
        now = time.perf_counter()
        self.steps += 1
        for out in outputs or ():
            n = len(getattr(out, "new_token_ids", None) or ())
            if n:
                rec = self.per.get(out.request_id)
                if rec is None:
                    self.per[out.request_id] = [now, now, float(n)]
                else:
                    rec[1] = now
                    rec[2] += n
        return self._orig(outputs, *args, **kwargs)

    def record(self) -> dict[str, Any] | None:
        """``tpot_ms``: the median over requests of (last - first token) / (tokens - 1); None without a clock
        or without a request of two tokens."""
        if self._orig is None:
            return None
        tpots = [(last - first) / (n - 1) * 1000.0 for first, last, n in self.per.values() if n > 1]
        return {"steps": self.steps, "requests": len(self.per), "tokens": int(sum(r[2] for r in self.per.values())),
                "tpot_ms": statistics.median(tpots) if tpots else None}


def stamps_ms(records: Iterable[dict[str, Any] | None]) -> float | None:
    """The timestamps' TPOT over one batch size's timed generates: the median of their ``tpot_ms``."""
    values = [float(r["tpot_ms"]) for r in records if r and r.get("tpot_ms") is not None]
    return statistics.median(values) if values else None


def compare(difference_ms: float | None, stamps: float | None, tol: float = DISAGREE) -> dict[str, Any]:
    """The two figures side by side: ``ratio`` = timestamps / difference, ``disagree`` when it is off 1 by
    more than ``tol`` (None when either figure is missing)."""
    if not difference_ms or stamps is None:
        return {"difference_ms": difference_ms, "timestamps_ms": stamps, "ratio": None, "disagree": None}
    ratio = stamps / difference_ms
    return {"difference_ms": difference_ms, "timestamps_ms": stamps, "ratio": ratio, "disagree": abs(ratio - 1) > tol}


def arm_methods(results_by_arm: dict[str, list[dict[str, Any]]], tpot_by_arm: dict[str, Any],
                batch: int) -> dict[str, dict[str, Any]]:
    """Per arm at ``batch``: the difference method's TPOT (``tpot_by_arm[arm]["median_ms"]``, the median over
    processes) beside the timestamps' (each process's median over its timed generates, then the median over
    processes), and :func:`compare` of the two."""
    out = {}
    for arm, diff in tpot_by_arm.items():
        per = []
        for res in results_by_arm.get(arm, []):
            row = next((r for r in res.get("batches", []) if r["batch"] == batch), None)
            value = stamps_ms((row or {}).get("t_tokens_clock") or [])
            if value is not None:
                per.append(value)
        out[arm] = compare(diff["median_ms"] if diff else None, statistics.median(per) if per else None)
    return out


def disagreement_note(batch: int, methods: dict[str, dict[str, Any]], tol: float = DISAGREE) -> str | None:
    """The report's note for the arms whose two TPOT figures differ by more than ``tol`` at ``batch``."""
    off = [f"{arm} {m['difference_ms']:.3f} vs {m['timestamps_ms']:.3f} ms ({m['ratio']:.3f}x)"
           for arm, m in methods.items() if m.get("disagree")]
    if not off:
        return None
    return (f"B={batch}: TPOT by difference and by per-token timestamps differ by more than {tol:.0%}: "
            + "; ".join(off) + " (a first token slower in one of the two generates moves the difference)")
