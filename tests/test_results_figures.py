"""Every figure in the "Current figures" table of benchmarks/results/README.md, rebuilt from the raw files
of its folder through tunekit's own code and compared with the figure as stated, to the stated precision.

Served TPOT figures come from the runner results (``runs/*.json``) through
``tunekit.evidence.serve_bench.analysis``; chain figures from the step times in ``chain.json``; standalone
per-token and per-problem figures from ``final.csv`` through ``tunekit.evidence.comparison.load_comparison``;
the Hugging Face decode-step figures from the step times in ``serving_check.json`` through
``tunekit.evidence.check_serving.judging.timing_summary``. A changed raw number changes the figure
(``test_a_changed_raw_number_changes_the_figure``), and every row of the table names one test here
(``test_every_current_figure_has_its_test``).
"""

from __future__ import annotations

import functools
import gzip
import json
import re
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest

from tunekit.evidence.check_serving.judging import timing_summary
from tunekit.evidence.serve_bench import analysis, endpoint

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def stated(value: float, text: str) -> None:
    """``value``, printed to the precision of the figure as stated (``text``), reads ``text``."""
    decimals = len(text.split(".", 1)[1]) if "." in text else 0
    assert f"{value:.{decimals}f}" == text, f"{value!r} reads {value:.{decimals}f}, stated {text}"


# ---- served (tunekit serve-bench): runs/*.json -----------------------------------------------------


@functools.cache
def _runs(folder: str | Path) -> dict[str, list[dict[str, Any]]]:
    return analysis.load_runs(RESULTS / folder / "runs")


def served(folder: str | Path, arm: str, batch: int, over: str = "vanilla") -> tuple[float, float, float]:
    """``over`` / ``arm`` TPOT at ``batch`` (medians of the per-process medians) and its min / max over the
    process pairs, as serve-bench reports it."""
    runs = _runs(folder)
    base, other = analysis.arm_tpot(runs[over], batch), analysis.arm_tpot(runs[arm], batch)
    pairs = analysis.pair_ratios(base, other)
    return base["median_ms"] / other["median_ms"], min(pairs), max(pairs)


def tpot_ms(folder: str | Path, arm: str, batch: int) -> float:
    return analysis.arm_tpot(_runs(folder)[arm], batch)["median_ms"]


def test_served_default_table_qwen() -> None:
    folder = "h200-serve-qwen35-27b-a831b66"
    x, lo, hi = served(folder, "tuned", 1)
    stated(x, "1.109")
    stated(lo, "1.107")
    stated(hi, "1.113")
    stated(tpot_ms(folder, "vanilla", 1), "15.27")
    stated(tpot_ms(folder, "tuned", 1), "13.77")
    for batch, figure in ((2, "1.073"), (4, "1.057"), (8, "1.061")):
        stated(served(folder, "tuned", batch)[0], figure)


def test_served_default_table_llama_and_passthrough() -> None:
    stated(served("h200-serve-llama31-8b-a831b66/tuned", "tuned", 1)[0], "1.093")
    x, lo, hi = served("h200-serve-llama31-8b-a831b66/passthrough", "passthrough", 1)
    stated(x, "0.993")
    stated(lo, "0.986")
    stated(hi, "0.999")


def test_served_passthrough_within_half_a_percent() -> None:
    for batch, figure in ((1, "0.999"), (2, "0.995"), (4, "0.996"), (8, "0.999")):
        x = served("h200-serve-qwen35-27b-2b88dba", "passthrough", batch)[0]
        stated(x, figure)
        assert abs(1 - x) < 0.005


def test_served_fold() -> None:
    folder = "h200-serve-fold-8031457"
    x, lo, hi = served(folder, "folded", 1)
    stated(x, "1.1224")
    stated(lo, "1.117")
    stated(hi, "1.129")
    stated(served(folder, "tuned", 1)[0], "1.1039")


def test_served_fold_with_joined_siblings() -> None:
    x, lo, hi = served("h200-serve-merge-df17426", "folded", 1)
    stated(x, "1.1291")
    stated(lo, "1.126")
    stated(hi, "1.130")


def test_served_fold_at_batch_sizes_the_fused_table_lacks() -> None:
    folder = "h200-serve-fold-batches-1bf210c"
    for batch, folded, tuned in ((1, "1.1246", "1.0978"), (2, "1.0950", "1.0627"), (8, "1.0591", "1.0624")):
        stated(served(folder, "folded", batch)[0], folded)
        stated(served(folder, "tuned", batch)[0], tuned)


def test_served_without_the_eviction_hint() -> None:
    folder = "h200-serve-noevict-a986fd9/serve"
    stated(served(folder, "folded", 1)[0], "1.1497")
    stated(tpot_ms(folder, "vanilla", 1), "14.953")
    stated(tpot_ms(folder, "folded", 1), "13.006")


