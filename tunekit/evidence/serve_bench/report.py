"""``serve.md`` and ``serve.png`` from a ``serve.json`` document (offline or endpoint mode)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tunekit.evidence.serve_bench import ARMS
from tunekit.evidence.serve_bench.agreement import NOT_JUDGED
from tunekit.evidence.serve_bench.profile import TOP_HOST_OPS, TOP_KERNELS, TOP_PY_FUNCS

EVIDENCE = ("end-to-end measurement in vLLM (the served-model layer of evidence): the whole decode step with "
            "attention, recurrence, sampling and the scheduler, one engine per process, arms alternated over "
            "processes")


def weights_text(settings: dict[str, Any]) -> str:
    """What the engines' weights were, for the report's evidence line."""
    weights = settings.get("weights", "dummy")
    if weights == "realistic":
        return (f"realistic weights (vLLM's dummy load, then tunekit's seeded recipe, seed "
                f"{settings.get('weights_seed', 0)}: per-kind scales, norm gains with outlier channels, peaked logits)")
    if weights == "checkpoint":
        return f"the checkpoint's own weights ({settings.get('model_dir')})"
    return "dummy weights (vLLM's dummy loader: nearly uniform logits)"


def _f(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _section(lines: list[str], intro: str, table: tuple[list[str], list[list[str]]]) -> None:
    """Append ``intro`` and ``table`` (head, rows) to the report's ``lines``, where the table has rows."""
    if table[1]:
        lines += ["", intro, "", _md_table(*table)]


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _arm_text(arm: str, serve: dict[str, Any]) -> str:
    """How an arm was run, for the report's header (only the arms that ran are named)."""
    if arm == "vanilla":
        return "vanilla = tunekit's plugin excluded by VLLM_PLUGINS"
    if arm == "passthrough":
        return "passthrough = plugin loaded, no table (its cost alone)"
    tables = ", ".join(f"`{t}`" for t in serve.get("tables", []))
    # the plugin's load-time join of sibling linears (on unless TUNEKIT_MERGE_SIBLINGS=0), as its processes recorded
    records = [r for r in serve.get("plugin", {}).get(arm, []) if isinstance(r, dict)]
    # (a plugin older than the join names the hook nowhere: then nothing is said)
    joined = [r for r in records if "merge_siblings" in r.get("installed", {})]
    apart = [r for r in records if "merge_siblings" in r.get("skipped", {})]
    merge = ("; sibling linears joined where the tables pay" if joined and len(joined) == len(records)
             else "; sibling linears apart (TUNEKIT_MERGE_SIBLINGS=0)" if apart and len(apart) == len(records)
             else "")
    if arm == "folded":
        return f"folded = plugin with TUNEKIT_TABLE = {tables}, the default (decoder norms folded{merge})"
    unfolded = f"tuned = plugin with TUNEKIT_TABLE = {tables} and TUNEKIT_FOLD_NORMS=0"
    return unfolded + (f" ({merge[2:]})" if merge else "")


def _arms(serve: dict[str, Any]) -> list[str]:
    present = {arm for row in serve["batches"] for arm, tp in row["tpot"].items() if tp}
    return [a for a in ARMS if a in present]


def tpot_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    arms = _arms(serve)
    unit = "C" if serve.get("mode") == "endpoint" else "B"
    folded = "folded" in arms
    head = ([unit] + [f"{a} TPOT ms (min-max)" for a in arms] + ["tuned speedup (min-max)"]
            + (["folded speedup (min-max)", "folded / tuned"] if folded else [])
            + ["passthrough ratio", "tokens/s " + " / ".join(arms)])
    rows = []
    for row in serve["batches"]:
        cells = [str(row["batch"])]
        for a in arms:
            tp = row["tpot"].get(a)
            cells.append(f"{tp['median_ms']:.3f} ({tp['min_ms']:.3f}-{tp['max_ms']:.3f})" if tp else "-")
        cells.append(f"{_f(row['speedup'], '.4f')} ({_f(row['speedup_min'], '.4f')}-{_f(row['speedup_max'], '.4f')})")
        if folded:
            cells.append(f"{_f(row.get('folded_speedup'), '.4f')} ({_f(row.get('folded_speedup_min'), '.4f')}-"
                         f"{_f(row.get('folded_speedup_max'), '.4f')})")
            cells.append(_f(row.get("folded_over_tuned"), ".4f"))
        cells.append(_f(row.get("passthrough_ratio"), ".4f"))
        cells.append(" / ".join(_f(row["tokens_per_s"].get(a), ".1f") for a in arms))
        rows.append(cells)
    return head, rows


