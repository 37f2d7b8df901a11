"""``tunekit check-serving``: the tables' ops under compile / graphs, and a patched HF model decoding.

Checks (one line each, PASS / FAIL / SKIP; INFO lines carry numbers that are not pass/fail):

1. Ops (:mod:`tunekit.evidence.check_serving.ops_check`): every table entry eagerly, compiled and graph-replayed.
2. Model (:mod:`tunekit.evidence.check_serving.hf_decode`): a few layers of Qwen3.5-27B or Llama-3.1-8B, BF16 random
   weights. A prompt of ``prompt_len`` random ids and an eager greedy decode of ``steps`` tokens
   (unpatched; step 0's logits come from the prefill). Then the same model tree over the same weights
   patched (``tunekit.patch``) and decoded teacher-forced with the unpatched tokens, so every step's
   logits compare like for like (a step's greedy token is its argmax; a free-running decode equals the
   reference up to the first differing argmax). The tolerance comes from the model itself: an fp32 copy
   decodes the same tokens, and the unpatched BF16 model's distance from it is this model's BF16 noise
   floor (E_vendor). A variant at most ``tol_factor`` times as far from fp32 as the unpatched eager one
   has max |variant - unpatched| <= (factor + 1) E_vendor =: tol (triangle inequality); checked: that max,
   and rms |variant - fp32| <= factor x rms |unpatched - fp32|. A differing greedy token is a near tie
   when the unpatched top-2 gap is at most twice the step's measured logit error (a flip moves two
   logits) and that error is within tol; any other differing token is a FAIL
   (:func:`~tunekit.evidence.check_serving.judging.judge_flips`).
   On CUDA the graphed variants (static cache + ``torch.compile(mode="reduce-overhead")``) are judged
   the same way: graphed unpatched and graphed patched against the eager unpatched run.
   Dispatch markers of the patched runs: a broken path (build / kernel / table / environment error,
   a kernel not built at capture) is a FAIL; a shape the tables do not cover is INFO.
3. Timing (CUDA only): one decode step of the four variants eager unpatched, eager patched, graphed
   unpatched, graphed patched, interleaved in rounds
   (:func:`~tunekit.evidence.check_serving.hf_decode.time_interleaved`);
   per variant the median step, and each ratio as the median of its per-round ratios (same-run ratios),
   with their spread (:func:`~tunekit.evidence.check_serving.judging.timing_summary`).
4. Unpatch: the patched tree's original forwards back, its eager decode bitwise equal to the unpatched run.

Everything goes to ``OUT/serving_check.json`` (format ``tunekit.serving_check/2``).
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tunekit.errors import UserError
from tunekit.evidence.check_serving.judging import classify_dispatch, compare_logits, timing_summary, tokens_verdict

FORMAT = "tunekit.serving_check/2"


@dataclass
class Settings:
    """What one check runs (the CLI's options)."""

    model: str = "qwen3.5-27b"
    tables: list[str] = field(default_factory=list)
    layers: int = 4
    steps: int = 16
    prompt_len: int = 8
    iters: int = 10
    rounds: int = 5
    warmup: int = 5
    seed: int = 0
    tol_factor: float = 2.0
    rel_tol: float = 0.25
    tiny: bool = False
    device: str | None = None
    compile_backend: str = "inductor"
    skip_ops: bool = False
    skip_model: bool = False
    skip_graphed: bool = False
    fold_norms: bool = False  # the patched model folds its decoder norms where the tables say it pays
    merge_siblings: bool = True  # ... and runs q/k/v, gate/up (...) as one GEMV of vLLM's merged shape
    out: str | None = None


def validate(settings: Settings, cuda_available: bool | None = None) -> None:
    """Bad input as a UserError (one line): model, counts, tables; the timing parts need a GPU."""
    from tunekit.evidence.check_serving.hf_decode import check_model_name

    check_model_name(settings.model)
    for name in ("layers", "steps", "prompt_len", "iters", "rounds"):
        if getattr(settings, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(settings, name)})")
    if settings.warmup < 0:
        raise UserError(f"--warmup must be >= 0 (got {settings.warmup})")
    if not settings.tol_factor >= 1:  # also NaN
        raise UserError(f"--tol-factor must be a number >= 1 (got {settings.tol_factor})")
    missing = [p for p in settings.tables if not Path(p).is_file()]
    if missing:
        raise UserError(f"no such table: {', '.join(missing)}")
    from tunekit import table as table_mod

    for path in settings.tables:
        try:
            table_mod.load(path)
        except table_mod.TableError as exc:
            raise UserError(f"table not usable: {exc}") from None
    if settings.out is not None and Path(settings.out).exists() and not Path(settings.out).is_dir():
        raise UserError(f"--out {settings.out} is a file: give a folder")
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    on_cpu = (settings.device or "").startswith("cpu") or not cuda_available
    if on_cpu and not settings.tiny:
        raise UserError("no GPU here (or TRITON_INTERPRET=1): the timed and graphed parts need CUDA; "
                        "--tiny runs the correctness parts on the CPU under TRITON_INTERPRET=1")
    if not settings.skip_model:
        from tunekit.evidence.check_serving.hf_decode import require_transformers

        require_transformers()


