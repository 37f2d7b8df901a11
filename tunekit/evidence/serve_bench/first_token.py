"""``serve-bench --first-token 64,2048,8192``: a time to first token that could show a 2% regression.

The 1-token generate of every TPOT pair is one sample per repeat, taken at the one ``--prompt-len`` right
after a ``--tokens`` generate; single ones of it moved from 84 to 192 ms within one H200 process. This mode
times the first token on its own, per case (prompt length, batch size):

* in every engine process, after the TPOT batch sizes: one untimed 1-token generate per case (warm-up:
  the prefill's compile and capture sizes, the allocator's blocks for that many tokens), then ``repeats``
  timed 1-token generates per case, the cases taken round-robin (``order``), each round starting one case
  later than the one before, so a drift over the process charges every case alike and no case always
  follows the longest prefill;
* every request's prompt is fresh: its first two token ids are the request's serial number in the process
  (``prompts``), so no two requests of a process share a first KV block and nothing is served from a prefix
  cache; the engines run with ``enable_prefix_caching=False`` in every arm besides. The serials start at 0 in
  every process, so every arm and process prefills the same token ids in the same order;
* every sample is recorded (seconds), with what Python's GC, the CUDA allocator and Triton's JIT did in it.

Figures (``summarize``; pure): per arm and case the median over a process's samples, then the median over
processes; vanilla's spread between its processes (max / min of their medians - 1) and within a process
(IQR / median, the largest over processes); per other arm the ratio arm / vanilla of those medians, with its
range over the process pairs of one round (arm #i / vanilla #i, which ran next to each other), and a verdict:

* ``within 2%``: the whole range inside [0.98, 1.02] and vanilla's process spread below 2%;
* ``slower`` / ``faster``: the whole range above 1.02 / below 0.98, vanilla's spread below 2%;
* ``unresolved (...)`` otherwise: a noisy run (vanilla's spread at or past 2%, one vanilla process) or a
  range across a bound is never a pass.

Standard library only at import: the runner (no tunekit beyond ``serve_bench``) and the analysis use it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

#: the band of "no first-token cost" (issue 48: within 2% of vanilla), and the most vanilla's processes may
#: differ for a run to resolve it
BAND = 0.02
#: timed 1-token generates per case and process unless told: the median of 20 moves by well under 2% when the
#: samples scatter by ~5% (IQR / median) around it
DEFAULT_REPEATS = 20
#: the fewest timed samples per case that give an IQR at all
MIN_REPEATS = 3
_ID_SPAN = 10_000  # as the runner's prompts: ordinary ids of any tokenizer
_ID_BASE = 100


def order(cases: int, repeats: int) -> list[int]:
    """The timed generates' case indexes: ``repeats`` rounds of every case once, round r starting at case r."""
    return [(r + j) % cases for r in range(repeats) for j in range(cases)]


