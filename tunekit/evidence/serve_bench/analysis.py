"""From runner results to ``serve.json``: TPOT per arm, speedups, prediction, coverage, agreement.

Pure: reads JSON documents (the runner's ``tunekit.serve_run/1`` results and
the ``TUNEKIT_DISPATCH_LOG`` files), imports no vLLM (and torch only where the
prediction asks an entry's backend whether its config runs at an M), so the
whole parent side is testable on recorded files. ``serve.json`` holds what is
derived and names the run files it came from (``runs``, ``run_file``), never a
copy of them: a report rebuilt from ``runs/`` gives the same figures.

Figures per batch size B:

* TPOT of an arm: the median over its processes of each process's median
  over repeats (the process, with its own engine start, compile and memory
  layout, is the unit that varies); spread: min / max of those per-process
  medians, and of every single repeat;
* ``speedup`` = vanilla TPOT / tuned TPOT (ratio of medians);
  ``speedup_min`` / ``speedup_max``: over the process pairs of one round
  (vanilla #i / tuned #i, which ran next to each other);
  ``passthrough_ratio`` likewise for the plugin without a table (below 1:
  the plugin alone costs time);
* prediction: the per-token saving the tables' standalone figures promise at
  M = B, sum over the model's problems (``ModelSpec.problems``, counts per
  token) that a table serves under the ops' own rule
  (``tunekit.table.serving_lookup``) of count x (baseline_us - time_us);
  ``predicted_speedup`` = vanilla / (vanilla - saving): Amdahl with the
  measured vanilla step as the whole. With ``--speculative`` the decode steps
  run the verify steps' M instead: the saving per step is weighted over
  vanilla's histogram of them and set against vanilla's time per step
  (``spec_decode.step_prediction``), or the row says why there is none.
  Tables tuned for another environment are left out (the ops serve nothing
  from them either).

With ``--speculative`` (``spec_decode.py``): per batch size and arm the acceptance from vLLM's counters and
the decode steps' M histogram (``spec_decode``); over the run, the dispatch coverage per M up to the largest
verify step's (``speculative``). TPOT stays per output token, so the arms compare at the same k.

With ``--first-token`` (``first_token.py``): ``ttft``, the time to first token per (prompt length, batch
size) from its own interleaved 1-token generates, each arm's ratio to vanilla with its range over process
pairs and a verdict that a noisy run cannot pass.

TPOT is also read from per-token timestamps (``tpot.py``); a batch size where
the two figures differ by more than 2% gets a note.

Agreement with vanilla (``agreement.py``): with real or realistic weights
the teacher-forced check (greedy tokens, max |Δlogprob| over the top-K, KL,
each against vanilla's own spread) gives the verdict; with dummy weights,
whose every token is a near tie, the free-running check of chosen-token
logprobs does, the teacher-forced figures reported beside it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tunekit import table as table_mod
from tunekit.errors import UserError
from tunekit.evidence.serve_bench import ARMS, TABLE_ARMS, first_token, spec_decode
from tunekit.evidence.serve_bench.agreement import DEFAULT_TOL, agreement_row
from tunekit.evidence.serve_bench.profile import arm_profile, compare
from tunekit.evidence.serve_bench.runner import FORMAT as RUN_FORMAT
from tunekit.evidence.serve_bench.tpot import arm_methods, disagreement_note

FORMAT = "tunekit.evidence.serve_bench/1"
#: The folder of a serve-bench run that holds one runner result per process (``run_file``).
RUNS_DIR = "runs"
_CAPTURE_NOTE = ("dispatch calls are counted when Python runs the op: under CUDA graphs once per capture, "
                 "replays are not counted (rows counted_at=capture are captures, not executions)")


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: corrupt {what} (not JSON: {exc})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: corrupt {what} (not a JSON object)")
    return doc


def run_file(arm: str, index: int) -> str:
    """The file name of process ``index`` of ``arm``'s result in ``RUNS_DIR``."""
    return f"{arm}-{index}.json"


def load_run(path: Path) -> dict[str, Any]:
    """One runner result; UserError unless it is a ``tunekit.serve_run/1`` document of a known arm."""
    doc = load_json(path, "runner result")
    if doc.get("format") != RUN_FORMAT:
        raise UserError(f"{path}: unknown format {doc.get('format')!r} (expected {RUN_FORMAT!r})")
    if doc.get("arm") not in ARMS or not isinstance(doc.get("index"), int):
        raise UserError(f"{path}: runner result without a known arm and index")
    if not doc.get("error"):
        for row in doc.get("batches", []):
            for key in ("batch", "tokens", "tpot_ms", "tpot_ms_median"):
                if key not in row:
                    raise UserError(f"{path}: batch row lacks {key!r}")
    return doc


