"""A campaign folder's state: ``DIR/campaign.json``, its lock, and where a step ran (commit, GPU).

``campaign.json`` (format ``tunekit.campaign/1``) holds the plan's name, path and hash, one record per
call of the runner (``calls``: start, end, budget, commit, GPU, host, how it ended) and one record per
step (``steps``, in the plan's order): ``state`` (one of :data:`STATES`), ``exit_code``, ``wall_s`` (its
last attempt), ``total_wall_s``, ``attempts``, ``command``, ``commit``, ``gpu``, ``started``, ``ended``,
``out`` / ``log`` (relative to DIR), ``note``. The file is replaced atomically at every change, so a
runner killed at any point leaves the last consistent state; a step it left ``running`` is read back as
``stopped``.

Call protocol: hold :class:`CampaignLock` on DIR, :func:`load` (or start) the state for a plan, change the
records, :func:`save` after each change.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

from tunekit.errors import UserError
from tunekit.evidence.campaign.plan import Plan

FORMAT = "tunekit.campaign/1"
STATE_FILE = "campaign.json"
LOCK_FILE = ".campaign.lock"
NOT_STARTED, RUNNING, DONE, FAILED, STOPPED = "not started", "running", "done", "failed", "stopped"
#: ``stopped``: cut short on purpose (budget, signal, a verb's own early stop, exit status 3): a rerun resumes it.
STATES = (NOT_STARTED, RUNNING, DONE, FAILED, STOPPED)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _fresh_step(step: Any, note: str = "") -> dict[str, Any]:
    return {"name": step.name, "verb": step.verb, "spec": step.spec_hash(), "state": NOT_STARTED,
            "estimate_s": step.estimate_s, "out": step.out, "log": f"logs/{step.name}.log", "exit_code": None,
            "wall_s": None, "total_wall_s": 0.0, "attempts": 0, "command": None, "commit": None, "gpu": None,
            "started": None, "ended": None, "note": note}


def load(out_dir: Path, plan: Plan) -> dict[str, Any]:
    """The folder's state matched to the plan: a step keeps its record while its definition is unchanged."""
    path = Path(out_dir) / STATE_FILE
    old: dict[str, Any] = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"{path}: not a readable campaign state ({exc}); move it away to start again") from None
        if not isinstance(old, dict) or old.get("format") != FORMAT:
            raise UserError(f"{path}: not a {FORMAT} file")
        if old.get("name") != plan.name:
            raise UserError(f"{out_dir} holds campaign {old.get('name')!r}, not {plan.name!r}: give another --out")
    recorded = {s["name"]: s for s in old.get("steps", [])}
    steps = []
    for step in plan.steps:
        rec = recorded.get(step.name)
        if rec is None:
            steps.append(_fresh_step(step))
        elif rec.get("spec") != step.spec_hash():
            steps.append(_fresh_step(step, f"the plan's definition changed since it was {rec.get('state')}"))
        else:
            rec = dict(rec, estimate_s=step.estimate_s, out=step.out)
            if rec["state"] == RUNNING:
                rec.update(state=STOPPED, note="the runner ended while it ran (killed?); a rerun resumes it")
            steps.append(rec)
    return {"format": FORMAT, "name": plan.name, "plan": {"path": str(plan.path), "sha256": plan.sha256},
            "out_dir": str(Path(out_dir).resolve()), "calls": old.get("calls", []), "steps": steps}


def save(out_dir: Path, state: dict[str, Any]) -> None:
    """Write ``campaign.json`` atomically (a reader or a kill never sees half a file)."""
    path = Path(out_dir) / STATE_FILE
    tmp = path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def first_unfinished(state: dict[str, Any]) -> int | None:
    """Index of the first step not done, or None when every step is done."""
    return next((i for i, s in enumerate(state["steps"]) if s["state"] != DONE), None)


class CampaignLock:
    """``fcntl.flock`` on ``DIR/.campaign.lock``: one runner per campaign folder (dropped however it dies)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> CampaignLock:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{self.path.parent} is in use by another campaign runner ({holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def git_commit(root: Path) -> str | None:
    """HEAD of the checkout at ``root`` (``+dirty`` where tracked files differ), or None if it is not its own
    git checkout (an exported copy inside another repository must not report that one's HEAD)."""
    try:
        res = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        lines = res.stdout.split()
        if res.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != Path(root).resolve():
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return lines[1] + ("+dirty" if status.returncode != 0 or status.stdout.strip() else "")


def gpu_description() -> str:
    """The GPUs this machine shows (nvidia-smi, else rocm-smi), without importing torch; ``none`` if neither."""
    queries = (["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
               ["rocm-smi", "--showproductname", "--csv"])
    for cmd in queries:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        lines = [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]
        if res.returncode != 0 or not lines:
            continue
        if cmd[0] == "rocm-smi":
            lines = [ln for ln in lines[1:] if not ln.lower().startswith("device")] or lines[1:]
        names = sorted(set(lines))
        return "; ".join(f"{n} (x{lines.count(n)})" if lines.count(n) > 1 else n for n in names)
    return "none (no nvidia-smi or rocm-smi answered)"