def test_served_fusion_confirmed_over_processes() -> None:
    confirm = "h200-serve-confirm-b61588d"
    x, lo, hi = served(f"{confirm}/lease1-2x2", "folded", 1)
    stated(x, "1.158")
    stated(lo, "1.155")
    stated(hi, "1.161")
    stated(x, "1.1580")
    stated(lo, "1.1552")
    stated(hi, "1.1607")
    stated(tpot_ms(f"{confirm}/lease1-2x2", "vanilla", 1), "15.108")
    stated(tpot_ms(f"{confirm}/lease1-2x2", "folded", 1), "13.047")
    pairs = []
    for run in ("lease1-2x2", "lease1-pair3", "lease2-pair4"):
        runs = _runs(f"{confirm}/{run}")
        pairs += analysis.pair_ratios(analysis.arm_tpot(runs["vanilla"], 1), analysis.arm_tpot(runs["folded"], 1))
    assert len(pairs) == 4
    stated(statistics.median(pairs), "1.1547")
    stated(min(pairs), "1.1428")
    stated(max(pairs), "1.1607")
    # every decode call at M=1 ran a table's kernel: tuned calls, no fallback, in each folded process
    folder = RESULTS / confirm / "lease1-2x2"
    logs = analysis.dispatch_logs(folder / "dispatch", "folded", _runs(f"{confirm}/lease1-2x2")["folded"])
    assert len(logs) == 2
    cov = analysis.coverage_at(analysis.merge_dispatch(logs), 1)
    assert cov["tuned_calls"] > 0 and cov["fallback_calls"] == 0


def test_served_first_token_at_par() -> None:
    folder = "h200-serve-ttft3-2fac948/ab"
    for batch, first, tpot in ((1, "0.977", "1.1037"), (8, "0.785", "1.0629")):
        runs = _runs(folder)
        vanilla, tuned = (analysis.arm_first_token(runs[arm], batch) for arm in ("vanilla", "tuned"))
        assert len(tuned["per_process_ms"]) == len(vanilla["per_process_ms"]) == 3
        stated(tuned["median_ms"] / vanilla["median_ms"], first)
        stated(served(folder, "tuned", batch)[0], tpot)
    for batch, figure in ((1, "0.998"), (8, "1.002")):
        stated(served("h200-serve-ttft3-2fac948/passthrough", "passthrough", batch)[0], figure)


def test_served_with_and_without_the_eviction_hint() -> None:
    stated(served("h200-memory-state-bd038d3/evict-ab/nohint", "folded", 1)[0], "1.1330")
    stated(served("h200-memory-state-bd038d3/evict-ab/hint", "folded", 1)[0], "1.1204")


def test_served_gap_runs() -> None:
    stated(served("h200-served-gap-ad3a8ee/call1-0802a99/serve", "folded", 1)[0], "1.1290")
    stated(served("h200-served-gap-ad3a8ee/call2-ad3a8ee/serve", "folded", 1)[0], "1.1319")


def test_served_through_vllm_serve() -> None:
    """The endpoint A/B keeps its raw rounds in serve.json (there are no runner results)."""
    doc = json.loads((RESULTS / "h200-serve-ranges-477659f/endpoint-llama/serve.json").read_text())
    summary = endpoint.summarize_endpoints(doc["arms"], doc["endpoints"], doc["settings"])
    rows = {b["batch"]: b for b in summary["batches"]}
    for c, tpot, ttft_tuned, ttft_vanilla in ((1, "1.1375", "40.1", "38.1"), (4, "0.999", "66.9", "71.5"),
                                              (8, "0.999", "68.4", "75.6")):
        stated(rows[c]["speedup"], tpot)
        stated(rows[c]["ttft_ms"]["tuned"], ttft_tuned)
        stated(rows[c]["ttft_ms"]["vanilla"], ttft_vanilla)


# ---- the decode-step chain (tunekit chain): chain.json ---------------------------------------------


def chain(path: str, m: int, variant: str, over: str = "vendor") -> float:
    """``over`` / ``variant`` step time at M = ``m``, from the step times ``chain.json`` recorded."""
    rows = {(r["m"], r["variant"]): r for r in json.loads((RESULTS / path).read_text())["results"]}
    return rows[(m, over)]["step_us"] / rows[(m, variant)]["step_us"]


def chain_row(path: str, m: int, variant: str) -> dict[str, Any]:
    return next(r for r in json.loads((RESULTS / path).read_text())["results"]
                if (r["m"], r["variant"]) == (m, variant))


def test_chain_m1248() -> None:
    path = "h200-chain-m1248-59df7cf/chain.json"
    stated(chain(path, 1, "tuned"), "1.137")
    stated(chain(path, 1, "tuned_gemv"), "1.116")
    stated(chain_row(path, 1, "vendor")["step_us"] / 1000, "14.11")
    stated(chain_row(path, 1, "tuned")["step_us"] / 1000, "12.40")
    for m, figure in ((2, "1.106"), (4, "1.075"), (8, "1.078")):
        stated(chain(path, m, "tuned"), figure)
    row = chain_row(path, 1, "tuned")
    stated(chain_row(path, 1, "vendor")["step_us"] - row["step_us"], "1704")
    stated(row["predicted_saving_us"], "1580")


def test_chain_m1_fresh_table() -> None:
    path = "h200-decode-944f424/chain/chain.json"
    stated(chain(path, 1, "tuned"), "1.143")
    vendor, tuned = chain_row(path, 1, "vendor"), chain_row(path, 1, "tuned")
    stated(vendor["step_us"] / 1000, "14.27")
    stated(tuned["step_us"] / 1000, "12.48")
    stated(vendor["step_us"] - tuned["step_us"], "1788")
    stated(tuned["predicted_saving_us"], "1630")