def load_runs(runs_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every finished (error-free) result in ``runs_dir`` by arm, ordered by process index."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(Path(runs_dir).glob("*.json")):
        if path.name.endswith(".spec.json"):
            continue
        doc = load_run(path)
        if not doc.get("error"):
            out.setdefault(doc["arm"], []).append(doc)
    for docs in out.values():
        docs.sort(key=lambda d: d["index"])
    return out


def dispatch_logs(dispatch_dir: Path, arm: str, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``TUNEKIT_DISPATCH_LOG`` files of ``arm``'s finished processes (``{arm}-{index}-{pid}.json``;
    a file of an earlier attempt of the same index has another pid and is left out). A process whose
    file is missing contributes the log embedded in its result."""
    logs = []
    for res in results:
        path = Path(dispatch_dir) / f"{arm}-{res['index']}-{res['pid']}.json"
        if path.is_file():
            logs.append(load_json(path, "dispatch log"))
        elif res.get("dispatch"):
            logs.append(res["dispatch"])
    return logs


# ---------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------


def _batch_row(result: dict[str, Any], batch: int) -> dict[str, Any] | None:
    return next((r for r in result.get("batches", []) if r["batch"] == batch), None)


def arm_tpot(results: Sequence[dict[str, Any]], batch: int) -> dict[str, Any] | None:
    """TPOT of one arm at ``batch``: median of the per-process medians, their min/max, every repeat's min/max."""
    rows = [(res["index"], _batch_row(res, batch)) for res in results]
    rows = [(i, r) for i, r in rows if r is not None]
    if not rows:
        return None
    medians = [float(r["tpot_ms_median"]) for _, r in rows]
    repeats = [float(t) for _, r in rows for t in r["tpot_ms"]]
    med = statistics.median(medians)
    return {"median_ms": med, "min_ms": min(medians), "max_ms": max(medians),
            "repeat_min_ms": min(repeats), "repeat_max_ms": max(repeats),
            "per_process_ms": {str(i): m for (i, _), m in zip(rows, medians, strict=True)},
            "processes": len(rows), "tokens_per_s": batch / (med / 1000.0) if med > 0 else None}


def arm_first_token(results: Sequence[dict[str, Any]], batch: int) -> dict[str, Any] | None:
    """One arm's 1-token generate at ``batch`` (prefill + one step: the offline time to first token), in
    ms: median of the per-process medians, their min/max and each process's median."""
    rows = [(res["index"], _batch_row(res, batch)) for res in results]
    rows = [(i, r) for i, r in rows if r is not None and r.get("t_1_s")]
    if not rows:
        return None
    medians = [statistics.median(float(t) for t in r["t_1_s"]) * 1000.0 for _, r in rows]
    doc: dict[str, Any] = {"median_ms": statistics.median(medians), "min_ms": min(medians), "max_ms": max(medians),
                           "per_process_ms": {str(i): m for (i, _), m in zip(rows, medians, strict=True)}}
    doc.update(_first_token_host(r for _, r in rows))
    return doc


def _first_token_host(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Over an arm's processes (median of each process's median per 1-token generate): the time its
    garbage collections took (``gc_ms``), the caching allocator's stalling events (``allocator_stalls``:
    cudaMalloc + cudaFree + OOM retries) and Triton JIT compiles (``jit_compiles``); None where the runner
    recorded none."""
    gc_ms, stalls, compiles = [], [], []
    for r in rows:
        host = [h for h in r.get("t_1_host") or [] if isinstance(h, dict)]
        if host:
            gc_ms.append(statistics.median(float(h.get("gc_ms", 0.0)) for h in host))
        counted_jit = [h["jit_compiles"] for h in host if h.get("jit_compiles") is not None]
        if counted_jit:
            compiles.append(statistics.median(counted_jit))
        counted = [h["allocator"] for h in host if h.get("allocator")]
        if counted:
            stalls.append(statistics.median(
                a.get("num_device_alloc", 0) + a.get("num_device_free", 0) + a.get("num_alloc_retries", 0)
                for a in counted))
    return {"gc_ms": statistics.median(gc_ms) if gc_ms else None,
            "allocator_stalls": statistics.median(stalls) if stalls else None,
            "jit_compiles": statistics.median(compiles) if compiles else None}


#: a tuned arm whose first token comes this much later than vanilla's gets a note
FIRST_TOKEN_NOTE_RATIO = 1.05


def first_token_spread(vanilla: dict[str, Any], ratio: float) -> str:
    """How a first-token ratio compares with vanilla's own spread between its processes (max / min of
    their medians): a host-bound prefill's time moves by 30-50% from process to process on the H200,
    so a ratio inside that spread is no measured difference."""
    per = list(vanilla["per_process_ms"].values())
    if len(per) < 2 or min(per) <= 0:
        return "one vanilla process: no spread between processes to compare it with"
    spread = max(per) / min(per)
    where = "within" if ratio <= spread else "beyond"
    return f"{where} vanilla's own spread over its {len(per)} processes ({spread:.2f}x)"


def pair_ratios(base: dict[str, Any] | None, other: dict[str, Any] | None) -> list[float]:
    """base / other TPOT over the processes of the same round (index)."""
    if not base or not other:
        return []
    common = sorted(set(base["per_process_ms"]) & set(other["per_process_ms"]), key=int)
    return [base["per_process_ms"][i] / other["per_process_ms"][i] for i in common
            if other["per_process_ms"][i] > 0]


def merged_table(tables: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The entries the ops serve from these tables, in order: the first table wins a duplicate key."""
    entries, seen = [], set()
    for table in tables:
        for e in table_mod.entries(table):
            if e.key not in seen:
                seen.add(e.key)
                entries.append(e)
    return {"entries": entries}