def first_token_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Offline runs: each arm's 1-token generate (prefill + one step) and tuned / vanilla (>1: later)."""
    arms = _arms(serve)
    head = (["B"] + [f"{a} 1-token generate ms (min-max)" for a in arms] + ["tuned / vanilla (min-max)"]
            + [f"{a} GC ms / allocator stalls / JIT compiles" for a in arms])
    rows = []
    for row in serve["batches"]:
        first = row.get("first_token") or {}
        cells = [str(row["batch"])]
        for a in arms:
            f = first.get(a)
            cells.append(f"{f['median_ms']:.1f} ({f['min_ms']:.1f}-{f['max_ms']:.1f})" if f else "-")
        cells.append(f"{_f(row.get('first_token_ratio'), '.3f')} ({_f(row.get('first_token_ratio_min'), '.3f')}-"
                     f"{_f(row.get('first_token_ratio_max'), '.3f')})")
        for a in arms:
            f = first.get(a) or {}
            cells.append(f"{_f(f.get('gc_ms'), '.2f')} / {_f(f.get('allocator_stalls'), '.0f')} / "
                         f"{_f(f.get('jit_compiles'), '.0f')}")
        rows.append(cells)
    return head, rows


def ttft_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """``--first-token``: per (prompt length, batch) vanilla's time, spread between and within its processes,
    and each other arm's time, ratio to vanilla (range over process pairs) and verdict."""
    ttft = serve.get("ttft") or {"cases": []}
    others = [a for a in ARMS if a != "vanilla" and any(a in c["arms"] for c in ttft["cases"])]
    head = (["prompt", "B", "vanilla ms (min-max)", "vanilla spread between / within processes"]
            + [h for a in others for h in (f"{a} ms", f"{a} / vanilla (pairs min-max)", f"{a} verdict")])
    rows = []
    for case in ttft["cases"]:
        v = case["arms"].get("vanilla")
        spread, iqr = case.get("vanilla_spread"), case.get("vanilla_iqr_rel")
        cells = [str(case["prompt_len"]), str(case["batch"]),
                 f"{v['median_ms']:.2f} ({v['min_ms']:.2f}-{v['max_ms']:.2f})" if v else "-",
                 f"{_f(None if spread is None else spread * 100, '.1f', '%')} / "
                 f"{_f(None if iqr is None else iqr * 100, '.1f', '%')}"]
        for a in others:
            fig, c = case["arms"].get(a), case["compared"].get(a) or {}
            cells += [_f(fig and fig["median_ms"], ".2f"),
                      "-" if c.get("ratio") is None else f"{c['ratio']:.4f} (" + (
                          "no pair" if c.get("min") is None else f"{c['min']:.4f}-{c['max']:.4f}") + ")",
                      c.get("verdict", "-")]
        rows.append(cells)
    return head, rows


def prediction_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["B", "vanilla ms", "measured saving ms", "predicted saving ms", "measured / predicted",
            "predicted over the ops that ran tuned ms", "speedup", "predicted speedup",
            "calls served by the tables (of per token)"]
    rows = []
    for row in serve["batches"]:
        meas, pred = row.get("measured_saving_ms"), row.get("predicted_saving_ms")
        gaps = row.get("predicted_unserved_us") or {}
        ran = pred - sum(gaps.values()) / 1000.0 if pred is not None else None
        rows.append([str(row["batch"]), _f(row.get("vanilla_tpot_ms"), ".3f"), _f(meas, ".3f"), _f(pred, ".3f"),
                     _f(meas / pred if meas is not None and pred else None, ".2f"),
                     _f(ran, ".3f") + (f" (without {', '.join(gaps)})" if gaps else ""), _f(row["speedup"], ".4f"),
                     _f(row.get("predicted_speedup"), ".4f"),
                     f"{row.get('predicted_served_calls')} of {row.get('predicted_calls')}"
                     if row.get("predicted_calls") is not None else "-"])
    return head, rows


