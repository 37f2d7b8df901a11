"""serve-bench's first-token mode (``--first-token``): the round-robin order, fresh prompts, the statistics and the
verdict each way on constructed samples, the option's errors, and the whole parent on the stub engine. Nothing here
needs vLLM or a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from serve_bench_helpers import REPO, TABLE, small_settings, use_fake_runner

from tunekit.errors import UserError
from tunekit.evidence.serve_bench import bench, first_token
from tunekit.evidence.serve_bench.report import ttft_table


def test_the_cases_are_taken_round_robin_each_round_one_case_later() -> None:
    seq = first_token.order(3, 4)
    assert seq == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
    rounds = [seq[i:i + 3] for i in range(0, len(seq), 3)]
    assert all(sorted(r) == [0, 1, 2] for r in rounds)  # every round takes every case once
    # over 3 rounds every case sits at every place of a round once: none always follows the longest prefill
    for case in range(3):
        assert sorted(r.index(case) for r in rounds[:3]) == [0, 1, 2]


class _Events:
    def __enter__(self) -> _Events:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def record(self) -> dict:
        return {"gc_ms": 0.0}


def test_measure_warms_every_case_then_times_every_one_with_fresh_prompts() -> None:
    calls: list[list[list[int]]] = []
    doc = first_token.measure(calls.append, [16, 40], [1, 3], repeats=5, vocab_size=32000, events=_Events)
    cases = [(16, 1), (16, 3), (40, 1), (40, 3)]
    # the warm-up: one untimed generate per case, in case order; then 5 rounds of the 4 cases
    assert [(len(c[0]), len(c)) for c in calls[:4]] == cases
    assert [(len(c[0]), len(c)) for c in calls[4:]] == [cases[k] for k in doc["order"]]
    assert len(calls) == 4 + 5 * 4 and doc["order"] == first_token.order(4, 5)
    for rec, (n, b) in zip(doc["cases"], cases, strict=True):
        assert (rec["prompt_len"], rec["batch"]) == (n, b)
        assert len(rec["t_s"]) == 5 and all(t >= 0 for t in rec["t_s"]) and len(rec["host"]) == 5
    # no request's first KV block repeats another's: the first two ids are its serial number
    prompts = [p for c in calls for p in c]
    assert doc["requests"] == len(prompts) == 4 * 2 + 5 * 8
    assert len({tuple(p[:2]) for p in prompts}) == len(prompts)
    assert all(100 <= t < 32000 for p in prompts for t in p)
    # the same ids in every process (and arm): the serials start at 0
    again: list[list[list[int]]] = []
    first_token.measure(again.append, [16, 40], [1, 3], repeats=5, vocab_size=32000)
    assert again == calls
    # a small vocabulary still gives distinct pairs
    small = first_token.prompts(300, 4, 0, vocab_size=200)
    assert len({tuple(p[:2]) for p in small}) == 300 and all(100 <= t < 200 for p in small for t in p)


def _doc(arm: str, index: int, samples_ms: dict[tuple[int, int], list[float]]) -> dict:
    cases = [{"prompt_len": n, "batch": b, "t_s": [t / 1000.0 for t in ms]} for (n, b), ms in samples_ms.items()]
    lengths = sorted({n for n, _ in samples_ms})
    batches = sorted({b for _, b in samples_ms})
    return {"arm": arm, "index": index,
            "first_token": {"lengths": lengths, "batches": batches, "repeats": 5, "cases": cases}}


def _results(vanilla_medians: list[float], other_medians: list[float], other: str = "folded") -> dict:
    """One case (64, 1): each process's five samples scatter +-1% around its median."""
    def samples(med: float) -> dict:
        return {(64, 1): [med * f for f in (0.99, 0.995, 1.0, 1.005, 1.01)]}
    return {"vanilla": [_doc("vanilla", i, samples(m)) for i, m in enumerate(vanilla_medians)],
            other: [_doc(other, i, samples(m)) for i, m in enumerate(other_medians)]}


