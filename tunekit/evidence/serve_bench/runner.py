"""One arm of ``tunekit serve-bench`` in its own process: one offline vLLM engine, one JSON result.

    python -m tunekit.evidence.serve_bench.runner --probe [--table T ...]       # JSON on stdout, vLLM not imported
    python -m tunekit.evidence.serve_bench.runner --spec RUN.spec.json --out RUN.json

The parent (``tunekit.evidence.serve_bench.bench``) sets the arm's environment
(``VLLM_PLUGINS``, ``TUNEKIT_TABLE``, ``TUNEKIT_DISPATCH_LOG``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` ...) and writes the spec; this module
only measures. It imports nothing heavy at module level, so the probe is cheap
and an import check needs no GPU.

Measurement (why not ``vllm.benchmarks.latency``): that benchmark times one
whole ``generate`` per iteration with temperature 1.0 and random prompts, one
engine per invocation. A per-token figure from it needs two invocations (two
output lengths), i.e. two engine starts (~25-150 s each) per batch size, and
it returns no tokens or logprobs for the agreement check. The same
difference method is done here directly with ``LLM.generate`` in one engine
for every batch size:

* per batch size B: B distinct token-id prompts of ``prompt_len`` tokens
  (the same in every arm; the spec's ``prompts`` = ``repeat`` tiles each one's
  own short pattern, for speculative decoding's n-gram proposer), a warm-up ``generate`` of ``tokens`` and of 1
  new token, then ``repeats`` timed pairs (1 token, ``tokens`` tokens),
  the order alternating per repeat so a drift charges both equally;
* TPOT = (t_tokens - t_1) / (tokens - 1): prefill, scheduling and Python
  overheads of a ``generate`` cancel; what is left is ``tokens - 1`` decode
  steps of B sequences;
* greedy (temperature 0), ``ignore_eos``, no detokenizer; prefix caching
  off so both calls of a pair prefill alike;
* each timed generate also notes when each request's tokens reach the
  engine's output processor (``tpot.TokenClock``): the decode TPOT from
  per-token timestamps, which needs no 1-token generate;
* afterwards (untimed, logprobs cost a top-k over the vocabulary per step)
  one ``generate`` of ``agree_steps`` tokens with ``logprobs=K``: the chosen
  token ids and logprobs of the first requests, for the agreement check;
  then the same requests teacher-forced with vanilla #0's tokens (the
  spec's ``forced``; ``tunekit.evidence.serve_bench.forced``), top-K per
  position, for the agreement against vanilla's spread.

Weights (the spec's ``weights``): ``dummy`` (vLLM's dummy loader, the
default), ``realistic`` (the dummy load followed by the seeded recipe of
``tunekit.evidence.serve_bench.weights``, applied at the end of the load:
before the plugin folds norms and before the CUDA graphs are captured) or
``checkpoint`` (the engine's ``load_format`` is vLLM's default: the model
folder's own weights).

Result (``format`` = ``tunekit.serve_run/1``; the parent's parse test reads it)::

    {"format", "arm", "index", "pid", "started", "wall_s", "python", "vllm", "torch", "device",
     "engine_start_s", "engine_args", "engine_args_dropped", "env": {recorded variables},
     "plugin": {"loaded", "installed", "skipped"}, "dispatch": tunekit.ops.dispatch_log() | None,
     "batches": [{"batch", "tokens", "prompt_len", "repeats", "t_tokens_s": [...], "t_1_s": [...],
                  "tpot_ms": [...], "tpot_ms_median", "tpot_ms_min", "tpot_ms_max", "tokens_per_s",
                  "short_outputs", "vllm_metrics": {...} | None,
                  "spec_decode": {"counters", "steps", "error"} (with a speculative_config: spec_decode.py),
                  "t_1_host" / "t_tokens_host": [HostEvents.record() per timed generate],
                  "t_tokens_clock": [TokenClock.record() per timed --tokens generate], "tpot_stamps_ms_median",
                  "agreement": {"steps", "logprobs", "requests": [{"token_ids", "logprobs", "top"}]},
                  "forced": {"steps", "topk", "rounds", "requests": [{"forced", "forced_from", "top",
                                                                      "prefill_steps"}]}}],
     "weights": {"mode", "seed", "applied", "counts"},
     "first_token": first_token.measure() (with --first-token: {"lengths", "batches", "repeats", "order",
                    "requests", "cases": [{"prompt_len", "batch", "t_s": [...], "host": [...]}]}),
     "error": None | "Type: message", "traceback"}
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import gc
import importlib.metadata
import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tunekit.evidence.serve_bench import first_token, spec_decode
from tunekit.evidence.serve_bench.forced import forced_row
from tunekit.evidence.serve_bench.tpot import TokenClock, stamps_ms
from tunekit.evidence.serve_bench.weights import describe, weights_after_start, weights_before_start

FORMAT = "tunekit.serve_run/1"
PROBE_FORMAT = "tunekit.serve_probe/1"
#: Lines starting with this are progress the parent echoes; everything else goes to the arm's log file.
PROGRESS = "serve-bench:"
#: Variables recorded in every result (what decided the arm).
RECORDED_ENV = ("VLLM_PLUGINS", "TUNEKIT_TABLE", "TUNEKIT_DISPATCH_LOG", "VLLM_ENABLE_V1_MULTIPROCESSING",
                "VLLM_USE_FLASHINFER_SAMPLER", "HF_HUB_OFFLINE", "VLLM_NO_USAGE_STATS", "CUDA_VISIBLE_DEVICES")
#: Token ids of the prompts stay below this (and below the vocabulary): ordinary ids of any tokenizer.
_ID_SPAN = 10_000
_ID_BASE = 100


def progress(text: str) -> None:
    print(f"{PROGRESS} {text}", flush=True)


# ---------------------------------------------------------------------------
# Probe: what this Python can run (no vLLM import, no engine)
# ---------------------------------------------------------------------------


def vllm_entry_points() -> dict[str, list[str]]:
    """Entry-point names of every ``vllm.*`` group visible to this Python (``VLLM_PLUGINS`` filters them all:
    vLLM applies the allow-list in ``load_plugins_by_group`` to general, platform and other plugin groups)."""
    eps = importlib.metadata.entry_points()
    if hasattr(eps, "groups"):
        groups = sorted(g for g in eps.groups if g.startswith("vllm."))
        return {g: sorted({ep.name for ep in eps.select(group=g)}) for g in groups}
    # Python 3.10/3.11 without .groups: a dict of group -> entry points
    return {g: sorted({ep.name for ep in items}) for g, items in eps.items() if g.startswith("vllm.")}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe(tables: list[str]) -> dict[str, Any]:
    """vLLM's presence and version, plugin entry points, flashinfer, the device and each table's stamp check."""
    out: dict[str, Any] = {"format": PROBE_FORMAT, "python": sys.executable,
                           "python_version": platform.python_version()}
    spec = importlib.util.find_spec("vllm")
    out["vllm"] = (_version("vllm") or "unknown") if spec is not None else None
    out["vllm_path"] = spec.origin if spec is not None else None
    out["flashinfer"] = importlib.util.find_spec("flashinfer") is not None
    out["entry_points"] = vllm_entry_points()
    out["table_mismatch"] = {}
    try:
        from tunekit import table as table_mod
        from tunekit.measure.device import detect

        device = detect().as_dict()
        out["device"] = device
        for path in tables:
            # the same check tunekit.ops makes when serving: a mismatch is a vendor path there
            out["table_mismatch"][path] = table_mod.environment_mismatch(table_mod.load(path), device)
    except Exception as exc:  # reported; the parent decides
        out["device_error"] = f"{type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


def accepted_fields(cls: Any) -> set[str] | None:
    """Names a constructor takes: dataclass fields, msgspec struct fields or signature; None if unknown."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    names = getattr(cls, "__struct_fields__", None)
    if names:
        return set(names)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def engine_kwargs(engine: dict[str, Any], fields: set[str] | None) -> tuple[dict[str, Any], list[str]]:
    """The spec's engine arguments that this vLLM's EngineArgs has (dropped names listed, never fatal
    for the optional ones: ``gdn_prefill_backend`` exists from vLLM 0.26 on)."""
    # speculative_config is required where given: a run told to speculate must never run without it
    required = {"model", "load_format", "skip_tokenizer_init", "dtype", "max_model_len", "max_num_seqs",
                "gpu_memory_utilization", "speculative_config"}
    if fields is None:
        return dict(engine), []
    kept = {k: v for k, v in engine.items() if k in fields or k in required}
    return kept, sorted(set(engine) - set(kept))


