"""Candidates are compiled, verified and timed in a worker process.

A kernel that crashes the process (illegal address, abort in a compiler),
hangs, or exhausts a resource must not take the search down: the parent
records the trial as failed with the error text and starts a fresh worker.

Call protocol (parent side)::

    with Worker(device_index=0) as worker:
        reply = worker.call({"kind": "trial", ...}, timeout=120)
        # reply["status"] in {"ok", "fail", "crash", "timeout"}

Task kinds handled in the child: ``device`` (describe the device), ``probe``
(bandwidth limit), ``trial`` (build + verify + time one candidate),
``final`` (interleaved re-measure of several verified candidates + vendor), ``sequences`` (the fusion
phase's fused and unfused sequences timed interleaved: :mod:`~tunekit.search.sequences`).

A worker never outlives the search that started it, however the search dies
(``kill -9`` included): on Linux the kernel kills it when its parent goes
(``PR_SET_PDEATHSIG``), and everywhere a watchdog thread in the child exits
as soon as the child is re-parented. The signals that stop a search (SIGINT,
SIGTERM, SIGHUP; a terminal or a scheduler sends them to the whole process
group) are the parent's to handle: the child ignores them.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing import resource_tracker
from typing import Any

from tunekit.search import stops

#: Hard cap for one reply; a first Triton compile takes a few seconds, a big
#: problem's verification (fp64 reference of a 2.5 GB weight) well under one.
DEFAULT_TIMEOUT_S = 180.0

#: Signals the search handles (it stops, keeps the trials and closes its workers); its worker ignores them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds between the child's looks at its parent (the watchdog, where the kernel's death signal is missing).
_PARENT_POLL_S = 0.5


class Worker:
    """A child process that evaluates tasks; restarted after a crash or hang."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._ctx = mp.get_context("spawn")
        # Candidates are timed without programmatic dependent launch unless the user asks for it
        # (TUNEKIT_PDL=1, kernels_triton.pdl): the standalone bench replays one kernel back to back, where
        # PDL overlaps every launch with the one before (0.96 us of a 4 us GEMV on an H100), a gain a
        # served step keeps only between two PDL kernels. Said here so that it holds whatever the default.
        self._env = {"TUNEKIT_PDL": os.environ.get("TUNEKIT_PDL", "0"), **(env or {})}
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None
        self.restarts = 0

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_child_main, args=(child, self._env, os.getpid()), daemon=True)
        # Ctrl-C and a closed terminal reach the whole process group: the parent decides (it stops the
        # search, keeps the trials and closes the worker), so the worker must not die on them with a
        # traceback of its own. The stop signals are blocked in this thread while the child starts: the
        # child inherits the mask through the spawn's fork and exec and unblocks them only once it ignores
        # them (_child_main), which covers its start-up; this process still gets them (another of its
        # threads, or this one once the mask is back), so none is lost. The resource tracker starts first:
        # its own start unblocks SIGINT and SIGTERM.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self._proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child.close()
        self._conn = parent

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._proc = None
        self._conn = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive() and self._conn is not None:
            try:
                self._conn.send(None)  # polite shutdown
                self._proc.join(timeout=5)
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    def call(self, task: dict[str, Any], timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
        """Run ``task`` in the child; a dead or stuck child becomes a failed reply."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        assert self._conn is not None and self._proc is not None
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        try:
            self._conn.send(task)
            # in slices: a stop signal recorded meanwhile is raised here within stops.POLL_S (the child,
            # busy with the task, is closed by the search on its way out)
            while not self._conn.poll(max(0.0, min(deadline - time.monotonic(), stops.POLL_S))):
                stops.STOPS.check()
                if time.monotonic() >= deadline:
                    break
            else:  # a reply came
                reply = self._conn.recv()
                reply["wall_s"] = time.perf_counter() - t0  # the call's whole time, as this side waited it
                return reply
            reply = {"status": "timeout", "error": f"no reply within {timeout:.0f} s (hang?); worker restarted"}
        except (EOFError, OSError, BrokenPipeError):
            self._proc.join(timeout=10)
            code = self._proc.exitcode
            reply = {"status": "crash", "error": f"worker process died (exit code {code}); worker restarted"}
        reply["wall_s"] = time.perf_counter() - t0
        self._kill()
        self.restarts += 1
        return reply


def _child_main(conn, env: dict[str, str], parent_pid: int | None = None) -> None:
    for signum in STOP_SIGNALS:  # the parent handles them (see Worker._start and the module docstring)
        signal.signal(signum, signal.SIG_IGN)  # also drops one that arrived while they were blocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if parent_pid is not None:
        die_with_parent(parent_pid)
    os.environ.update(env)
    state = _ChildState()
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:
            return
        try:
            reply = state.handle(task)
        except Exception as exc:  # a candidate's error is data, not a worker failure
            reply = {"status": "fail", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        try:
            conn.send(reply)
        except OSError:  # BrokenPipeError: the parent died while this trial ran; nothing to report to
            os._exit(0)


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (its parent) dies, however it dies.

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, the kernel's signal at the parent's
    death (strictly: the death of the parent's thread that started this process; the
    search closes every worker before such a thread ends). Everywhere, and as a
    backstop: a daemon thread that exits the process once it is re-parented. A parent
    already gone when this runs is caught by the first look.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # no libc prctl: the watchdog alone
            pass
    if os.getppid() != parent_pid:
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)  # no cleanup to run: the parent recorded (or will fail) the trial in flight

    threading.Thread(target=watch, name="tunekit-parent-watchdog", daemon=True).start()


class _ChildState:
    """Lives in the worker: keeps the device, rotation buffers and built kernels."""

    def __init__(self) -> None:
        from tunekit.measure import device as device_mod

        self.device = device_mod.detect()
        self._rotation_key: str | None = None
        self._rotation = None
        self._kernels: dict[str, Any] = {}

    def handle(self, task: dict[str, Any]) -> dict[str, Any]:
        kind = task["kind"]
        if kind == "device":
            return {"status": "ok", "device": self.device.as_dict()}
        if kind == "probe":
            from tunekit.measure.bench import probe_bandwidth

            return {"status": "ok", "probe": probe_bandwidth(self.device).as_dict()}
        if kind == "trial":
            return self._trial(task)
        if kind == "final":
            return self._final(task)
        if kind == "sequences":
            from tunekit.search.sequences import measure

            return measure(self, task)
        raise ValueError(f"unknown task kind {kind!r}")

    # -- helpers -----------------------------------------------------------
    def _problem(self, task):
        from tunekit.problems.shapes import Problem

        p = task["problem"]
        return Problem(p["op"], p["dtype"], p["m"], p["n"], p["k"], p.get("count", 1))

    def _rotation_for(self, problem):
        from tunekit.measure.bench import Rotation
        from tunekit.problems import opspec

        if self._rotation_key != problem.key:
            # one problem's buffers at a time: lm_head copies are GBs
            self._rotation = None
            self._kernels.clear()
            self._sync_free()
            self._rotation = Rotation(opspec.get(problem.op), problem, self.device)
            self._rotation_key = problem.key
        return self._rotation

    def forget_problem(self) -> None:
        """Drop the current problem's rotation and kernels (a task that needs the memory for others)."""
        self._rotation, self._rotation_key = None, None
        self._kernels.clear()
        self._sync_free()

    def _sync_free(self) -> None:
        from tunekit.measure.bench import release_memory

        if self.device.is_gpu:
            release_memory()  # and wait while the driver clears it: a timing next would share the memory system

    def _build(self, backend_name: str, problem, params: dict):
        import json

        from tunekit import backends

        key = f"{backend_name}|{json.dumps(params, sort_keys=True)}"
        if key not in self._kernels:
            backend = backends.get(backend_name)
            self._kernels[key] = backend.build(problem, params, self.device)
        return self._kernels[key]

    def _trial(self, task: dict[str, Any]) -> dict[str, Any]:
        import torch

        from tunekit import backends
        from tunekit.backends.base import BuildError
        from tunekit.measure import verify
        from tunekit.measure.bench import time_kernel
        from tunekit.problems import opspec

        problem = self._problem(task)
        spec = opspec.get(problem.op)
        rotation = self._rotation_for(problem)
        tdev = torch.device(self.device.torch_device)
        record: dict[str, Any] = {"status": "fail"}
        t0 = time.perf_counter()
        try:
            kernel = self._build(task["backend"], problem, task["params"])
            # The first call compiles (Triton JITs at first launch).
            kernel(rotation.inputs[0], rotation.outputs[0])
            if self.device.is_gpu:
                torch.cuda.synchronize()
        except BuildError as exc:
            record.update(error=f"build failed: {exc}", build_log=exc.log[-4000:])
            return record
        # build + first launch: covers Triton's JIT (at first launch) and run-time compiled HIP alike
        record["compile_s"] = time.perf_counter() - t0
        if getattr(kernel, "compile_s", None) is not None:
            record["rtc_compile_s"] = kernel.compile_s
            record["rtc_cache_hit"] = bool(getattr(kernel, "cache_hit", False))

        reference_kernel = None
        if task.get("numerics") == "exact":
            backend = backends.get(task["backend"])
            space = backend.space(problem)
            # the fixed values (numerics choices such as VLLM_ROUNDING) belong to the reference too
            reference_kernel = self._build(task["backend"], problem, dict(space.fixed) | space.reference)
        t0 = time.perf_counter()
        result = verify.verify(
            kernel, spec, problem, tdev, seed=int(task.get("seed", 0)),
            numerics=task.get("numerics", "bounded"), reference_kernel=reference_kernel,
        )
        record.update(max_abs_err=result.max_abs_err, err_ratio=result.err_ratio,
                      verify_s=time.perf_counter() - t0)  # with the exact policy's reference build
        if not result.ok:
            record["error"] = f"verification failed: {result.reason}"
            return record
        t0 = time.perf_counter()
        timing = time_kernel(kernel, rotation)
        record.update(status="ok", error="", time_s=time.perf_counter() - t0,
                      **_timing_fields(timing, spec.bytes_moved(problem)))
        return record

    def _final(self, task: dict[str, Any]) -> dict[str, Any]:
        import torch

        from tunekit.measure import verify
        from tunekit.measure.bench import time_interleaved
        from tunekit.problems import opspec

        problem = self._problem(task)
        spec = opspec.get(problem.op)
        clock = time.perf_counter
        t0 = clock()
        rotation = self._rotation_for(problem)
        # where the re-measure's seconds go (the report's split): inputs, each candidate's build and check, timing
        spent: dict[str, Any] = {"rotation_s": clock() - t0, "build_s": {}, "verify_s": {}}
        kernels = {}
        dropped = {}
        for cand in task["candidates"]:
            t0 = clock()
            if not cand.get("optional"):
                kernels[cand["label"]] = self._build(cand["backend"], problem, cand["params"])
                spent["build_s"][cand["label"]] = clock() - t0
                continue
            # An optional baseline (Inductor, a peer) compiles at its first call: do that
            # here, so a failure drops it instead of the whole re-measure. It is verified
            # as a candidate is (a peer computing wrong results is never timed, never a bar
            # to beat): vendor is the reference's own composition, the others are not.
            stage = "build_s"
            try:
                kernel = self._build(cand["backend"], problem, cand["params"])
                kernel(rotation.inputs[0], rotation.outputs[0])
                self._sync_free()
                spent[stage][cand["label"]] = clock() - t0
                stage, t0 = "verify_s", clock()
                checked = verify.verify(kernel, spec, problem, torch.device(self.device.torch_device),
                                        seed=int(task.get("seed", 0)), numerics="bounded")
            except Exception as exc:  # noqa: BLE001 - any compile error: record it, go on
                dropped[cand["label"]] = f"{type(exc).__name__}: {str(exc)[:500]}"
                spent[stage][cand["label"]] = clock() - t0
                continue
            spent["verify_s"][cand["label"]] = clock() - t0
            if not checked.ok:
                dropped[cand["label"]] = f"verification failed: {checked.reason}"
                continue
            kernels[cand["label"]] = kernel
        t0 = clock()
        timings = time_interleaved(kernels, rotation, repeats=task.get("repeats"))
        spent["time_s"] = clock() - t0
        nbytes = spec.bytes_moved(problem)
        return {
            "status": "ok",
            "timings": {label: _timing_fields(t, nbytes) for label, t in timings.items()},
            "dropped": dropped,
            "spent": spent,
        }


def _timing_fields(timing, nbytes: int) -> dict[str, Any]:
    return {
        "time_us": timing.median_us,
        "time_min_us": timing.min_us,
        "time_p25_us": timing.p25_us,
        "time_p75_us": timing.p75_us,
        "spread": timing.spread,
        "repeats": timing.repeats,
        "launches": timing.launches,
        "copies": timing.copies,
        "timing_kind": timing.kind,
        "gbps": nbytes / (timing.median_us * 1e-6) / 1e9 if timing.median_us > 0 else 0.0,
    }