def test_chain_with_the_fold() -> None:
    for call, fused, tuned in (("call4", "1.155", "1.132"), ("call5", "1.165", "1.144")):
        path = f"h200-fusion-fold-4995aae/{call}/chain/chain.json"
        stated(chain(path, 1, "tuned_fused"), fused)
        stated(chain(path, 1, "tuned"), tuned)


def test_chain_with_the_glu_epilogue() -> None:
    for call, figure in (("call2-b060e49", "1.1712"), ("call3-6352057", "1.1723"), ("call4-7f6a916", "1.1726"),
                         ("call5-9f51eb5", "1.1634")):
        stated(chain(f"h200-glu/{call}/chain/chain.json", 1, "tuned_fused"), figure)


def test_chain_with_the_fold_and_joined_siblings() -> None:
    path = "h200-serve-merge-df17426/chain/chain.json"
    stated(chain(path, 1, "tuned_fused"), "1.1816")
    stated(chain(path, 1, "tuned"), "1.1568")


def test_chain_fusion_at_m248_checked_as_a_whole() -> None:
    path = "h200-chain-m248-b8efa4a/check-a2fa226/chain/chain.json"
    assert not any(r["variant"] == "tuned_fused" and r["m"] == 2
                   for r in json.loads((RESULTS / path).read_text())["results"])  # left out: = tuned
    stated(chain(path, 4, "tuned_fused", over="tuned"), "1.029")
    stated(chain(path, 8, "tuned_fused", over="tuned"), "1.018")


# ---- standalone (tunekit search): final.csv through tunekit compare's loader -----------------------


@functools.cache
def comparison(folder: str) -> Any:
    from tunekit.evidence.comparison import load_comparison  # imports torch (opspec): here, not at collection

    return load_comparison(RESULTS / folder)


def problem(folder: str, op: str, m: int, n: int, k: int) -> Any:
    return next(p for p in comparison(folder).problems if (p.op, p.m, p.n, p.k) == (op, m, n, k))


def test_standalone_m1_per_token_both_backends() -> None:
    (t,) = comparison("h200-m1-triton-hip-5cc8e72").tokens
    assert (t.m, t.calls) == (1, 305)
    stated(t.speedup, "1.123")
    stated(t.vendor_us / 1000, "13.620")
    stated(t.tuned_us / 1000, "12.130")
    stated(t.vendor_us / t.only_us["triton"], "1.120")
    stated(t.vendor_us / t.only_us["hip"], "1.106")
    x = problem("h200-m1-96x5120-hip-grid-50a1373", "gemv", 1, 96, 5120).best
    stated(x["hip"].time_us, "2.65")
    stated(x["triton"].time_us, "2.59")


def test_standalone_m1_search_from_scratch() -> None:
    (t,) = comparison("h200-m1-triton-hip-b1ce9d6").tokens
    stated(t.speedup, "1.119")
    stated(t.vendor_us / 1000, "13.67")
    stated(t.tuned_us / 1000, "12.21")
    stated(t.floor_us / 1000, "11.30")


def test_standalone_m1248_per_token() -> None:
    speedups = {t.m: t.speedup for t in comparison("h200-m1248-gemv-ew-fab7a9c/gemv").tokens}
    for m, figure in ((1, "1.117"), (2, "1.093"), (4, "1.052"), (8, "1.064")):
        stated(speedups[m], figure)


def test_h100_small_m_per_token() -> None:
    speedups = {t.m: t.speedup for t in comparison("h100-small-m-gemv-3fc28cd").tokens}
    for m, figure in ((1, "1.077"), (2, "1.064"), (4, "1.021"), (8, "1.001")):
        stated(speedups[m], figure)


def test_h100_real_verdict_smollm2() -> None:
    doc = json.loads((RESULTS / "h100-real-verdict-smollm2-85ebda3/verdict.json").read_text())
    assert doc["device"].startswith("NVIDIA H100")
    arms = {name: arm["agreement"] for name, arm in doc["arms"].items()}
    assert [arms[a]["verdict"] for a in ("unfolded", "folded", "folded+drop_residual")] == ["pass", "pass", "fail"]
    assert all(arm["served_tuned_calls"] == 10920 for arm in doc["arms"].values())
    stated(arms["unfolded"]["max_abs_logprob_diff"], "0.324")
    stated(arms["folded+drop_residual"]["max_abs_logprob_diff"], "16.15")
    stated(arms["unfolded"]["spread"][0]["max_abs_logprob_diff"], "0.232")


def test_standalone_elementwise() -> None:
    problems = comparison("h200-ew-m1-4096-triton-hip-2265568").problems
    big = [p for p in problems if p.m == 4096]
    pct = [p.winner.pct_of_limit for p in big]
    inductor = [p.baselines["inductor"].time_us / p.winner.time_us for p in big]
    stated(min(pct), "86.0")
    stated(max(pct), "105.2")
    stated(min(inductor), "1.003")
    stated(max(inductor), "1.41")
    one = {p.op: p.baselines["inductor"].time_us / p.best["triton"].time_us for p in problems if p.m == 1}
    rest = [x for op, x in one.items() if op != "silu_and_mul"]
    stated(min(rest), "1.03")
    stated(max(rest), "1.93")
    stated(one["silu_and_mul"], "0.961")