def predicted_saving_us(spec: Any, table: dict[str, Any], m: int, tp: int = 1) -> dict[str, Any]:
    """Saving per forward at M = ``m`` (a decode step: per token at batch ``m``) the table's standalone figures
    predict: sum over the model's problems (``ModelSpec.problems``, all ops) of count x (baseline - tuned) of
    the entry the ops serve them from (``tunekit.table.serving_lookup``, serving's own rule: an M between two
    tabulated ones takes the next entry above whose config runs at it, the stock path where none does)."""
    from tunekit.problems.shapes import OPS
    from tunekit.table import saving_us
    from tunekit.table import serving_lookup as lookup

    saving, served, calls = 0.0, 0, 0
    by_op: dict[str, float] = {}
    for p in spec.problems(tp=tp, m_list=[m], ops=OPS):
        calls += p.count
        entry = lookup(table, p.op, p.dtype, p.m, p.n, p.k)
        if entry is not None:
            served += p.count
            saving += p.count * saving_us(entry)
            by_op[p.op] = by_op.get(p.op, 0.0) + p.count * saving_us(entry)
    return {"saving_us": saving, "served_calls": served, "calls": calls, "by_op": by_op}


def unserved_predictions(pred: dict[str, Any] | None, cov: dict[str, Any] | None) -> dict[str, float]:
    """{op: predicted saving us} of the ops the table serves at this M that ran no tuned call in the
    engine (the dispatch logs at M): a routing gap, or a fallback, that the prediction still counts."""
    if not pred or cov is None:
        return {}
    tuned = {op for op, impls in cov["by_op"].items() if any(k.startswith("tuned") and v for k, v in impls.items())}
    return {op: us for op, us in sorted(pred["by_op"].items()) if op not in tuned}


# ---------------------------------------------------------------------------
# Dispatch coverage
# ---------------------------------------------------------------------------


