"""What the load-time steps and the routes serving their result share: the marks set on vLLM's modules
and the sibling-linear groups.

Below ``fold`` and ``merge`` (and the plugin's duties that read their marks), so neither step imports
the other: the merge reads a fold's mark (:data:`FOLD_EPS`, one eps or none per group), the fold prices
a sibling group as the merge will join it (:func:`sibling_groups`).

Call protocol::

    getattr(norm, FOLDED, False)        # True on a folded norm: its forward passes x on
    getattr(linear, FOLD_EPS, None)     # the folded norm's eps on each of its consumers: rms_gemv
    getattr(linear, JOINED_N, n)        # the joined row count on each linear of a joined group
    key in REFUSED                      # (op, dtype, N, K, device) a load check refused: no graph node gets it
    sibling_groups(model)               # [("in_proj_qkvz+in_proj_ba", [linears]), ...]

No vLLM import: module classes are matched by name only.
"""

from __future__ import annotations

from torch import nn

__all__ = ["FOLDED", "FOLD_EPS", "JOINED_N", "REFUSED", "SIBLING_LINEARS", "sibling_groups"]

#: Set on a folded norm (True): its forward is ``fold.folded_norm_forward``.
FOLDED = "_tunekit_folded"
#: Set on each consumer of a folded norm: the norm's eps (its GEMM computes ``rms_gemv``).
FOLD_EPS = "_tunekit_fold_eps"
#: Set on each joined linear: the joined row count, the N whose table entry decides its route (a part's
#: GEMV reaches the graph as a tunekit op only for the pass to merge it with its siblings).
JOINED_N = "_tunekit_joined_n"
#: Fused GEMV keys (op, dtype, N, K, device) whose kernel failed its check on a layer's weights at load
#: (``tunekit.integrations.vllm.verify_fold``): the compile pass routes no graph node to them (a residual
#: add stays an add where ``gemv_add`` failed).
REFUSED: set[tuple[str, str, int, int, str]] = set()

#: vLLM module class name -> groups of child linears called on one input, in call order.
SIBLING_LINEARS: dict[str, tuple[tuple[str, ...], ...]] = {
    "QwenGatedDeltaNetAttention": (("in_proj_qkvz", "in_proj_ba"),),
}


def sibling_groups(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """("in_proj_qkvz+in_proj_ba", [linears]) for every :data:`SIBLING_LINEARS` group ``model`` has
    (by module class and child names only)."""
    found = []
    for module in model.modules():
        for names in SIBLING_LINEARS.get(type(module).__name__, ()):
            linears = [getattr(module, name, None) for name in names]
            if all(isinstance(c, nn.Module) for c in linears):
                found.append(("+".join(names), linears))
    return found