def coverage_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["B", "arm", "op", "tuned calls", "fallback calls (reason)"]
    rows = []
    for row in serve["batches"]:
        for arm, cov in (row.get("coverage") or {}).items():
            if not cov:
                continue
            if not cov["by_op"]:
                rows.append([str(row["batch"]), arm, "-", "0", "no call at this M"])
            for op, impls in sorted(cov["by_op"].items()):
                tuned = sum(v for k, v in impls.items() if k.startswith("tuned:"))
                fb = ", ".join(f"{k.split(':', 1)[1]} x{v}" for k, v in sorted(impls.items())
                               if not k.startswith("tuned:"))
                rows.append([str(row["batch"]), arm, op, str(tuned), fb or "-"])
    return head, rows


def agreement_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["B", "pair", "sequences", "ids equal", "near ties", "max abs logprob diff", "failed", "verdict"]
    rows = []
    for row in serve["batches"]:
        ag = row.get("agreement") or {}
        for pair in ("tuned_vs_vanilla", "folded_vs_vanilla", "passthrough_vs_vanilla", "vanilla_vs_vanilla"):
            a = ag.get(pair)
            if not a:
                continue
            rows.append([str(row["batch"]), pair.replace("_vs_", " vs "), str(a["sequences"]), str(a["ids_equal"]),
                         str(a["near_ties"]), f"{a['max_abs_logprob_diff']:.3g}", str(a["failed"]),
                         "pass" if a["ok"] else "FAIL"])
    return head, rows


def forced_lines(serve: dict[str, Any]) -> list[str]:
    """One line per batch size and arm: the teacher-forced verdict and its checks against the caps
    (``agreement.line``), then vanilla's spread itself."""
    from tunekit.evidence.serve_bench.agreement import COMPARED_ARMS, line

    out = []
    for row in serve["batches"]:
        doc = (row.get("agreement") or {}).get("forced")
        if not doc:
            continue
        judged = row["agreement"].get("verdict") != "not judged"
        for arm in COMPARED_ARMS:
            if doc.get(arm):
                out.append(f"- B={row['batch']}: {line(arm, doc[arm], doc, judged)}")
        spread = ", ".join(
            f"{what} {s['max_abs_logprob_diff']:.3g} / {s['kl_max']:.3g} ({s['sequences']} sequences)"
            for what, s in (("between processes", doc["spread"]["processes"]),
                            ("across batch sizes", doc["spread"]["batches"])) if s) or "none measured"
        within = {True: "within the caps", False: "past the caps (" + "; ".join(doc.get("spread_over_caps") or [])
                  + ")" + (": inconclusive" if judged else ""),
                  None: "none measured" if not judged else "the caps alone judge"}[doc.get("spread_within_caps")]
        out.append(f"- B={row['batch']}: vanilla's spread (max |dlogprob| / KL max): {spread}; {within}")
    return out


def tpot_methods_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per batch size and arm: TPOT by difference and by per-token timestamps, their ratio, a flag past 2%."""
    head = ["B", "arm", "difference ms", "timestamps ms", "timestamps / difference", "within 2%"]
    rows = []
    for row in serve["batches"]:
        for arm, m in (row.get("tpot_methods") or {}).items():
            if m.get("timestamps_ms") is None:
                continue
            rows.append([str(row["batch"]), arm, _f(m["difference_ms"], ".3f"), _f(m["timestamps_ms"], ".3f"),
                         _f(m["ratio"], ".4f"), "no: FLAGGED" if m["disagree"] else "yes"])
    return head, rows


def profile_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per batch size and kernel category: us per decode step in vanilla and tuned, saved, kernels per step."""
    head = ["B", "category", "vanilla us/step", "tuned us/step", "saved us", "kernels/step vanilla / tuned"]
    rows = []
    for r in serve["batches"]:
        cmp = r.get("profile_compare")
        if not cmp:
            continue
        for name, c in sorted(cmp["categories"].items(), key=lambda kv: -kv[1]["vanilla_us"]):
            rows.append([str(r["batch"]), name, _f(c["vanilla_us"], ".1f"), _f(c["tuned_us"], ".1f"),
                         _f(c["saved_us"], "+.1f"), f"{c['vanilla_kernels']:.0f} / {c['tuned_kernels']:.0f}"])
        out = cmp["outside_kernels_us"]
        rows.append([str(r["batch"]), "**kernels, all**", "", "", _f(cmp["kernel_saved_us"], "+.1f"), ""])
        saved_out = (out["vanilla"] - out["tuned"]) if out.get("vanilla") is not None and out.get("tuned") is not None \
            else None
        rows.append([str(r["batch"]), "outside kernels", _f(out.get("vanilla"), ".1f"), _f(out.get("tuned"), ".1f"),
                     _f(saved_out, "+.1f"), ""])
    return head, rows


