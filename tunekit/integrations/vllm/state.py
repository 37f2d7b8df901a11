"""The vLLM plugin's shared state, below every duty: its logger, switches, marker and what it installed.

Everything here is read by more than one of the plugin's modules (``gemm``,
``custom_ops``, ``vendors``, ``compile``, ``load``, and ``plugin`` on top);
none of them imports another duty for it. Imports neither vLLM nor torch (``table_paths`` asks
``tunekit.ops``, which serving imports anyway, when it is called).

Call protocol::

    table_paths()            # the tables TUNEKIT_TABLE names (tunekit.ops.table_paths); [] = plugin off
    fold_requested()         # TUNEKIT_FOLD_NORMS unless 0
    merge_requested()        # TUNEKIT_MERGE_SIBLINGS unless 0
    env_flag("VLLM_X", False)  # vLLM's parse of a boolean env var
    getattr(fn, MARK, False)   # True on whatever the plugin wrapped or registered: installs stay idempotent
    STATE["installed"]         # hook -> what it does (``plugin.installed()`` reads it)
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

__all__ = ["FOLD_ENV", "LOCK", "MARK", "MERGE_ENV", "STATE", "env_flag", "fold_requested", "logger",
           "merge_requested", "table_paths"]

# A child of vLLM's logger: vLLM configures "vllm" (its handler, VLLM_LOGGING_LEVEL) in every
# process, so the plugin's lines land in vLLM's own log, where a user reads what was installed.
logger = logging.getLogger("vllm.tunekit")

#: Set to 0 to keep decoder norms unfolded (``tunekit.integrations.vllm.fold``; on by default: it folds only
#: where the tables' rms_gemv entries pay and the fold passes its check on the loaded weights).
FOLD_ENV = "TUNEKIT_FOLD_NORMS"
#: Set to 0 to keep sibling linears' weights apart (``tunekit.integrations.vllm.merge``; on by default:
#: it joins only where the tables' entries for the joined shape pay, and moves no value).
MERGE_ENV = "TUNEKIT_MERGE_SIBLINGS"

#: Set (True) on every function and class the plugin installs: a second install finds it and does nothing.
MARK = "_tunekit_wrapped"

#: Guards ``STATE["registered"]``: ``register`` runs once per process.
LOCK = threading.Lock()
#: This process's plugin: registered yet, hook -> what it does / why it was not installed, the paths of the
#: norms the last load folded (``fold_outcome``) and the digest of what the last load's check of the shipped
#: tables kept (``shipped_outcome``; "": none checked): both part of the compile-cache key, a graph traces them.
STATE: dict[str, Any] = {"registered": False, "installed": {}, "skipped": {}, "fold_outcome": [],
                         "shipped_outcome": ""}


def table_paths() -> list[str]:
    """The tables to serve: the paths ``TUNEKIT_TABLE`` names, blanks dropped (``tunekit.ops.table_paths``: the
    variable's one reader); none: the plugin installs nothing."""
    from tunekit import ops

    return ops.table_paths()


def fold_requested() -> bool:
    """Whether the fold runs (on unless ``TUNEKIT_FOLD_NORMS`` is 0 or false)."""
    return os.environ.get(FOLD_ENV, "1").strip().lower() not in ("0", "false")


def merge_requested() -> bool:
    """Whether the sibling-linear join runs (on unless ``TUNEKIT_MERGE_SIBLINGS`` is 0)."""
    return os.environ.get(MERGE_ENV, "1").strip().lower() not in ("0", "false")


def env_flag(name: str, default: bool) -> bool:
    """vLLM's parse of a boolean env var ("1"/"true"), read from vllm.envs when it knows the name."""
    try:
        import vllm.envs as envs

        return bool(getattr(envs, name))
    except Exception:
        value = os.environ.get(name)
        return default if value is None else value.strip().lower() in ("1", "true")