def test_elementwise_checks() -> None:
    log = gzip.decompress((RESULTS / "h200-ew-check-9bd870c/elementwise_check.log.gz").read_bytes()).decode()
    lines = log.splitlines()
    assert sum(ln.startswith("PASS") for ln in lines) == 168 and not any(ln.startswith("FAIL") for ln in lines)
    assert "checks failed: 0" in lines
    tunekit = [ln for ln in lines if ln.startswith("PASS launches") and ln.split()[2] in ("triton", "hip")]
    assert tunekit and all(ln.split(": ")[1].startswith("1 ") for ln in tunekit)  # one launch per call


def test_standalone_fold_runs_at_gemv_speed() -> None:
    call = "h200-fusion-fold-4995aae/call4"
    for n, fused, plain in ((34816, "79.53", "79.37"), (16384, "38.88", "38.77"), (14336, "34.72", "34.42")):
        stated(problem(f"{call}/fused", "rms_gemv", 1, n, 5120).best["triton"].time_us, fused)
        stated(problem(f"{call}/main", "gemv", 1, n, 5120).best["triton"].time_us, plain)


def test_standalone_glu_epilogue() -> None:
    call = "h200-glu/call5-9f51eb5"
    stated(problem(f"{call}/fused", "gemv_silu_mul", 1, 34816, 5120).winner.time_us, "81.79")
    stated(problem(f"{call}/fused", "rms_gemv_silu_mul", 1, 34816, 5120).winner.time_us, "82.91")
    stated(problem(f"{call}/main", "gemv", 1, 34816, 5120).winner.time_us, "81.04")
    stated(problem(f"{call}/fused", "rms_gemv", 1, 34816, 5120).winner.time_us, "81.18")
    stated(problem(f"{call}/main", "silu_and_mul", 1, 17408, 34816).winner.time_us, "1.26")


# ---- Hugging Face models patched (tunekit check-serving): serving_check.json -----------------------


def hf(path: str, ratio: str) -> float:
    doc = json.loads((RESULTS / path / "serving_check.json").read_text())
    return timing_summary(doc["model"]["timing"]["times_ms"])["ratios"][ratio]["median"]


def test_hf_merged_siblings() -> None:
    for call, graphed, eager in (("call1-b349f32", "1.092", "1.170"), ("call2-a1b7e82", "1.114", "1.149")):
        stated(hf(f"h200-hf-merge/{call}/check-merge", "patched_speedup_graphed"), graphed)
        stated(hf(f"h200-hf-merge/{call}/check-merge", "patched_speedup_eager"), eager)
    stated(hf("h200-hf-merge/call2-a1b7e82/check-main", "patched_speedup_graphed"), "1.027")
    llama = "h200-hf-merge/call3-95d4b71-llama"
    stated(hf(f"{llama}/check-merge", "patched_speedup_graphed"), "1.011")
    stated(hf(f"{llama}/check-main", "patched_speedup_graphed"), "1.003")
    stated(hf(f"{llama}/check-merge", "patched_speedup_eager"), "1.246")


def test_hf_folded_norms() -> None:
    stated(hf("h200-hf-fold-ab58dfb/check-fold", "patched_speedup_eager"), "1.179")
    stated(hf("h200-hf-fold-ab58dfb/check-fold", "patched_speedup_graphed"), "1.041")
    stated(hf("h200-hf-fold-ab58dfb/check", "patched_speedup_graphed"), "1.073")
    stated(hf("h200-hf-fold-38742fc/check-fold", "patched_speedup_graphed"), "1.070")
    stated(hf("h200-hf-fold-38742fc/check", "patched_speedup_graphed"), "1.044")


def test_hf_own_shape_tables() -> None:
    stated(hf("h200-serving-cb5d37c/check", "patched_speedup_eager"), "1.156")
    stated(hf("h200-serving-cb5d37c/check", "patched_speedup_graphed"), "1.066")
    # per call, eager, on the launch-bound 96x5120 (wall us; benchmarks/probes/dispatch_overhead.py's
    # definitions): the patched module's vendor path over the unpatched nn.Linear, its tuned path over the
    # bound launcher net of what the unpatched module costs over F.linear
    doc = json.loads((RESULTS / "h200-serving-cb5d37c/dispatch.json").read_text())
    row = next(r for r in doc["rows"] if (r["op"], r["n"], r["k"]) == ("gemv", 96, 5120))
    stated(row["patched_vendor_wall_us"] - row["module_wall_us"], "1.87")
    stated(row["patched_tuned_wall_us"] - row["bound_wall_us"] - (row["module_wall_us"] - row["direct_wall_us"]),
           "4.83")


# ---- probes (their own scripts' raw rows) ----------------------------------------------------------


def test_probed_and_not_built() -> None:
    rows = json.loads((RESULTS / "h200-boundary-probes-9af5854/gemv_boundary.json").read_text())["rows"]

    def median(probe: str, variant: str) -> float:
        return statistics.median(r["layer_us"] for r in rows if (r["probe"], r["variant"]) == (probe, variant))

    fused = min(median("gated", v) for v in {r["variant"] for r in rows if r["probe"] == "gated"}
                if v.startswith("fused"))
    stated(fused, "18.60")
    stated(median("gated", "unfused"), "18.53")
    pdl = {r["variant"] for r in rows if r["probe"] == "pdl" and r["variant"].startswith("pdl")}
    assert pdl and all(median("pdl", v) > median("pdl", "plain") for v in pdl)  # no PDL variant gains


