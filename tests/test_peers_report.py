"""Peers in `tunekit compare` and in the final re-measure: columns, per-token sums, tuned over vendor and
over the best peer, the reasons a peer is missing, and the per-token path counted once per layer.

Fixtures: a run folder of real recorded rows (`h200-m1-triton-hip-5cc8e72`: vendor, best Triton, best HIP)
plus rows of stand-in peers (tests/peer_backends.py, loaded as ``module:ATTR``); a default-run folder
(Qwen3.5-27B's problems with the fused families served) with made-up times.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from rich.console import Console

from tunekit import backends
from tunekit.evidence import compare as report
from tunekit.evidence import comparison
from tunekit.evidence.served_path import id_of
from tunekit.problems.models.load import load_model
from tunekit.problems.shapes import MODEL_OPS, Problem
from tunekit.search import finals

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "benchmarks" / "results" / "h200-m1-triton-hip-5cc8e72"
SKINNY, MISSING = "peer_backends:SKINNY", "peer_backends:MISSING"
PEERS = ("vendor", "inductor", SKINNY, MISSING)
GPU = {"vendor": "nvidia", "name": "Test GPU", "arch": "sm_90", "cu_count": 132, "wave_size": 32,
       "l2_bytes": 50 << 20, "memory_bytes": 141 << 30, "runtime": "cuda 13.0", "torch_device": "cuda:0"}
PROBE = {"read_gbps": 4557.0, "copy_gbps": 4107.0, "kind": "gpu"}
# the recorded times (us) the fixture copies: (n, k) -> count, vendor, best triton, best hip
RECORDED_US = {(96, 5120): (48, 7.156, 2.542375, 2.734),
               (5120, 6144): (64, 17.9152, 16.9528, 17.156),
               (14336, 5120): (16, 38.061599, 34.961601, 35.904799)}
# the stand-in peer's times: faster than the best tuned on 5120x6144, slower on 14336x5120; 96x5120 is not
# a multiple of 64 (its shape check refuses it)
SKINNY_US = {(5120, 6144): 16.5, (14336, 5120): 36.5}


@pytest.fixture(autouse=True)
def stand_in_peers(monkeypatch):
    monkeypatch.setattr(backends, "BASELINES", PEERS)
    finals._peer_here.cache_clear()
    yield
    finals._peer_here.cache_clear()


def _record(problem: Problem) -> str:
    """The peer record the final re-measure writes for the fixture's problems (its own function)."""
    candidates, left_out = finals.peer_arms(problem, GPU)
    timings = {c["label"]: {} for c in candidates}
    return json.dumps(finals.peer_record(candidates, timings, {}, left_out), sort_keys=True)


def _write_peer_run(path: Path) -> Path:
    path.mkdir(parents=True)
    recorded = pd.read_csv(RECORDED / "final.csv.gz")
    rows, problems = [], []
    for (n, k), (count, vendor_us, triton_us, hip_us) in RECORDED_US.items():
        mine = recorded[(recorded.n == n) & (recorded.k == k)]
        best = {b: mine[mine.backend == b].sort_values("time_us").iloc[0].to_dict()
                for b in ("vendor", "triton", "hip")}
        # the literals above are the recorded file's numbers (to its float32 noise, 1e-7): a changed file fails
        # here, not silently below
        assert [best[b]["time_us"] for b in ("vendor", "triton", "hip")] == pytest.approx(
            [vendor_us, triton_us, hip_us], rel=1e-7)
        assert int(best["vendor"]["count"]) == count
        problem = Problem("gemv", "bf16", 1, n, k, count, tuple(str(best["vendor"]["names"]).split(";")))
        problems.append(problem.as_dict())
        record = _record(problem)
        picked = list(best.values())
        if (n, k) in SKINNY_US:
            t = SKINNY_US[(n, k)]
            picked.append(dict(best["vendor"], label=SKINNY, backend=SKINNY, time_us=t, time_p25_us=t, time_p75_us=t,
                               gbps=2 * (n * k + n + k) / (t * 1e3), pct_of_limit=None, params="{}"))
        for row in picked:
            rows.append(dict(row, peers=record))
    meta = {"command": "tunekit search --model qwen3.5-27b (three of its problems)", "model": "qwen3.5-27b",
            "backends": ["triton", "hip"], "min_gain": 0.01, "problems": problems, "device": GPU, "probe": PROBE}
    (path / "run.json").write_text(json.dumps(meta))
    pd.DataFrame(rows).to_csv(path / "final.csv", index=False)
    return path


