"""Run a campaign plan's steps in order, as subprocesses, inside a device-time budget; a rerun resumes.

Each step runs as its own process (``python -m tunekit VERB ...`` or the plan's script) from the
repository root, in a session of its own, its stdout and stderr written to ``DIR/logs/STEP.log`` and
echoed. Before a step starts, the budget left must cover its ``min_s`` (by default its whole
estimate), else the runner stops there and says so. A running step is stopped (SIGINT to its process
group, which tunekit's verbs answer by storing what they finished; SIGTERM after ``grace_s``; SIGKILL
10 s later) when the budget ends or when the runner gets SIGINT or SIGTERM. Every change of state is
written to ``campaign.json`` and ``README.md`` at once; ``--pack FILE.tgz`` packs the folder after
every step (a device call returns what is under its ``$OUT``, also when its limit cuts it short).

Exit codes of :func:`run_campaign`'s :class:`Outcome`: 0 every step done; 1 a step failed; 3 stopped
before a step that did not fit, or a step stopped early by itself (a rerun resumes); 130 / 143 stopped
by SIGINT / SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tunekit.errors import UserError
from tunekit.evidence.campaign import readme
from tunekit.evidence.campaign import state as state_mod
from tunekit.evidence.campaign.plan import SCRIPT, Plan, Rendered, repo_root, resolve
from tunekit.evidence.campaign.state import DONE, FAILED, RUNNING, STOPPED

Log = Callable[[str], None]
#: Exit status with which a step says it stopped early on purpose and a rerun resumes it (serve-bench).
EARLY_STOP = 3


def _print(text: str) -> None:
    # flushed: the steps' output goes to the same stdout unbuffered, and the order must hold in a log
    print(text, flush=True)


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    message: str


class _Signals:
    """SIGINT and SIGTERM counted instead of raised while steps run (main thread only); restored on exit."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def name(self) -> str:
        return signal.Signals(self.received[0]).name if self.received else ""


def _check_paths(out_dir: Path, pack: Path | None) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out {out_dir}: exists and is not a folder")
    if pack is not None:
        pack = pack.resolve()
        if pack == out_dir or out_dir in pack.parents:
            raise UserError(f"--pack {pack}: inside the campaign folder it packs; put it elsewhere")
        if pack.is_dir():
            raise UserError(f"--pack {pack}: is a folder; give a file name (.tgz)")


def _command_line(r: Rendered, left_s: float | None) -> list[str]:
    """The step's command with the runner's own options: ``--out`` its folder, ``--stop-after`` the budget left."""
    argv = list(r.argv)
    if r.takes_out:
        argv += ["--out", str(r.step_dir)]
    if r.takes_stop_after and left_s is not None:
        argv += ["--stop-after", f"{max(left_s, 1.0):.0f}"]
    return argv


def _environment(r: Rendered) -> dict[str, str]:
    env = dict(os.environ)
    env.update(r.env)
    # the steps run this tunekit: the repository root importable by a script step too
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(repo_root()) not in parts:
        parts.append(str(repo_root()))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _copy_output(source: BinaryIO, log_file: BinaryIO, echo: bool) -> None:
    """The step's output into its log, and echoed (the runner's stdout is what a device call shows)."""
    with log_file:
        while chunk := source.read1(65536) if hasattr(source, "read1") else source.read(65536):
            log_file.write(chunk)
            log_file.flush()
            if echo:
                with contextlib.suppress(OSError, ValueError):
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()


def _stop(proc: subprocess.Popen, grace_s: float, signals: _Signals) -> None:
    """SIGINT to the step's process group; SIGTERM after ``grace_s`` (or at a second signal); SIGKILL 10 s later."""
    seen = len(signals.received)
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        end = time.monotonic() + wait_s
        while time.monotonic() < end and proc.poll() is None and len(signals.received) <= seen + 1:
            time.sleep(0.1)
        if proc.poll() is not None:
            return
        seen = len(signals.received)


