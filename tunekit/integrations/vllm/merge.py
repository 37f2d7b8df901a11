"""Lay out the weights of a vLLM layer's sibling linears as one tensor, once, after its weights load.

Qwen3.5's Gated DeltaNet reads its normed input with two linears, in_proj_qkvz
(16384 rows for the 27B) and in_proj_ba (96 rows): two GEMV launches, the
second a 1 MB read that still costs a whole launch (2.6 us tuned, 7.3 us
cuBLAS). With both weights consecutive row blocks of one [16480, K] tensor,
one GEMV over the joined rows serves both (``tunekit::sibling_gemv``): the
compile-range pass of ``tunekit.integrations.vllm.compile`` rewrites the two
``gemv`` / ``rms_gemv`` nodes of one x into it (``graph_routes.merge_siblings``)
where a table holds the joined shape.

Which linears: the groups ``marks.SIBLING_LINEARS`` names per module class (read
from the forward in vLLM 0.26 and 0.33: each group is called on the same
tensor, one after the other), each a plain unquantized linear without a bias
whose GEMM goes through tunekit's route, all of one dtype, device and K, and
all folded with one norm or none (``marks.FOLD_EPS``). A group is joined
where :func:`merge_pays` says the tables' M=1 entries make the one GEMV
cheaper than the group's own.

Nothing changes numerically: each weight keeps its values, only its storage
moves. A later weight load writes into the same views (vLLM's weight loaders
copy into ``param.data``); anything that replaces a weight tensor breaks the
layout, and the op then runs one GEMV per weight (counted as
``sibling_gemv fallback:not_joined``), never a wrong result.

Call protocol::

    groups = merge_plan(model, honours)   # [(op, "in_proj_qkvz+in_proj_ba", [linears])]: op gemv / rms_gemv
    counts = merge_model(model, honours)  # {"in_proj_qkvz+in_proj_ba joined": 48, ...}; fills JOINED

No vLLM import: the plan reads module classes and attributes only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tunekit.integrations.vllm.marks import FOLD_EPS, JOINED_N, sibling_groups

__all__ = ["JOINED", "merge_model", "merge_pays", "merge_plan"]

#: What this process joined: ((rows of each weight, in call order), K). The graph pass merges only these.
JOINED: set[tuple[tuple[int, ...], int]] = set()


def _plain_linear(c: nn.Module, honours: Callable[[nn.Module], bool]) -> bool:
    weight = getattr(c, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_contiguous()
            and getattr(c, "bias", None) is None and type(getattr(c, "quant_method", None)).__name__
            == "UnquantizedLinearMethod" and honours(c))


def merge_plan(model: nn.Module, honours: Callable[[nn.Module], bool]) -> list[tuple[str, str, list[nn.Module]]]:
    """(op, names, linears) for every ``marks.SIBLING_LINEARS`` group that can be joined: each linear plain,
    unquantized, bias-free and routed by tunekit (``honours``), one dtype, device and K, and one fold
    eps for all (op ``rms_gemv``) or none (op ``gemv``)."""
    plan = []
    for names, linears in sibling_groups(model):
        if not all(_plain_linear(c, honours) for c in linears):
            continue
        first = linears[0].weight
        if any(c.weight.dtype != first.dtype or c.weight.device != first.device
               or c.weight.shape[1] != first.shape[1] for c in linears):
            continue
        eps = {getattr(c, FOLD_EPS, None) for c in linears}
        if len(eps) != 1:
            continue
        plan.append(("gemv" if eps == {None} else "rms_gemv", names, linears))
    return plan


def merge_pays(op: str, weight: torch.Tensor, rows: list[int]) -> bool:
    """Whether the tables' M=1 entries say one ``op`` GEMV over the joined rows beats the group's own
    GEMVs: the joined shape needs an entry; a part without one counts 0 us (the vendor part is never
    the merge's excuse), except a folded part (``rms_gemv``): without an entry it could only run the
    norm and vLLM's GEMM, so the joined entry is its one tuned path."""
    from tunekit.ops import dtype_name, served_entry

    dtype, device, k = dtype_name(weight.dtype), str(weight.device), weight.shape[1]
    entry = served_entry(op, dtype, 1, sum(rows), k, device)
    if entry is None:
        return False
    parts = [served_entry(op, dtype, 1, n, k, device) for n in rows]
    if op == "rms_gemv" and any(p is None for p in parts):
        return True
    return entry.time_us < sum(p.time_us for p in parts if p is not None)


@torch.no_grad()
def _join(linears: list[nn.Module]) -> None:
    weights = [c.weight.data for c in linears]
    joined = torch.cat(weights, dim=0)  # a new tensor: the old storages are freed with their last view
    start = 0
    for c, w in zip(linears, weights, strict=True):
        c.weight.data = joined[start:start + w.shape[0]]
        setattr(c, JOINED_N, joined.shape[0])
        start += w.shape[0]


def merge_model(model: nn.Module, honours: Callable[[nn.Module], bool]) -> dict[str, int]:
    """Join every group :func:`merge_plan` finds whose joined GEMV :func:`merge_pays` for; add each
    joined layout to :data:`JOINED`. Returns counts: ``"<names> joined"`` and ``"<names> (not in the
    tables or not paying)"``."""
    counts: dict[str, int] = {}
    for op, names, linears in merge_plan(model, honours):
        rows = [c.weight.shape[0] for c in linears]
        pays = merge_pays(op, linears[0].weight, rows)
        if pays:
            _join(linears)
            JOINED.add((tuple(rows), linears[0].weight.shape[1]))
        key = f"{names} joined" if pays else f"{names} (not in the tables or not paying)"
        counts[key] = counts.get(key, 0) + 1
    return counts