def merge_dispatch(logs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sum the markers of several dispatch logs: rows per (op, dtype, shape, m, bias, impl, counted_at,
    vendor) and totals of tuned / fallback calls, per reason, per vendor and per place of counting.

    ``vendor`` is what served a fallback (vLLM's kernel, tunekit's default-config kernel or the
    composition and why; None for a tuned call and in logs written before markers carried it): one
    reason served by two vendors is two rows, since their costs differ."""
    rows: dict[tuple, int] = {}
    tables: list[Any] = []
    for log in logs:
        tables.append(log.get("tables"))
        for c in log.get("calls", []):
            key = (c["op"], c["dtype"], c["shape"], int(c["m"]), bool(c.get("bias")), c["impl"],
                   c.get("counted_at", "call"), c.get("vendor"))
            rows[key] = rows.get(key, 0) + int(c["calls"])
    merged = [{"op": k[0], "dtype": k[1], "shape": k[2], "m": k[3], "bias": k[4], "impl": k[5],
               "counted_at": k[6], "vendor": k[7], "calls": v}
              for k, v in sorted(rows.items(), key=lambda kv: str(kv[0]))]
    out = _coverage_totals(merged)
    out.update({"processes": len(logs), "rows": merged, "tables": tables, "note": _CAPTURE_NOTE})
    return out


def _coverage_totals(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Totals of merged rows. ``by_op``: op -> {impl: calls}, a fallback's impl suffixed with
    `` [vendor]`` where the row names what served it (what the report prints per op and impl)."""
    by_op: dict[str, dict[str, int]] = {}
    reasons: dict[str, int] = {}
    vendors: dict[str, int] = {}
    counted: dict[str, int] = {}
    tuned = fallback = 0
    for r in rows:
        vendor = r.get("vendor")
        impl = f"{r['impl']} [{vendor}]" if vendor and not r["impl"].startswith("tuned:") else r["impl"]
        by_op.setdefault(r["op"], {})
        by_op[r["op"]][impl] = by_op[r["op"]].get(impl, 0) + r["calls"]
        counted[r["counted_at"]] = counted.get(r["counted_at"], 0) + r["calls"]
        if r["impl"].startswith("tuned:"):
            tuned += r["calls"]
        else:
            fallback += r["calls"]
            reason = r["impl"].split(":", 1)[-1]
            reasons[reason] = reasons.get(reason, 0) + r["calls"]
            if vendor:
                vendors[vendor] = vendors.get(vendor, 0) + r["calls"]
    return {"tuned_calls": tuned, "fallback_calls": fallback, "by_op": by_op, "fallback_reasons": reasons,
            "fallback_vendors": vendors, "counted_at": counted}


def coverage_at(coverage: dict[str, Any] | None, m: int) -> dict[str, Any] | None:
    """The merged markers of the calls with M = ``m`` (a decode step of batch ``m``)."""
    if coverage is None:
        return None
    return _coverage_totals([r for r in coverage["rows"] if r["m"] == m])


def _coverage_up_to(coverage: dict[str, Any] | None, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The merged markers of the calls at every M a verify step of this run can run (``verify_bound``)."""
    if coverage is None:
        return None
    bound = spec_decode.verify_bound(settings["batches"], settings["speculative"])
    return _coverage_totals([r for r in coverage["rows"] if r["m"] <= bound])


# ---------------------------------------------------------------------------
# serve.json
# ---------------------------------------------------------------------------


def _prediction(row: dict[str, Any], spec: Any, serving: dict[str, Any], batch: int, vm: float | None,
                notes: list[str]) -> dict[str, Any] | None:
    """Fill ``row``'s prediction; returns it (``saving_us``, ``by_op``) for the coverage check, None where there
    is none. Without speculation the decode steps run M = B: the saving at M = B against vanilla's TPOT. With
    it they run the verify steps' M: ``spec_decode.step_prediction`` over vanilla's histogram of them, and
    where that cannot be made the row says why (``prediction_unavailable``) and predicts nothing."""
    if "spec_decode" not in row:
        pred = predicted_saving_us(spec, serving, batch)
        saving = pred["saving_us"] / 1000.0
        row.update(predicted_saving_ms=saving, predicted_served_calls=pred["served_calls"],
                   predicted_calls=pred["calls"], predicted_speedup=vm / (vm - saving) if vm and vm > saving else None)
        return pred
    step = spec_decode.step_prediction(row["spec_decode"].get("vanilla"), vm,
                                       lambda m: predicted_saving_us(spec, serving, m))
    row["prediction_unavailable"] = step["unavailable"]
    row["prediction_per_step"] = {key: step[key] for key in ("predicted_step_saving_ms", "vanilla_step_ms",
                                                             "tokens_per_step", "by_m")}
    row.update({key: step[key] for key in ("predicted_saving_ms", "predicted_served_calls", "predicted_calls",
                                           "predicted_speedup")})
    if step["unavailable"]:
        notes.append(f"B={batch}: no prediction: {step['unavailable']}; the decode steps run the verify steps' M, "
                     "not M = B")
        return None
    return {"saving_us": step["predicted_step_saving_ms"] * 1000.0, "by_op": step["by_op"]}


def _first(results: dict[str, list[dict[str, Any]]], key: str) -> Any:
    for arm in ARMS:
        for res in results.get(arm, []):
            if res.get(key):
                return res[key]
    return None


def summarize(settings: dict[str, Any], results: dict[str, list[dict[str, Any]]],
              coverage: dict[str, dict[str, Any]], spec: Any | None,
              tables: Sequence[tuple[str, dict[str, Any]]], table_mismatch: dict[str, list[str]] | None = None,
              tol: float = DEFAULT_TOL, commit: str | None = None) -> dict[str, Any]:
    """The ``serve.json`` document. ``results``: runner results by arm; ``coverage``: ``merge_dispatch``
    of the tuned and passthrough arms; ``tables``: (path, table) as given to the tuned arm. The results
    are named (``runs``: arm -> their files, relative to the run folder), not copied."""
    table_mismatch = table_mismatch or {}
    usable = [t for path, t in tables if not table_mismatch.get(path)]
    serving = merged_table(usable)
    notes: list[str] = []
    if tables and len(usable) < len(tables):
        left = [p for p, _ in tables if table_mismatch.get(p)]
        notes.append(f"tables tuned for another environment, left out of the prediction: {', '.join(left)}")
    tuned_cov = coverage.get("tuned")
    if "tuned" in results and tuned_cov is not None and tuned_cov["tuned_calls"] == 0:
        reasons = ", ".join(f"{k} x{v}" for k, v in sorted(tuned_cov["fallback_reasons"].items())) or "no calls"
        notes.append(f"the tuned arm served nothing: zero tuned calls in its dispatch logs ({reasons})")
    if "tuned" in results and tuned_cov is None:
        notes.append("no dispatch log of the tuned arm: its coverage is unknown")
    batches = []
    for batch in settings["batches"]:
        tpot = {arm: arm_tpot(results.get(arm, []), batch) for arm in ARMS if arm in results}
        v, t, p = tpot.get("vanilla"), tpot.get("tuned"), tpot.get("passthrough")
        row: dict[str, Any] = {"batch": batch, "tpot": tpot}
        for arm in ARMS:
            row[f"{arm}_tpot_ms"] = tpot[arm]["median_ms"] if tpot.get(arm) else None
        ratios = pair_ratios(v, t)
        row["speedup"] = v["median_ms"] / t["median_ms"] if v and t else None
        row["speedup_min"] = min(ratios) if ratios else None
        row["speedup_max"] = max(ratios) if ratios else None
        pratios = pair_ratios(v, p)
        row["passthrough_ratio"] = v["median_ms"] / p["median_ms"] if v and p else None
        row["passthrough_ratio_min"] = min(pratios) if pratios else None
        row["passthrough_ratio_max"] = max(pratios) if pratios else None
        f = tpot.get("folded")  # the fold's gain: over vanilla, and over tuned in the same run
        fratios = pair_ratios(v, f)
        row["folded_speedup"] = v["median_ms"] / f["median_ms"] if v and f else None
        row["folded_speedup_min"] = min(fratios) if fratios else None
        row["folded_speedup_max"] = max(fratios) if fratios else None
        row["folded_over_tuned"] = t["median_ms"] / f["median_ms"] if t and f else None
        vm = v["median_ms"] if v else None
        if settings.get("speculative"):
            row["spec_decode"] = {arm: spec_decode.arm_figures([(_batch_row(res, batch) or {}).get("spec_decode")
                                                                for res in results.get(arm, [])])
                                  for arm in ARMS if arm in results}
            if (note := spec_decode.acceptance_note(batch, row["spec_decode"])) is not None:
                notes.append(note)
        row.update(dict.fromkeys(("predicted_saving_ms", "predicted_served_calls", "predicted_calls",
                                  "predicted_speedup")))
        pred = _prediction(row, spec, serving, batch, vm, notes) if spec is not None and tables else None
        row["measured_saving_ms"] = vm - t["median_ms"] if v and t else None
        row["tokens_per_s"] = {arm: tp["tokens_per_s"] for arm, tp in tpot.items() if tp}
        row["tpot_methods"] = arm_methods(results, tpot, batch)
        if (note := disagreement_note(batch, row["tpot_methods"])) is not None:
            notes.append(note)
        # the time to the first token: "never slower" covers the prefill too, which runs eager above the
        # captured sizes (a routed layer's op then costs host time on every call)
        first = {arm: arm_first_token(results.get(arm, []), batch) for arm in ARMS if arm in results}
        row["first_token"] = first
        vf, tf = first.get("vanilla"), first.get("tuned")
        row["first_token_ratio"] = tf["median_ms"] / vf["median_ms"] if vf and tf and vf["median_ms"] > 0 else None
        fratios = pair_ratios(tf, vf)
        row["first_token_ratio_min"] = min(fratios) if fratios else None
        row["first_token_ratio_max"] = max(fratios) if fratios else None
        if row["first_token_ratio"] is not None and row["first_token_ratio"] > FIRST_TOKEN_NOTE_RATIO:
            notes.append(f"B={batch}: the first token (a 1-token generate) takes {row['first_token_ratio']:.2f}x "
                         f"vanilla's time with the table ({tf['median_ms']:.1f} vs {vf['median_ms']:.1f} ms); "
                         + first_token_spread(vf, row["first_token_ratio"]))
        row["coverage"] = {arm: coverage_at(coverage.get(arm), batch) for arm in (*TABLE_ARMS, "passthrough")
                           if arm in results}
        # the ops a prediction counts against the tuned calls at the Ms it was made for (with speculation: every
        # M up to the largest verify step's, where the markers count the padded M the GEMVs ran at)
        gaps = unserved_predictions(pred, row["coverage"].get("tuned") if not settings.get("speculative") else
                                    _coverage_up_to(coverage.get("tuned"), settings))
        row["predicted_unserved_us"] = gaps
        if gaps:
            notes.append(f"B={batch}: the prediction counts ops that ran no tuned call in vLLM ("
                         + ", ".join(f"{op} {us:.0f} us" for op, us in gaps.items())
                         + "): a routing gap or a fallback; the dispatch coverage says which")
        row["agreement"] = agreement_row(results, batch, tol, settings.get("weights", "dummy"), settings["batches"])
        profiles = {arm: arm_profile((_batch_row(res, batch) or {}).get("profile") for res in results.get(arm, []))
                    for arm in ARMS if arm in results}
        profile_errors = sorted({err for res in (r for docs in results.values() for r in docs)
                                 if (err := (_batch_row(res, batch) or {}).get("profile_error"))})
        if profile_errors:
            notes.append(f"B={batch}: no profile from some processes: " + "; ".join(profile_errors))
        if any(profiles.values()):
            row["profile"] = profiles
            row["profile_compare"] = compare(profiles.get("vanilla"), profiles.get("tuned"),
                                             {arm: row[f"{arm}_tpot_ms"] for arm in ("vanilla", "tuned")})
        if row["agreement"]["verdict"] == "fail":
            notes.append(f"B={batch}: tuned and vanilla disagree beyond the logprob tolerance {tol:.4g}"
                         if row["agreement"]["judged_by"] != "teacher-forced" else
                         f"B={batch}: an arm serving the tables disagrees with vanilla past the caps a correct "
                         "kernel stays within (teacher-forced check; serve.md says which figure)")
        elif row["agreement"]["verdict"] == "inconclusive":
            notes.append(f"B={batch}: agreement inconclusive: vanilla's own spread is past the caps, so this run "
                         "cannot tell a kernel's error from its noise (serve.md gives the spread)")
        batches.append(row)
    short = sum(r.get("short_outputs", 0) for docs in results.values() for res in docs for r in res["batches"])
    if short:
        notes.append(f"{short} timed outputs were shorter than --tokens (max_model_len?): their TPOT is off")
    ttft = first_token.summarize(results) if settings.get("first_token") else None
    notes.extend(first_token.notes(ttft))
    speculative = None
    if settings.get("speculative"):
        bound = spec_decode.verify_bound(settings["batches"], settings["speculative"])
        speculative = {"setting": settings["speculative"], "prompts": settings.get("prompts"), "verify_max_m": bound,
                       "coverage": {arm: spec_decode.verify_coverage(cov, bound) for arm, cov in coverage.items()}}
        if min(settings["batches"]) * settings.get("prompt_len", 0) <= bound:
            notes.append(f"prompts of {settings.get('prompt_len')} tokens prefill at M <= {bound}: the coverage per "
                         "M of the verify steps counts those prefill calls too")
    return {
        "format": FORMAT, "mode": "offline", "speculative": speculative, "model": settings.get("model"),
        "layers": settings.get("layers"),
        "device": _first(results, "device"), "vllm": _first(results, "vllm"), "torch": _first(results, "torch"),
        "tunekit_commit": commit, "settings": settings, "tables": [p for p, _ in tables],
        "table_mismatch": table_mismatch,
        "engine_start_s": {arm: [res.get("engine_start_s") for res in docs] for arm, docs in results.items()},
        "plugin": {arm: [res.get("plugin") for res in docs] for arm, docs in results.items()},
        "runs": {arm: [f"{RUNS_DIR}/{run_file(arm, res['index'])}" for res in docs] for arm, docs in results.items()},
        "coverage": coverage, "batches": batches, "ttft": ttft, "notes": notes,
    }