def _run_step(r: Rendered, rec: dict[str, Any], out_dir: Path, deadline: float | None, signals: _Signals,
              save: Callable[[], None], log: Log, grace_s: float, echo: bool) -> str:
    """Run one step to its end; returns why it ended early ('' if it was not stopped by the runner)."""
    left = None if deadline is None else deadline - time.monotonic()
    argv = _command_line(r, left)
    if r.takes_out or r.step.verb == SCRIPT:  # a verb without --out leaves its output in its log only
        r.step_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / rec["log"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    rec.update(state=RUNNING, command=argv, started=state_mod.now(), ended=None, exit_code=None, wall_s=None,
               attempts=rec.get("attempts", 0) + 1, note="")
    save()
    log(f"campaign: step {rec['name']} ({r.step.verb}, estimate {r.step.estimate_s:.0f} s"
        + ("" if left is None else f", {left:.0f} s of budget left") + f"): {shlex.join(argv)}")
    log_file = open(log_path, "ab")  # noqa: SIM115 - closed by the copying thread at the output's end
    log_file.write(f"=== attempt {rec['attempts']}, {rec['started']}: {shlex.join(argv)}\n".encode())
    log_file.flush()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=repo_root(), env=_environment(r), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        log_file.write(f"cannot start: {exc}\n".encode())
        log_file.close()
        rec.update(state=FAILED, exit_code=None, ended=state_mod.now(), wall_s=0.0, note=f"cannot start: {exc}")
        return ""
    reader = threading.Thread(target=_copy_output, args=(proc.stdout, log_file, echo), daemon=True)
    reader.start()
    why = ""
    while proc.poll() is None:
        if signals.received:
            why = f"stopped by {signals.name}"
        elif deadline is not None and time.monotonic() >= deadline:
            why = "stopped at the end of the budget"
        if why:
            log(f"campaign: {why}: stopping step {rec['name']} (SIGINT, then SIGTERM after {grace_s:.0f} s)")
            _stop(proc, grace_s, signals)
            break
        time.sleep(0.1)
    code = proc.wait()
    reader.join(timeout=5)  # a grandchild still holding the pipe must not hold the runner
    wall = time.monotonic() - t0
    rec.update(exit_code=code, ended=state_mod.now(), wall_s=round(wall, 1),
               total_wall_s=round((rec.get("total_wall_s") or 0.0) + wall, 1))
    if why:
        rec.update(state=STOPPED, note=f"{why} after {wall:.0f} s; a rerun resumes it")
    elif code == 0:
        rec.update(state=DONE)
    elif code in (EARLY_STOP, 130):
        rec.update(state=STOPPED, note=f"stopped early by itself (exit status {code}); a rerun resumes it")
    else:
        rec.update(state=FAILED, note=f"exit status {code}: see {rec['log']}")
    return why


def _pack(out_dir: Path, pack: Path) -> None:
    """The campaign folder as one .tgz (written beside, then moved: never half an archive)."""
    pack.parent.mkdir(parents=True, exist_ok=True)
    tmp = pack.with_name(f".{pack.name}.{os.getpid()}.tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(out_dir, arcname=out_dir.name,
                filter=lambda info: None if Path(info.name).name == state_mod.LOCK_FILE else info)
    os.replace(tmp, pack)


def run_campaign(plan: Plan, out_dir: Path, *, budget_s: float | None = None, pack: Path | None = None,
                 log: Log = _print, grace_s: float = 30.0, echo: bool = True) -> Outcome:
    """Run the plan's unfinished steps in order in ``out_dir`` (created; resumed if it holds this campaign)."""
    t_start = time.monotonic()
    out_dir = Path(out_dir).resolve()
    if budget_s is not None and not budget_s > 0:
        raise UserError(f"--budget-s must be > 0 seconds (got {budget_s})")
    rendered = resolve(plan, out_dir)  # every error of the plan before anything runs
    _check_paths(out_dir, pack)
    try:
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {out_dir}: cannot create it ({exc.strerror})") from None
    deadline = None if budget_s is None else t_start + budget_s
    with state_mod.CampaignLock(out_dir), _Signals() as signals:
        state = state_mod.load(out_dir, plan)
        (out_dir / "plan.toml").write_text(plan.text)
        call = {"started": state_mod.now(), "ended": None, "budget_s": budget_s,
                "commit": state_mod.git_commit(repo_root()), "gpu": state_mod.gpu_description(),
                "host": socket.gethostname(), "result": None}
        state["calls"].append(call)

        def save() -> None:
            state_mod.save(out_dir, state)
            readme.write(out_dir, plan, state)

        save()
        outcome: Outcome | None = None
        try:
            outcome = _loop(plan, rendered, state, call, out_dir, deadline, budget_s, signals, save, pack, log,
                            grace_s, echo)
        finally:
            call.update(ended=state_mod.now(), result=outcome.message if outcome else "ended by an error")
            save()
            if pack is not None:
                _pack(out_dir, pack)
    log(f"campaign: {outcome.message}")
    return outcome


def _loop(plan: Plan, rendered: list[Rendered], state: dict[str, Any], call: dict[str, Any], out_dir: Path,
          deadline: float | None, budget_s: float | None, signals: _Signals, save: Callable[[], None],
          pack: Path | None, log: Log, grace_s: float, echo: bool) -> Outcome:
    failed: list[str] = []
    for r, rec in zip(rendered, state["steps"], strict=True):
        if rec["state"] == DONE:
            continue
        if signals.received:
            return _signalled(signals, f"before step {rec['name']}")
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < r.step.min_s:
                need = "its estimate" if r.step.min_s == r.step.estimate_s else "its min_s"
                return Outcome(3, f"stopped before step {rec['name']}: {need} {r.step.min_s:.0f} s does not fit in "
                                  f"the {max(left, 0):.0f} s left of --budget-s {budget_s:g}; rerun to resume")
        rec.update(commit=call["commit"], gpu=call["gpu"])
        why = _run_step(r, rec, out_dir, deadline, signals, save, log, grace_s, echo)
        save()
        if pack is not None:
            _pack(out_dir, pack)
        log(f"campaign: step {rec['name']}: {rec['state']} (exit {rec['exit_code']}, {rec['wall_s']} s)")
        if why.startswith("stopped by"):
            return _signalled(signals, f"during step {rec['name']} (now {STOPPED})")
        if rec["state"] == STOPPED:
            return Outcome(3, f"step {rec['name']} stopped ({rec['note']}); rerun to resume")
        if rec["state"] == FAILED:
            failed.append(rec["name"])
            if not r.step.continue_on_failure:
                return Outcome(1, f"step {rec['name']} failed ({rec['note']}); the steps after it did not run; "
                                  "a rerun starts again at the first step not done")
    if failed:
        return Outcome(1, f"every step ran; failed: {', '.join(failed)} (a rerun runs them again)")
    return Outcome(0, f"every step of {plan.name} is done; see {out_dir / 'README.md'}")


def _signalled(signals: _Signals, where: str) -> Outcome:
    code = 128 + signals.received[0]
    return Outcome(code, f"stopped by {signals.name} {where}; the state is consistent: rerun the same command to "
                         "resume")


def dry_run(plan: Plan, out_dir: Path, *, budget_s: float | None = None, log: Log = _print) -> None:
    """Print every step's state and command and the time estimate; run and write nothing."""
    out_dir = Path(out_dir).resolve()
    rendered = resolve(plan, out_dir)
    recorded = state_mod.load(out_dir, plan)["steps"] if (out_dir / state_mod.STATE_FILE).exists() else None
    left = budget_s
    todo = 0.0
    fits = True
    log(f"campaign {plan.name}: {len(rendered)} steps, folder {out_dir}")
    for i, r in enumerate(rendered):
        st = recorded[i]["state"] if recorded else state_mod.NOT_STARTED
        mark = ""
        if st != DONE:
            todo += r.step.estimate_s
            if left is not None:
                fits = fits and left >= r.step.min_s
                mark = "" if fits else " [past this call's budget]"
        log(f"  {i + 1}. {r.step.name} [{st}] estimate {r.step.estimate_s:.0f} s{mark}")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in r.env.items())
        left_then = left if st != DONE and fits else None
        log(f"     {env + ' ' if env else ''}{shlex.join(_command_line(r, left_then))}")
        if st != DONE and left is not None:
            left = max(left - r.step.estimate_s, 0.0)
    budget = "" if budget_s is None else f" (--budget-s {budget_s:g})"
    log(f"estimate of the steps not done: {todo:.0f} s ({todo / 60:.1f} min){budget}")