# ---- the table and the tests ------------------------------------------------------------------------


def _current_rows() -> list[str]:
    text = (RESULTS / "README.md").read_text()
    section = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    return [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith(("| claim", "| ---"))]


def test_every_current_figure_has_its_test() -> None:
    rows = _current_rows()
    named = [name for row in rows for name in re.findall(r"`(test_\w+)`", row.rsplit("|", 2)[1])]
    assert len(named) == len(rows), "each row names one test in its last column"
    module = sys.modules[__name__]
    assert all(callable(getattr(module, name, None)) for name in named), [n for n in named if not hasattr(module, n)]
    figures = {n for n in dir(module) if n.startswith("test_")} - {
        "test_every_current_figure_has_its_test", "test_a_changed_raw_number_changes_the_figure"}
    assert figures == set(named), figures ^ set(named)
    for row in rows:  # the folder cell names folders that exist
        for folder in re.findall(r"`(h[12]00-[\w.-]+)", row):
            assert (RESULTS / folder).is_dir(), folder


def test_a_changed_raw_number_changes_the_figure(tmp_path: Path) -> None:
    src = RESULTS / "h200-serve-confirm-b61588d" / "lease1-2x2"
    shutil.copytree(src / "runs", tmp_path / "runs")
    path = tmp_path / "runs" / "folded-0.json"
    doc = json.loads(path.read_text())
    doc["batches"][0]["tpot_ms_median"] *= 1.001
    path.write_text(json.dumps(doc))
    with pytest.raises(AssertionError):
        stated(served(tmp_path, "folded", 1)[0], "1.1580")
    chain_doc = json.loads((RESULTS / "h200-serve-merge-df17426/chain/chain.json").read_text())
    next(r for r in chain_doc["results"] if r["variant"] == "tuned_fused")["step_us"] += 2.0
    (tmp_path / "chain.json").write_text(json.dumps(chain_doc))
    with pytest.raises(AssertionError):
        stated(chain(str(tmp_path / "chain.json"), 1, "tuned_fused"), "1.1816")


# ---- search pace: trials.csv -----------------------------------------------------------------------------
def test_default_search_rate() -> None:
    folder = RESULTS / "h200-default-search-7465fa3"
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(gzip.decompress((folder / "trials.csv.gz").read_bytes()).decode())))
    run = json.loads((folder / "run.json").read_text())
    studies = len(run["problems"]) * len(run["backends"])
    complete: dict[str, int] = {}
    for row in rows:
        complete[row["study"]] = complete.get(row["study"], 0) + (row["state"] == "COMPLETE")
    finished = sum(n >= run["trials"] for n in complete.values())
    wall = float(re.search(r"wall_s=([\d.]+)", (folder / "wall1.txt").read_text()).group(1))
    assert (studies, finished, len(rows)) == (128, 27, 2221)
    stated(wall, "553.5")
    stated(wall * studies / finished / 60, "44")


def test_h100_pdl_chain() -> None:
    """PDL on the H100: the chain and the MLP blocks with and without it, from every replay of three processes."""
    folder = RESULTS / "h100-pdl-chain-3594146"
    names = ("run1-m1", "run2-m1-4-16", "run3-m1-2")
    runs = [json.loads(gzip.open(folder / f"{name}.json.gz").read()) for name in names]

    def saved(times: dict[str, list[float]]) -> tuple[float, float]:
        off, on = statistics.median(times["triton"]), statistics.median(times["triton_pdl"])
        return off - on, 1 - on / off

    chain = [saved(r["per_m"]["1"]["times_us"]) for r in runs]
    assert all(r["per_m"]["1"]["bit_equal_pdl"] and r["mlp_blocks"]["1"]["bit_equal_pdl"] for r in runs)
    assert all(row["bit_equal"] for r in runs for row in r["dependent_gate"])
    stated(min(share for _, share in chain) * 100, "0.45")
    stated(max(share for _, share in chain) * 100, "0.46")
    stated(min(us for us, _ in chain), "79")
    stated(max(us for us, _ in chain), "81")
    mlp = [saved(r["mlp_blocks"]["1"]["times_us"])[1] * 100 for r in runs]
    stated(min(mlp), "0.95")
    stated(max(mlp), "0.99")
    offs = [statistics.median(r["per_m"]["1"]["times_us"]["triton"]) / 1e3 for r in runs]
    ons = [statistics.median(r["per_m"]["1"]["times_us"]["triton_pdl"]) / 1e3 for r in runs]
    stated(statistics.median(offs), "17.50")
    stated(statistics.median(ons), "17.42")
    small = [statistics.median(r["small_n96_x256"]["triton"]) - statistics.median(r["small_n96_x256"]["triton_pdl"])
             for r in runs]
    stated(statistics.median(small) / 256, "0.96")


