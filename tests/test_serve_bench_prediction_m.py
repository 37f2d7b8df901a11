"""serve-bench's prediction at the M a decode step runs: with ``--speculative`` weighted over vanilla's histogram
of the verify steps' M and set against vanilla's time per step (hand-computed on recorded figures), unavailable
(never the M = B figure) where the histogram is missing, and every M taken from the entry serving itself would
take (``tunekit.table.serving_lookup``: an entry whose config cannot run at M = 3 is passed over in both).
No vLLM: the runner results are written here as the runner records them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_ops import _entry, _rows, _within_bound, _xw, make_table

from tunekit import backends, ops
from tunekit import table as table_mod
from tunekit.evidence.serve_bench import analysis

N, K = 24, 192
#: valid at every M <= 16 (tests/test_routing_between_m.py)
TILE = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 2, "num_stages": 1}
#: this module's backend below, loaded by the registry as ``module:ATTR``
EVEN = "test_serve_bench_prediction_m:EVEN_M"


class _EvenM:
    """The Triton backend refusing every odd M: no Triton config refuses M = 3 yet runs M = 4, and the rule
    under test is what serving does with an entry that cannot run the M it is asked to serve."""

    def __getattr__(self, name: str) -> Any:
        return getattr(backends.get("triton"), name)

    def invalid_reason(self, problem: Any, params: dict[str, Any]) -> str | None:
        if problem.m % 2:
            return f"M={problem.m} is odd"
        return backends.get("triton").invalid_reason(problem, params)


EVEN_M = _EvenM()


def _timed(m: int, saving: float, backend: str = "triton") -> dict[str, Any]:
    """A GEMV entry at ``m`` whose standalone figures save ``saving`` us per call (time 1 us)."""
    return dict(_entry("gemv", m, N, K, backend=backend, params=TILE), time_us=1.0, baseline_us=1.0 + saving)


def _spec(count: int = 3) -> SimpleNamespace:
    """A model of one GEMV problem called ``count`` times per forward (``ModelSpec.problems``' protocol)."""
    def problems(tp: int, m_list: list[int], ops: Any) -> list[SimpleNamespace]:
        return [SimpleNamespace(op="gemv", dtype="bf16", m=m, n=N, k=K, count=count) for m in m_list]
    return SimpleNamespace(problems=problems)


def _result(arm: str, batch: int, tpot_ms: float, spec_decode: dict[str, Any] | None) -> dict[str, Any]:
    """One runner result of one process at one batch size, as the runner records it (both arms chose the same
    token at the same logprob: the agreement check has its figures and passes)."""
    agreement = {"steps": 1, "requests": [{"token_ids": [7], "logprobs": [-0.5], "top": [{"7": -0.5}]}]}
    row = {"batch": batch, "tokens": 16, "tpot_ms": [tpot_ms], "tpot_ms_median": tpot_ms, "spec_decode": spec_decode,
           "agreement": agreement}
    return {"arm": arm, "index": 0, "pid": 1, "batches": [row]}


def _summarize(vanilla_steps: dict[str, int] | None) -> dict[str, Any]:
    """serve.json at B = 2, k = 3, vanilla at 4.0 ms and tuned at 3.99 ms per output token; every arm accepted
    15 of 30 draft tokens over 10 drafts (mean accepted length 2.5); ``vanilla_steps``: vanilla's decode
    steps' M histogram (None: not recorded)."""
    counters = {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 15, "accepted_per_pos": [8, 5, 2]}
    tuned_fig = {"counters": counters, "steps": {"decode_m": {"8": 10}}}
    vanilla_fig = {"counters": counters, "steps": None if vanilla_steps is None else {"decode_m": vanilla_steps}}
    results = {"vanilla": [_result("vanilla", 2, 4.0, vanilla_fig)], "tuned": [_result("tuned", 2, 3.99, tuned_fig)]}
    # as a table's JSON holds them: params a dict (a search row's are its JSON text), the kernel named
    table = {"entries": [{**_timed(m, saving), "params": dict(TILE), "kernel": "gemv"}
                         for m, saving in ((1, 10.0), (4, 6.0), (8, 2.0))]}
    settings = {"batches": [2], "speculative": "ngram:3", "weights": "dummy", "prompt_len": 64}
    return analysis.summarize(settings, results, {}, _spec(), [("t.json", table)])


def test_the_speculative_prediction_is_weighted_over_vanillas_verify_steps() -> None:
    # vanilla's 10 decode steps: 2 at M = 1, 6 at M = 3 (served by the M = 4 entry), 2 at M = 8; 3 calls per step
    doc = _summarize({"1": 2, "3": 6, "8": 2})
    (row,) = doc["batches"]
    per_step = row["prediction_per_step"]
    assert per_step["by_m"] == {"1": {"steps": 2, "saving_us": 30.0, "served_calls": 3},
                                "3": {"steps": 6, "saving_us": 18.0, "served_calls": 3},
                                "8": {"steps": 2, "saving_us": 6.0, "served_calls": 3}}
    # S = (2 x 30 + 6 x 18 + 2 x 6) / 10 = 18 us per step; a step yields L = 2.5 tokens per sequence, so
    # vanilla's step is 4.0 x 2.5 = 10 ms and the speedup 10 / (10 - 0.018); per output token 0.018 / 2.5 ms
    assert per_step["predicted_step_saving_ms"] == pytest.approx(0.018)
    assert per_step["tokens_per_step"] == pytest.approx(2.5) and per_step["vanilla_step_ms"] == pytest.approx(10.0)
    assert row["predicted_speedup"] == pytest.approx(10.0 / (10.0 - 0.018))
    assert row["predicted_saving_ms"] == pytest.approx(0.0072)
    assert row["predicted_speedup"] == pytest.approx(4.0 / (4.0 - row["predicted_saving_ms"]))
    assert row["measured_saving_ms"] == pytest.approx(0.01) and row["prediction_unavailable"] is None
    # not the M = B figure: at M = 2 the M = 4 entry would give 18 us per token
    assert row["predicted_saving_ms"] != pytest.approx(0.018)


def test_without_vanillas_histogram_the_prediction_is_unavailable() -> None:
    doc = _summarize(None)
    (row,) = doc["batches"]
    assert row["prediction_unavailable"] is not None and "decode steps' M" in row["prediction_unavailable"]
    assert (row["predicted_saving_ms"], row["predicted_speedup"], row["predicted_calls"]) == (None, None, None)
    assert any(n.startswith("B=2: no prediction:") and "not M = B" in n for n in doc["notes"])
    assert row["speedup"] == pytest.approx(4.0 / 3.99)  # the measurement stands on its own


@pytest.mark.usefixtures("clean_ops")  # conftest.py: no table or markers leak
def test_an_m_between_two_entries_is_predicted_from_the_entry_serving_takes(tmp_path: Path) -> None:
    # M = 4's entry cannot run M = 3: serving passes it over for M = 8's, and so does the prediction
    path = make_table(tmp_path / "t.json", [_timed(2, 9.0), _timed(4, 6.0, backend=EVEN), _timed(8, 2.0)])
    table = table_mod.load(path)
    assert table_mod.lookup(table, "gemv", "bf16", 3, N, K).m == 4  # the bare M rule would take it
    assert table_mod.serving_lookup(table, "gemv", "bf16", 3, N, K).m == 8
    assert table_mod.serving_lookup(table, "gemv", "bf16", 4, N, K).backend == EVEN  # its own M it runs
    assert analysis.predicted_saving_us(_spec(), table, 3)["saving_us"] == pytest.approx(3 * 2.0)
    assert analysis.predicted_saving_us(_spec(), table, 4)["saving_us"] == pytest.approx(3 * 6.0)

    ops.load_tables(str(path))
    served = {}
    for m in (2, 3, 4):
        x, w = _xw(m, N, K, seed=m)
        assert _within_bound(torch.ops.tunekit.gemv(x, w, None), x, w), m
        (marker,) = _rows(shape=f"{N}x{K}", m=m)
        served[m] = (marker["impl"], marker["served_m"])
    assert served == {2: ("tuned:triton", 2), 3: ("tuned:triton", 8), 4: (f"tuned:{EVEN}", 4)}
    assert {m: table_mod.serving_lookup(table, "gemv", "bf16", m, N, K).m for m in served} == \
        {m: s for m, (_, s) in served.items()}