#: ``repeat`` prompts: each request's pattern of this many distinct ids, tiled (speculative decoding's n-gram
#: proposer finds the prompt's last tokens earlier in it, so every sequence gets drafts from its first step)
REPEAT_PERIOD = 8


def make_prompts(batch: int, prompt_len: int, vocab_size: int, kind: str = "distinct") -> list[list[int]]:
    """``batch`` distinct token-id prompts (no shared prefix), the same in every arm and process; ``repeat``:
    request r's own REPEAT_PERIOD ids over and over (distinct from the other requests')."""
    span = max(1, min(_ID_SPAN, vocab_size - _ID_BASE))
    if kind == "repeat":
        return [[_ID_BASE + (r * REPEAT_PERIOD + j % REPEAT_PERIOD) * 37 % span for j in range(prompt_len)]
                for r in range(batch)]
    return [[_ID_BASE + (r * 7919 + j * 131 + r * j) % span for j in range(prompt_len)] for r in range(batch)]


def _sampling(sampling_cls: Any, fields: set[str] | None, max_tokens: int, logprobs: int | None = None) -> Any:
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if fields is None or "detokenize" in fields:
        kwargs["detokenize"] = False
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    return sampling_cls(**kwargs)


def _step_items(step: Any) -> list[tuple[int, float, int | None]]:
    """One decode step's logprobs as (token id, logprob, rank), whatever container this vLLM uses."""
    if step is None:
        return []
    items = step.items() if hasattr(step, "items") else step
    out = []
    for tid, lp in items:
        out.append((int(tid), float(getattr(lp, "logprob", lp)), getattr(lp, "rank", None)))
    return out