def test_h100_chain_pdl_and_load_check() -> None:
    """PDL in the whole chain (one process per setting) and the load check's cost, from the raw files."""
    folder = RESULTS / "h100-chain-pdl-loadcheck-f9e2499"

    def step(name: str, m: int, variant: str) -> dict[str, Any]:
        doc = json.loads(gzip.open(folder / f"chain-{name}.json.gz").read())
        assert doc["device"]["name"] == "NVIDIA H100 80GB HBM3" and doc["calls_per_step"] == 546
        return next(r for r in doc["results"] if r["m"] == m and r["variant"] == variant)

    def ms(name: str, m: int, variant: str) -> float:
        return step(name, m, variant)["step_us"] / 1e3

    for off, on, m in (("m1-4-pdl0", "m1-4-pdl1", 1), ("m1-4-pdl0b", "m1-4-pdl1b", 1), ("m1-4-pdl0", "m1-4-pdl1", 4),
                       ("m2-16-pdl0", "m2-16-pdl1", 2), ("m2-16-pdl0", "m2-16-pdl1", 16)):
        stated(ms(on, m, "vendor") / ms(off, m, "vendor"), "0.985")  # vendor moved with the setting
    stated(ms("m1-4-pdl0", 1, "tuned"), "17.474")
    stated(ms("m1-4-pdl1", 1, "tuned"), "17.366")
    stated(ms("m1-4-pdl1", 1, "tuned") / ms("m1-4-pdl0", 1, "tuned"), "0.994")
    stated(ms("m1-4-pdl0", 4, "tuned_fused"), "17.919")
    stated(ms("m1-4-pdl1", 4, "tuned_fused"), "17.630")
    stated(ms("m2-16-pdl1", 16, "tuned_fused") / ms("m2-16-pdl0", 16, "tuned_fused"), "0.985")
    # the same-run ratios
    for name, m, variant, text in (("m1-4-pdl0", 1, "tuned", "1.0721"), ("m1-4-pdl1", 1, "tuned", "1.0624"),
                                   ("m1-4-pdl0", 1, "tuned_fused", "1.0759"),
                                   ("m2-16-pdl0", 2, "tuned_fused", "1.0809"),
                                   ("m2-16-pdl1", 2, "tuned_fused", "1.0750"),
                                   ("m1-4-pdl0", 4, "tuned_fused", "1.0518"), ("m1-4-pdl1", 4, "tuned_fused", "1.0528"),
                                   ("m2-16-pdl0", 16, "tuned_fused", "1.0596"),
                                   ("m2-16-pdl1", 16, "tuned_fused", "1.0591")):
        stated(ms(name, m, "vendor") / ms(name, m, variant), text)
    with pytest.raises(StopIteration):  # at M=1 with PDL on the fusion check left every family out
        step("m1-4-pdl1", 1, "tuned_fused")
    for name, m, variant, text in (("m1-4-pdl0", 1, "tuned_fused", "59"), ("m2-16-pdl0", 2, "tuned_fused", "66"),
                                   ("m1-4-pdl0", 4, "tuned_fused", "49"), ("m2-16-pdl0", 16, "tuned_fused", "60")):
        row = step(name, m, variant)
        stated(100 * row["measured_saving_us"] / row["predicted_saving_us"], text)
    lines = (folder / "loadcheck.txt").read_text().splitlines()
    pattern = r"(\d+) entries at every M they serve, (\d+) calls \(([\d.]+) s, (\d+) ms an entry\); all passed"
    costs = [re.search(pattern, line).groups() for line in lines if line.startswith("tunekit: load check")]
    assert costs == [("66", "1266", "17.05", "258"), ("66", "1266", "3.39", "51")]


def test_bf16_margins_over_eight_prompts() -> None:
    """The verdict's margins per real checkpoint over eight prompts (CPU numerics), from margins.json."""
    doc = json.loads((RESULTS / "cpu-bf16-margins-c34c265" / "margins.json").read_text())
    assert len(doc["prompts"]) == 8 and doc["steps"] == 6

    def arm(model: str, name: str) -> dict[str, Any]:
        figures = doc["models"][model]["arms"][name]
        assert figures["positions"] == 48
        return figures

    stated_rows = {  # model -> arm -> (max |dlogprob|, KL, share of the cap in %, verdict)
        "smollm2 bf16": {"vanilla spread (one forward)": ("0.311", "7.8e-03", "57", None),
                         "correct, unfolded": ("0.368", "8.2e-03", "67", "pass"),
                         "correct, folded": ("0.387", "1.0e-02", "70", "pass"),
                         "one down_proj drops a K block": ("0.871", "2.4e-02", "158", "fail")},
        "gemma3-270m bf16": {"vanilla spread (one forward)": ("0.281", "5.3e-03", "51", None),
                             "correct, unfolded": ("0.396", "2.3e-03", "72", "pass"),
                             "correct, folded": ("0.375", "2.9e-03", "68", "pass"),
                             "one down_proj drops a K block": ("0.940", "4.9e-02", "171", "fail")},
    }
    for model, rows in stated_rows.items():
        for name, (lp, kl, share, verdict) in rows.items():
            figures = arm(model, name)
            stated(figures["max_abs_logprob_diff"], lp)
            assert f"{figures['kl_max']:.1e}" == kl, (model, name, figures["kl_max"])
            stated(100 * figures["share_of_logprob_cap"], share)
            assert figures.get("verdict") == verdict, (model, name)
    for model in ("smollm2 fp32", "gemma3-270m fp32"):
        for name in ("correct, unfolded", "correct, folded"):
            assert arm(model, name)["verdict"] == "pass" and arm(model, name)["share_of_logprob_cap"] < 0.04
        for name in ("one down_proj drops a K block", "one residual dropped"):
            assert arm(model, name)["verdict"] == "fail" and arm(model, name)["share_of_logprob_cap"] > 800
    stated(arm("smollm2 bf16", "one residual dropped")["max_abs_logprob_diff"], "16.3")
    stated(arm("gemma3-270m bf16", "one residual dropped")["max_abs_logprob_diff"], "8.46")


