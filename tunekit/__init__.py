"""tunekit: a kernel autotuner for LLM decode (BF16 small-M GEMV and fused elementwise ops).

Main use::

    tunekit search --model qwen3.5-27b      # verified, timed winners -> runs/qwen3.5-27b/table.json
    tunekit show runs/qwen3.5-27b/table.json

Serving the table (imported on first use, so ``import tunekit`` stays light)::

    tunekit.patch(model, table="runs/qwen3.5-27b/table.json")   # nn.Linear & co. -> torch.ops.tunekit.*
    tunekit.dispatch_stats()                                     # which kernel served which call
    tunekit.unpatch(model)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "dispatch_stats", "patch", "unpatch"]


def patch(model: Any, table: Any = None, only_covered: bool = True, fold_norms: bool = True,
          merge_siblings: bool = True) -> dict[str, int]:
    """Route ``model``'s modules that a table covers through the tunekit ops (``fold_norms``, on by default:
    fold the decoder norms into their consumers where the tables say it pays and the fold passes its check on
    the model's weights; ``fold_norms=False`` keeps them; ``merge_siblings``, on by default: run
    the linears a module calls on one input, q/k/v or gate/up, as one GEMV of vLLM's merged shape where a
    table covers it); see
    ``tunekit.integrations.torch_patch.patch``."""
    from tunekit.integrations.torch_patch import patch as _patch

    return _patch(model, table, only_covered=only_covered, fold_norms=fold_norms, merge_siblings=merge_siblings)


def unpatch(model: Any) -> int:
    """Undo :func:`patch`; see ``tunekit.integrations.torch_patch.unpatch``."""
    from tunekit.integrations.torch_patch import unpatch as _unpatch

    return _unpatch(model)


def dispatch_stats(reset: bool = False) -> list[dict[str, Any]]:
    """The dispatch markers of this process; see ``tunekit.ops.dispatch_stats``."""
    from tunekit.ops import dispatch_stats as _stats

    return _stats(reset)