def prompts(batch: int, length: int, serial: int, vocab_size: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` token ids for the requests numbered ``serial``..``serial + batch - 1``:
    the first two ids spell the number (distinct up to 10^8 requests), the rest vary with it."""
    span = max(2, min(_ID_SPAN, vocab_size - _ID_BASE))
    out = []
    for s in range(serial, serial + batch):
        head = [_ID_BASE + s % span, _ID_BASE + (s // span) % span]
        body = [_ID_BASE + (s * 7919 + j * 131 + s * j) % span for j in range(2, length)]
        out.append((head + body)[:length])
    return out


def measure(generate: Callable[[list[list[int]]], Any], lengths: Sequence[int], batches: Sequence[int],
            repeats: int, vocab_size: int, events: Callable[[], Any] | None = None,
            log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Warm-up and timed 1-token generates of every (length, batch) case (module docstring). ``generate`` takes
    token-id prompts and runs one 1-token generate of them; ``events``: a context manager per timed generate
    whose ``record()`` is kept (the runner's ``HostEvents``). Returns the result's ``first_token`` record."""
    cases = [(int(n), int(b)) for n in lengths for b in batches]
    serial = 0
    for n, b in cases:  # warm-up, untimed: its requests still take serials, so no later prompt repeats one
        generate(prompts(b, n, serial, vocab_size))
        serial += b
    records: list[dict[str, Any]] = [{"prompt_len": n, "batch": b, "t_s": [], "host": []} for n, b in cases]
    sequence = order(len(cases), repeats)
    for k in sequence:
        n, b = cases[k]
        batch_prompts = prompts(b, n, serial, vocab_size)
        serial += b
        ctx = events() if events is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            start = time.perf_counter()
            generate(batch_prompts)
            elapsed = time.perf_counter() - start
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        records[k]["t_s"].append(elapsed)
        if ctx is not None:
            records[k]["host"].append(ctx.record())
    if log is not None:
        log("first token: " + ", ".join(f"L={r['prompt_len']} B={r['batch']} "
                                         f"{statistics.median(r['t_s']) * 1000.0:.2f} ms" for r in records))
    return {"lengths": [int(n) for n in lengths], "batches": [int(b) for b in batches], "repeats": repeats,
            "order": sequence, "requests": serial, "cases": records}


# ---------------------------------------------------------------------------
# Figures (pure)
# ---------------------------------------------------------------------------


def process_figures(t_s: Sequence[float]) -> dict[str, Any]:
    """One process's samples of one case, in ms: median, IQR / median (None below 2 samples), min, max."""
    ms = [float(t) * 1000.0 for t in t_s]
    med = statistics.median(ms)
    iqr = None
    if len(ms) >= 2 and med > 0:
        q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
        iqr = (q3 - q1) / med
    return {"median_ms": med, "iqr_rel": iqr, "min_ms": min(ms), "max_ms": max(ms), "samples": len(ms)}


def _case(doc: dict[str, Any], length: int, batch: int) -> dict[str, Any] | None:
    record = doc.get("first_token") or {}
    return next((c for c in record.get("cases", []) if c["prompt_len"] == length and c["batch"] == batch
                 and c.get("t_s")), None)


def arm_case(docs: Sequence[dict[str, Any]], length: int, batch: int) -> dict[str, Any] | None:
    """One arm at one case over its processes: per process (by index) its figures; the median of their
    medians, their min / max, the spread between them (max / min - 1; None with one process) and the largest
    IQR / median within one."""
    per = {str(d["index"]): process_figures(c["t_s"]) for d in docs if (c := _case(d, length, batch)) is not None}
    if not per:
        return None
    medians = [p["median_ms"] for p in per.values()]
    iqrs = [p["iqr_rel"] for p in per.values() if p["iqr_rel"] is not None]
    return {"median_ms": statistics.median(medians), "min_ms": min(medians), "max_ms": max(medians),
            "spread": max(medians) / min(medians) - 1.0 if len(medians) >= 2 and min(medians) > 0 else None,
            "iqr_rel_max": max(iqrs) if iqrs else None, "per_process": per}


def ratios(arm: dict[str, Any], vanilla: dict[str, Any]) -> list[float]:
    """arm #i / vanilla #i over the indexes both have (the processes of one round ran next to each other)."""
    common = sorted(set(arm["per_process"]) & set(vanilla["per_process"]), key=int)
    return [arm["per_process"][i]["median_ms"] / vanilla["per_process"][i]["median_ms"] for i in common
            if vanilla["per_process"][i]["median_ms"] > 0]


def verdict(low: float | None, high: float | None, vanilla_spread: float | None) -> str:
    """The case's verdict from the ratio's range over process pairs and vanilla's spread between processes."""
    if vanilla_spread is None:
        return "unresolved (one vanilla process: no spread between processes)"
    if low is None or high is None:
        return "unresolved (no process pair of this arm and vanilla)"
    if vanilla_spread < BAND:
        if 1.0 - BAND <= low and high <= 1.0 + BAND:
            return "within 2%"
        if low > 1.0 + BAND:
            return "slower"
        if high < 1.0 - BAND:
            return "faster"
    return f"unresolved (vanilla spread {vanilla_spread * 100.0:.1f}%)"


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """``serve.json``'s ``ttft``: the cases of the processes' ``first_token`` records (None where no process
    has one), each with every arm's figures and every other arm's ratio to vanilla and verdict."""
    records = [d["first_token"] for docs in results.values() for d in docs if d.get("first_token")]
    if not records:
        return None
    # every process of a run times the same cases; a folder resumed by hand may mix some: their union
    lengths = list(dict.fromkeys(n for r in records for n in r["lengths"]))
    batches = list(dict.fromkeys(b for r in records for b in r["batches"]))
    cases = []
    for length in lengths:
        for batch in batches:
            arms = {arm: fig for arm, docs in results.items() if (fig := arm_case(docs, length, batch)) is not None}
            if not arms:
                continue
            vanilla = arms.get("vanilla")
            compared: dict[str, Any] = {}
            for arm, fig in arms.items():
                if arm == "vanilla" or vanilla is None:
                    continue
                pairs = ratios(fig, vanilla)
                low, high = (min(pairs), max(pairs)) if pairs else (None, None)
                compared[arm] = {"ratio": fig["median_ms"] / vanilla["median_ms"] if vanilla["median_ms"] > 0
                                 else None, "min": low, "max": high, "pairs": len(pairs),
                                 "verdict": verdict(low, high, vanilla["spread"])}
            cases.append({"prompt_len": length, "batch": batch, "arms": arms,
                          "vanilla_spread": vanilla["spread"] if vanilla else None,
                          "vanilla_iqr_rel": vanilla["iqr_rel_max"] if vanilla else None, "compared": compared})
    return {"lengths": lengths, "batches": batches, "repeats": max(r["repeats"] for r in records),
            "band": BAND, "cases": cases}


def notes(ttft: dict[str, Any] | None) -> list[str]:
    """A note per case and arm whose verdict is not ``within 2%``."""
    out = []
    for case in (ttft or {}).get("cases", []):
        for arm, c in case["compared"].items():
            if c["verdict"] == "within 2%":
                continue
            where = f"first token at prompt {case['prompt_len']}, B={case['batch']}: {arm} / vanilla"
            span = "-" if c["min"] is None else f"{c['min']:.3f}-{c['max']:.3f}"
            more = (": more --processes or --first-token-repeats, or a quieter machine"
                    if c["verdict"].startswith("unresolved") else "")
            out.append(f"{where} {span} over {c['pairs']} process pairs, {c['verdict']}{more}")
    return out
