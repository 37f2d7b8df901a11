"""--seed-from: configs of earlier runs (table.json or trials.csv) are measured first, nearest first."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import optuna
import pandas as pd
import pytest

from tunekit.errors import UserError
from tunekit.problems.shapes import Problem
from tunekit.search import finals
from tunekit.search.engine import SearchConfig, read_seed_records, run_search
from tunekit.search.studies import _seeds_from_files

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "benchmarks" / "results" / "h200-m1248-gemv-ew-fab7a9c" / "gemv"
DOMAINS = {"BLOCK_N": [1, 2, 4, 8], "BLOCK_K": [64, 128, 256], "num_warps": [1, 2, 4], "num_stages": [1, 2],
           "SPLIT_K": [1, 2], "W_EVICT": [""], "SPLIT_REDUCE": ["kernel"], "M_MODE": ["tile"]}
DEFAULT = {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2, "SPLIT_K": 1, "W_EVICT": "",
           "SPLIT_REDUCE": "kernel", "M_MODE": "tile"}


def _trials_csv(path: Path, rows: list[tuple[int, int, int, dict, float, str]]) -> Path:
    pd.DataFrame([{"op": "gemv", "backend": "triton", "m": m, "n": n, "k": k, "params": json.dumps(p),
                   "status": status, "time_us": t} for m, n, k, p, t, status in rows]).to_csv(path, index=False)
    return path


def test_seeds_come_nearest_first_and_skip_failures_duplicates_and_foreign_values(tmp_path) -> None:
    csv = _trials_csv(tmp_path / "trials.csv", [
        (2, 96, 256, {"BLOCK_N": 8, "BLOCK_K": 64}, 5.0, "ok"),      # other M, same shape
        (1, 512, 256, {"BLOCK_N": 2, "BLOCK_K": 64}, 3.0, "ok"),     # same M, other shape
        (1, 96, 256, {"BLOCK_N": 1, "BLOCK_K": 128}, 9.0, "ok"),     # same problem, slower
        (1, 96, 256, {"BLOCK_N": 1, "BLOCK_K": 64}, 2.0, "ok"),      # same problem, fastest
        (1, 96, 256, {"BLOCK_N": 2, "BLOCK_K": 128}, 1.0, "fail"),   # failed: never a seed
        (1, 96, 256, {"BLOCK_N": 64, "BLOCK_K": 64}, 1.0, "ok"),     # value outside today's domain
        (1, 96, 256, DEFAULT, 1.5, "ok"),                            # the default is enqueued anyway
    ])
    seeds = _seeds_from_files([csv], "triton", Problem("gemv", "bf16", 1, 96, 256), DOMAINS, DEFAULT)
    picked = [(s["BLOCK_N"], s["BLOCK_K"]) for s in seeds]
    assert picked == [(1, 64), (1, 128), (2, 64), (8, 64)]
    assert all(set(s) == set(DOMAINS) for s in seeds)


def test_recorded_runs_seed_every_m_of_the_model(tmp_path) -> None:
    records = read_seed_records(RECORDED / "trials.csv.gz")
    assert {r["m"] for r in records if r["backend"] == "triton"} == {1, 2, 4, 8}
    from tunekit.backends import get

    backend = get("triton")
    problem = Problem("gemv", "bf16", 4, 14336, 5120)
    space = backend.space(problem)
    seeds = _seeds_from_files([RECORDED / "trials.csv.gz", RECORDED / "table.json"], "triton", problem,
                              space.domains, space.default)
    assert seeds, "the recorded M=4 trials give seeds"
    same = [r for r in records if (r["backend"], r["m"], r["n"], r["k"]) == ("triton", 4, 14336, 5120)]
    best = min(same, key=lambda r: r["time_us"])["params"]
    assert all(seeds[0][k] == v for k, v in best.items() if k in seeds[0])


def test_a_missing_or_foreign_seed_file_is_one_clear_error(tmp_path) -> None:
    with pytest.raises(UserError, match="no such file"):
        read_seed_records(tmp_path / "nope.csv")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="not a trials table"):
        read_seed_records(tmp_path / "other.csv")


def _seeded_trials(tmp_path: Path, seed: dict, trials: int, **options) -> list:
    """The trials of an 8x256 GEMV search (Triton) seeded with one recorded ``seed``, in order.

    Only the study's trial order is asserted, so the search is made cheap on the interpreter: N=8 (its
    search space is the one of any N: N enters no validity rule; K=256 keeps BLOCK_K 128 and 256 valid) is
    2 to 4 programs a launch where 96 was 24 to 48, and the final re-measure, which no test here reads,
    times one round instead of FINAL_REPEATS (30 rounds were 3/4 of the test's time).
    """
    csv = _trials_csv(tmp_path / "trials.csv", [(1, 8, 256, seed, 1.0, "ok")])
    with mock.patch.object(finals, "FINAL_REPEATS", 1):
        run_search(SearchConfig(problems=[Problem("gemv", "bf16", 1, 8, 256)], backends=["triton"],
                                out_dir=tmp_path / "run", trials=trials, seed_from=(csv,), warm_start=0, **options))
    storage = f"sqlite:///{tmp_path / 'run' / 'optuna.db'}"
    (summary,) = [s for s in optuna.get_all_study_summaries(storage) if s.study_name.endswith("triton|bounded")]
    return optuna.load_study(study_name=summary.study_name, storage=storage).get_trials(deepcopy=False)


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_search_measures_the_seed_right_after_the_default(tmp_path) -> None:
    seed = {"BLOCK_N": 2, "BLOCK_K": 128, "num_warps": 2}
    trials = _seeded_trials(tmp_path, seed, 2)
    assert {k: trials[1].params[k] for k in seed} == seed


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_a_seed_without_a_restricted_tunable_takes_the_allowed_value(tmp_path) -> None:
    # recorded without num_stages (as if before it existed); --restrict leaves its default (2) out
    seed = {"BLOCK_N": 2, "BLOCK_K": 128, "num_warps": 2}
    first = _seeded_trials(tmp_path, seed, 1, restrict={"num_stages": ("3",)})[0]
    assert {k: first.params[k] for k in seed} == seed and first.params["num_stages"] == 3


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_a_seed_recorded_with_a_fixed_tunable_keeps_its_tile_config(tmp_path) -> None:
    # trials recorded while W_EVICT was searched (evict_first) seed the same tile without the hint
    seed = {"BLOCK_N": 2, "BLOCK_K": 128, "num_warps": 2, "W_EVICT": "evict_first"}
    trials = _seeded_trials(tmp_path, seed, 2)
    assert "W_EVICT" not in trials[1].params
    assert {k: trials[1].params[k] for k in ("BLOCK_N", "BLOCK_K", "num_warps")} == {"BLOCK_N": 2, "BLOCK_K": 128,
                                                                                    "num_warps": 2}


def test_a_seed_recorded_with_another_value_of_a_pinned_tunable_is_kept() -> None:
    # HIP's REDUCE_DPP changes nothing on NVIDIA and is pinned to 0 there; runs from before the
    # pinning recorded REDUCE_DPP=1 for the same kernel (h200-m1-triton-hip-b1ce9d6: the best
    # 96x5120 HIP config, 2.56 us). The seed must survive with the pinned value.
    from tunekit.backends import get

    problem = Problem("gemv", "bf16", 1, 96, 5120)
    space = get("hip").space(problem)
    domains = dict(space.domains, REDUCE_DPP=[0])
    files = [REPO / "benchmarks" / "results" / "h200-m1-triton-hip-b1ce9d6" / "trials.csv.gz"]
    kept = _seeds_from_files(files, "hip", problem, domains, space.default, {"REDUCE_DPP": 0})
    dropped = _seeds_from_files(files, "hip", problem, domains, space.default)
    best = {"ROWS_PER_BLOCK": 1, "THREADS_PER_ROW": 512, "VEC": 8, "UNROLL": 2, "NONTEMPORAL": 1, "X_IN_SHARED": 0}
    assert {k: kept[0][k] for k in best} == best and kept[0]["REDUCE_DPP"] == 0
    assert all(s["REDUCE_DPP"] == 0 for s in kept)
    assert not any(all(s[k] == v for k, v in best.items()) for s in dropped)  # what the bug did


def test_a_fused_gemv_study_is_seeded_by_the_gemv_winners_after_its_own_records(tmp_path) -> None:
    from tunekit.backends import get

    recorded = REPO / "benchmarks" / "results" / "h200-decode-944f424" / "main" / "table.json"
    fused = Problem("gemma_rms_norm_gemv", "bf16", 1, 14336, 5120)  # input norm -> qkv_proj
    space = get("triton").space(fused)
    gemv = next(e for e in read_seed_records(recorded)
                if (e["op"], e["backend"], e["m"], e["n"], e["k"]) == ("gemv", "triton", 1, 14336, 5120))
    seeds = _seeds_from_files([recorded], "triton", fused, space.domains, space.default)
    # qkv_proj's GEMV winner first (its tile tunables carried over, the rest at the default)
    assert seeds and all(seeds[0][k] == v for k, v in gemv["params"].items() if k in space.domains)
    assert set(seeds[0]) == set(space.domains)
    own = pd.DataFrame([{"op": "gemma_rms_norm_gemv", "backend": "triton", "m": 1, "n": 14336, "k": 5120,
                         "params": json.dumps(space.default | {"BLOCK_N": 16}), "status": "ok", "time_us": 50.0}])
    own.to_csv(tmp_path / "trials.csv", index=False)
    seeds = _seeds_from_files([recorded, tmp_path / "trials.csv"], "triton", fused, space.domains, space.default)
    assert seeds[0]["BLOCK_N"] == 16  # a record of the fused op itself comes before the GEMV's
    sibling = own.assign(op="gemma_fused_add_rms_norm_gemv", params=json.dumps(space.default | {"BLOCK_N": 32}))
    sibling.to_csv(tmp_path / "sibling.csv", index=False)
    seeds = _seeds_from_files([recorded, tmp_path / "sibling.csv"], "triton", fused, space.domains, space.default)
    assert seeds[0]["BLOCK_N"] == 32  # then a sibling's (the same kernel with a residual) ...
    assert all(seeds[1][k] == v for k, v in gemv["params"].items() if k in space.domains)  # ... then the GEMV's
    # a plain norm: the table has only its Gemma sibling's entries (one kernel), and no GEMV seeds a norm
    norm = Problem("rms_norm", "bf16", 1, 5120, 5120)
    domains = get("triton").space(norm).domains
    gemma = [{k: v for k, v in e["params"].items() if k in domains} for e in read_seed_records(recorded)
             if e["op"] == "gemma_rms_norm" and e["n"] == 5120]
    seeds = _seeds_from_files([recorded], "triton", norm, domains, {})
    assert seeds and all(s in gemma for s in seeds)


def test_a_fused_studys_own_records_do_not_crowd_out_the_gemv_winners(tmp_path) -> None:
    # an earlier search of the fused op holds more verified configs than a study takes seeds; the
    # GEMV's winner for the shape (a tile config that search never reached) still comes in
    from tunekit.backends import get
    from tunekit.search.studies import SEEDS_FROM_FILES

    recorded = REPO / "benchmarks" / "results" / "h200-decode-944f424" / "main" / "table.json"
    fused = Problem("gemma_rms_norm_gemv", "bf16", 1, 14336, 5120)
    space = get("triton").space(fused)
    gemv = next(e for e in read_seed_records(recorded)
                if (e["op"], e["backend"], e["m"], e["n"], e["k"]) == ("gemv", "triton", 1, 14336, 5120))
    own = [space.default | {"BLOCK_N": n, "BLOCK_K": k} for n in (8, 16, 32) for k in (512, 1024, 2048, 4096)]
    pd.DataFrame([{"op": fused.op, "backend": "triton", "m": 1, "n": 14336, "k": 5120, "params": json.dumps(p),
                   "status": "ok", "time_us": 50.0 + i} for i, p in enumerate(own)]).to_csv(tmp_path / "t.csv",
                                                                                           index=False)
    assert len(own) > SEEDS_FROM_FILES
    seeds = _seeds_from_files([tmp_path / "t.csv", recorded], "triton", fused, space.domains, space.default)
    assert len(seeds) == SEEDS_FROM_FILES
    assert seeds[0]["BLOCK_N"] == 8 and seeds[0]["BLOCK_K"] == 512  # the op's own best first
    winner = [s for s in seeds if all(s[k] == v for k, v in gemv["params"].items() if k in space.domains)]
    assert winner and seeds.index(winner[0]) == 1  # the GEMV's winner next, taken in turn
    assert sum(s in own for s in seeds) >= SEEDS_FROM_FILES // 2  # the op's own records keep most slots