def test_the_statistics_of_one_case() -> None:
    ttft = first_token.summarize(_results([100.0, 101.0, 100.5], [102.0, 103.02, 100.5]))
    case = ttft["cases"][0]
    v = case["arms"]["vanilla"]
    assert v["median_ms"] == pytest.approx(100.5) and (v["min_ms"], v["max_ms"]) == pytest.approx((100.0, 101.0))
    assert case["vanilla_spread"] == pytest.approx(0.01)
    # IQR / median of 0.99, 0.995, 1, 1.005, 1.01 (inclusive quartiles: 0.995 and 1.005)
    assert case["vanilla_iqr_rel"] == pytest.approx(0.01)
    assert v["per_process"]["1"]["samples"] == 5
    c = case["compared"]["folded"]
    assert c["ratio"] == pytest.approx(102.0 / 100.5)
    assert (c["min"], c["max"], c["pairs"]) == (pytest.approx(1.0), pytest.approx(1.02), 3)


@pytest.mark.parametrize(("vanilla", "other", "want"), [
    # a 3% slower arm, vanilla's processes within 0.5%: resolved as slower
    ([100.0, 100.5, 100.2], [103.0, 103.5, 103.2], "slower"),
    # the same 3% with vanilla's processes 5% apart: no verdict
    ([100.0, 105.0, 102.0], [103.0, 108.15, 105.06], "unresolved (vanilla spread 5.0%)"),
    # equal arms, tight vanilla: the one pass
    ([100.0, 100.5, 100.2], [100.3, 100.2, 100.4], "within 2%"),
    # equal on the median but one pair past the bound: not a pass
    ([100.0, 100.5, 100.2], [100.0, 103.0, 100.2], "unresolved (vanilla spread 0.5%)"),
    # equal arms over a vanilla spread of exactly 2%: not a pass either
    ([100.0, 102.0], [100.0, 102.0], "unresolved (vanilla spread 2.0%)"),
    ([100.0, 100.5, 100.2], [96.0, 96.5, 96.2], "faster"),
    # one process per arm: no spread, so no verdict however close
    ([100.0], [100.0], "unresolved (one vanilla process: no spread between processes)"),
])
def test_each_verdict(vanilla: list[float], other: list[float], want: str) -> None:
    ttft = first_token.summarize(_results(vanilla, other))
    assert ttft["cases"][0]["compared"]["folded"]["verdict"] == want
    notes = first_token.notes(ttft)
    assert notes == [] if want == "within 2%" else (len(notes) == 1 and want in notes[0])


def test_the_verdict_needs_process_pairs_and_the_report_shows_every_case() -> None:
    # tuned ran as processes 3 and 4 only: no pair with vanilla's 0-2
    results = _results([100.0, 100.5, 100.2], [])
    results["tuned"] = [_doc("tuned", i, {(64, 1): [100.0] * 5}) for i in (3, 4)]
    case = first_token.summarize(results)["cases"][0]
    assert case["compared"]["tuned"]["verdict"] == "unresolved (no process pair of this arm and vanilla)"
    assert "folded" not in case["arms"]  # an arm without samples is left out, not invented
    assert first_token.summarize({"vanilla": [{"arm": "vanilla", "index": 0}]}) is None
    # the table: an arm with samples in any case gets its columns, "-" where a case lacks it
    results = _results([100.0, 100.5, 100.2], [103.0, 103.5, 103.2])
    results["tuned"] = [_doc("tuned", 0, {(64, 2): [100.0] * 5})]
    results["vanilla"].append(_doc("vanilla", 3, {(64, 2): [100.0] * 5}))
    head, rows = ttft_table({"ttft": first_token.summarize(results)})
    assert head == ["prompt", "B", "vanilla ms (min-max)", "vanilla spread between / within processes",
                    "tuned ms", "tuned / vanilla (pairs min-max)", "tuned verdict",
                    "folded ms", "folded / vanilla (pairs min-max)", "folded verdict"]
    assert rows[0] == ["64", "1", "100.20 (100.00-100.50)", "0.5% / 1.0%", "-", "-", "-", "103.20",
                       "1.0299 (1.0299-1.0300)", "slower"]
    assert rows[1][:7] == ["64", "2", "100.00 (100.00-100.00)", "- / 0.0%", "100.00", "1.0000 (no pair)",
                           "unresolved (one vanilla process: no spread between processes)"]


