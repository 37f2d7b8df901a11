"""A measured trial's figures in the storage: one user attribute (``MEASURE_ATTR``) holding them all.

The worker's reply (times, errors, its compile / verify / time split) is stored as one dict: one storage write
per trial, where one attribute per figure cost 19 commits, 63 ms a trial on SQLite. Storages written before
hold each figure as its own attribute; :func:`trial_figure` reads both.
"""

from __future__ import annotations

from typing import Any

MEASURE_ATTR = "measure"


def trial_figure(trial: Any, key: str) -> Any:
    """A measured trial's figure ``key`` (None where it has none)."""
    figures = trial.user_attrs.get(MEASURE_ATTR)
    if isinstance(figures, dict) and key in figures:
        return figures[key]
    return trial.user_attrs.get(key)


def trial_figures(attrs: dict[str, Any]) -> dict[str, Any]:
    """A trial's user attributes with its figures flattened into them (the columns of trials.csv)."""
    attrs = dict(attrs)
    figures = attrs.pop(MEASURE_ATTR, None)
    return attrs | (figures if isinstance(figures, dict) else {})
