"""``DIR/README.md`` of a campaign folder, from its plan and its recorded state: what ran, at which commit,
on which GPU, and where each step's raw output lies. Rewritten after every change of state."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from tunekit.evidence.campaign.plan import Plan
from tunekit.evidence.campaign.state import DONE


def _short(commit: str | None) -> str:
    if not commit:
        return "-"
    sha, plus, rest = commit.partition("+")
    return sha[:10] + plus + rest


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


def _command(argv: list[str] | None, out_dir: Path) -> str:
    """The command as one would type it from the repository root, the campaign folder shown as DIR."""
    if not argv:
        return ""
    words = list(argv)
    if len(words) > 2 and words[1:3] == ["-m", "tunekit"]:
        words = ["tunekit", *words[3:]]
    elif words[0].endswith("python") or "python3" in Path(words[0]).name:
        words = ["python", *words[1:]]
    text = shlex.join(words)
    return text.replace(str(out_dir), "DIR")


def render(plan: Plan, state: dict[str, Any]) -> str:
    """The README's Markdown."""
    out_dir = Path(state["out_dir"])
    lines = [f"# Campaign `{plan.name}`", ""]
    if plan.about:
        lines += [plan.about, ""]
    done = sum(s["state"] == DONE for s in state["steps"])
    lines += [f"Plan: `{plan.path}` (sha256 {plan.sha256[:12]}; copied to `plan.toml`). {done} of "
              f"{len(state['steps'])} steps done. Written by `tunekit campaign`; every step's state is in "
              "`campaign.json`, its output (stdout and stderr) in `logs/STEP.log`, its files in its folder.", ""]
    commits = sorted({s["commit"] for s in state["steps"] if s.get("commit")})
    gpus = sorted({s["gpu"] for s in state["steps"] if s.get("gpu")})
    if commits:
        lines.append("Commit" + ("s" if len(commits) > 1 else "") + ": " + ", ".join(f"`{c}`" for c in commits))
    if gpus:
        lines.append("GPU: " + "; ".join(gpus))
    if commits or gpus:
        lines.append("")
    lines += ["## Steps", "", "| # | step | verb | state | exit | wall (last / all) | estimate | commit | output |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, rec in enumerate(state["steps"], 1):
        exit_code = "-" if rec.get("exit_code") is None else str(rec["exit_code"])
        wall = f"{_seconds(rec.get('wall_s'))} / {_seconds(rec.get('total_wall_s') or None)}"
        folder = f"[`{rec['out']}/`]({rec['out']}/), " if (out_dir / rec["out"]).is_dir() else ""
        lines.append(f"| {i} | {rec['name']} | {rec['verb']} | {rec['state']} | {exit_code} | {wall} | "
                     f"{_seconds(rec.get('estimate_s'))} | {_short(rec.get('commit'))} | {folder}[log]({rec['log']}) |")
    lines.append("")
    for i, (step, rec) in enumerate(zip(plan.steps, state["steps"], strict=True), 1):
        lines += [f"### {i}. {step.name}", ""]
        if step.about:
            lines += [step.about, ""]
        facts = [f"state **{rec['state']}**"]
        if rec.get("attempts"):
            facts.append(f"{rec['attempts']} attempt(s), last {rec.get('started') or '?'} to {rec.get('ended') or '?'}")
        if rec.get("gpu"):
            facts.append(f"GPU {rec['gpu']}")
        if rec.get("commit"):
            facts.append(f"commit `{rec['commit']}`")
        lines.append("; ".join(facts) + ".")
        if rec.get("note"):
            lines += ["", rec["note"]]
        if rec.get("command"):
            lines += ["", "```", _command(rec["command"], out_dir), "```"]
        lines.append("")
    if state.get("calls"):
        lines += ["## Runner calls", "", "| # | started | ended | budget | commit | GPU | host | result |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for i, call in enumerate(state["calls"], 1):
            budget = "-" if call.get("budget_s") is None else f"{call['budget_s']:.0f} s"
            lines.append(f"| {i} | {call.get('started', '-')} | {call.get('ended') or '-'} | {budget} | "
                         f"{_short(call.get('commit'))} | {call.get('gpu', '-')} | {call.get('host', '-')} | "
                         f"{call.get('result') or 'running'} |")
        lines.append("")
    return "\n".join(lines)


def write(out_dir: Path, plan: Plan, state: dict[str, Any]) -> Path:
    path = Path(out_dir) / "README.md"
    tmp = path.with_name(".README.md.tmp")
    tmp.write_text(render(plan, state))
    tmp.replace(path)
    return path
