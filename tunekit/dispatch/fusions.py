"""Whether to fuse a layer group, as the served tables decided it (their ``fusions`` section).

The search measured each group's fused sequence against the unfused one at every M and recorded the
decision (``tunekit.table_fusions``): a group is fused where one M at least pays, and inside the op the
fused kernel serves exactly the Ms that paid (``fused_m``, ``tunekit.dispatch.decisions``); integrations
that fuse (the torch patch's and the vLLM plugin's norm folds, the plugin's ``gemv_add`` epilogue)
follow it and never re-derive it from entries of different studies. Where no served table decides a
group, the older rule still answers (a fold pays where the tables' M=1 ``rms_gemv`` entries beat the
norm's and the GEMVs' entries: ``fused_gemv.fold_pays``; ``gemv_add`` where a table holds it), and the
decision's line says so: a table written before the section existed, or a group its search did not know
(a ``--shape`` search).

Call protocol (never raises; each answer carries one line for the integration's log, and ``first``
says whether this process gives that group's answer for the first time since the tables changed)::

    d = fold_decision("gemma_rms_norm", norm.weight, [(n, k), ...], joined=False, price_ops=(...))
    d.fuse, d.line, d.source, d.first          # source: "table" or "entries"
    d.notice                                   # once per load: tables without the section, named,
                                               # or a section without the per-M choice (fused_m)
    d = add_decision("bf16", n, k, "cuda:0")    # None: no table decides that gemv_add group
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tunekit.dispatch.state import STATE, dtype_name
from tunekit.table_fusions import describe, group_key

#: (tables epoch, group key) answers given in this process: each group's line is logged once per load
_SAID: set[tuple[int, str]] = set()


@dataclass(frozen=True)
class Decision:
    """Whether to fuse, the one line that says why, where it came from ("table" or "entries"), and whether
    this process gives it for the first time since the tables changed."""

    fuse: bool
    line: str
    source: str
    key: str
    first: bool
    #: said once per load of the tables, with the first answer from tables without a ``fusions`` section
    notice: str | None = None


def _first(key: str) -> bool:
    said = (STATE.epoch, key)
    if said in _SAID:
        return False
    _SAID.add(said)
    return True


def _decided(key: str, device: str) -> tuple[dict | None, str]:
    """(the served tables' record of ``key`` on ``device``, or None and why none decides it: "older" where
    some served table has no ``fusions`` section)."""
    from tunekit.dispatch.tables import serving_table

    index = serving_table(device)
    if index is None:
        return None, "no table serves this device"
    record = index.fusions.get(key)
    if record is not None:
        return record, ""
    if index.unmeasured:
        return None, "older"
    return None, "no served table measured this group (its search did not list it)"


def _notice(device: str) -> str | None:
    """Once per load: which served tables have no ``fusions`` section, and what that means."""
    from tunekit.dispatch.tables import serving_table

    index = serving_table(device)
    unmeasured = index.unmeasured if index is not None else ()
    if not unmeasured or not _first("older tables"):
        return None
    return (f"{', '.join(unmeasured)} {'has' if len(unmeasured) == 1 else 'have'} no fusions section (written "
            "before tunekit measured fusions): folds are priced from the tables' M=1 entries as before, and "
            "gemv_add serves wherever a table holds it; search again for a measured decision")


def fold_decision(norm_op: str, norm_weight: torch.Tensor, consumer_shapes: list[tuple[int, int]],
                  joined: bool = False, price_ops: tuple[str, ...] | None = None) -> Decision:
    """Whether to fold a norm of convention ``norm_op`` (``rms_norm`` / ``gemma_rms_norm``) into consumers of
    ``consumer_shapes`` (``joined``: sibling linears serving lays out as one weight): the served tables'
    decision for that group, else the older rule on their M=1 entries (``price_ops``: the norm ops it prices,
    the first a table holds; default ``norm_op``)."""
    from tunekit.dispatch.fused_gemv import fold_pays

    shapes = [(int(n), int(k)) for n, k in consumer_shapes]
    family = "sibling_rms_gemv" if joined and len(shapes) > 1 else "rms_gemv"
    dtype, device = dtype_name(norm_weight.dtype), str(norm_weight.device)
    key = group_key(family, norm_op, dtype, shapes)
    try:
        record, why = _decided(key, device)
    except Exception as exc:  # noqa: BLE001 - serving never raises for tunekit's sake
        record, why = None, f"the tables could not be read ({type(exc).__name__}: {exc})"
    if record is not None:
        return Decision(bool(record["fuse"]), describe(key, record), "table", key, _first(key),
                        _all_or_nothing_notice(record))
    pays = fold_pays(price_ops or (norm_op,), norm_weight, shapes, joined)
    why = "a table without a fusions section" if why == "older" else why
    line = (f"{'fused' if pays else 'not fused'}: {family} ({key.split('|', 1)[1]}): no measured decision ({why}); "
            f"priced from the tables' M=1 entries: {'they pay' if pays else 'an entry missing or not paying'}")
    return Decision(pays, line, "entries", key, _first(key), _notice(device))


def add_decision(dtype: str, n: int, k: int, device: str) -> Decision | None:
    """The served tables' decision on ``gemv_add`` at (N, K), or None where none decides it (the older rule
    then holds: ``gemv_add`` wherever a table holds it)."""
    key = group_key("gemv_add", None, dtype, [(n, k)])
    try:
        record, _ = _decided(key, device)
    except Exception:  # noqa: BLE001 - serving never raises for tunekit's sake
        return None
    if record is None:
        return None
    return Decision(bool(record["fuse"]), describe(key, record), "table", key, _first(key),
                    _all_or_nothing_notice(record))


def _all_or_nothing_notice(record: dict) -> str | None:
    """Once per load, for a decision read from a fusions section written before the per-M choice."""
    if "fused_m" in record or not _first("all-or-nothing tables"):
        return None
    return ("a served table's fusions section has no per-M choice (fused_m; written before tunekit chose "
            "fusion per M): its groups are fused at every M or at none, as decided then; search again to "
            "choose per M")