# ---------------------------------------------------------------------------
# Reporting of the judged parts
# ---------------------------------------------------------------------------


def report_dispatch(report: Any, phase: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    result = classify_dispatch(rows)
    for line in result["uncovered"]:
        report.info(f"{phase} no tuned entry: {line}")
    for line in result["vendor"]:
        report.info(f"{phase} vendor path: {line}")
    report.add("FAIL" if result["broken"] else "PASS", f"model dispatch {phase}",
               f"{result['tuned_calls']} of {result['calls']} routed calls tuned"
               + (f"; broken: {'; '.join(result['broken'])}" if result["broken"] else ""))
    return result


def predicted_saving(rows: list[dict[str, Any]], steps: int, device: str) -> dict[str, Any]:
    """The tables' own prediction for a graphed decode step (Amdahl over their standalone timings):
    per tuned call in the dispatch ``rows`` of ``steps`` decode steps, its serving entry's saving
    (``tunekit.table.saving_us``). Calls whose entry is not found under the row's key (one served
    from another layout, as HF's gated norm can be) are counted as unpriced, never guessed.

    A folded norm's consumer (``rms_gemv``) is priced against the plain GEMV of its shape (the
    ``gemv`` entry's vendor time), not against its own baseline (an eager norm + mm): in the graphed
    unpatched model Inductor runs that norm inside the residual add before it, so what the fold
    removes there is the GEMV's excess, not a norm launch. Without a ``gemv`` entry of the shape the
    call is unpriced."""
    from tunekit.dispatch.tables import served_entry
    from tunekit.table import saving_us

    saving, priced, unpriced = 0.0, 0, 0
    for row in rows:
        if not str(row["impl"]).startswith("tuned"):
            continue
        n, k = (int(v) for v in str(row["shape"]).split("x"))
        entry = served_entry(row["op"], row["dtype"], row["m"], n, k, device)
        if entry is not None and row["op"] == "rms_gemv":
            plain = served_entry("gemv", row["dtype"], row["m"], n, k, device)
            entry = None if plain is None else replace(entry, baseline_us=plain.baseline_us)
        if entry is None:
            unpriced += row["calls"]
            continue
        saving += row["calls"] * saving_us(entry)
        priced += row["calls"]
    return {"saving_us_per_step": saving / steps if steps else 0.0, "priced_calls": priced,
            "unpriced_calls": unpriced, "steps": steps}


def report_comparison(report: Any, label: str, result: dict[str, Any]) -> dict[str, Any]:
    """PASS / FAIL lines of one variant against the eager unpatched run: logits, then greedy tokens."""
    steps, tol = result["steps"], result["tol_abs"]
    if "err_vendor_vs_fp32" in result:
        report.add("PASS" if result["ok"] else "FAIL", f"{label} logits",
                   f"max|variant - unpatched| {result['max_abs_diff']:.4g} ({result['max_rel_to_std']:.3%} of the "
                   f"logit std), allowed {tol:.4g} = {result['tol_factor'] + 1:g} x max|unpatched - fp32| "
                   f"{result['err_vendor_vs_fp32']:.4g}; rms error vs fp32: variant {result['rms_tuned_vs_fp32']:.4g}"
                   f", unpatched {result['rms_vendor_vs_fp32']:.4g} ({result['rms_ratio']:.2f}x, allowed "
                   f"{result['tol_factor']:g}x)")
    else:
        report.add("PASS" if result["ok"] else "FAIL", f"{label} logits",
                   f"max|variant - unpatched| {result['max_abs_diff']:.4g} = {result['max_rel_to_std']:.3%} of the "
                   f"logit std ({result['criterion']})")
    fp32 = "err_vendor_vs_fp32" in steps[0]
    report.log("  step  max|diff|   rel/std   top2 gap  " + ("unpatched/fp32 variant/fp32  " if fp32 else "")
               + "tokens")
    for r in steps:
        extra = f"{r['err_vendor_vs_fp32']:14.4g} {r['err_tuned_vs_fp32']:12.4g} " if fp32 else ""
        same = "same" if r["token_unpatched"] == r["token_patched"] else "DIFF"
        report.log(f"  {r['step']:4d} {r['max_abs_diff']:10.4g} {r['rel_to_std']:9.3%} {r['top2_gap']:10.4g} "
                   f"{extra} {r['token_unpatched']} / {r['token_patched']} {same}")
    verdict = tokens_verdict(steps, tol)
    for r in steps:
        if "near_tie" in r:
            report.add("PASS" if r["near_tie"] else "FAIL", f"{label} token step {r['step']}",
                       f"greedy token differs ({r['token_unpatched']} -> {r['token_patched']}): unpatched top-2 "
                       f"gap {r['top2_gap']:.4g}, measured logit error {r['max_abs_diff']:.4g}, tol {tol:.4g}: "
                       + ("a near tie" if r["near_tie"] else "NOT a near tie"))
    report.add("PASS" if verdict["ok"] else "FAIL", f"{label} greedy tokens",
               f"{verdict['agree']} of {verdict['steps']} steps pick the unpatched token"
               + ("" if verdict["tokens_equal"] else
                  f"; differing steps {verdict['differing_steps']} (near ties are allowed)"))
    result["tokens"] = verdict
    return result


def report_timing(report: Any, summary: dict[str, Any], device_type: str) -> None:
    note = "" if device_type == "cuda" else " (CPU: not evidence)"
    medians = ", ".join(f"{name} {row['median_ms']:.3f}" for name, row in summary["variants"].items())
    report.add("INFO", "model decode step", f"median ms per step: {medians}{note}")
    for name, row in summary["ratios"].items():
        report.add("INFO", f"model ratio {name}",
                   f"{row['numerator']} / {row['denominator']} = {row['median']:.3f}x "
                   f"(rounds {row['min']:.3f}-{row['max']:.3f}){note}")


def report_prediction(report: Any, summary: dict[str, Any], predicted: dict[str, Any]) -> None:
    """The graphed step the tables predict (their standalone saving off the unpatched graphed step),
    next to the measured ratio: what a graphed decode can gain from these tables at most."""
    base = summary["variants"]["graphed_unpatched"]["median_ms"] * 1e3
    saving = predicted["saving_us_per_step"]
    speedup = base / (base - saving) if base > saving else math.inf
    predicted["graphed_speedup"] = speedup
    measured = summary["ratios"]["patched_speedup_graphed"]["median"]
    report.add("INFO", "model predicted patched_speedup_graphed",
               f"the tables' standalone saving {saving:.1f} us per step ({predicted['priced_calls']} tuned calls "
               f"priced, {predicted['unpriced_calls']} not) off {base:.1f} us: {speedup:.3f}x predicted, "
               f"{measured:.3f}x measured")


# ---------------------------------------------------------------------------
# The model check
# ---------------------------------------------------------------------------


def check_model(report: Any, settings: Settings, device: Any) -> dict[str, Any]:
    import copy

    import torch

    import tunekit
    from tunekit import ops
    from tunekit.evidence.check_serving import hf_decode as hf
    from tunekit.evidence.check_serving.checks import error_text, sync

    result: dict[str, Any] = {"model": settings.model}
    try:
        config = hf.build_config(settings.model, settings.layers, settings.tiny)
        kw = hf.config_kwargs(settings.model, settings.layers, settings.tiny)
        result["config"] = kw
        t0 = time.perf_counter()
        model = hf.build_model(settings.model, config, device, settings.seed)
        result["build_s"] = time.perf_counter() - t0
        params = sum(p.numel() for p in model.parameters())
        result.update(parameters=params, attn_implementation=getattr(model.config, "_attn_implementation", None),
                      norm_calls_per_decode_step=hf.decode_norm_calls(settings.model, config))
        gen = torch.Generator().manual_seed(settings.seed)
        prompt = torch.randint(0, config.vocab_size, (1, settings.prompt_len), generator=gen).to(device)
        result["prompt"] = prompt[0].tolist()
        report.add("PASS", "model build",
                   f"{type(model).__name__} {settings.layers} layers {kw.get('layer_types', '')}, hidden "
                   f"{kw['hidden_size']}, vocab {kw['vocab_size']}, {params / 1e9:.3f} B params BF16 on {device} "
                   f"({result['build_s']:.1f} s); attention {result['attn_implementation']}")
    except Exception as exc:
        report.add("FAIL", "model build", error_text(exc))
        result["error"] = traceback.format_exc()
        return result

    try:
        base = hf.decode(model, prompt, settings.steps)
        result["unpatched_tokens"] = base["tokens"]
        report.add("PASS", "model decode unpatched", f"{settings.steps} greedy tokens {base['tokens']}")
    except Exception as exc:
        report.add("FAIL", "model decode unpatched", error_text(exc))
        result["error"] = traceback.format_exc()
        return result
    fp32 = None
    try:
        model32 = copy.deepcopy(model).float()
        fp32 = hf.decode(model32, prompt, settings.steps, forced=base["tokens"])
        del model32
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report.add("PASS", "model decode fp32 reference", "same weights in fp32, teacher-forced with the tokens above")
    except Exception as exc:
        report.add("FAIL", "model decode fp32 reference", error_text(exc) + " (falling back to --rel-tol)")

    # the patched variant: a second module tree over the same weights
    tables = list(settings.tables)
    try:
        patched_model = hf.shared_copy(model)
        counts = tunekit.patch(patched_model, table=tables or None, fold_norms=settings.fold_norms,
                               merge_siblings=settings.merge_siblings)
        result.update(patch_counts=counts, tables_served=ops.loaded_tables())
        report.add("PASS", "model patch", f"routed {counts}")
    except Exception as exc:
        report.add("FAIL", "model patch", error_text(exc))
        result["error"] = traceback.format_exc()
        return result
    compared: dict[str, Any] = {}
    try:
        patched = hf.decode(patched_model, prompt, settings.steps, forced=base["tokens"], stats=True)
        result["patched_tokens"] = patched["tokens"]
        result["dispatch_prefill"] = report_dispatch(report, "prefill", patched["stats_prefill"])
        result["dispatch_decode"] = report_dispatch(report, "decode", patched["stats_decode"])
        # the decode phase ran steps - 1 forwards (the first token comes from the prefill)
        result["predicted"] = predicted_saving(patched["stats_decode"], settings.steps - 1, str(device))
        compared["eager_patched"] = report_comparison(
            report, "model eager patched",
            compare_logits(base, patched, fp32, settings.tol_factor, settings.rel_tol))
    except Exception as exc:
        report.add("FAIL", "model decode patched", error_text(exc))
        result["patched_error"] = traceback.format_exc()

    graphed_ok = device.type == "cuda" and not settings.skip_graphed
    max_len = settings.prompt_len + max(settings.steps, settings.warmup + settings.rounds * settings.iters) + 8
    if not graphed_ok:
        reason = "skipped (--skip-graphed)" if settings.skip_graphed else "no CUDA"
        report.add("SKIP", "model graphed decode", reason)
    else:
        try:
            result["prepare"] = ops.prepare(device)
            graphed = {"graphed_unpatched": hf.StepDecoder(model, max_len, graphed=True),
                       "graphed_patched": hf.StepDecoder(patched_model, max_len, graphed=True)}
            for name, decoder in graphed.items():
                ops.reset_stats()
                run = decoder.decode(prompt, settings.steps, forced=base["tokens"])
                sync(device)
                stats = ops.dispatch_stats(reset=True)
                if name == "graphed_patched":
                    result["dispatch_graphed"] = report_dispatch(report, "graphed decode", stats)
                compared[name] = report_comparison(
                    report, f"model {name.replace('_', ' ')}",
                    compare_logits(base, run, fp32, settings.tol_factor, settings.rel_tol))
            result["cudagraph_skips"] = _cudagraph_skips()
            report.add("FAIL" if result["cudagraph_skips"] else "PASS", "model graphed: CUDA graphs used",
                       f"Inductor cudagraph skips {result['cudagraph_skips'] or 'none'}")
        except Exception as exc:
            report.add("FAIL", "model graphed decode", error_text(exc))
            result["graphed_error"] = traceback.format_exc()
            graphed_ok = False
    result["comparison"] = compared

    if device.type == "cuda":
        try:
            decoders = {"eager_unpatched": hf.StepDecoder(model, max_len, graphed=False),
                        "eager_patched": hf.StepDecoder(patched_model, max_len, graphed=False)}
            if graphed_ok:
                decoders.update(graphed)  # compiled and captured above; the cache is reset at the prefill
            times = hf.time_interleaved(decoders, prompt, settings.warmup, settings.iters, settings.rounds)
            summary = timing_summary(times)
            summary.update(warmup=settings.warmup, iters_per_round=settings.iters, rounds=settings.rounds,
                           clock="cuda events around each step", cache="StaticCache (every variant)",
                           times_ms=times)
            result["timing"] = summary
            report_timing(report, summary, device.type)
            if graphed_ok and "predicted" in result:
                report_prediction(report, summary, result["predicted"])
        except Exception as exc:
            report.add("FAIL", "model timing", error_text(exc))
            result["timing_error"] = traceback.format_exc()
    else:
        report.add("SKIP", "model timing", "no CUDA: nothing is timed")

    try:
        routed = sum(v for k, v in result.get("patch_counts", {}).items() if "(" not in k)  # not the kept ones
        restored = tunekit.unpatch(patched_model)
        again = hf.decode(patched_model, prompt, settings.steps)
        same = again["tokens"] == base["tokens"] and all(
            torch.equal(a, b) for a, b in zip(again["logits"], base["logits"], strict=True))
        result.update(unpatch_restored=restored, unpatch_bitwise_equal=same)
        report.add("PASS" if same and restored == routed else "FAIL", "model unpatch",
                   f"restored {restored} of {routed} modules; logits bitwise equal to the unpatched run: {same}")
    except Exception as exc:
        report.add("FAIL", "model unpatch", error_text(exc))
    del model, patched_model
    if device.type == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return result


def _cudagraph_skips() -> dict[str, int]:
    """Inductor's counted reasons for running a compiled graph without CUDA graphs (empty: graphs ran)."""
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return {}
    return {k: v for k, v in counters["inductor"].items() if "cudagraph_skip" in k}


# ---------------------------------------------------------------------------
# The whole check
# ---------------------------------------------------------------------------


def run_check(settings: Settings, log: Callable[[str], None] = print, argv: Sequence[str] | None = None
              ) -> dict[str, Any]:
    """Run the checks (call :func:`validate` first); returns the results, written to ``OUT/serving_check.json``."""
    import json

    from tunekit import ops
    from tunekit.evidence.check_serving.checks import Report, environment, error_text, pick_device
    from tunekit.evidence.check_serving.ops_check import check_ops

    device = pick_device(settings.device)
    report = Report(log)
    env = environment(device)
    tables = list(settings.tables) or ops.table_paths()
    log(f"device {env.get('gpu', device)}; torch {env['torch']}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}; model {settings.model}; tables {tables or 'none'}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        report.info("CPU without TRITON_INTERPRET=1: tuned Triton kernels cannot run here (fallback:interpreter_off)")
    results: dict[str, Any] = {"format": FORMAT, "argv": list(argv if argv is not None else sys.argv),
                               "settings": asdict(settings), "environment": env, "tables": tables}
    started = time.perf_counter()
    try:
        ops.load_tables(tables)
        results["tables_loaded"] = ops.loaded_tables()
        for row in results["tables_loaded"]:
            if row.get("error"):
                report.add("FAIL", f"table {row['path']}", row["error"])
            else:
                report.add("PASS", f"table {row['path']}", f"{row['entries']} entries")
    except Exception as exc:
        report.add("FAIL", "tables", error_text(exc))

    if not settings.skip_ops:
        try:
            results["ops"] = check_ops(report, tables, device, settings.seed, settings.compile_backend)
            results["tables_after_ops"] = ops.loaded_tables()
        except Exception as exc:
            report.add("FAIL", "ops", error_text(exc))
    if not settings.skip_model:
        try:
            results["model"] = check_model(report, replace(settings, tables=tables), device)
        except Exception as exc:
            report.add("FAIL", "model", error_text(exc))
            results["model_error"] = traceback.format_exc()
    results.update(checks=report.checks, failures=report.count("FAIL"), passed=report.count("PASS"),
                   skipped=report.count("SKIP"), wall_s=time.perf_counter() - started)
    if settings.out is not None:
        out = Path(settings.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            path = out / "serving_check.json"
            path.write_text(json.dumps(results, indent=2, default=str) + "\n")
            results["written"] = str(path)
            log(f"wrote {path}")
        except OSError as exc:
            log(f"FAIL writing {out}: {error_text(exc)}")
            results["failures"] += 1
    log(f"checks: {results['passed']} passed, {results['failures']} failed, {results['skipped']} skipped "
        f"({time.perf_counter() - started:.1f} s)")
    if results["failures"] == 0:
        log("SERVING_OK")
    return results