def agreement_record(outputs: list[Any], requests: int) -> list[dict[str, Any]]:
    """Chosen token ids, their logprobs and the top-K of the first ``requests`` requests."""
    records = []
    for out in outputs[:requests]:
        comp = out.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        chosen, tops = [], []
        for tid, step in zip(ids, comp.logprobs or [], strict=False):
            items = _step_items(step)
            by_id = {i: lp for i, lp, _ in items}
            chosen.append(by_id.get(tid))
            tops.append([[i, lp] for i, lp, _ in sorted(items, key=lambda x: -x[1])])
        records.append({"token_ids": ids, "logprobs": chosen, "top": tops})
    return records


def vllm_metrics(outputs: list[Any]) -> dict[str, Any] | None:
    """vLLM's own per-request timestamps, when this version attaches them (``RequestOutput.metrics``;
    None with stats logging off, the LLM default): its decode TPOT, median over requests."""
    tpots, raw = [], None
    for out in outputs:
        m = getattr(out, "metrics", None)
        if m is None:
            continue
        values = {k: v for k, v in (vars(m) if hasattr(m, "__dict__") else {}).items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if raw is None:
            raw = values
        first = values.get("first_token_ts", values.get("first_token_time"))
        last = values.get("last_token_ts", values.get("last_token_time"))
        n = values.get("num_generation_tokens")
        if first and last and n and n > 1:
            tpots.append((last - first) / (n - 1) * 1000.0)
    if raw is None:
        return None
    return {"request0": raw, "tpot_ms_median": statistics.median(tpots) if tpots else None}


def plugin_state() -> dict[str, Any]:
    """The tunekit vLLM plugin's hooks, if vLLM loaded it in this process (the engine runs here:
    VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    mod = sys.modules.get("tunekit.integrations.vllm.plugin")
    if mod is None:
        return {"loaded": False, "installed": {}, "skipped": {}}
    return {"loaded": True, "installed": mod.installed(), "skipped": mod.skipped()}


#: torch.cuda.memory_stats() counters that mean host stalls: a cudaMalloc / cudaFree (the caching
#: allocator's pool did not serve the request; a free synchronizes the device), a retry after an
#: out-of-memory (every cached block freed first) and a wait on all streams
_ALLOCATOR_EVENTS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


class HostEvents:
    """What a generate's host time went to that no profiler table names: Python's garbage collections
    (time and count, through ``gc.callbacks``), the CUDA caching allocator's stalling events
    (:data:`_ALLOCATOR_EVENTS`, differences of ``torch.cuda.memory_stats``) and Triton JIT compiles
    (``@triton.jit`` kernels missing from the in-memory cache: a compile, or a load from the disk cache,
    tens of ms each; Triton's ``knobs.runtime.jit_post_compile_hook``, chained to the one set before,
    such as vLLM's JIT monitor). A context manager; ``record()`` after it: ``{"gc_ms", "gc_collections":
    [gen0, gen1, gen2], "allocator": {...}, "jit_compiles"}`` (``allocator`` None without an initialized
    CUDA, ``jit_compiles`` None without Triton's hook)."""

    def __init__(self) -> None:
        self.gc_s, self.collections, self._t0 = 0.0, [0, 0, 0], None
        self._mem0: dict[str, int] | None = None
        self.allocator: dict[str, int] | None = None
        self.jit_compiles: int | None = None
        self._runtime: Any = None
        self._prev_hook: Any = None
        self._hook: Any = None

    def _on_compile(self, *args: Any, **kwargs: Any) -> Any:
        self.jit_compiles = (self.jit_compiles or 0) + 1
        return self._prev_hook(*args, **kwargs) if self._prev_hook is not None else None

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.gc_s += time.perf_counter() - self._t0
            self.collections[min(int(info.get("generation", 0)), 2)] += 1
            self._t0 = None

    def __enter__(self) -> HostEvents:
        self._mem0 = _allocator_counts()
        gc.callbacks.append(self._on_gc)
        knobs = getattr(sys.modules.get("triton"), "knobs", None)  # never imported here
        runtime = getattr(knobs, "runtime", None)
        if runtime is not None and hasattr(runtime, "jit_post_compile_hook"):
            self._runtime, self._prev_hook, self.jit_compiles = runtime, runtime.jit_post_compile_hook, 0
            self._hook = self._on_compile  # one bound method, so __exit__ can tell it is still the one set
            runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._on_gc)
        if self._runtime is not None:
            if self._runtime.jit_post_compile_hook is self._hook:  # a hook set since is left alone
                self._runtime.jit_post_compile_hook = self._prev_hook
            self._runtime = None
        after = _allocator_counts()
        if self._mem0 is not None and after is not None:
            self.allocator = {k: after[k] - self._mem0[k] for k in _ALLOCATOR_EVENTS}

    def record(self) -> dict[str, Any]:
        return {"gc_ms": self.gc_s * 1000.0, "gc_collections": list(self.collections), "allocator": self.allocator,
                "jit_compiles": self.jit_compiles}


def _allocator_counts() -> dict[str, int] | None:
    torch = sys.modules.get("torch")  # never imported here: a process without torch records nothing
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        stats = torch.cuda.memory_stats()
    except Exception:  # noqa: BLE001 - a counter is evidence, never a reason to lose the timing
        return None
    return {k: int(stats.get(k, 0)) for k in _ALLOCATOR_EVENTS}


def measure_batch(llm: Any, prompts: list[Any], sampling: Any, batch: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Warm-up, then ``repeats`` interleaved (1 token, ``tokens`` tokens) pairs; TPOT by difference.
    Each timed generate also records its :class:`HostEvents` (``t_1_host``, ``t_tokens_host``)."""
    tokens, repeats = int(spec["tokens"]), int(spec["repeats"])
    long_params, one_params = sampling(tokens), sampling(1)
    llm.generate(prompts, long_params, use_tqdm=False)  # warm-up: graphs, kernels, allocator
    llm.generate(prompts, one_params, use_tqdm=False)
    t_tokens, t_one, short, last = [], [], 0, None
    host_tokens: list[dict[str, Any]] = []
    host_one: list[dict[str, Any]] = []
    clocks: list[dict[str, Any] | None] = []
    for r in range(repeats):
        # alternate the order so that a drift within the pair charges both lengths alike
        for n in ((1, tokens) if r % 2 == 0 else (tokens, 1)):
            # the clock runs in both lengths: its cost per engine step cancels in the difference
            with HostEvents() as events, TokenClock(llm) as clock:
                start = time.perf_counter()
                outs = llm.generate(prompts, long_params if n == tokens else one_params, use_tqdm=False)
                elapsed = time.perf_counter() - start
            if n == tokens:
                t_tokens.append(elapsed)
                host_tokens.append(events.record())
                clocks.append(clock.record())
                short += sum(1 for o in outs if len(o.outputs[0].token_ids) != tokens)
                last = outs
            else:
                t_one.append(elapsed)
                host_one.append(events.record())
    tpot = [(a - b) / (tokens - 1) * 1000.0 for a, b in zip(t_tokens, t_one, strict=True)]
    med = statistics.median(tpot)
    row: dict[str, Any] = {
        "batch": batch, "tokens": tokens, "prompt_len": int(spec["prompt_len"]), "repeats": repeats,
        "t_tokens_s": t_tokens, "t_1_s": t_one, "tpot_ms": tpot, "tpot_ms_median": med,
        "tpot_ms_min": min(tpot), "tpot_ms_max": max(tpot),
        "tokens_per_s": batch / (med / 1000.0) if med > 0 else None,
        "short_outputs": short, "vllm_metrics": vllm_metrics(last or []),
        "t_1_host": host_one, "t_tokens_host": host_tokens,
        "t_tokens_clock": clocks, "tpot_stamps_ms_median": stamps_ms(clocks),
    }
    return row


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Start the engine, measure every batch size; returns the result document (``error`` set on failure)."""
    started = time.perf_counter()
    result: dict[str, Any] = {
        "format": FORMAT, "arm": spec["arm"], "index": spec["index"], "pid": os.getpid(),
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.executable, "env": {k: os.environ.get(k) for k in RECORDED_ENV},
        "batches": [], "error": None,
    }
    try:
        _run(spec, result)
    except BaseException as exc:  # the parent reads the error from the result; the log has the rest
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-6000:]
    result["wall_s"] = time.perf_counter() - started
    result["plugin"] = plugin_state()
    ops = sys.modules.get("tunekit.ops")  # imported by the plugin; never here (vanilla must not load it)
    result["dispatch"] = ops.dispatch_log() if ops is not None else None
    return result


def _run(spec: dict[str, Any], result: dict[str, Any]) -> None:
    # The engine core in this process: the plugin's state and dispatch markers are readable here.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    result["vllm"] = getattr(vllm, "__version__", None)
    result["torch"] = torch.__version__
    kwargs, dropped = engine_kwargs(spec["engine"], accepted_fields(EngineArgs))
    result["engine_args"], result["engine_args_dropped"] = kwargs, dropped
    progress(f"{spec['arm']} #{spec['index']}: starting vLLM {result['vllm']} (pid {os.getpid()})")
    why_not = weights_before_start(spec)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result["engine_start_s"] = time.perf_counter() - t0
    result["weights"] = weights_after_start(spec, llm, why_not)
    if result["weights"].get("counts"):
        progress(f"{spec['arm']} #{spec['index']}: realistic weights {result['weights']['applied']} "
                 f"({describe(result['weights']['counts'])})")
    result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    progress(f"{spec['arm']} #{spec['index']}: engine up in {result['engine_start_s']:.1f} s on {result['device']}")
    sp_fields = accepted_fields(SamplingParams)

    def sampling(n: int, logprobs: int | None = None) -> Any:
        return _sampling(SamplingParams, sp_fields, n, logprobs)

    speculative = "speculative_config" in kwargs
    known: dict[int, list[int]] = {}  # request -> the tokens it was forced with (its prompt is the same at every B)
    for batch in spec["batches"]:
        ids = make_prompts(batch, int(spec["prompt_len"]), int(spec["vocab_size"]), spec.get("prompts", "distinct"))
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]
        if speculative:
            row = _measure_speculative(llm, prompts, sampling, batch, spec)
        else:
            row = measure_batch(llm, prompts, sampling, batch, spec)
        steps, k = int(spec["agree_steps"]), int(spec["logprobs"])
        outs = llm.generate(prompts, sampling(steps, k), use_tqdm=False)
        requests = int(spec.get("agree_requests", 8))
        row["agreement"] = {"steps": steps, "logprobs": k, "requests": agreement_record(outs, requests)}
        row["forced"] = forced_row(llm, sampling, TokensPrompt, ids, spec, batch, known)
        profile_steps = int(spec.get("profile_steps", 0))
        if profile_steps > 0:  # after the timing: the profiler's overhead never enters a TPOT
            row.update(profile_row(lambda n, prompts=prompts: llm.generate(prompts, sampling(n), use_tqdm=False),
                                   profile_steps, torch.cuda.is_available()))
        result["batches"].append(row)
        progress(f"{spec['arm']} #{spec['index']}: B={batch} TPOT {row['tpot_ms_median']:.3f} ms "
                 f"({row['tpot_ms_min']:.3f}-{row['tpot_ms_max']:.3f}), {row['tokens_per_s']:.1f} tokens/s")
    if spec.get("first_token"):  # after every TPOT figure: its long prefills never precede a timed pair
        one = sampling(1)
        result["first_token"] = first_token.measure(
            lambda ids: llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], one, use_tqdm=False),
            spec["first_token"], spec["batches"], int(spec["first_token_repeats"]), int(spec["vocab_size"]),
            events=HostEvents, log=lambda text: progress(f"{spec['arm']} #{spec['index']}: {text}"))