@pytest.mark.parametrize(("options", "fragment"), [
    ({"first_token": [64, 1]}, "--first-token takes distinct prompt lengths 2..262143, got 64,1"),
    ({"first_token": [64, 300000]}, "2..262143"),
    ({"first_token": [64, 64]}, "distinct"),
    ({"first_token": [64], "first_token_repeats": 2}, "--first-token-repeats must be at least 3, got 2"),
])
def test_option_errors_are_one_line(options: dict, fragment: str) -> None:
    with pytest.raises(UserError, match=fragment.replace("+", r"\+")) as err:
        small_settings(**options)
    assert "\n" not in str(err.value)


def test_settings_without_the_mode_are_as_before_and_with_it_fit_the_longest_prompt() -> None:
    plain = small_settings()
    assert "first_token" not in plain.key() and "first_token_repeats" not in plain.key()  # earlier runs resume
    assert plain.max_model_len == 64
    s = small_settings(first_token=[64, 8192])
    assert s.key()["first_token"] == [64, 8192] and s.key()["first_token_repeats"] == 20
    assert s.max_model_len >= 8192 + 1 and s.max_model_len % 64 == 0
    assert s.engine(Path("/m"))["enable_prefix_caching"] is False


def test_cli_option_errors_are_one_line(tmp_path: Path) -> None:
    for args, fragment in ((["--first-token", "64,x"], "bad --first-token '64,x'"),
                           (["--first-token", "64", "--first-token-repeats", "1"], "at least 3"),
                           (["--first-token", "64", "--endpoint", "vanilla=http://127.0.0.1:9"], "offline engines")):
        res = subprocess.run([sys.executable, "-m", "tunekit", "serve-bench", "--model", "qwen3.5-27b", "--table",
                              str(TABLE), "--out", str(tmp_path / "o"), *args],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
        err = res.stderr.strip().splitlines()
        assert res.returncode != 0 and len(err) == 1 and fragment in err[0], res.stderr


def test_every_process_times_every_case_on_the_stub_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_runner(tmp_path, monkeypatch)
    out = tmp_path / "serve"
    lines: list[str] = []
    settings = small_settings(arms=["vanilla", "folded"], first_token=[8, 24], first_token_repeats=3)
    serve = bench.run_offline(settings, out, lines.append)
    spec = json.loads((out / "runs" / "folded-1.spec.json").read_text())
    assert spec["first_token"] == [8, 24] and spec["first_token_repeats"] == 3
    for arm in ("vanilla", "folded"):
        for i in (0, 1):
            rec = json.loads((out / "runs" / f"{arm}-{i}.json").read_text())["first_token"]
            assert Counter(rec["order"]) == {k: 3 for k in range(4)}
            assert [(c["prompt_len"], c["batch"], len(c["t_s"])) for c in rec["cases"]] == [
                (8, 1, 3), (8, 2, 3), (24, 1, 3), (24, 2, 3)]
            assert rec["requests"] == (1 + 2) * 2 * (1 + 3)  # (B=1 + B=2) x 2 lengths x (warm-up + 3 timed)
    ttft = serve["ttft"]
    assert [(c["prompt_len"], c["batch"]) for c in ttft["cases"]] == [(8, 1), (8, 2), (24, 1), (24, 2)]
    for case in ttft["cases"]:
        assert set(case["arms"]["vanilla"]["per_process"]) == set(case["arms"]["folded"]["per_process"]) == {"0", "1"}
        c = case["compared"]["folded"]
        assert c["pairs"] == 2 and c["min"] <= c["max"]
        # sleeps on a shared CPU decide which verdict; it must be one of the four
        assert c["verdict"] in ("within 2%", "slower", "faster") or c["verdict"].startswith("unresolved (vanilla")
    # the TPOT figures are still there, and the report carries the table
    assert all(row["tpot"]["vanilla"] for row in serve["batches"])
    md = (out / "serve.md").read_text()
    assert "Time to first token on its own (--first-token)" in md and "| 24 | 2 |" in md
    assert any("first token at prompts of 8,24 x 3" in ln for ln in lines)
    # --report-only rebuilds the same figures from the files
    again = bench.report_dir(out, log=lambda s: None)
    assert again["ttft"] == json.loads((out / "serve.json").read_text())["ttft"]
