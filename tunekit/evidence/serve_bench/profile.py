"""Where a served decode step's GPU time goes: kernel time per category, per arm (``serve-bench --profile``).

The served saving can fall short of what the tables' standalone figures
predict. This tells the two possible causes apart by measurement, in the
same engine process that was timed:

* **GPU time.** torch's profiler (CUPTI) records every kernel; CUPTI reports
  the kernels of vLLM's CUDA-graph replays one by one too (seen on the H200:
  tunekit's kernels by name, grid and block). Two generates are profiled per
  batch size: 1 token (prefill) and ``1 + steps`` tokens. Their difference
  divided by ``steps`` is one decode step's kernel time and kernel count per
  category. This is the TPOT method applied to kernels, so prefill cancels
  out.
* **What is not kernel time.** TPOT minus the step's kernel time: launch gaps,
  host work the graph does not hide, the scheduler.

Kernel time is kept per category, per kernel name and per launch
(:func:`launch_totals`: name, grid, block and the kernel before it, with the
launch gap), the last so that one GEMV problem's launch inside the step can be
set beside the same kernel in ``tunekit chain --profile-replays`` and beside
its own standalone time in this process (:func:`in_process_kernel_times`).

Categories are read from kernel names (:data:`CATEGORIES`, first match wins):
tunekit's own kernels (Triton and HIP), the vendor GEMMs (cuBLAS / CUTLASS),
attention, the linear-attention recurrence, Inductor's fused Triton kernels,
copies, and everything else. Comparing vanilla's row with tuned's shows which
category the saving came from, and whether another one grew. An opaque
tunekit op can stop an Inductor fusion; that shows as more ``inductor``
kernels.

The engine core must run in the profiling process. The runner ensures this
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

#: (category, kernel-name pattern), first match wins. tunekit's kernels come first: their names say
#: gemv / rms_norm too. Triton names its kernels after the jit function; the HIP family's are tunekit_*.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("tunekit_gemv", re.compile(r"^(_gemv_kernel|_split_k_reduce_kernel|_rms_norm_gemv_kernel|"
                                r"_silu_mul_gemv_kernel|tunekit_gemv)")),
    ("tunekit_elementwise", re.compile(r"^(_rms_norm_kernel|_fused_add_rms_norm_kernel|_gated_rms_norm_kernel|"
                                       r"_silu_and_mul_kernel|_bias_gelu_kernel|tunekit_)")),
    # Inductor names its kernels after the graph nodes they fuse, so one that reads a GEMV's output says
    # gemv (triton_poi_fused_gemv_mul_silu_slice_1 on the H200): its prefix decides before any name does
    ("inductor", re.compile(r"^triton_")),
    # attention before the GEMMs: FlashAttention's kernels say splitkv, CUTLASS-built ones gemm
    ("attention", re.compile(r"flash|fmha|attn|attention|paged", re.I)),
    ("vendor_gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitkreduce|wgmma", re.I)),
    ("recurrence", re.compile(r"recurrent|chunk_|gated_delta|delta_rule|conv1d|causal_conv|fla_|gdn", re.I)),
)
#: the event categories of torch's Chrome trace that are device work
_DEVICE_CATS = {"kernel": None, "gpu_memcpy": "copies", "gpu_memset": "copies"}


def categorize(name: str) -> str:
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return "other"


#: kernels kept by name per profiled step (the largest by time): enough to name what a category's change is
TOP_KERNELS = 40
#: launch shapes kept per profiled step (``by_launch``): every GEMV problem of a decode step and its neighbours
TOP_LAUNCHES = 80
#: a kernel's name is cut to this many characters (C++ template names run to kilobytes)
NAME_CHARS = 160


def _device_events(trace: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """(event, category) for each device event of a Chrome trace (kernels, memcpys, memsets), in file order."""
    for event in trace.get("traceEvents", []):
        if isinstance(event, dict) and event.get("ph") == "X" and event.get("cat") in _DEVICE_CATS:
            yield event, _DEVICE_CATS[event["cat"]] or categorize(str(event.get("name", "")))


def kernel_totals(trace: dict[str, Any], by_name: bool = False) -> dict[str, dict[str, float]]:
    """{category: {"us": summed duration, "kernels": count}} over a Chrome trace's device events;
    ``by_name``: keyed by ``"category: kernel name"`` instead (the name cut to NAME_CHARS)."""
    totals: dict[str, dict[str, float]] = {}
    for event, category in _device_events(trace):
        key = f"{category}: {str(event.get('name', ''))[:NAME_CHARS]}" if by_name else category
        slot = totals.setdefault(key, {"us": 0.0, "kernels": 0})
        slot["us"] += float(event.get("dur", 0.0))
        slot["kernels"] += 1
    return totals


#: a gap between two device events at most this long is a launch gap inside one replay; a longer one is
#: the host's turn between steps (sampling, scheduling) and is not charged to the kernel after it
IN_GRAPH_GAP_US = 20.0
#: the kernel before a launch is named by this many characters in a ``by_launch`` key
AFTER_CHARS = 48


def launch_totals(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Device time per launch shape and neighbour: {"category: name grid=(x,y,z) block=(x,y,z) after=prev":
    {"us", "kernels", "gap_us"}} over a Chrome trace's device events, in time order per stream.

    One kernel name runs many problems (tunekit's ``_gemv_kernel`` serves every GEMV shape); its grid and
    block tell them apart where the configs differ, and the kernel that ran before it tells them apart
    where they do not (a layer's output GEMV after the gated norm, down_proj after SiLU-and-mul). The
    predecessor is also what a launch's in-situ cost may depend on. ``gap_us`` sums the idle time
    between the previous event's end and this launch's start, where that is a launch gap
    (:data:`IN_GRAPH_GAP_US`)."""
    events = sorted(_device_events(trace), key=lambda ec: (str(ec[0].get("tid", "")), float(ec[0].get("ts", 0.0))))
    totals: dict[str, dict[str, float]] = {}
    prev: dict[str, Any] | None = None
    for event, category in events:
        if prev is not None and str(prev.get("tid", "")) != str(event.get("tid", "")):
            prev = None  # another stream: its first event has no predecessor here
        name = str(event.get("name", ""))
        args = event.get("args") or {}
        shape = "".join(f" {field}=({','.join(str(v) for v in args[field])})" for field in ("grid", "block")
                        if isinstance(args.get(field), list))
        after = str(prev.get("name", ""))[:AFTER_CHARS] if prev is not None else "-"
        key = f"{category}: {name[:NAME_CHARS]}{shape} after={after}"
        slot = totals.setdefault(key, {"us": 0.0, "kernels": 0, "gap_us": 0.0})
        slot["us"] += float(event.get("dur", 0.0))
        slot["kernels"] += 1
        if prev is not None:
            gap = float(event.get("ts", 0.0)) - float(prev.get("ts", 0.0)) - float(prev.get("dur", 0.0))
            if 0.0 < gap <= IN_GRAPH_GAP_US:
                slot["gap_us"] += gap
        prev = event
    return totals


