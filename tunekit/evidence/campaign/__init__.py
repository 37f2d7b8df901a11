"""``tunekit campaign PLAN.toml --out DIR``: a device campaign as data, run step by step within a budget.

A plan (TOML, ``benchmarks/plans/*.toml``) lists steps, each a tunekit CLI invocation (verb + options)
or a repository script, with its output folder and its estimated device time. The runner runs the
steps in order as subprocesses, records each step's state in ``DIR/campaign.json`` (a rerun resumes at
the first step not done) and writes ``DIR/README.md`` from the plan and the states.

Modules, bottom up:

* ``verbs``: the CLI's verbs and options (read from the app ``tunekit.cli`` hands in), what a step is checked
  against;
* ``plan``: the plan format, its checks, and the commands rendered for a campaign folder;
* ``state``: ``campaign.json`` (atomic), the folder's lock, commit and GPU of a call;
* ``readme``: ``DIR/README.md``;
* ``runner``: the steps as subprocesses, the budget, signals, ``--pack``; ``--dry-run``.
"""

from __future__ import annotations

from tunekit.evidence.campaign.plan import Plan, Step, load_plan, resolve
from tunekit.evidence.campaign.runner import Outcome, dry_run, run_campaign
from tunekit.evidence.campaign.verbs import read_verbs

__all__ = ["Outcome", "Plan", "Step", "dry_run", "load_plan", "read_verbs", "resolve", "run_campaign"]
