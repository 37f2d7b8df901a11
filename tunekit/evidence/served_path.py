"""Which of a run's problems make up one decode step: the path the plugin serves, each layer counted once.

A default model search (``shapes.MODEL_OPS``) lists a layer several ways: ``gemv`` for every linear, the
elementwise ops (a ``fused_add_rms_norm`` is the residual add and the norm after it), and the fused
families the plugin serves. ``rms_gemv`` is a norm folded into every GEMV that reads it: the norm's launch
and those GEMVs are gone. ``gemv_add`` is the residual add in the GEMV's epilogue: that GEMV is gone, and
the add is taken off the fused add + norm after it. Summing every listed problem counts those layers
twice and overstates the per-token prediction. :func:`served_counts` gives, per problem, the calls per
token that the served path runs (the plugin's default: norms folded, residual adds in the epilogue), and
one line per M saying what was counted in place of what.

What a fused problem replaces is read from its layer names (``Problem.names``, as
``ModelSpec.rms_gemvs`` / ``residual_gemvs`` write them): ``input_layernorm+qkv_proj`` is the norm, then
its consumers (``linear_attn.in_proj_qkvz+in_proj_ba``: a sibling named without its module prefix takes
the previous part's). The fused families the plugin does not serve (``tunekit chain`` only: the norm ->
GEMV prologue, SiLU-and-mul prologue or epilogue) are left out where the run holds the served path of the
same layers, and counted as listed otherwise (a run of those families alone).

Pure: no torch, no file access. Call protocol: ``served_counts(problems)`` with objects that have ``op``,
``dtype``, ``m``, ``n``, ``names`` (``;``-joined layer names) and ``count``; returns
``(counts, lines)``: ``counts[id_of(p)]`` the calls counted (a float: a merged problem may be counted in
part), ``lines`` the report's sentences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tunekit.problems.shapes import ELEMENTWISE_OPS, FUSED_GEMV_OPS, SERVED_FUSED_OPS

PLAIN_NORMS = ("rms_norm", "gemma_rms_norm")
ADD_NORMS = ("fused_add_rms_norm", "gemma_fused_add_rms_norm")
#: The plain norm a fused add + norm becomes once its add is in a GEMV's epilogue.
PLAIN_OF = dict(zip(ADD_NORMS, PLAIN_NORMS, strict=True))


def id_of(p: Any) -> tuple[str, str, int, int, int]:
    """The problem's identity in a run: (op, dtype, m, n, k)."""
    return (p.op, p.dtype, int(p.m), int(p.n), int(p.k))


def layer_parts(entry: str) -> list[str]:
    """``input_layernorm+linear_attn.in_proj_qkvz+in_proj_ba`` -> its layers, the prefix restored:
    ``[input_layernorm, linear_attn.in_proj_qkvz, linear_attn.in_proj_ba]``."""
    parts: list[str] = []
    for part in (x.strip() for x in entry.split("+")):
        if part and "." not in part and parts and "." in parts[-1]:
            part = parts[-1].rsplit(".", 1)[0] + "." + part
        if part:
            parts.append(part)
    return parts


def _entries(p: Any) -> list[str]:
    return [e for e in str(p.names or "").split(";") if e.strip()]


def _layers(p: Any) -> set[str]:
    return {part for entry in _entries(p) for part in layer_parts(entry)}


class _Step:
    """One M's problems and the calls still counted of each."""

    def __init__(self, problems: Sequence[Any]) -> None:
        self.problems = list(problems)
        self.left = {id_of(p): float(p.count or 0) for p in problems}

    def of(self, ops: Sequence[str]) -> list[Any]:
        return [p for p in self.problems if p.op in ops]

    def take(self, pool: list[Any], layer: str, amount: float) -> float:
        """Remove up to ``amount`` calls of ``layer`` from the problems of ``pool`` naming it; the calls removed."""
        taken = 0.0
        for p in pool:
            if amount - taken <= 0:
                break
            if layer in _layers(p):
                x = min(self.left[id_of(p)], amount - taken)
                self.left[id_of(p)] -= x
                taken += x
        return taken


def _fmt(x: float) -> str:
    return f"{x:g}"