def test_h100_default_path_served() -> None:
    """The default path on an H100 (every default: search, then the plugin with its table), from serve.json."""
    doc = json.loads((RESULTS / "h100-default-30e1f56" / "serve.json").read_text())
    assert doc["device"].startswith("NVIDIA H100") and doc["settings"]["prompt_len"] == 64
    by_batch = {b["batch"]: b for b in doc["batches"]}
    one, four = by_batch[1], by_batch[4]
    stated(one["vanilla_tpot_ms"], "20.723")
    stated(one["folded_tpot_ms"], "18.771")
    stated(one["folded_speedup"], "1.104")
    stated(one["folded_speedup_min"], "1.1037")
    stated(one["folded_speedup_max"], "1.1042")
    stated(one["predicted_speedup"], "1.117")
    stated(four["folded_speedup"], "1.061")
    assert (four["predicted_served_calls"], four["predicted_calls"]) == (418, 546)


def test_h100_peers_per_token() -> None:
    """Every row of the README's per-token table of the peers on an H100, from each run's final.csv."""
    folder = RESULTS / "h100-peers-5db322d"
    names = {"Qwen3.5-27B": "qwen3.5-27b", "Llama-3.1-8B": "llama-3.1-8b"}
    peers = ("vllm_skinny_heuristic", "flashinfer", "inductor_max_autotune", "triton_autotune")
    rows = [line.split("|")[1:-1] for line in (folder / "README.md").read_text().splitlines()
            if line.startswith(("| Qwen3.5-27B |", "| Llama-3.1-8B |"))]
    rows = [cells for cells in rows if len(cells) == 9]  # the per-token table's (the time split has 5 cells)
    assert len(rows) == 10
    comps = {}
    for cells in rows:
        model, m, *figures = (c.strip().strip("*") for c in cells)
        comp = comps.setdefault(model, comparison(f"h100-peers-5db322d/{names[model]}"))
        t = next(t for t in comp.tokens if t.m == int(m))
        values = [t.vendor_us / t.tuned_us, *(t.vendor_us / t.peer_us[p] for p in peers),
                  t.vendor_us / t.best_peer_us, t.best_peer_us / t.tuned_us]
        for value, text in zip(values, figures, strict=True):
            stated(value, text)
    for comp in comps.values():  # every peer timed on every problem, on the H100
        assert comp.gpu.startswith("NVIDIA H100")
        assert all(set(peers) <= set(p.baselines) for p in comp.problems)


def test_h100_peers_time_split() -> None:
    from tunekit.evidence.time_split import split_table

    head, rows = split_table(RESULTS / "h100-peers-5db322d" / "qwen3.5-27b")
    by_part = {r[0]: r for r in rows}
    final = by_part["final re-measure (build, verify and time every candidate and peer)"]
    stated(float(final[head.index("total s")]), "230.0")
    assert final[-1] == "66.8%"
    workers = [by_part["triton: worker"], by_part["hip: worker"]]
    stated(sum(float(r[head.index("compile s")]) for r in workers), "0.8")
    assert sum(int(r[1]) for r in workers) == 210


def test_h100_canary_cost() -> None:
    """README: the canary's cost per eager call, two processes per setting, medians of 5 repeats."""
    lines = [json.loads(x) for x in (RESULTS / "h100-canary-cost-5db322d" / "canary.jsonl").read_text().splitlines()]
    med = {}
    for doc in lines:
        assert doc["tuned_calls"] == 505 and doc["shapes"] == 7
        med.setdefault(doc["canary"], []).append(sorted(doc["us_per_call"])[2])
    off, hundred, every = med[""], med["100"], med["1"]
    for value, text in zip(off + hundred + every, ("160.3", "162.0", "161.6", "163.7", "5160", "5238"), strict=True):
        stated(value, text)
    stated(100 * (hundred[0] / off[0] - 1), "0.8")
    stated(100 * (hundred[1] / off[1] - 1), "1.0")
    stated(every[0] / off[0], "32")
    spikes = [max(doc["us_per_call"]) for doc in lines if doc["canary"] == "100"]
    assert [f"{s:.0f}" for s in spikes] == ["416", "424"]


def test_cpu_commands_and_tiers() -> None:
    """README: the two commands' times and the CI tiers, from the recorded runs on the 2-core CPU machine."""
    folder = RESULTS / "cpu-ci-workers-e70d0a4"
    times = dict(line.split() for line in (folder / "commands.txt").read_text().splitlines())
    readme = (REPO / "README.md").read_text()
    for key, text in (("total_s", "183"), ("setup_s", "167"), ("demo_s", "15")):
        stated(float(times[key]), text)
        assert f"{text} s" in readme, text

    def tiers(name: str) -> list[float]:
        text = (folder / name).read_text()
        return [float(x) for x in re.findall(r"passed.* in ([0-9.]+)s", text)] + \
            [float(re.findall(r"\[(\d+) s\]: done", text)[0])]

    fast, slow, lean, lean_slow, whole = tiers("ci-e70d0a4-3-workers.txt")
    stated(fast, "672")  # pytest's own figure; the step line rounds the same run to 673 s
    assert "673 s on the same machine" in readme and f"tiers {whole:.0f} s" in readme
    before = tiers("ci-4e12ea4-2-workers.txt")
    assert [f"{t:.0f}" for t in before] == ["721", "1122", "318", "73", "2443"]
    ab = dict(re.findall(r"-n (\d): .* in ([0-9.]+)s", (folder / "fast-tier-ab.txt").read_text()))
    stated(100 * (1 - float(ab["3"]) / float(ab["2"])), "9")


