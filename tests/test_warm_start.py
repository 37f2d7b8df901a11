"""Warm start measures the nearest studies' winners first: the same shape at the neighbouring Ms, then
further Ms, then other shapes; a short budget measures only the first few."""

from __future__ import annotations

import optuna
from optuna.distributions import CategoricalDistribution

from tunekit.problems.shapes import Problem
from tunekit.search.studies import _warm_start, warm_start_order


def _study(storage, name: str, m: int, n: int, k: int, best: int) -> None:
    study = optuna.create_study(study_name=name, storage=storage)
    study.set_user_attr("backend", "triton")
    study.set_user_attr("problem", {"op": "gemv", "m": m, "n": n, "k": k})
    dist = {"A": CategoricalDistribution(list(range(10)))}
    trial = optuna.trial.create_trial(params={"A": best}, distributions=dist, value=1.0,
                                      user_attrs={"status": "ok"})
    study.add_trial(trial)


def test_the_same_shape_at_the_nearest_m_comes_first(tmp_path) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'o.db'}")
    # created in a search's order: every shape at M=1, then M=4, then M=16
    _study(storage, "a1", 1, 5120, 17408, best=1)
    _study(storage, "b1", 1, 96, 5120, best=2)
    _study(storage, "a4", 4, 5120, 17408, best=4)
    _study(storage, "b4", 4, 96, 5120, best=5)
    _study(storage, "a16", 16, 5120, 17408, best=6)
    problem = Problem("gemv", "bf16", 8, 5120, 17408)
    seeds = _warm_start(storage, "a8", "triton", problem, {"A": list(range(10))}, {"A": 0}, per_study=1)
    # same shape: M=4 and M=16 (one power of two away, in creation order), then M=1; then the other shape,
    # nearest M first
    assert [s["A"] for s in seeds] == [4, 6, 1, 5, 2]
    assert warm_start_order(problem, {"m": 4, "n": 5120, "k": 17408})[0] == 0
    assert warm_start_order(problem, {"m": 8, "n": 96, "k": 5120})[0] == 1
