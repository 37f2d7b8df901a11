"""When a study may stop before ``--trials``: its best is near the device's measured limit, or it stopped improving.

A study's trials cost a build, a verification and a timing each; most of a default search's time goes into
studies whose best was found early (on the H200 the winners of every Qwen3.5-27B shape came from a handful of
configs, found within the first trials by the warm start). Two rules, both read from the measured trials in
the storage alone (so every worker and host sharing the study agrees, and a resumed run decides the same):

* **near the limit**: the best verified trial moves its bytes at ``1 - near_limit`` or more of the run's
  measured limit (read bandwidth for a GEMV, copy bandwidth for an elementwise op: the trial's
  ``pct_of_limit``); nothing measured can be much faster. Never on the CPU interpreter (no limit measured).
* **plateau**: no trial in the last ``patience`` measured ones beat the best before it by more than
  ``min_gain`` (a failed or slower trial counts as no gain).

Neither fires before ``min_trials`` measured trials (the default config, the seeds and the warm start's
configs are measured first; the sampler needs a few of its own). The reason is stored on the study
(``stopped``) and shown in the search's summary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from optuna.trial import FrozenTrial, TrialState

from tunekit.search.figures import trial_figure


@dataclass(frozen=True)
class StopRule:
    """The early-stopping settings of a search (``--min-trials``, ``--stop-near-limit``, ``--stop-patience``,
    ``--stop-gain``); a zero ``near_limit`` or ``patience`` turns that rule off."""

    min_trials: int = 12
    near_limit: float = 0.02
    patience: int = 10
    min_gain: float = 0.01

    def check(self) -> None:
        from tunekit.errors import UserError

        if self.min_trials < 1:
            raise UserError(f"--min-trials must be at least 1 (got {self.min_trials})")
        if not 0 <= self.near_limit < 1:
            raise UserError(f"--stop-near-limit must be in [0, 1) (got {self.near_limit}); 0.02: within 2% of the "
                            "measured limit, 0: off")
        if self.patience < 0:
            raise UserError(f"--stop-patience must be >= 0 (got {self.patience}); 0: off")
        if not 0 <= self.min_gain < 1:
            raise UserError(f"--stop-gain must be in [0, 1) (got {self.min_gain}); 0.01: a 1% gain")


def _ok_value(trial: FrozenTrial) -> float | None:
    if trial.state == TrialState.COMPLETE and trial.user_attrs.get("status") == "ok" and trial.value is not None:
        return float(trial.value)
    return None


def stop_reason(measured: Iterable[FrozenTrial], rule: StopRule) -> str | None:
    """Why the study whose ``measured`` trials (the ones a worker evaluated, any order) these are may stop now,
    or None to go on."""
    trials = sorted(measured, key=lambda t: t.number)
    if len(trials) < rule.min_trials:
        return None
    best: FrozenTrial | None = None
    since_gain = 0  # measured trials since the last one that beat the best before it by more than min_gain
    for trial in trials:
        value = _ok_value(trial)
        if value is not None and (best is None or value < float(best.value) * (1.0 - rule.min_gain)):
            since_gain = 0
        else:
            since_gain += 1
        if value is not None and (best is None or value < float(best.value)):
            best = trial
    if best is None:
        return None  # nothing verified yet: the study goes on to --trials (a failing family says so there)
    pct = trial_figure(best, "pct_of_limit")
    if rule.near_limit > 0 and isinstance(pct, (int, float)) and pct >= 100.0 * (1.0 - rule.near_limit):
        return (f"near the limit: best {float(best.value):.2f} us at {pct:.1f}% of the measured limit "
                f"(--stop-near-limit {rule.near_limit:g}) after {len(trials)} trials")
    if rule.patience > 0 and since_gain >= rule.patience:
        return (f"plateau: no gain over {rule.min_gain:.0%} in the last {since_gain} trials "
                f"(--stop-patience {rule.patience}), best {float(best.value):.2f} us after {len(trials)} trials")
    return None