def _one_m(problems: Sequence[Any]) -> tuple[dict[tuple, float], str | None]:
    step = _Step(problems)
    gemvs = step.of(("gemv",))
    plain, add_norms = step.of(PLAIN_NORMS), step.of(ADD_NORMS)
    replaced_gemv = folded = 0.0
    folded_adds: dict[int, float] = {}  # norm width -> folded fused add + norm calls (their add left to place)
    for p in step.of(("rms_gemv",)):
        entries = _entries(p)
        for entry in entries:
            parts = layer_parts(entry)
            share = float(p.count or 0) / len(entries)  # exact for every built-in model: one entry per problem
            if len(parts) < 2:
                continue
            norm, consumers = parts[0], parts[1:]
            for layer in consumers:
                replaced_gemv += step.take(gemvs, layer, share)
            x = step.take(plain, norm, share)  # layer 0's input norm: plain, no residual yet
            folded += x
            share -= x
            for q in add_norms:
                x = step.take([q], norm, share)
                share -= x
                folded += x
                folded_adds[int(q.n)] = folded_adds.get(int(q.n), 0.0) + x
    as_plain = unplaced = 0.0
    for p in step.of(("gemv_add",)):
        entries = _entries(p)
        for entry in entries:
            share = float(p.count or 0) / len(entries)
            for layer in layer_parts(entry):
                replaced_gemv += step.take(gemvs, layer, share)
        adds = float(p.count or 0)
        # the adds of folded norms first (their norm is in rms_gemv, the add lands here) ...
        x = min(adds, folded_adds.get(int(p.n), 0.0))
        folded_adds[int(p.n)] = folded_adds.get(int(p.n), 0.0) - x
        adds -= x
        # ... then unfolded fused add + norm calls of the same width: each becomes a plain norm
        for q in add_norms:
            if adds <= 0 or int(q.n) != int(p.n):
                continue
            x = min(adds, step.left[id_of(q)])
            adds -= x
            target = next((r for r in plain if r.op == PLAIN_OF[q.op] and (r.n, r.k) == (q.n, q.k)), None)
            if target is None:
                unplaced += x  # no plain norm of that width measured: the call stays a fused add + norm
                continue
            step.left[id_of(q)] -= x
            step.left[id_of(target)] += x
            as_plain += x
        # adds beyond these: no norm problem in the run holds them, so nothing counts them twice
    served_layers = set()
    for p in problems:
        if p.op == "gemv" or p.op in SERVED_FUSED_OPS or p.op in ELEMENTWISE_OPS:
            served_layers |= _layers(p)
    chain_only = [p for p in problems if p.op in FUSED_GEMV_OPS and p.op not in SERVED_FUSED_OPS]
    dropped_chain = []
    for p in chain_only:
        if _layers(p) & served_layers:
            step.left[id_of(p)] = 0.0
            dropped_chain.append(p.op)
    fused = [op for op in SERVED_FUSED_OPS if step.of((op,))]
    if not fused and not dropped_chain:
        return step.left, None
    parts = []
    if fused:
        parts.append(f"counted the served path: {' and '.join(fused)}")
    if replaced_gemv:
        parts.append(f"{_fmt(replaced_gemv)} gemv calls left out (served as {' / '.join(fused)})")
    if folded:
        parts.append(f"{_fmt(folded)} norm calls left out (folded into rms_gemv)")
    if as_plain:
        parts.append(f"{_fmt(as_plain)} fused add + norm calls counted as plain norms (the add in gemv_add)")
    if unplaced:
        parts.append(f"{_fmt(unplaced)} gemv_add calls whose add is still counted in a fused add + norm "
                     "(no plain norm of that width measured)")
    left_adds = sum(folded_adds.values())
    if left_adds and not step.of(("gemv_add",)):
        parts.append(f"the residual adds of {_fmt(left_adds)} folded fused add + norm calls are in no sum "
                     "(no gemv_add measured; a lone add is not a problem)")
    if dropped_chain:
        ops = ", ".join(sorted(set(dropped_chain)))
        parts.append(f"left out {ops} (not served by the plugin, tunekit chain only; the served path of the same "
                     "layers is counted)")
    return step.left, "; ".join(parts)


def served_counts(problems: Sequence[Any]) -> tuple[dict[tuple, float], list[str]]:
    """Per problem the calls per token the served path runs, and one line per M group saying what was counted."""
    groups: dict[tuple[int, str], list[Any]] = {}
    for p in problems:
        groups.setdefault((int(p.m), p.dtype), []).append(p)
    counts: dict[tuple, float] = {}
    said: dict[str, list[int]] = {}
    for (m, _), group in sorted(groups.items()):
        left, line = _one_m(group)
        counts.update(left)
        if line:
            said.setdefault(line, []).append(m)
    lines = [f"M={','.join(map(str, sorted(set(ms))))}: {line}" for line, ms in said.items()]
    return counts, lines