def _measure_speculative(llm: Any, prompts: list[Any], sampling: Any, batch: int,
                         spec: dict[str, Any]) -> dict[str, Any]:
    """``measure_batch`` with the batch size's spec-decode record (``row["spec_decode"]``): vLLM's acceptance
    counters over its generates and the M of each engine step (``spec_decode``). The step hook is on during
    every generate of both lengths, as the token clock is: its cost cancels in the difference."""
    def read() -> dict[str, Any]:
        return spec_decode.counters(llm.get_metrics())

    try:
        before, error = read(), None
    except Exception as exc:  # noqa: BLE001 - a vLLM without metrics still gives its TPOT; the report says why
        before, error = None, f"LLM.get_metrics() failed: {type(exc).__name__}: {exc}"
    with spec_decode.StepShapes(llm) as shapes:
        row = measure_batch(llm, prompts, sampling, batch, spec)
    counts = spec_decode.delta(before, read()) if before is not None else None
    row["spec_decode"] = {"counters": counts, "steps": shapes.record(), "error": error}
    return row


def profile_row(generate: Any, steps: int, have_cuda: bool) -> dict[str, Any]:
    """The batch row's ``profile`` (and ``profile_error``). A profiler that fails is recorded, not raised:
    the timing this process already took stays valid and must not be lost with it."""
    if not have_cuda:
        return {"profile": None, "profile_error": "no CUDA device: no kernels to profile"}
    from tunekit.evidence.serve_bench.profile import decode_step_profile

    try:
        profile = decode_step_profile(generate, steps)
        if os.environ.get("TUNEKIT_PROFILE_KERNELS") == "1":
            from tunekit.evidence.serve_bench.profile import in_process_kernel_times
            profile["in_process"] = in_process_kernel_times()
        return {"profile": profile}
    except Exception as e:  # noqa: BLE001 - any profiler failure; the report shows the message
        return {"profile": None, "profile_error": f"profiler failed: {type(e).__name__}: {e}"}


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tunekit.evidence.serve_bench.runner")
    parser.add_argument("--probe", action="store_true")
    parser.add_argument("--table", action="append", default=[])
    parser.add_argument("--spec", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.table)), flush=True)
        return 0
    if args.spec is None or args.out is None:
        parser.error("give --probe, or --spec and --out")
    spec = json.loads(args.spec.read_text())
    result = run(spec)
    _write(args.out, result)
    ops = sys.modules.get("tunekit.ops")
    if ops is not None:
        ops.write_dispatch_log()  # TUNEKIT_DISPATCH_LOG ({pid} expanded); os._exit below skips atexit
    return 1 if result["error"] else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result and the dispatch log are written: skip the in-process engine's teardown at
    # interpreter exit, which can hang or print errors long after the measurement.
    os._exit(code)