def _md_rows(md: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    lines = md.splitlines()
    i = next(j for j, line in enumerate(lines) if line.startswith(header_start))
    cells = []
    for line in lines[i:]:
        if not line.startswith("|"):
            break
        cells.append([c.strip() for c in line.strip()[1:-1].split(" | ")])
    return cells[0], cells[2:]


def test_peer_columns_per_token_sums_and_ratios(tmp_path) -> None:
    comp = comparison.load_comparison(_write_peer_run(tmp_path / "run"))
    assert comp.peers == [SKINNY]
    (t,) = comp.tokens
    vendor = 48 * 7.156 + 64 * 17.9152 + 16 * 38.061599
    # tuned: the best tuned where it beats the stock path (the table's gate); on 5120x6144 the peer is faster
    # than Triton, but a peer is no bar (without an entry the plugin serves vendor, not the peer): Triton serves
    tuned = 48 * 2.542375 + 64 * 16.9528 + 16 * 34.961601
    skinny = 48 * 7.156 + 64 * 16.5 + 16 * 36.5  # the peer where it was measured, vendor on 96x5120
    assert t.calls == 128
    assert t.vendor_us == pytest.approx(vendor, rel=1e-7)
    assert t.tuned_us == pytest.approx(tuned, rel=1e-7)
    assert t.peer_us == {SKINNY: pytest.approx(skinny, rel=1e-7)} and t.peer_calls == {SKINNY: 80}
    assert t.best_peer_us == pytest.approx(skinny, rel=1e-7)
    assert t.over_best_peer == pytest.approx(skinny / tuned, rel=1e-7)
    assert t.speedup == pytest.approx(vendor / tuned, rel=1e-7)
    o_proj = next(p for p in comp.problems if p.n == 5120)
    assert o_proj.served_us() == pytest.approx(16.9528, rel=1e-7) and o_proj.best_peer.time_us == 16.5
    assert o_proj.best["triton"].speedup == pytest.approx(17.9152 / 16.9528)  # over vendor, not over the peer

    report.compare_run(comp.run_dir, Console(file=io.StringIO(), width=300))
    md = (comp.run_dir / "report.md").read_text()
    head, rows = _md_rows(md, "| M |")
    expect = ["1", "128", f"{vendor / 1e3:.3f}", f"{tuned / 1e3:.3f}", f"{vendor / tuned:.4f}"]
    assert rows[0][:5] == expect
    assert (rows[0][head.index(f"{SKINNY} ms (s; calls served)")]
            == f"{skinny / 1e3:.3f} ({vendor / skinny:.4f}; 80 of 128)")
    assert rows[0][head.index("best peer ms")] == f"{skinny / 1e3:.3f}"
    assert rows[0][head.index("tuned / best peer")] == f"{skinny / tuned:.4f}"
    # per problem: the peer's column, tuned over vendor and over the best peer
    head, rows = _md_rows(md, "| op |")
    by_n = {row[head.index("N")]: row for row in rows}
    assert by_n["5120"][head.index(f"{SKINNY} µs")] == "16.50"
    assert by_n["96"][head.index(f"{SKINNY} µs")] == "-"
    assert by_n["5120"][head.index("tuned / vendor")] == f"{17.9152 / 16.9528:.3f}x"
    assert by_n["5120"][head.index("tuned / best peer")] == f"{16.5 / 16.9528:.3f}x"  # below 1: the peer wins
    assert by_n["14336"][head.index("tuned / best peer")] == f"{36.5 / 34.961601:.3f}x"
    assert by_n["14336"][head.index("tuned / vendor")] == f"{38.061599 / 34.961601:.3f}x"
    assert by_n["96"][head.index("best peer")] == "-" and by_n["96"][head.index("tuned / best peer")] == "-"
    # the CSV files hold the markdown's cells
    for name, start in (("compare_problems.csv", "| op |"), ("compare_tokens.csv", "| M |")):
        with (comp.run_dir / name).open(newline="") as handle:
            table = list(csv.reader(handle))
        md_head, md_rows = _md_rows(md, start)
        assert table[0] == md_head and table[1:] == md_rows
    # Amdahl: the peer and the best peer as variants
    _, rows = report.amdahl_table(comp)
    assert [r[1] for r in rows] == ["tuned (all backends)", "triton only", "hip only", f"{SKINNY} (peer)",
                                    "best peer"]
    assert rows[-1][2] == f"{vendor / skinny:.4f}"


def test_missing_peers_one_line_each_with_the_reason(tmp_path) -> None:
    run = _write_peer_run(tmp_path / "run")
    comp = comparison.load_comparison(run)
    lines = dict(line.split(": ", 1) for line in comp.peer_lines)
    assert list(lines) == ["inductor", SKINNY, MISSING]
    assert lines["inductor"] == "not measured: 3 problems (gemv m1): no inductor kernel for op gemv"
    assert lines[SKINNY] == ("measured on 2 of 3 problems; not on 1 problem (gemv m1): shape unsupported: "
                             "N=96 is not a multiple of 64")
    assert lines[MISSING] == ("not measured: 3 problems (gemv m1): unavailable here: package missing: "
                              "stand-in-peers is not installed")
    out = Console(file=io.StringIO(), width=300)
    report.print_comparison(out, comp)
    text = out.file.getvalue()
    md = report.write_markdown(comp, [])
    for line in comp.peer_lines:
        assert f"peer {line}" in text and f"- {line}" in md.read_text()
    assert "Traceback" not in text


def test_recorded_runs_say_each_peer_was_not_measured() -> None:
    comp = comparison.load_comparison(RECORDED)
    assert comp.peers == [] and len(comp.peer_lines) == 3
    assert all(line.endswith("not measured in this run (its final.csv records no peer arms: the run predates them)")
               for line in comp.peer_lines)
    (t,) = comp.tokens
    assert t.peer_us == {} and t.best_peer_us is None
    _, rows = report.token_table(comp)
    assert rows[0][-4:-2] == ["-", "-"]


def test_peer_arms_record_each_reason() -> None:
    problem = Problem("gemv", "bf16", 1, 1024, 512)
    candidates, left_out = finals.peer_arms(problem, GPU)
    assert candidates == [{"label": SKINNY, "backend": SKINNY, "params": {}, "optional": True}]
    assert left_out == {"inductor": "no inductor kernel for op gemv",
                        MISSING: "unavailable here: package missing: stand-in-peers is not installed"}
    _, left_out = finals.peer_arms(Problem("gemv", "bf16", 1, 96, 5120), GPU)
    assert left_out[SKINNY] == "shape unsupported: N=96 is not a multiple of 64"
    # a module that will not import, a check that raises, the CPU: each one line, never a traceback
    finals._peer_here.cache_clear()
    backends.BASELINES = ("vendor", "peer_backends_not_installed:PEER", "peer_backends:BROKEN", "inductor")
    _, left_out = finals.peer_arms(Problem("gemma_rms_norm", "bf16", 1, 5120, 5120), dict(GPU, vendor="cpu"))
    assert left_out["peer_backends_not_installed:PEER"] == (
        "cannot be loaded here (ModuleNotFoundError: No module named 'peer_backends_not_installed')")
    assert left_out["peer_backends:BROKEN"] == "no peer_backends:BROKEN kernel for op gemma_rms_norm"
    assert left_out["inductor"] == "unavailable here: the Inductor baseline is measured on GPUs only"
    _, left_out = finals.peer_arms(problem, GPU)
    assert left_out["peer_backends:BROKEN"] == "unavailable here (asking raised RuntimeError: driver query failed)"
    assert all("\n" not in why for why in left_out.values())


def test_peers_not_asked_are_recorded_as_such() -> None:
    """``search --peers``: a peer not asked is left out with its own reason; Inductor, a stock baseline (the bar
    of the elementwise ops), is asked whatever the list says."""
    problem = Problem("gemv", "bf16", 1, 1024, 512)
    candidates, left_out = finals.peer_arms(problem, GPU, asked=())
    assert candidates == []
    assert left_out == {"inductor": "no inductor kernel for op gemv", SKINNY: finals.NOT_ASKED,
                        MISSING: finals.NOT_ASKED}
    candidates, left_out = finals.peer_arms(problem, GPU, asked=(SKINNY,))
    assert [c["label"] for c in candidates] == [SKINNY] and left_out[MISSING] == finals.NOT_ASKED
    _, left_out = finals.peer_arms(Problem("gemma_rms_norm", "bf16", 1, 5120, 5120), dict(GPU, vendor="cpu"), ())
    assert left_out["inductor"] == "unavailable here: the Inductor baseline is measured on GPUs only"


@pytest.mark.slow  # two CPU searches: the slow tier
def test_peers_asked_later_rerun_only_the_final_re_measure(tmp_path) -> None:
    """A search without peers, then the same --out with them: no trial is measured again, and the final
    re-measure runs again with the peer interleaved (its record "ok" where it said "not asked")."""
    from tunekit.search.common import SearchConfig
    from tunekit.search.engine import run_search

    def search(peers):
        cfg = SearchConfig(problems=[Problem("gemv", "bf16", 1, 128, 64)], backends=["triton"], out_dir=tmp_path,
                           trials=2, sampler="grid", warm_start=0, peers=peers)
        return run_search(cfg, progress=False, log=lambda s: None)

    first = search(())
    assert {r["backend"] for r in first.final_rows} == {"vendor", "triton"}
    assert json.loads(first.final_rows[0][finals.PEERS_COLUMN])[SKINNY] == finals.NOT_ASKED
    measured = len(pd.read_csv(first.trials_path).query("measured == True"))
    second = search(None)
    assert len(pd.read_csv(second.trials_path).query("measured == True")) == measured
    assert sum(s.measured_now for s in second.stats) == 0
    assert {r["backend"] for r in second.final_rows} == {"vendor", "triton", SKINNY}
    assert json.loads(second.final_rows[0][finals.PEERS_COLUMN])[SKINNY] == "ok"


def test_final_rows_carry_the_peer_record() -> None:
    """The re-measure's rows (final.csv) hold every peer's outcome: timed, dropped by the worker, left out."""
    backends.BASELINES = ("vendor", SKINNY, "peer_backends:FAILS_BUILD", MISSING)
    problem = Problem("gemv", "bf16", 1, 1024, 512, 2, ("a_proj",))
    timing = {"time_us": 5.0, "time_p25_us": 4.9, "time_p75_us": 5.1, "spread": 0.04, "gbps": 210.0,
              "timing_kind": "gpu"}
    calls = []

    class Worker:
        def call(self, task, timeout):
            calls.append(task)
            return {"status": "ok", "timings": {"vendor": dict(timing), SKINNY: dict(timing, time_us=4.0)},
                    "dropped": {"peer_backends:FAILS_BUILD": "BuildError: stand-in peer: injected build failure"}}

    logged = []
    run = SimpleNamespace(cfg=SimpleNamespace(trial_timeout_s=10, numerics="bounded", peers=None),
                          bar=SimpleNamespace(log=logged.append), probe=PROBE, device=GPU)
    candidates = [{"label": "vendor", "backend": "vendor", "params": {}}, *finals.peer_arms(problem, GPU)[0]]
    rows = finals._final_remeasure(run, SimpleNamespace(worker=Worker(), final_split={}), problem, candidates)
    assert [c["label"] for c in calls[0]["candidates"]] == ["vendor", SKINNY, "peer_backends:FAILS_BUILD"]
    assert [r["label"] for r in rows] == ["vendor", SKINNY]
    record = json.loads(rows[0][finals.PEERS_COLUMN])
    assert all(r[finals.PEERS_COLUMN] == rows[0][finals.PEERS_COLUMN] for r in rows)
    assert record == {SKINNY: "ok",
                      "peer_backends:FAILS_BUILD": "dropped in the worker (build, first call or verification): "
                                                   "BuildError: stand-in peer: injected build failure",
                      MISSING: "unavailable here: package missing: stand-in-peers is not installed"}
    # speedups over the stock path, as the table gates: the faster peer is reported, not the bar
    assert rows[0]["baseline"] == "vendor" and rows[1]["speedup"] == pytest.approx(1.25)
    assert any("FAILS_BUILD dropped" in line for line in logged)
    assert finals.PEERS_COLUMN == comparison.PEERS_COLUMN


# ---- the per-token path: one served path per layer ------------------------------------------------


def _write_default_run(path: Path, ms: tuple[int, ...] = (1,)) -> tuple[Path, list[Problem], dict]:
    """Qwen3.5-27B's default search problems (gemv, the elementwise ops, rms_gemv, gemv_add) with made-up
    times: vendor 1 + i us, triton 0.8x of it (i: the problem's index)."""
    path.mkdir(parents=True)
    problems = load_model("qwen3.5-27b").problems(1, list(ms), "bf16", MODEL_OPS)
    rows, times = [], {}
    for i, p in enumerate(problems):
        vendor = 1.0 + i
        times[p.key] = (vendor, 0.8 * vendor)
        for backend, t in (("vendor", vendor), ("triton", 0.8 * vendor)):
            rows.append({**p.as_dict(), "names": ";".join(p.names),
                         "label": backend if backend == "vendor" else "triton#0", "backend": backend,
                         "params": "{}", "time_us": t, "gbps": 1.0, "pct_of_limit": None, "timing_kind": "gpu"})
    meta = {"command": "tunekit search --model qwen3.5-27b", "model": "qwen3.5-27b", "backends": ["triton"],
            "min_gain": 0.01, "problems": [p.as_dict() for p in problems], "device": GPU, "probe": PROBE}
    (path / "run.json").write_text(json.dumps(meta))
    pd.DataFrame(rows).to_csv(path / "final.csv", index=False)
    return path, problems, times


def test_default_run_counts_each_layer_once(tmp_path) -> None:
    run, problems, times = _write_default_run(tmp_path / "run")
    comp = comparison.load_comparison(run)
    counted = {id_of(p): comp.calls(p) for p in comp.problems}
    by_op: dict[str, float] = {}
    for p in problems:
        by_op[p.op] = by_op.get(p.op, 0.0) + counted[id_of(p)]
    # the served path: every norm consumer as rms_gemv, every residual writer as gemv_add, lm_head a plain
    # GEMV, the final norm a plain norm (its add is in the last down_proj's epilogue), the rest as listed
    assert by_op == {"gemv": 1, "rms_gemv": 128, "gemv_add": 128, "gemma_rms_norm": 1,
                     "gemma_fused_add_rms_norm": 0, "gated_rms_norm": 48, "silu_and_mul": 64}
    assert counted[id_of(next(p for p in problems if p.names == ("lm_head",)))] == 1
    expected_vendor = sum(counted[id_of(p)] * times[p.key][0] for p in problems)
    everything = sum(p.count * times[p.key][0] for p in problems)  # the double count this replaces
    (t,) = comp.tokens
    assert t.calls == 1 + 128 + 128 + 1 + 48 + 64
    assert t.vendor_us == pytest.approx(expected_vendor, rel=1e-7) and t.vendor_us < 0.75 * everything
    assert t.tuned_us == pytest.approx(0.8 * expected_vendor, rel=1e-7)
    (line,) = comp.path_lines
    assert line == ("M=1: counted the served path: rms_gemv and gemv_add; 304 gemv calls left out (served as "
                    "rms_gemv / gemv_add); 128 norm calls left out (folded into rms_gemv); 1 fused add + norm "
                    "calls counted as plain norms (the add in gemv_add)")
    md = report.write_markdown(comp, []).read_text()
    assert f"- {line}" in md and "counted/token" in md


def test_gemv_add_without_the_fold_turns_fused_norms_plain(tmp_path) -> None:
    """gemv, the norms and gemv_add (no rms_gemv): each GEMV that writes the residual is counted as gemv_add,
    and each fused add + norm after it as a plain norm."""
    run, problems, times = _write_default_run(tmp_path / "run")
    keep = [p for p in problems if p.op != "rms_gemv"]
    final = pd.read_csv(run / "final.csv")
    final[final.op != "rms_gemv"].to_csv(run / "final.csv", index=False)
    meta = json.loads((run / "run.json").read_text())
    meta["problems"] = [p.as_dict() for p in keep]
    (run / "run.json").write_text(json.dumps(meta))
    comp = comparison.load_comparison(run)
    counted = {(p.op, p.n, p.k): comp.calls(p) for p in comp.problems}
    assert counted[("gemv", 5120, 6144)] == 0 and counted[("gemv", 5120, 17408)] == 0  # o/out_proj, down_proj
    assert counted[("gemv", 14336, 5120)] == 16 and counted[("gemv", 34816, 5120)] == 64  # not residual writers
    assert counted[("gemma_fused_add_rms_norm", 5120, 5120)] == 0
    assert counted[("gemma_rms_norm", 5120, 5120)] == 1 + 128
    (t,) = comp.tokens
    assert t.vendor_us == pytest.approx(sum(comp.calls(p) * times[p.key][0] for p in keep), rel=1e-7)


def test_chain_only_families_left_out_where_the_served_path_covers_their_layers(tmp_path) -> None:
    """gemv_silu_mul (tunekit chain only) beside rms_gemv on the same gate_up_proj: left out, said so."""
    path = tmp_path / "run"
    path.mkdir()
    spec = load_model("qwen3.5-27b")
    problems = spec.problems(1, [1], "bf16", ("rms_gemv", "gemv_silu_mul", "rms_gemv_silu_mul"))
    rows = []
    for p in problems:
        for backend in ("vendor", "triton"):
            rows.append({**p.as_dict(), "names": ";".join(p.names), "label": backend, "backend": backend,
                         "params": "{}", "time_us": 10.0, "gbps": 1.0, "pct_of_limit": None, "timing_kind": "gpu"})
    (path / "run.json").write_text(json.dumps({"problems": [p.as_dict() for p in problems], "device": GPU,
                                               "probe": PROBE}))
    pd.DataFrame(rows).to_csv(path / "final.csv", index=False)
    comp = comparison.load_comparison(path)
    counted = {p.op: comp.calls(p) for p in comp.problems if p.op != "rms_gemv"}
    assert counted == {"gemv_silu_mul": 0, "rms_gemv_silu_mul": 0}
    assert comp.tokens[0].calls == 128
    assert "left out gemv_silu_mul, rms_gemv_silu_mul (not served by the plugin" in comp.path_lines[0]


def test_the_worker_drops_a_peer_with_wrong_results_before_timing_it(monkeypatch) -> None:
    """A peer is verified as a candidate is: one that computes wrong results is never timed, never a bar."""
    from tunekit.search.worker import _ChildState

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    problem = {"op": "gemv", "dtype": "bf16", "m": 1, "n": 128, "k": 64, "count": 1}
    task = {"kind": "final", "problem": problem, "repeats": 2, "candidates": [
        {"label": "vendor", "backend": "vendor", "params": {}},
        {"label": SKINNY, "backend": SKINNY, "params": {}, "optional": True},
        {"label": "peer_backends:WRONG", "backend": "peer_backends:WRONG", "params": {}, "optional": True}]}
    reply = _ChildState().handle(task)
    assert reply["status"] == "ok"
    assert set(reply["timings"]) == {"vendor", SKINNY}
    assert reply["dropped"]["peer_backends:WRONG"].startswith("verification failed:")