def read_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def per_step(short: dict[str, dict[str, float]], long: dict[str, dict[str, float]], steps: int
             ) -> dict[str, dict[str, float]]:
    """One decode step per category: (long - short) / steps, for each field (kernel time in us, the
    count, and any other the tables hold, such as ``by_launch``'s gap_us)."""
    out = {}
    for category in sorted(set(short) | set(long)):
        a, b = short.get(category, {}), long.get(category, {})
        out[category] = {f: (b.get(f, 0.0) - a.get(f, 0.0)) / steps for f in sorted(set(a) | set(b))}
    return out


def top_kernels(step: dict[str, dict[str, float]], n: int = TOP_KERNELS) -> dict[str, dict[str, float]]:
    """The ``n`` entries of a per-step by-name difference with the most time."""
    return dict(sorted(step.items(), key=lambda kv: -abs(kv[1]["us"]))[:n])


def traced(run: Callable[[], Any], activity: str) -> dict[str, Any]:
    """The Chrome trace of ``run()`` under torch's profiler with one activity ("CUDA" or "CPU")."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[getattr(ProfilerActivity, activity)]) as prof:
        run()
        torch.cuda.synchronize()
    fd, name = tempfile.mkstemp(suffix=".json", prefix="tunekit-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(name)
        return read_trace(Path(name))
    finally:
        os.unlink(name)


def profile_totals(run: Callable[[], Any]) -> tuple[dict[str, dict[str, float]], ...]:
    """Kernel totals of everything ``run()`` puts on the GPU (torch's profiler, CUDA activity only), per
    category, per kernel name and per launch shape (:func:`launch_totals`)."""
    trace = traced(run, "CUDA")
    return kernel_totals(trace), kernel_totals(trace, by_name=True), launch_totals(trace)


#: host ops kept by name from the profiled 1-token generate (the largest by inclusive time)
TOP_HOST_OPS = 30


def host_totals(trace: dict[str, Any], n: int = TOP_HOST_OPS) -> dict[str, dict[str, float]]:
    """{op name: {"us": summed inclusive CPU time, "calls": count}} of a trace's ``cpu_op`` events, the
    ``n`` largest. Inclusive: a nested op counts in its parent too, so compare a name across arms, not
    names with each other."""
    totals: dict[str, dict[str, float]] = {}
    for event in trace.get("traceEvents", []):
        if isinstance(event, dict) and event.get("ph") == "X" and event.get("cat") == "cpu_op":
            slot = totals.setdefault(str(event.get("name", ""))[:NAME_CHARS], {"us": 0.0, "calls": 0})
            slot["us"] += float(event.get("dur", 0.0))
            slot["calls"] += 1
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]["us"])[:n])


def host_profile(run: Callable[[], Any]) -> dict[str, dict[str, float]]:
    """The host ops of ``run()`` (torch's profiler, CPU activity only, so the kernel profiles stay free of
    its overhead): where a prefill's time goes when its kernels take the same time in both arms."""
    return host_totals(traced(run, "CPU"))


#: Python functions kept from the cProfile-d 1-token generate (the largest by own time)
TOP_PY_FUNCS = 30


def _py_name(key: tuple[str, int, str]) -> str:
    """cProfile's (file, line, function) as ``package/module.py:line(function)`` (a builtin: its name)."""
    filename, line, func = key
    if filename == "~" or not filename:
        return func[:NAME_CHARS]
    path = Path(filename)
    return f"{path.parent.name}/{path.name}:{line}({func})"[:NAME_CHARS]


def _cprofiled(run: Callable[[], Any]) -> dict[tuple[str, int, str], tuple]:
    """cProfile's stats of ``run()``: {(file, line, function): (primitive calls, calls, own s, cum s, callers)}."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        run()
    finally:
        prof.disable()
    return pstats.Stats(prof).stats


def _top_functions(stats: dict[tuple[str, int, str], tuple], n: int = TOP_PY_FUNCS) -> dict[str, dict[str, float]]:
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return {_py_name(key): {"us": own * 1e6, "cum_us": cum * 1e6, "calls": float(calls)}
            for key, (_, calls, own, cum, _) in top}


def decode_step_profile(generate: Callable[[int], Any], steps: int) -> dict[str, Any]:
    """``generate(n)`` runs one generate of n new tokens at the measured batch size. Returns the step's
    kernel time and count per category, their total (``busy_us``), the raw totals of both runs, the
    kernels by name, the host ops of a third, CPU-profiled 1-token generate (``prefill_host``) and the
    Python functions of a fourth under cProfile (``prefill_python``)."""
    short, short_names, short_launches = profile_totals(lambda: generate(1))
    long, long_names, long_launches = profile_totals(lambda: generate(1 + steps))
    step = per_step(short, long, steps)
    return {"steps": steps, "per_step": step, "busy_us": sum(c["us"] for c in step.values()),
            "kernels": sum(c["kernels"] for c in step.values()), "short": short, "long": long,
            "by_kernel": top_kernels(per_step(short_names, long_names, steps)),
            "by_launch": top_kernels(per_step(short_launches, long_launches, steps), TOP_LAUNCHES),
            "prefill_host": host_profile(lambda: generate(1)),
            **_prefill_python(lambda: generate(1))}


#: rotated operands larger than this are not timed in the engine's process (its KV cache holds most of the
#: GPU's memory; lm_head's two 2.5 GB copies would not fit beside it)
IN_PROCESS_MAX_BYTES = 2 << 30


def in_process_kernel_times() -> dict[str, dict[str, float]]:
    """Each tuned kernel this process serves, timed standalone here: ``{"op MxNxK": {"us": median,
    "table_us": its entry's time}}``, through the search's own timing path (``tunekit.measure.bench``: rotated
    cold weights, a CUDA graph of launches of that kernel alone).

    ``by_launch`` gives a kernel's time inside the decode step; this gives the same kernel's time in the
    same process with the step's neighbours taken away. Where the in-step time exceeds the table's,
    the two tell a kernel that is slower in this process (built, bound or placed differently) from
    one that is slower among the step's other kernels. Problems whose rotated operand exceeds
    :data:`IN_PROCESS_MAX_BYTES` are left out; a problem that fails to time records its error."""

    from tunekit.dispatch.state import STATE
    from tunekit.measure.bench import Rotation, release_memory, rotation_size, time_kernel
    from tunekit.measure.device import detect
    from tunekit.problems import opspec
    from tunekit.problems.shapes import Problem

    info = detect()
    out: dict[str, dict[str, Any]] = {}
    for (op, dtype, m, n, k, _device), choice in sorted(STATE.choices.items(), key=lambda kv: str(kv[0])):
        if choice.kernel is None or not choice.impl.startswith("tuned:") or op not in opspec.OPS:
            continue
        problem = Problem(op, dtype, m, n, k)
        key = f"{op} {m}x{n}x{k}"
        row: dict[str, Any] = {"us": float("nan"),
                               "table_us": float(choice.entry.time_us) if choice.entry else float("nan")}
        if rotation_size(opspec.get(op), problem, info)[1] > IN_PROCESS_MAX_BYTES:
            out[key] = row | {"error": "rotated operand too large beside the KV cache"}
            continue
        try:
            rotation = Rotation(opspec.get(op), problem, info)
            out[key] = row | {"us": time_kernel(choice.kernel, rotation).median_us}
            del rotation
        except Exception as exc:  # noqa: BLE001 - one problem's failure is recorded, the others still run
            out[key] = row | {"error": f"{type(exc).__name__}: {exc}"}
        release_memory()
    return out


def _prefill_python(run: Callable[[], Any]) -> dict[str, Any]:
    """Python's own profiler (cProfile) over ``run()``. torch's profiler sees aten ops and kernels, not
    the Python between them: ``prefill_python`` ({function: {"us": own time, "cum_us": inclusive time,
    "calls"}}, the :data:`TOP_PY_FUNCS` with the most own time) names the functions where an eager
    prefill's host time goes; ``prefill_python_calls`` counts every Python call of it. A count does
    not depend on how fast the host ran, so it tells more host work (a count that grew) from a slower
    host (equal counts, more time): the two causes a time alone cannot separate."""
    stats = _cprofiled(run)
    return {"prefill_python": _top_functions(stats), "prefill_python_calls": float(sum(v[1] for v in stats.values()))}


def arm_profile(rows: Iterable[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Median over an arm's processes of each category's per-step time and count (None: no profile)."""
    import statistics

    profiles = [r for r in rows if r]
    if not profiles:
        return None
    return {"processes": len(profiles), "per_step": _medians([p["per_step"] for p in profiles], "kernels"),
            "busy_us": statistics.median(p["busy_us"] for p in profiles),
            "kernels": statistics.median(p["kernels"] for p in profiles),
            "by_kernel": _medians([p.get("by_kernel", {}) for p in profiles], "kernels"),
            "by_launch": _medians([p.get("by_launch", {}) for p in profiles], "kernels"),
            "in_process": _medians([p.get("in_process", {}) for p in profiles if "in_process" in p], "table_us"),
            "prefill_host": _medians([p.get("prefill_host", {}) for p in profiles], "calls"),
            "prefill_python": _medians([p.get("prefill_python", {}) for p in profiles], "calls"),
            "prefill_work": _prefill_work(profiles)}


def _prefill_work(profiles: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The 1-token generate's work, counted (medians over processes): kernels launched and Python calls
    made; None where no process recorded it (results from before the Python call count)."""
    import statistics

    kernels = [sum(c["kernels"] for c in p["short"].values()) for p in profiles if p.get("short")]
    calls = [p["prefill_python_calls"] for p in profiles if p.get("prefill_python_calls") is not None]
    return {"kernels": statistics.median(kernels) if kernels else None,
            "python_calls": statistics.median(calls) if calls else None}


def _medians(tables: Sequence[dict[str, dict[str, float]]], count: str) -> dict[str, dict[str, float]]:
    """Per name in any of ``tables`` ({name: {"us", count, ...}}, one per process), the median of each
    numeric field; a name or field missing from a process counts 0 there."""
    import statistics

    fields = sorted({"us", count} | {f for t in tables for row in t.values() for f in row
                                     if isinstance(row.get(f), (int, float))})
    return {k: {f: statistics.median(t.get(k, {}).get(f, 0.0) for t in tables) for f in fields}
            for k in sorted({k for t in tables for k in t})}


def _side_by_side(vanilla: dict[str, dict[str, float]], tuned: dict[str, dict[str, float]],
                  count: str) -> dict[str, dict[str, float]]:
    """Per name in either arm: each arm's time and count (0 where absent) and ``saved_us`` (vanilla - tuned)."""
    zero = {"us": 0.0, count: 0.0}
    rows = {}
    for k in sorted(set(vanilla) | set(tuned)):
        v, t = vanilla.get(k, zero), tuned.get(k, zero)
        rows[k] = {"vanilla_us": v["us"], "tuned_us": t["us"], f"vanilla_{count}": v[count],
                   f"tuned_{count}": t[count], "saved_us": v["us"] - t["us"]}
    return rows


def _most_changed(vanilla: dict[str, Any], tuned: dict[str, Any], key: str, count: str,
                  n: int) -> dict[str, dict[str, float]]:
    """The ``n`` names of both arms' ``key`` tables (:func:`_side_by_side`) whose time changed most."""
    rows = _side_by_side(vanilla.get(key, {}), tuned.get(key, {}), count)
    return dict(sorted(rows.items(), key=lambda kv: -abs(kv[1]["saved_us"]))[:n])


def compare(vanilla: dict[str, Any] | None, tuned: dict[str, Any] | None,
            tpot_ms: dict[str, float | None]) -> dict[str, Any] | None:
    """Per category, vanilla minus tuned per decode step (us saved; negative: grew), and each arm's time
    outside kernels (TPOT - busy): where the measured saving came from and what ate into it."""
    if not vanilla or not tuned:
        return None
    rows = _side_by_side(vanilla["per_step"], tuned["per_step"], "kernels")
    outside = {arm: (tpot_ms[arm] * 1000.0 - prof["busy_us"]) if tpot_ms.get(arm) else None
               for arm, prof in (("vanilla", vanilla), ("tuned", tuned))}
    # the kernels whose time changed most between the arms: what a category's change is made of
    changed = _most_changed(vanilla, tuned, "by_kernel", "kernels", 20)
    # the host ops of the 1-token generate whose time changed most (a name in one arm's top only counts
    # 0 in the other: read it as "at least")
    host_changed = _most_changed(vanilla, tuned, "prefill_host", "calls", 15)
    python_changed = _most_changed(vanilla, tuned, "prefill_python", "calls", 15)
    return {"categories": rows, "kernel_saved_us": vanilla["busy_us"] - tuned["busy_us"],
            "outside_kernels_us": outside, "kernels_changed": changed, "prefill_host_changed": host_changed,
            "prefill_python_changed": python_changed,
            "prefill_work": {"vanilla": vanilla.get("prefill_work"), "tuned": tuned.get("prefill_work")}}