def kernel_changes_table(serve: dict[str, Any], n: int = 10) -> tuple[list[str], list[list[str]]]:
    """Per batch size, the ``n`` kernels whose time per decode step changed most from vanilla to tuned."""
    head = ["B", "category: kernel", "vanilla us/step", "tuned us/step", "saved us", "kernels/step vanilla / tuned"]
    rows = []
    for r in serve["batches"]:
        changed = (r.get("profile_compare") or {}).get("kernels_changed") or {}
        for name, c in list(changed.items())[:n]:
            rows.append([str(r["batch"]), f"`{name.replace('|', '/').replace('`', '')}`", _f(c["vanilla_us"], ".1f"),
                         _f(c["tuned_us"], ".1f"), _f(c["saved_us"], "+.1f"),
                         f"{c['vanilla_kernels']:.0f} / {c['tuned_kernels']:.0f}"])
    return head, rows


def tuned_launches_table(serve: dict[str, Any], n: int = 8) -> tuple[list[str], list[list[str]]]:
    """Per batch size and tunekit arm, its ``n`` tunekit GEMV launches with the most time per decode step
    (``by_launch``: launch shape and the kernel before it), per launch: what the table's standalone
    figure is checked against inside the step."""
    head = ["B", "arm", "launch", "us per launch", "launches/step", "launch gap us"]
    rows = []
    for r in serve["batches"]:
        for arm, prof in sorted((r.get("profile") or {}).items()):
            if arm == "vanilla" or not prof:
                continue
            launches = [(k, v) for k, v in (prof.get("by_launch") or {}).items()
                        if k.startswith("tunekit_gemv:") and v.get("kernels", 0) >= 0.5]
            for key, v in sorted(launches, key=lambda kv: -kv[1]["us"])[:n]:
                name = key.split(": ", 1)[1].replace("|", "/").replace("`", "")
                rows.append([str(r["batch"]), arm, f"`{name}`", _f(v["us"] / v["kernels"], ".2f"),
                             _f(v["kernels"], ".0f"), _f(v.get("gap_us", 0.0) / v["kernels"], ".2f")])
    return head, rows


def in_process_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per batch size and arm, each served tuned kernel timed standalone in the engine's process
    (``TUNEKIT_PROFILE_KERNELS=1``) against its table entry."""
    head = ["B", "arm", "problem", "table us", "in-process us", "in-process / table"]
    rows = []
    for r in serve["batches"]:
        for arm, prof in sorted((r.get("profile") or {}).items()):
            for problem, v in sorted(((prof or {}).get("in_process") or {}).items()):
                us, table_us = v.get("us"), v.get("table_us")
                ratio = us / table_us if us is not None and us == us and table_us else None
                rows.append([str(r["batch"]), arm, problem, _f(table_us, ".2f"),
                             _f(us if us == us else None, ".2f"), _f(ratio, ".3f")])
    return head, rows


def prefill_changes_table(serve: dict[str, Any], key: str, what: str,
                          n: int = 10) -> tuple[list[str], list[list[str]]]:
    """Per batch size, the ``n`` names of the 1-token generate's profile ``key`` of ``profile_compare``
    (``prefill_host_changed``: host ops, inclusive CPU time; ``prefill_python_changed``: Python functions,
    own time) whose time changed most from vanilla to tuned; ``what`` heads the name column."""
    head = ["B", what, "vanilla ms", "tuned ms", "calls vanilla / tuned"]
    rows = []
    for r in serve["batches"]:
        changed = (r.get("profile_compare") or {}).get(key) or {}
        for name, c in list(changed.items())[:n]:
            rows.append([str(r["batch"]), f"`{name.replace('|', '/').replace('`', '')}`",
                         _f(c["vanilla_us"] / 1000.0, ".3f"), _f(c["tuned_us"] / 1000.0, ".3f"),
                         f"{c['vanilla_calls']:.0f} / {c['tuned_calls']:.0f}"])
    return head, rows


def prefill_work_table(serve: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Per batch size, the 1-token generate's kernel and Python-call counts of vanilla and tuned."""
    head = ["B", "kernels vanilla / tuned", "Python calls vanilla / tuned", "Python calls tuned / vanilla"]
    rows = []
    for r in serve["batches"]:
        work = (r.get("profile_compare") or {}).get("prefill_work") or {}
        v, t = work.get("vanilla") or {}, work.get("tuned") or {}
        if not v or not t:
            continue
        vc, tc = v.get("python_calls"), t.get("python_calls")
        rows.append([str(r["batch"]), f"{_f(v.get('kernels'), '.0f')} / {_f(t.get('kernels'), '.0f')}",
                     f"{_f(vc, '.0f')} / {_f(tc, '.0f')}", _f(tc / vc if vc and tc is not None else None, ".4f")])
    return head, rows