def test_h100_cold_search_split() -> None:
    """The fresh-machine split: compiling is 70% of the workers' trial time but a quarter of the wall; the final
    re-measure and the search process are as large."""
    from tunekit.evidence.time_split import split_table

    folder = RESULTS / "h100-cold-search-split-7462051"
    head, rows = split_table(folder)
    assert head[-1] == "share of 192 s"
    by_part = {r[0].split(" (")[0]: r for r in rows}
    workers = [by_part["triton: worker"], by_part["hip: worker"]]
    assert sum(int(r[1]) for r in workers) == 255
    compile_s = sum(float(r[head.index("compile s")]) for r in workers)
    stated(compile_s, "47.5")
    stated(sum(float(r[head.index("total s")]) for r in workers), "67.7")
    stated(sum(float(r[head.index("time s")]) for r in workers), "12.1")
    stated(100 * compile_s / sum(float(r[head.index("total s")]) for r in workers), "70")
    phases = json.loads((folder / "time.json").read_text())
    wall = sum(w["trials"] + w["finals"] for w in phases["workers"]) + phases["setup_s"] + phases["fusion_s"]
    stated(wall, "192")
    stated(100 * compile_s / wall, "24.7")
    assert by_part["final re-measure"][-1] == "35.7%"
    assert by_part["search process in the trial phase"][-1] == "22.4%"
    text = (folder / "README.md").read_text()
    for figure in ("47.5 s", "67.7 s", "(70%)", "(24.7%)", "(35.7%)", "(22.4%)", "1.0991x"):
        assert figure in text, figure
    import pandas as pd

    tokens = pd.read_csv(folder / "compare_tokens.csv")
    stated(float(tokens.loc[tokens["M"] == 1, "s (tuned)"].iloc[0]), "1.0991")


def test_h100_search_ab() -> None:
    """The same bounded search by the tree before (A) and after (B) the host-loop and peers changes, one call,
    cold caches each: the final re-measure, the search process per trial, the trials and the prediction."""
    import pandas as pd

    from tunekit.evidence.time_split import split_table

    folder = RESULTS / "h100-search-ab-673617e"
    assert (folder / "gpu.txt").read_text().splitlines()[1].startswith("NVIDIA H100 80GB HBM3")
    figures = {}
    for arm in ("A", "B"):
        head, rows = split_table(folder / arm)
        by_part = {r[0].split(" (")[0]: r for r in rows}
        trials = sum(int(by_part[f"{b}: worker"][1]) for b in ("triton", "hip"))
        host = float(by_part["search process in the trial phase"][head.index("total s")])
        phases = json.loads((folder / arm / "time.json").read_text())
        final = sum(w["finals"] for w in phases["workers"])
        tokens = pd.read_csv(folder / arm / "compare_tokens.csv")
        figures[arm] = {"trials": trials, "host": host, "per_trial_ms": 1e3 * host / trials, "final": final,
                        "wall": phases["wall_s"], "token": float(tokens.loc[tokens["M"] == 1, "s (tuned)"].iloc[0])}
    a, b = figures["A"], figures["B"]
    assert (a["trials"], b["trials"]) == (291, 352)
    for value, text in ((a["wall"], "196.1"), (b["wall"], "138.0"), (a["final"], "69.4"), (b["final"], "11.6"),
                        (a["host"], "46.6"), (b["host"], "37.0"), (a["per_trial_ms"], "160"),
                        (b["per_trial_ms"], "105"), (a["token"], "1.0914"), (b["token"], "1.1084"),
                        (100 * (1 - b["per_trial_ms"] / a["per_trial_ms"]), "34"),
                        (100 * (b["trials"] / a["trials"] - 1), "21"), (a["final"] - b["final"], "58"),
                        (100 * (a["final"] - b["final"]) / a["final"], "83"),
                        (100 * (b["token"] / a["token"] - 1), "1.6")):
        stated(value, text)
    # B's re-measure by part: no peer built, Inductor the one baseline compiled (the elementwise bar)
    head, rows = split_table(folder / "B")
    parts = {r[0]: float(r[head.index("total s")]) for r in rows if r[0].startswith("final re-measure: ")}
    stated(parts["final re-measure: graphs and timing"], "6.9")
    stated(parts["final re-measure: inductor (build, first call, check)"], "2.9")
    assert not any("autotune" in part for part in parts)
    text = (folder / "README.md").read_text()
    for figure in ("196.1 s", "138.0 s", "| 291 | 352 |", "160 ms (46.6 s)", "105 ms (37.0 s)", "69.4 s (36.1%)",
                   "1.0914x", "1.1084x", "83%"):
        assert figure in text, figure
