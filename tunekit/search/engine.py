"""One Optuna study per (problem, backend); every trial stored; winners re-measured.

Flow of ``run_search``::

    run folder + storage (SQLite in the folder unless --storage URL)
    worker: describe device, probe the read-bandwidth limit (once per run)
    for each problem, for each backend:
        study (resumed if it exists; trials a dead process left RUNNING marked failed)
        enqueue the default config first
        ask -> skip duplicates / invalid -> worker builds, verifies, times -> tell
    for each problem: top candidates of every backend + the baselines (vendor;
        for elementwise ops also Inductor where it runs) re-measured interleaved
        in one graph session (the ranking that counts); speedups are against the
        faster baseline
    for each layer group whose fusion the run searched, at every M: the fused
        sequence against the unfused one serving would run, interleaved
        (the table's "fusions" section)
    write trials.csv, final.csv, run.json, table.json

This module runs the search (the run folder's lock, the storage, a worker
process and thread per ``--gpus`` slot, the device probe, the run's files);
each duty is a module of its own:

* :mod:`~tunekit.search.studies`: a study's name, domains, pinned and restricted
  params, and what it measures first (default config, ``--seed-from`` seeds,
  warm start);
* :mod:`~tunekit.search.trials`: the trial loop of one worker thread;
* :mod:`~tunekit.search.finals`: the interleaved final re-measure (``final.csv``'s rows);
* :mod:`~tunekit.search.fusion_phase`: each layer group's fusion decided by a measurement of both sequences;
* :mod:`~tunekit.search.storage` and :mod:`~tunekit.search.liveness`: opening the
  storage, and the owners and heartbeats of the trials in flight;
* :mod:`~tunekit.search.common`: the configuration and the state they share.

Sharing: the run folder is locked for the whole run (``results.RunLock``: a
second search on it is refused). Several searches may share one storage
(``--storage``): SQLite in WAL mode with a busy timeout, and every trial in
flight records its owner (``host:pid``) and Optuna's heartbeat, so a search
fails only the RUNNING trials whose process is gone, never another live
search's.

Faults: a run folder made for another problem set is refused unless ``--add``
(``results.folder_problems``: the union is then searched); a storage or run
folder lost mid-run ends the run with one ``UserError`` naming the cause and
the fix (``storage.fault``), after the trials.csv that can still be written and
with no temporary file left; the worker processes die with this one
(``worker.die_with_parent``).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tunekit import backends as backend_registry
from tunekit.errors import UserError
from tunekit.problems.shapes import Problem
from tunekit.search import fleet
from tunekit.search.common import Run, SearchConfig, SearchOutcome, StudyStats, WorkerContext, study_name
from tunekit.search.finals import final_phase, final_rows, peer_asked
from tunekit.search.fusion_phase import fusion_phase
from tunekit.search.liveness import HEARTBEAT_S, STALE_AFTER_S, Liveness
from tunekit.search.progress import Progress
from tunekit.search.stops import POLL_S, STOPS
from tunekit.search.storage import fault as storage_fault
from tunekit.search.storage import open_storage, storage_url, stored_trials
from tunekit.search.studies import SAMPLERS, read_seed_records, seed_paths
from tunekit.search.trials import trial_phase
from tunekit.search.worker import Worker

# The entry point's API (tunekit.cli imports these from here); the names live in the duty modules.
__all__ = ["SearchConfig", "SearchOutcome", "StudyStats", "open_storage", "read_seed_records", "run_search"]


def run_search(cfg: SearchConfig, progress: bool | str = True, log: Callable[[str], None] = print) -> SearchOutcome:
    """Run (or resume) the search described by ``cfg``; see the module docstring.

    Holds the run folder's lock throughout. When the run stops early (Ctrl-C,
    an error), the trials in flight are recorded as interrupted and trials.csv
    is written from the storage before the exception goes on. ``progress``: True or "bars" (progress
    bars), "lines" (``progress:`` lines, for a pipe or a file), False (none); see
    :mod:`~tunekit.search.progress`. Ctrl-C, SIGTERM and SIGHUP (where Python handles them) are only
    recorded while it runs and raised where it checks (:mod:`~tunekit.search.stops`).
    """
    with STOPS.recorded():
        return _run_search(cfg, progress, log)


def _run_search(cfg: SearchConfig, progress: bool | str, log: Callable[[str], None]) -> SearchOutcome:
    from tunekit.search import results

    if cfg.sampler not in SAMPLERS:
        raise UserError(f"unknown sampler {cfg.sampler!r} (choose from {', '.join(SAMPLERS)})")
    if cfg.trials < 1:
        raise UserError("--trials must be at least 1")
    cfg.stop.check()
    if not (math.isfinite(cfg.min_gain) and cfg.min_gain >= 0):
        raise UserError(f"--min-gain must be a number >= 0 (got {cfg.min_gain}); 0.01 asks a 1% gain")
    slots = fleet.parse_gpus(cfg.gpus, fleet.visible_gpu_count(), os.environ.get("TRITON_INTERPRET") == "1")
    fleet.heartbeat_settings(HEARTBEAT_S, STALE_AFTER_S)  # a bad setting fails before anything starts
    STOPS.check()
    results.make_run_dir(cfg.out_dir)
    url = storage_url(cfg.out_dir, cfg.storage)
    with results.RunLock(cfg.out_dir, cfg.command):
        # the folder's problem set, checked under its lock and before the storage opens: another
        # command's set is refused (unless --add), touching nothing
        cfg.problems = results.folder_problems(cfg.out_dir, cfg.problems, cfg.add)
        STOPS.check()
        storage = open_storage(url)
        outcome = SearchOutcome(run_dir=cfg.out_dir)
        run = Run(cfg=cfg, storage=storage, url=url, outcome=outcome, started=time.monotonic())
        try:
            STOPS.check()
            results.check_trials_kept(cfg.out_dir, stored_trials(storage), url)
            return _run_locked(run, slots, progress, log)
        except BaseException as exc:
            run.stop.set()
            lost = storage_fault(exc, url, cfg.out_dir)
            for ctx in run.contexts:
                try:
                    ctx.live.fail_current(f"interrupted (the search process stopped: {type(exc).__name__})")
                except Exception:  # noqa: BLE001 - a lost storage: the next run fails the trial (its owner is gone)
                    pass
            if outcome.device and outcome.trials_path is None:
                try:  # the finished trials are in the storage; the csv too, where that still works
                    results.write_trials(cfg.out_dir, storage, cfg, outcome.device, outcome.probe)
                except Exception:  # noqa: BLE001 - the stop's own exception is the one to report
                    pass
            results.remove_temp_files(cfg.out_dir)  # a write the fault cut short (a full disk's 0-byte file)
            if lost is not None:
                raise lost from None  # one line: the cause, the fix, the trials kept, rerun to resume
            raise
        finally:
            for ctx in run.contexts:
                ctx.live.close()


def _run_locked(run: Run, slots: Sequence[fleet.Slot], progress: bool | str,
                log: Callable[[str], None]) -> SearchOutcome:
    from tunekit import table as table_mod
    from tunekit.search import results

    cfg, outcome = run.cfg, run.outcome
    out_dir = cfg.out_dir
    host, pid = fleet.host_name(), os.getpid()
    try:
        for index, slot in enumerate(slots):
            worker = Worker(env=slot.env)
            live = Liveness(run.storage, f"{host}:{pid}:{slot.label}")
            run.contexts.append(WorkerContext(index, slot, worker, live))
            STOPS.check()
        for ctx in run.contexts:
            reply = ctx.worker.call({"kind": "device"})
            if reply["status"] != "ok":
                raise UserError(f"the worker ({ctx.slot.label}) could not start: {reply.get('error')}")
            ctx.device = reply["device"]
        device = run.contexts[0].device
        outcome.device = device
        if any(str(p) == "auto" for p in cfg.seed_from):
            given = set(cfg.seed_from)
            cfg.seed_from = tuple(seed_paths(cfg.seed_from, device))
            found = [str(p) for p in cfg.seed_from if p not in given]
            log(f"seeds: the shipped tables measured on {device['name']}: {', '.join(found) or 'none'} "
                "(tunekit tables; --seed-from none: a fresh search)")
        run.usable = _usable_backends(cfg.backends, device)
        run.stamp, run.stamp_text = fleet.device_stamp(table_mod.environment_stamp(device, run.usable))
        for ctx in run.contexts[1:]:
            stamp, text = fleet.device_stamp(table_mod.environment_stamp(ctx.device, run.usable))
            if stamp != run.stamp:
                first = run.contexts[0].slot.label
                raise UserError(f"--gpus: {ctx.slot.label} is {text}, {first} is {run.stamp_text}: "
                                "one device model per table; run one search per model")
        for ctx in run.contexts:
            ctx.live.stamp = run.stamp
        log(f"device: {device['name']} ({device['arch']}, {device['cu_count']} CUs, "
            f"wave {device['wave_size']}, L2 {device['l2_bytes'] >> 20} MiB); backends: {', '.join(run.usable)}"
            + (f"; {len(slots)} workers ({', '.join(s.label for s in slots)})" if len(slots) > 1 else ""))
        reply = run.contexts[0].worker.call({"kind": "probe"}, timeout=600)
        if reply["status"] != "ok":
            raise UserError(f"bandwidth probe failed: {reply.get('error')}")
        probe = reply["probe"]
        outcome.probe = probe
        if probe["kind"] == "cpu":
            log("timing: CPU interpreter (TRITON_INTERPRET=1): times and GB/s here show that the pipeline "
                "works; they are not bandwidth evidence (no read-bandwidth limit is measured on a CPU)")
        else:
            log(f"read-bandwidth limit: {probe['read_gbps']:.0f} GB/s (copy {probe['copy_gbps']:.0f} GB/s, "
                f"{probe['kind']} timing)")
        STOPS.check()
        results.write_run_json(out_dir, cfg, run.url, device, probe, run.usable)
        _log_unavailable_peers(cfg.problems, device, log, cfg.peers)
        STOPS.check()

        studies = sum(len(run.backends_for(p)) for p in cfg.problems)
        run.bar = Progress(progress, log, studies=studies, trials=cfg.trials, workers=len(run.contexts),
                           cpu=probe["kind"] == "cpu")
        run.bar.plan(len(cfg.problems), len(run.usable))
        setup_s = time.monotonic() - run.started
        try:
            if len(run.contexts) == 1:
                _worker_main(run, run.contexts[0])  # in this thread: Ctrl-C stays deferred around each ask
            else:
                _run_threads(run)
            STOPS.check()
            t0 = time.monotonic()
            outcome.fusions = fusion_phase(run, run.contexts[0])  # every final is in: the entries are known
            fusion_s = time.monotonic() - t0
        finally:
            run.bar.stop()
    finally:
        for ctx in run.contexts:
            ctx.worker.close()

    # the files: a stop between two of them is raised before the next (trials.csv is then written on the
    # way out if it was not yet); one after the last, by run_search's end
    STOPS.check()
    outcome.final_rows.extend(final_rows(run))
    outcome.stats = _merged_stats(outcome.stats)
    names = [study_name(device["arch"], p, b, cfg.numerics) for p in cfg.problems for b in run.backends_for(p)]
    outcome.participants = fleet.participants(run.storage, names) | {
        "here": {"host": fleet.host_name(), "workers": [ctx.slot.label for ctx in run.contexts]}}
    part = outcome.participants
    log(f"workers: {len(run.contexts)} here ({', '.join(ctx.slot.label for ctx in run.contexts)}); "
        f"the storage's trials of these studies were measured by {part['workers']} worker(s) on "
        f"{part['gpus']} GPU(s) of {part['hosts']} host(s)")
    STOPS.check()
    results.write_run_json(out_dir, cfg, run.url, device, probe, run.usable, participants=outcome.participants)
    STOPS.check()
    outcome.trials_path = results.write_trials(out_dir, run.storage, cfg, device, probe)
    STOPS.check()
    if outcome.trials_path.name != "trials.csv":
        log(f"warning: {out_dir / 'trials.csv'} lists more trials than this storage holds for {device['arch']}; "
            f"kept as it is, this run's trials are in {outcome.trials_path}")
    results.write_final(out_dir, outcome.final_rows)
    STOPS.check()
    table = table_mod.build_table(outcome.final_rows, device, probe, cfg.min_gain, run.usable, tp=cfg.tp,
                                  fusions=outcome.fusions)
    outcome.table_path = table_mod.save(table, out_dir / "table.json")
    results.write_time(out_dir, {
        "started": run.started_at, "wall_s": time.monotonic() - run.started, "setup_s": setup_s, "fusion_s": fusion_s,
        "workers": [{"label": ctx.slot.label, **ctx.phase_s, "final_split": ctx.final_split}
                    for ctx in run.contexts]})
    return outcome


def _run_threads(run: Run) -> None:
    """One thread per worker (each drives its own device process); the first error stops all."""

    def main(ctx: WorkerContext) -> None:
        try:
            _worker_main(run, ctx)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            with run.lock:
                run.errors.append(exc)
            run.stop.set()

    threads = [threading.Thread(target=main, args=(ctx,), name=f"tunekit-{ctx.slot.label}", daemon=True)
               for ctx in run.contexts]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                STOPS.check()  # Python runs signal handlers in this thread: the stop is raised here
                thread.join(timeout=POLL_S)
    except BaseException:
        run.stop.set()
        for ctx in run.contexts:  # a trial in flight returns at once (its worker is gone)
            ctx.worker.close()
        for thread in threads:
            thread.join(timeout=30)
        raise
    if run.errors:
        raise run.errors[0]


def _worker_main(run: Run, ctx: WorkerContext) -> None:
    """Trials of every study that still needs some, then the final re-measures no one has claimed."""
    studies = [(problem, backend) for problem in run.cfg.problems for backend in run.backends_for(problem)]
    t0 = time.monotonic()
    trial_phase(run, ctx, _rotated(studies, ctx.index, len(run.contexts)))
    ctx.phase_s["trials"] = time.monotonic() - t0
    if not run.stop.is_set():
        t0 = time.monotonic()
        final_phase(run, ctx, _rotated(list(run.cfg.problems), ctx.index, len(run.contexts)))
        ctx.phase_s["finals"] = time.monotonic() - t0


def _rotated(items: list, index: int, count: int) -> list:
    """Workers start at different places of the queue, so they rarely meet in one study."""
    shift = index * len(items) // max(count, 1)
    return items[shift:] + items[:shift]


def _merged_stats(stats: list[StudyStats]) -> list[StudyStats]:
    """One row per study: the counts of every worker of this process that ran trials in it."""
    merged: dict[tuple, StudyStats] = {}
    for s in stats:
        key = (s.problem.key, s.backend)
        if key not in merged:
            merged[key] = s
            continue
        m = merged[key]
        m.measured_before = min(m.measured_before, s.measured_before)
        for name in ("measured_now", "ok", "failed", "invalid", "duplicates"):
            setattr(m, name, getattr(m, name) + getattr(s, name))
        bests = [b for b in (m.best_us, s.best_us) if b is not None]
        m.best_us = min(bests) if bests else None
        m.stopped = m.stopped or s.stopped
    return list(merged.values())


def _usable_backends(requested: Sequence[str], device: dict[str, Any]) -> list[str]:
    from tunekit.measure.device import DeviceInfo

    info = DeviceInfo(**device)
    usable = []
    for name in requested:
        try:
            backend = backend_registry.get(name)
        except (KeyError, ImportError, AttributeError) as exc:
            raise UserError(f"backend {name!r}: {exc}") from None
        reason = backend.unavailable_reason(info)
        if reason:
            raise UserError(f"backend {name!r} cannot run here: {reason}")
        usable.append(name)
    return usable


def _log_unavailable_peers(problems: Sequence[Problem], device: dict[str, Any], log: Callable[[str], None],
                           asked: Sequence[str] | None = None) -> None:
    """One line at the start per baseline besides vendor that cannot run here for any of the problems (each
    problem's re-measure records the same reason: ``finals.peer_arms``), and one for the peers not asked."""
    from tunekit.measure.device import DeviceInfo

    info = DeviceInfo(**device)
    left = [name for name in backend_registry.PEERS if not peer_asked(name, asked)]
    if left:
        log(f"peers not timed ({', '.join(left)}): --peers all times them beside the winners")
    for name in backend_registry.BASELINES:
        if name == "vendor" or not peer_asked(name, asked):
            continue
        backend = backend_registry.get(name)
        if not any(p.op in backend.ops for p in problems):
            continue
        reason = backend.unavailable_reason(info)
        if reason:
            log(f"{name} baseline: not measured ({reason})")