def _m_hist(hist: dict[str, int] | None) -> str:
    """``{"4": 120, "3": 7}`` -> ``4: 120, 3: 7`` (most steps first)."""
    items = sorted((hist or {}).items(), key=lambda kv: (-kv[1], int(kv[0])))
    return ", ".join(f"{m}: {n}" for m, n in items) or "-"


def spec_lines(serve: dict[str, Any]) -> list[str]:
    """The speculative-decoding section: acceptance and the decode steps' M per arm and batch size, then
    the dispatch coverage per M up to the largest verify step's."""
    spec = serve["speculative"]
    head = ["B", "arm", "TPOT ms", "acceptance", "mean accepted length", "drafts", "decode steps' M (steps)",
            "mean M"]
    rows = []
    for row in serve["batches"]:
        for arm, f in (row.get("spec_decode") or {}).items():
            if f:
                rows.append([str(row["batch"]), arm, _f(row.get(f"{arm}_tpot_ms"), ".3f"),
                             _f(f["acceptance_rate"], ".3f"), _f(f["mean_accepted_length"], ".2f"),
                             _f(f["counters"].get("drafts"), "d"), _m_hist(f["decode_m"]), _f(f["mean_m"], ".2f")])
    lines = ["", f"Speculative decoding: vLLM's {spec['setting']} in every arm ({spec.get('prompts')} prompts). "
             "Acceptance = accepted / draft tokens, mean accepted length = 1 + accepted / drafts (vLLM's counters "
             "over the batch size's generates, summed over processes); M of a decode step = the tokens the "
             "scheduler ran in it (each sequence's last token and its drafts), before any CUDA-graph padding.",
             "", _md_table(head, rows) if rows else "(no process recorded spec-decode figures)"]
    head = ["arm", "M", "tuned calls", "fallback calls", "by op and impl"]
    rows = []
    for arm, cov in (spec.get("coverage") or {}).items():
        for m, cell in (cov or {}).get("by_m", {}).items():
            ops = "; ".join(f"{op} " + ", ".join(f"{impl} x{n}" for impl, n in sorted(impls.items()))
                            for op, impls in sorted(cell["ops"].items()))
            rows.append([arm, m, str(cell["tuned"]), str(cell["fallback"]), ops])
    if rows:
        lines += ["", f"Dispatch coverage at the verify steps' M (every M up to {spec['verify_max_m']}, the largest "
                  "batch with all its drafts), from the plugin's markers over the whole run (markers carry no step): "
                  "the M a GEMV ran at, after padding to a captured size; under CUDA graphs counted at capture.",
                  "", _md_table(head, rows)]
    return lines


