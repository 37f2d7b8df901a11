"""``tunekit search --budget``: how much of the problem list and of each study a search spends on.

``full`` (the default) keeps every problem and ``--trials`` trials per study. ``quick`` is for a user
in a hurry (the CPU interpreter, a first look at a new model); it trims, decided on the CPU from the
problem list alone (nothing is measured to decide it):

* M = 1 only, unless ``--m`` was given: the decode batch of a single stream, every token pays it;
* per M, the problems with the largest estimated time per step, largest first, until they make
  ``QUICK_SHARE`` of that M's estimate. A call is estimated as the bytes it must move (each op's
  roofline numerator, ``opspec.bytes_moved``) plus ``LAUNCH_BYTES``, a launch's fixed cost in bytes'
  worth, times its calls per step (``Problem.count``);
* ``QUICK_TRIALS`` measured trials per study, unless ``--trials`` was given.

Call protocol::

    plan = apply_budget("quick", problems, trials=None, m_given=False)
    plan.problems, plan.trials   # what the search runs
    plan.note                    # one line saying what was trimmed (None: nothing was)

Imports torch (through ``opspec``) only when ``quick`` estimates a problem list.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from tunekit.errors import UserError
from tunekit.problems.shapes import ELEMENTWISE_OPS, Problem

BUDGETS = ("full", "quick")
#: Measured trials per (problem, backend) study of a full search (``--trials``' default).
FULL_TRIALS = 40
#: ... and of a quick one: the default config, the warm start and a few sampled configs.
QUICK_TRIALS = 8
#: Share of each M's estimated time per step that a quick search keeps.
QUICK_SHARE = 0.9
#: A launch's fixed cost in bytes read: on the H200 the 1 MB GEMV (96x5120, M=1) took 2.54 us at best,
#: about 2.3 us more than its bytes at the 4.55 TB/s read limit (benchmarks/results/
#: h200-m1248-gemv-ew-fab7a9c), i.e. ~10 MB. Without it a norm would count as the ~20 KB it moves,
#: where its launch alone costs what reading ~10 MB does.
LAUNCH_BYTES = 10_000_000


@dataclass(frozen=True)
class Budgeted:
    """What a search runs under a budget: its problems, trials per study, and the line saying what
    the budget trimmed (None when it trimmed nothing)."""

    problems: list[Problem]
    trials: int
    note: str | None = None


def estimated_cost(problem: Problem) -> int:
    """The estimate a quick budget ranks problems by: (bytes moved per call + ``LAUNCH_BYTES``) x calls
    per step."""
    from tunekit.problems import opspec  # imports torch: only when a quick budget ranks problems

    return (opspec.get(problem.op).bytes_moved(problem) + LAUNCH_BYTES) * problem.count


def _largest(problems: list[Problem], share: float) -> list[Problem]:
    """The problems with the largest estimates, largest first, until they make ``share`` of the total."""
    costs = {p.key: estimated_cost(p) for p in problems}
    total = sum(costs.values())
    kept: list[Problem] = []
    covered = 0
    for p in sorted(problems, key=lambda p: (-costs[p.key], p.key)):
        if kept and covered >= share * total:
            break
        kept.append(p)
        covered += costs[p.key]
    return kept


def _ops_text(problems: list[Problem]) -> str:
    """``3 gemv, 1 rms_gemv and 4 elementwise ops`` (the ops of ``problems``, counted)."""
    counts = Counter("elementwise ops" if p.op in ELEMENTWISE_OPS else p.op for p in problems)
    parts = [f"{n} {op}" for op, n in sorted(counts.items(), key=lambda item: (item[0] == "elementwise ops",
                                                                                 item[0]))]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def apply_budget(budget: str, problems: Sequence[Problem], trials: int | None, m_given: bool) -> Budgeted:
    """The problems and trials per study a search runs under ``budget`` (``BUDGETS``).

    ``trials``: ``--trials`` as given (None: not given, the budget's default); ``m_given``: whether
    ``--m`` was given (a quick budget keeps the user's M list, else M = 1 only). Keeps the problems'
    order. Raises ``UserError`` for an unknown budget.
    """
    if budget not in BUDGETS:
        raise UserError(f"bad --budget {budget!r}: expected one of {', '.join(BUDGETS)}")
    problems = list(problems)
    if budget == "full":
        return Budgeted(problems, FULL_TRIALS if trials is None else trials)
    ms = sorted({p.m for p in problems})
    m_note = ""
    if not m_given and len(ms) > 1:
        ms = ms[:1]
        m_note = f"M={ms[0]} only; "
    kept: set[str] = set()
    left_out: list[Problem] = []
    for m in ms:
        at_m = [p for p in problems if p.m == m]
        largest = _largest(at_m, QUICK_SHARE)
        kept.update(p.key for p in largest)
        left_out += [p for p in at_m if p.key not in {q.key for q in largest}]
    chosen = [p for p in problems if p.key in kept]
    what = f"left out {_ops_text(left_out)}" if left_out else "none left out"
    parts = [f"{len(chosen)} of {len(problems)} problems ({m_note}the largest ones, {QUICK_SHARE:.0%} of each "
             f"M's estimated time per step; {what})"]
    if trials is None:
        parts.append(f"{QUICK_TRIALS} trials per study instead of {FULL_TRIALS}")
    note = f"--budget quick: {', '.join(parts)}; --budget full tunes everything"
    return Budgeted(chosen, QUICK_TRIALS if trials is None else trials, note)
