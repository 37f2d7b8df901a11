"""The study of one (problem, backend): its sampler and parameter domains, and the configs it measures first.

A study (named by :func:`~tunekit.search.common.study_name`) is opened once per search (:func:`shared_study`):
the worker threads of this process share its Study object, whose sampler then sees every worker's asks, as
Optuna's n_jobs does. Opening it checks the storage's device stamp, records the problem, backend, numerics and
kernel source hash, and fails the trials a dead process left RUNNING. Each parameter's domain is pruned to the
values some valid config uses (:func:`_prune_domains`), pinned where the backend says a tunable changes nothing
on this device (``pinned_params``) and narrowed by ``--restrict``. A new study gets the default config enqueued
first, then the best configs of earlier runs (``--seed-from``, nearest problem first: :func:`read_seed_records`),
then the best configs of the other studies of the op in this storage (warm start).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from tunekit import backends as backend_registry
from tunekit.errors import UserError
from tunekit.problems.shapes import FUSED_GEMV_OPS, Problem
from tunekit.search import fleet
from tunekit.search.common import Run, StudyStats, best_us, params_key, retrying, study_name, trial_index
from tunekit.search.liveness import fail_dead_trials

SAMPLERS = ("tpe", "random", "grid")


def _make_sampler(name: str, space_domains: dict[str, list[Any]], seed: int) -> optuna.samplers.BaseSampler:
    if name == "tpe":
        # multivariate: the tunables interact (tile size x warps x split).
        # constant_liar: trials in flight in other workers count as bad, so parallel workers spread out
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=8, constant_liar=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler(space_domains, seed=seed)
    raise UserError(f"unknown sampler {name!r} (choose from {', '.join(SAMPLERS)})")


@dataclass
class OpenStudy:
    """A study opened by one worker: its sampler, pruned domains and counts (opened once per worker)."""

    study: optuna.Study
    name: str
    backend: Any
    fixed: dict[str, Any]
    distributions: dict[str, CategoricalDistribution]
    wanted: int
    stats: StudyStats  # as opened: what the storage held before this search
    task: Any
    emptied: list[str]


def shared_study(run: Run, problem: Problem, backend_name: str) -> OpenStudy:
    """The study opened once per search (domain pruning, warm start); the workers of this process
    share its Study object, whose sampler then sees every worker's asks, as Optuna's n_jobs does."""
    key = (problem.key, backend_name)
    with run.lock:
        lock = run.open_locks.setdefault(key, threading.Lock())
    with lock:
        if key not in run.opened:
            run.opened[key] = _open_study(run, problem, backend_name)
        return run.opened[key]


def _open_study(run: Run, problem: Problem, backend_name: str) -> OpenStudy:
    cfg, storage, device, bar = run.cfg, run.storage, run.device, run.bar
    backend = backend_registry.get(backend_name)
    space = backend.space(problem)
    stats = StudyStats(problem=problem, backend=backend_name)
    name = study_name(device["arch"], problem, backend_name, cfg.numerics)
    domains = _prune_domains(backend, problem, space.domains, space.fixed)
    # Tunables with no effect on this device are pinned, so one kernel is not
    # measured under several names (REDUCE_DPP only changes AMD code).
    pinned_for = getattr(backend, "pinned_params", None)
    pinned: dict[str, Any] = {}
    if pinned_for is not None:
        from tunekit.measure.device import DeviceInfo

        for key, value in pinned_for(DeviceInfo(**device)).items():
            if key in domains and value in domains[key]:
                domains[key] = [value]
                pinned[key] = value
    emptied = []
    for key, allowed in cfg.restrict.items():  # --restrict: the user narrows the space
        if key in domains:
            domains[key] = [v for v in domains[key] if str(v) in allowed]
            if not domains[key]:
                emptied.append(f"{key}={','.join(allowed)}")
    sampler = _make_sampler(cfg.sampler, domains, cfg.seed)
    study = retrying(lambda: optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                                 direction="minimize", load_if_exists=True))
    fleet.check_study_stamp(study, run.stamp, run.stamp_text, run.url)
    for key, value in (("problem", problem.as_dict()), ("backend", backend_name), ("numerics", cfg.numerics)):
        if study.user_attrs.get(key) != value:
            retrying(lambda key=key, value=value: study.set_user_attr(key, value))
    source = backend.source_hash()
    previous_source = study.user_attrs.get("source_hash")
    if previous_source and previous_source != source:
        # resuming keeps finished trials as measured; say so when they timed other kernel sources
        bar.log(f"warning: {name}: the {backend_name} kernel sources changed since this study's "
                f"trials ran ({previous_source} -> {source}); they are kept, not re-measured "
                "(use a new --out to start over)")
    if previous_source != source:
        retrying(lambda: study.set_user_attr("source_hash", source))
    fail_dead_trials(study, storage)
    # an emptied domain: no distribution (Optuna refuses one without choices), no trial
    distributions = {} if emptied else {k: CategoricalDistribution(v) for k, v in domains.items()}
    wanted = cfg.trials if domains else 1
    measured = len(trial_index(study, "")[0])
    stats.measured_before = measured
    opened = OpenStudy(study, name, backend, dict(space.fixed), distributions, wanted, stats,
                       bar.add(f"{problem.op} m{problem.m} {problem.n}x{problem.k} {backend_name}", wanted,
                               min(measured, wanted)), emptied)
    if emptied:
        # the study exists (the final re-measure reads it) but gets no new trial
        bar.log(f"{name}: --restrict {' '.join(emptied)} leaves no valid value for this problem; no new trials")
        stats.best_us = best_us(study)
        return opened
    if not study.get_trials(deepcopy=False):
        default = dict(space.fixed) | dict(space.default)
        reason = backend.invalid_reason(problem, default)
        if reason is None and all(space.default.get(k) in v for k, v in domains.items()):
            study.enqueue_trial(space.default)
        else:
            # a plugin's default may not fit every shape; the sampler starts without it
            bar.log(f"{name}: the default config is not valid here ({reason or 'outside the pruned domains'}); "
                    "not enqueued")
        # A seed recorded before a tunable existed takes its default, or, where
        # pinning or --restrict left the default out, the first value allowed:
        # `--restrict NEW=1 --seed-from old/trials.csv` re-measures old winners with NEW=1.
        # A pinned tunable is the same kernel at any value here: a seed recorded
        # with another value (REDUCE_DPP=1 from before pinning) is that kernel.
        fill = {k: (v if v in domains.get(k, [v]) else domains[k][0]) for k, v in space.default.items()}
        for params in _seeds_from_files(cfg.seed_from, backend_name, problem, domains, fill, pinned):
            study.enqueue_trial(params)
        for params in _warm_start(storage, name, backend_name, problem, domains, fill, cfg.warm_start, pinned):
            study.enqueue_trial(params)
    return opened


#: Largest search space whose valid points are enumerated to prune domains.
PRUNE_LIMIT = 300_000
#: Random points tried before that enumeration (it is skipped once all values are seen valid).
_PRUNE_SAMPLES = 3000
#: Up to this many values unseen after those points, each is enumerated alone (with an early exit).
_PRUNE_PER_VALUE = 3


def _prune_domains(backend, problem: Problem, domains: dict[str, list[Any]],
                   fixed: dict[str, Any]) -> dict[str, list[Any]]:
    """Drop the values of each parameter that no valid config of ``problem`` uses.

    Small problems make most of the space invalid (BLOCK_K = 8192 at K = 128):
    without pruning a sampler spends its attempts on them (each is cheap but
    the budget of attempts is finite). The predicate is pure Python, so the
    whole product is enumerated when it is small enough.
    """
    import itertools

    names = list(domains)
    size = 1
    for name in names:
        size *= len(domains[name])
    if not names or size > PRUNE_LIMIT:
        return dict(domains)
    import random

    used: dict[str, set] = {name: set() for name in names}
    wanted = sum(len(domains[n]) for n in names)

    def mark(values: tuple) -> None:
        params = dict(fixed) | dict(zip(names, values, strict=True))
        if backend.invalid_reason(problem, params) is None:
            for name, value in zip(names, values, strict=True):
                used[name].add(repr(value))

    # Random points first: on most shapes every value is soon seen in a valid
    # config and nothing can be pruned (the full product costs ~1.5 s per GEMV
    # study, a large share of a short budget); only otherwise enumerate it all.
    rng = random.Random(0)
    for _ in range(_PRUNE_SAMPLES):
        mark(tuple(rng.choice(domains[n]) for n in names))
        if sum(map(len, used.values())) == wanted:
            return dict(domains)
    unseen = wanted - sum(map(len, used.values()))
    if unseen > _PRUNE_PER_VALUE:
        # many values never valid (a small shape): one pass over the product is cheaper
        for values in itertools.product(*(domains[n] for n in names)):
            mark(values)
        names_left: list[str] = []
    else:
        names_left = names
    # Each value not seen yet: enumerate the configs holding it, up to the first valid one.
    for i, name in enumerate(names_left):
        for value in domains[name]:
            if repr(value) in used[name]:
                continue
            others = [domains[n] if j != i else [value] for j, n in enumerate(names)]
            for values in itertools.product(*others):
                mark(values)
                if repr(value) in used[name]:
                    break
    if not any(used.values()):
        return dict(domains)  # nothing valid: let the trials record why
    return {name: [v for v in domains[name] if repr(v) in used[name]] for name in names}


#: (storage, study name) -> (trial count when read, its best verified params, best first).
_BEST_CACHE: dict[tuple[int, str], tuple[int, list[dict[str, Any]]]] = {}


def _best_params(storage, study: Any, count: int) -> list[dict[str, Any]]:
    """The ``count`` fastest verified configs of a study, read once per trial count: late
    studies of a long run would otherwise sort every earlier study's trials again."""
    key = (id(storage), study.study_name)
    # ``study``: a FrozenStudy of storage.get_all_studies(), whose id Optuna keeps as _study_id (no public
    # getter; get_study_id_from_name would cost a query per study asked)
    trials = storage.get_all_trials(study._study_id, deepcopy=False)
    cached = _BEST_CACHE.get(key)
    if cached is None or cached[0] != len(trials) or len(cached[1]) < count:
        done = sorted((t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok"),
                      key=lambda t: t.value)
        cached = (len(trials), [dict(t.params) for t in done[:max(count, 8)]])
        _BEST_CACHE[key] = cached
    return cached[1][:count]


def warm_start_order(problem: Problem, other: dict[str, Any]) -> tuple[int, float, float]:
    """Sort key of another study's problem as a seed source for ``problem``: the same shape first, then the
    nearest M (in powers of two: M=4 seeds M=8 before M=1 does), then the nearest shape (log bytes)."""
    m, n, k = (int(other.get(key) or 1) for key in ("m", "n", "k"))
    same_shape = (n, k) == (problem.n, problem.k)
    return (0 if same_shape else 1, abs(math.log2(m) - math.log2(problem.m)),
            abs(math.log2(n * k) - math.log2(problem.n * problem.k)))


def _warm_start(storage, name: str, backend: str, problem: Problem, domains: dict[str, list[Any]],
                default: dict[str, Any], per_study: int, pinned: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The best verified configs of the other studies of this op and backend in the storage, nearest first.

    Good GEMV configs transfer between shapes (on the H200 the M=1 winners of
    all seven Qwen3.5-27B shapes came from a few small tiles), so each new
    study first measures them: a prior for TPE and a floor for short budgets.
    A short budget measures only the first few: the same shape's neighbouring
    Ms come first (:func:`warm_start_order`), since a config that wins at M=1
    is rarely right at M=16 (on the H100 a 3-trial search seeded from M=1
    found nothing over cuBLAS at M=8 and 16).
    """
    if per_study <= 0:
        return []
    sources = []
    # the studies' attributes only: Optuna's study summaries would load every trial of every study, once per
    # new study (quadratic in a long search: 250 ms per study at 24 studies of 8 trials on the CPU)
    for other in storage.get_all_studies():
        attrs = other.user_attrs
        if other.study_name == name or attrs.get("backend") != backend:
            continue
        if attrs.get("problem", {}).get("op") != problem.op:
            continue
        sources.append((warm_start_order(problem, attrs.get("problem", {})), len(sources), other))
    seeds: list[dict[str, Any]] = []
    keys: set[str] = set()
    for _, _, other in sorted(sources, key=lambda item: item[:2]):
        for trial_params in _best_params(storage, other, per_study):
            # a parameter added to the space after that trial ran takes its
            # default, which keeps the kernel the trial measured
            params = {k: v for k, v in (default | trial_params | (pinned or {})).items() if k in domains}
            if set(params) != set(domains) or any(params[k] not in domains[k] for k in domains):
                continue
            key = params_key(params)
            if key not in keys:
                keys.add(key)
                seeds.append(params)
    return seeds


#: Seeds one study takes from --seed-from files: of the op itself, its siblings (same kernel) and,
#: for a fused GEMV family, the GEMV, taken in turn; within each, the same problem first, then the
#: same M, then any M (nearest shapes first).
SEEDS_FROM_FILES = 8


def seed_paths(paths: Sequence[Path], device: dict[str, Any]) -> list[Path]:
    """``--seed-from`` with ``auto`` replaced, in its place, by the shipped tables measured on ``device``'s GPU
    model (``tunekit.shipped``): their winners are measured first, then refined by this search."""
    from tunekit import shipped

    out: list[Path] = []
    for path in paths:
        if str(path) == shipped.AUTO:
            out.extend(s.path for s in shipped.for_device(device))
        else:
            out.append(Path(path))
    return out


def read_seed_records(path: Path) -> list[dict[str, Any]]:
    """(op, backend, m, n, k, params, time_us) records of the verified configs in a
    dispatch table (``table.json``) or a trials table (``trials.csv`` / ``.parquet``)."""
    if not path.is_file():
        raise UserError(f"--seed-from {path}: no such file")
    if path.stat().st_size == 0:
        raise UserError(f"--seed-from {path}: the file is empty")
    if path.suffix == ".json":
        from tunekit import table as table_mod

        return [e.to_json() for e in table_mod.entries(table_mod.load(path))]  # the records trials files give
    import pandas as pd

    from tunekit.search import results

    needed = ("op", "backend", "m", "n", "k", "params", "status", "time_us")
    if path.suffix == ".parquet":
        try:
            frame = pd.read_parquet(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors have no common base worth naming
            raise UserError(f"--seed-from {path}: not a readable parquet file ({exc})") from None
        missing = sorted(set(needed) - set(frame.columns))
        if missing:
            raise UserError(f"--seed-from {path}: not a trials table (columns {missing} missing)")
    else:
        try:
            frame = results.read_csv(path, "trials table", needed)
        except UserError as exc:
            raise UserError(f"--seed-from {exc}") from None
    frame = frame[frame["status"] == "ok"]
    try:
        return [{"op": r.op, "backend": r.backend, "m": int(r.m), "n": int(r.n), "k": int(r.k),
                 "params": json.loads(r.params), "time_us": float(r.time_us)} for r in frame.itertuples()]
    except (TypeError, ValueError) as exc:  # ValueError covers a params cell that is not JSON
        raise UserError(f"--seed-from {path}: a verified trial's row is malformed ({exc})") from None


def _seeds_from_files(paths: Sequence[Path], backend: str, problem: Problem, domains: dict[str, list[Any]],
                      default: dict[str, Any], pinned: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Configs of earlier runs (``--seed-from``) for this study, best-first per nearness.

    ``default`` fills tunables a record lacks; ``pinned`` overrides what a record says for them."""
    if not paths:
        return []
    # Records of the op itself, of its siblings (the ops that read the same search-space file: one
    # kernel, the weight convention or the residual differ) and, for a fused GEMV family, of the GEMV
    # (its tile tunables have the same names, and (m, n, k) the same meaning): ranks 0, 1, 2.
    from tunekit.problems import oprecords

    files = {name: record.space for name, record in oprecords.RECORDS.items() if record.space}
    stem = files.get(problem.op, problem.op)
    rank = {op: 1 for op, s in files.items() if s == stem} | {stem: 1}
    if problem.op in FUSED_GEMV_OPS:
        rank["gemv"] = 2
    rank[problem.op] = 0
    records = [r for path in paths for r in read_seed_records(Path(path))
               if r["op"] in rank and r["backend"] == backend]

    def nearness(r: dict[str, Any]) -> tuple:
        same_shape = (r["n"], r["k"]) == (problem.n, problem.k)
        return (rank[r["op"]], not (same_shape and r["m"] == problem.m), r["m"] != problem.m, not same_shape,
                abs(math.log(r["n"] * r["k"]) - math.log(problem.n * problem.k)), abs(r["m"] - problem.m),
                r["time_us"])

    # One queue per rank, nearest first, taken in turn: a fused op's many own records (an earlier
    # search of it) must not crowd out the GEMV's winners, whose tile configs may be better ones
    # the earlier search never reached.
    queues: list[list[dict[str, Any]]] = []
    for level in sorted(set(rank.values())):
        queue = sorted((r for r in records if rank[r["op"]] == level), key=nearness)
        if queue:
            queues.append(queue)
    seeds: list[dict[str, Any]] = []
    keys = {params_key({k: v for k, v in default.items() if k in domains})}
    while queues and len(seeds) < SEEDS_FROM_FILES:
        for queue in list(queues):
            while queue:
                record = queue.pop(0)
                params = {k: v for k, v in (default | record["params"] | (pinned or {})).items() if k in domains}
                if set(params) != set(domains) or any(params[k] not in domains[k] for k in domains):
                    continue  # recorded with a space that no longer holds it
                key = params_key(params)
                if key not in keys:
                    keys.add(key)
                    seeds.append(params)
                    break
            if not queue:
                queues.remove(queue)
            if len(seeds) == SEEDS_FROM_FILES:
                break
    return seeds