def write_spec_index(doc: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``serve.json`` and ``serve.md`` of a ``--speculative`` run's folder: each setting's figures side by side
    (its own folder holds the whole report)."""
    path = out / "serve.json"
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    head = ["speculative", "B", "vanilla TPOT ms", "tuned TPOT ms", "tuned speedup", "acceptance vanilla / tuned",
            "mean M vanilla / tuned"]
    rows = []
    for v in doc["variants"]:
        for r in v["rows"]:
            sd = r.get("spec_decode") or {}
            van, tun = sd.get("vanilla") or {}, sd.get("tuned") or {}
            rows.append([f"[{v['speculative']}]({v['folder']}/serve.md)", str(r["batch"]),
                         _f(r["tpot"].get("vanilla"), ".3f"), _f(r["tpot"].get("tuned"), ".3f"),
                         _f(r.get("speedup"), ".4f"),
                         f"{_f(van.get('acceptance_rate'), '.3f')} / {_f(tun.get('acceptance_rate'), '.3f')}",
                         f"{_f(van.get('mean_m'), '.2f')} / {_f(tun.get('mean_m'), '.2f')}"])
    lines = ["## Served decode with speculative decoding", "",
             "One serve-bench run per setting, every arm at that setting (tuned over vanilla at the same k); "
             "each folder's serve.md has the whole report (coverage per M, agreement, notes).", "",
             _md_table(head, rows)]
    notes = [f"{v['speculative']}: {n}" for v in doc["variants"] for n in v.get("notes", [])]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    md = out / "serve.md"
    md.write_text("\n".join(lines) + "\n")
    return path, md


def write_markdown(serve: dict[str, Any], path: Path) -> Path:
    """The report section: settings, TPOT per arm, prediction vs measurement, coverage, agreement, notes."""
    s = serve.get("settings", {})
    endpoint = serve.get("mode") == "endpoint"
    lines = [f"## Served decode: {serve.get('model') or 'endpoints'}", ""]
    if endpoint:
        lines.append("A/B against running OpenAI-compatible servers (streaming /v1/completions, token-id prompts, "
                     f"greedy, ignore_eos): {', '.join(f'{a} {u}' for a, u in serve.get('endpoints', {}).items())}; "
                     f"{s.get('tokens')} new tokens, prompts of {s.get('prompt_len')} tokens, {s.get('repeats')} "
                     "rounds per arm and concurrency, arms alternated per round. TPOT per request = (last token - "
                     "first token) / (tokens - 1).")
    else:
        tokens = s.get("tokens") or 2
        layers = f" ({serve['layers']} layers)" if serve.get("layers") else ""
        lines += [f"Evidence: {EVIDENCE}; {weights_text(s)}.", "",
                  f"Device {serve.get('device')}, vLLM {serve.get('vllm')}, torch {serve.get('torch')}, tunekit "
                  f"{(serve.get('tunekit_commit') or '?')[:12]}; model {serve.get('model')}{layers}, bf16, "
                  f"{s.get('processes', '?')} processes per arm, {s.get('repeats')} repeats per process, {tokens} new "
                  f"tokens after prompts of {s.get('prompt_len')} tokens. TPOT = (t({tokens} tokens) - t(1 token)) / "
                  f"{tokens - 1} per generate of B prompts; an arm's figure is the median of its processes' medians, "
                  "(min-max) over processes; speedup spread over the process pairs of one round.", "",
                  "Arms: " + "; ".join(_arm_text(a, serve) for a in _arms(serve)) + "."]
    lines += ["", _md_table(*tpot_table(serve))]
    _section(lines, "TPOT two ways: the difference method above, and the decode time from per-token timestamps "
             "inside the --tokens generate (each request's (last - first token) / (tokens - 1), median over "
             "requests, generates and processes), which no 1-token generate enters; a disagreement above 2% is "
             "flagged (and noted below).", tpot_methods_table(serve))
    if endpoint:
        head = ["C"] + [f"{a} TTFT ms" for a in _arms(serve)] + [f"{a} tokens/s (all requests)" for a in _arms(serve)]
        rows = [[str(r["batch"])] + [_f((r.get("ttft_ms") or {}).get(a), ".1f") for a in _arms(serve)]
                + [_f((r.get("throughput_tokens_per_s") or {}).get(a), ".1f") for a in _arms(serve)]
                for r in serve["batches"]]
        lines += ["", _md_table(head, rows)]
    elif any(r.get("first_token") for r in serve["batches"]):
        lines += ["", "Time to the first token offline: a 1-token generate of B prompts (prefill and one step; "
                  "median over repeats per process, then over processes). Prefills above the captured sizes run "
                  "eager; where the plugin's compile_ranges hook is installed, the graph vLLM compiles for token "
                  "counts above the tables' largest M holds no tunekit op.", "",
                  _md_table(*first_token_table(serve))]
    if serve.get("ttft"):
        t = serve["ttft"]
        lines += ["", f"Time to first token on its own (--first-token): per process, {t['repeats']} timed 1-token "
                  "generates per (prompt, B) after an untimed one, the cases round-robin, every request a fresh "
                  "prompt (no prefix-cache hit); an arm's figure is the median of its processes' medians. Spread "
                  "between vanilla's processes: max / min of their medians - 1; within: the largest IQR / median. "
                  f"Verdict: within {t['band']:.0%} only with the whole range of arm #i / vanilla #i inside "
                  f"1 +- {t['band']:g} and vanilla's spread between processes below {t['band']:.0%}; slower / "
                  "faster with the whole range past a bound; otherwise unresolved.", "",
                  _md_table(*ttft_table(serve))]
    if any(r.get("predicted_saving_ms") is not None for r in serve["batches"]):
        at = ("per output token S / L: S the saving of a forward at each M vanilla's decode steps ran, weighted "
              "by their share of its steps, L its mean accepted length (the tokens a step yields per sequence); "
              "predicted speedup = vanilla x L / (vanilla x L - S)" if serve.get("speculative") else
              "per token at M = B; predicted speedup = vanilla / (vanilla - saving)")
        lines += ["", "Prediction from the tables' standalone figures (sum of count x (baseline - tuned) over the "
                  f"model's problems, each from the entry serving takes at that M; {at}):", "",
                  _md_table(*prediction_table(serve))]
    cov = coverage_table(serve)
    if cov[1]:
        lines += ["", "Dispatch coverage at M = B, merged over the processes' TUNEKIT_DISPATCH_LOG files. "
                  "Under CUDA graphs calls are counted at capture (replays run no Python): counts are captures "
                  "and eager calls, not executions.", "", _md_table(*cov)]
    if serve.get("speculative"):
        lines += spec_lines(serve)
    ag = agreement_table(serve)
    if ag[1]:
        tol = next((r["agreement"]["tolerance"] for r in serve["batches"] if r.get("agreement")), None)
        lines += ["", f"Agreement over the first {s.get('agree_steps')} decode steps (chosen-token logprobs while the "
                  f"ids agree; a differing id passes as a near tie when both tokens are within the tolerance in both "
                  f"runs). Tolerance {_f(tol, '.4g')} nats = 4 BF16 unit roundoffs; vanilla vs vanilla is the "
                  "run-to-run floor." + (" Dummy weights make every distribution nearly uniform, so ids are near "
                                         "ties and the text is meaningless; this check gives the verdict."
                                         if s.get("weights", "dummy") == "dummy" else
                                         f" Reported; {NOT_JUDGED}." if s.get("weights") == "realistic" else
                                         " Reported; the teacher-forced check below gives the verdict."),
                  "", _md_table(*ag)]
    forced = forced_lines(serve)
    if forced:
        doc = next(r["agreement"]["forced"] for r in serve["batches"] if (r.get("agreement") or {}).get("forced"))
        not_judged = s.get("weights") == "realistic"
        caps = doc["caps"]
        lines += ["", ("Teacher-forced figures (" + NOT_JUDGED + "): the synthetic recipe's vanilla processes "
                       "disagree past any cap a correct kernel stays within (1.36 nats on 27B), so nothing here "
                       "is a verdict; a checkpoint's (--model-dir, or the real checkpoints of `tunekit "
                       "real-weights`) is judged (docs/evidence.md, \"The agreement verdict\"). "
                       if not_judged else "Teacher-forced agreement: ")
                  + f"every process decodes the prompts followed by vanilla #0's greedy "
                  f"tokens ({doc['steps']} positions per request; a request whose own token differs starts again "
                  f"after it), and keeps the top-{doc.get('topk')} logprobs of each position. Per arm against "
                  "vanilla: greedy tokens (share equal, first divergence, mismatches beyond a near tie of "
                  f"{doc['near_tie']:.3g} nats), max |dlogprob| over the top-{doc.get('topk')}, and KL(vanilla || "
                  "arm) over the tokens both lists hold plus one bucket for the rest of the vocabulary (a lower "
                  "bound of the full-vocabulary KL; `mass` is how much of vanilla's distribution the shared tokens "
                  f"hold). Caps (what a correct BF16 kernel moves, measured on real checkpoints, with margin): "
                  f"{caps['logprob']:.3g} nats and KL {caps['kl']:.3g}; vanilla's own spread (between processes, "
                  "and the same request at other batch sizes) past a cap makes the verdict inconclusive, never a "
                  "pass." + (" Informational on dummy weights." if s.get("weights", "dummy") == "dummy" else ""),
                  ""]
        lines += forced
    prof = profile_table(serve)
    if prof[1]:
        steps = s.get("profile_steps")
        lines += ["", f"Kernel time per decode step (torch's profiler, CUDA graph replays included: the difference of "
                  f"a 1-token and a {_f(1 + steps if steps else None, 'd')}-token generate over {steps} steps; median "
                  "over processes). `saved` = vanilla - tuned; the `outside kernels` row is TPOT minus the step's "
                  "kernel time (launch gaps, host work), so kernel time + outside = TPOT.", "", _md_table(*prof)]
        _section(lines, "The kernels whose time per decode step changed most (by name, among each process's "
                 f"{TOP_KERNELS} largest):", kernel_changes_table(serve))
        _section(lines, "Host ops of a 1-token generate (prefill + one step) whose CPU time changed most "
                 f"(torch's profiler, CPU only; inclusive times, among each process's {TOP_HOST_OPS} "
                 "largest): where time to first token goes when the kernels match.",
                 prefill_changes_table(serve, "prefill_host_changed", "host op"))
        _section(lines, "Work of a 1-token generate, counted (medians over processes): kernels launched and "
                 "Python calls made (cProfile). Equal counts with a longer time mean a slower host, not "
                 "more host work.", prefill_work_table(serve))
        _section(lines, "Python functions of another 1-token generate (cProfile; own time, among each process's "
                 f"{TOP_PY_FUNCS} largest): the host work between the ops.",
                 prefill_changes_table(serve, "prefill_python_changed", "Python function"))
    # per arm, not vanilla against tuned: shown for a folded-only run too
    _section(lines, "tunekit's GEMV launches inside the decode step (per launch shape and the kernel before it: "
             "one kernel name serves many problems), per launch: the table's standalone figures are checked "
             "against these:", tuned_launches_table(serve))
    _section(lines, "Each served tuned kernel timed standalone in the engine's own process after the profile "
             "(`TUNEKIT_PROFILE_KERNELS=1`; the search's timing path), against its table entry:",
             in_process_table(serve))
    if serve.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {n}" for n in serve["notes"]]
    if path.with_suffix(".png").exists():
        lines += ["", f"![TPOT per arm]({path.with_suffix('.png').name})"]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_reports(serve: dict[str, Any], out: Path) -> tuple[Path, Path, Path | None]:
    """``serve.json``, ``serve.png`` and ``serve.md`` in ``out``; returns their paths (png: None without
    matplotlib). The json is replaced atomically (a crash leaves the previous one whole); the plot comes
    first because the markdown links it when present."""
    path = out / "serve.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(serve, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    png = write_plot(serve, out / "serve.png")
    return path, write_markdown(serve, out / "serve.md"), png


def write_plot(serve: dict[str, Any], path: Path) -> Path | None:
    """TPOT per arm per batch size (bars: median; whiskers: min-max over processes). None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    arms = _arms(serve)
    rows = serve["batches"]
    if not arms or not rows:
        return None
    fig = Figure(figsize=(1.6 + 1.4 * len(rows), 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(arms)
    colors = {"vanilla": "#7f7f7f", "passthrough": "#ff7f0e", "tuned": "#1f77b4"}
    for j, arm in enumerate(arms):
        xs, ys, lo, hi = [], [], [], []
        for i, row in enumerate(rows):
            tp = row["tpot"].get(arm)
            if not tp:
                continue
            xs.append(i + (j - (len(arms) - 1) / 2) * width)
            ys.append(tp["median_ms"])
            lo.append(tp["median_ms"] - tp["min_ms"])
            hi.append(tp["max_ms"] - tp["median_ms"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=arm, color=colors.get(arm))
    ax.set_xticks(range(len(rows)))
    unit = "concurrency" if serve.get("mode") == "endpoint" else "batch"
    ax.set_xticklabels([f"{unit} {r['batch']}" for r in rows])
    ax.set_ylabel("TPOT (ms per token)")
    ax.set_title(f"{serve.get('model') or 'served model'}: decode TPOT per arm"
                 + (f" ({serve['device']})" if serve.get("device") else ""), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
