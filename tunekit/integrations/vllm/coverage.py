"""Whether a layer reaches a tunekit op: the static checks every route of the vLLM plugin makes.

The rule: a layer reaches a tunekit op only where the loaded tables can serve
it; everything else is vLLM's own code, untouched, so its traced graph is the
one plain vLLM traces.

* Per layer, from static facts only (op, dtype, N, K of the layer, device)
  and the tables' keys (``tunekit.ops.covers``: an entry at some M),
  decided once per trace and baked into the graph (:func:`covered`): a
  covered layer calls the tunekit op, any other runs vLLM's own forward /
  GEMM.
* An eager call (M known: vLLM's logits, computed outside the compiled
  graph at every step; ``enforce_eager``) above the largest M the tables
  hold for the layer runs vLLM's own path and never enters the op
  (:func:`eager_above_tables`; the gated norm, whose flattened rows do not
  tell the token count, by the most rows an entry serves). Traced graphs
  get the same from the compile ranges (``tunekit.integrations.vllm.compile``).

Call protocol (the GEMM route, ``gemm``, and the CustomOp routes, ``custom_ops``, call these through
the module, so a test that patches one patches every route)::

    if coverage.covered("gemv", x, n, k) and not coverage.eager_above_tables("gemv", x, n, k):
        return torch.ops.tunekit.gemv(x, weight, bias)
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

__all__ = ["TABLE_DTYPES", "covered", "eager_above_tables"]


def _ops() -> Any:
    # Eager vLLM asks on every call of every layer: no import statement here.
    return sys.modules.get("tunekit.ops") or importlib.import_module("tunekit.ops")


#: vLLM's tensor-parallel size, handed to the dispatch tables once vLLM's parallel state knows it
_TP_KNOWN: list[bool] = [False]

#: what serves a layer the tables do not cover: its own vLLM code (the ``vendor`` of its ``layer`` marker)
LAYER_VENDOR = "vllm"


def _sync_tp() -> None:
    """Tell the dispatch tables vLLM's tensor-parallel size (once, when vLLM's parallel state is up): a table
    tuned for another TP size then covers none of this rank's shapes (``tunekit.dispatch.tables``)."""
    if _TP_KNOWN[0]:
        return
    try:
        from vllm.distributed import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return
        size = parallel_state.get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - no parallel state to ask: TP unknown, tables serve as they record
        return
    _ops().set_tensor_parallel(int(size))
    _TP_KNOWN[0] = True


def _covers_impl(op: str, dtype: str, n: int | None, k: int, device: str) -> bool:
    _sync_tp()
    ops = _ops()
    if ops.covers(op, dtype, n, k, device):
        return True
    if n is not None and ops.other_tp(op, dtype, n, k, device) is not None:
        # a table holds the layer's shape but was tuned for another TP size: the layer keeps vLLM's
        # code, and the markers say why (per call when eager, once per trace when compiled)
        ops.count_layer(op, dtype, f"{n}x{k}", 0, "fallback:tp_mismatch", LAYER_VENDOR)
    return False


#: torch dtype -> the tables' dtype name (tunekit.ops' names; other dtypes are never tabulated)
TABLE_DTYPES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# Evaluated once per trace and baked in as a constant: whether the tables hold
# (op, dtype, N, K) is fixed per layer (N, K are not the token dimension), and
# the table lookup itself (locks, file reads) must not be traced. Layers the
# tables do not cover keep vLLM's own path (its CUDA kernel, or the native
# code inductor fuses), which the op's vendor path would not match.
try:
    _covers = torch.compiler.assume_constant_result(_covers_impl)
except AttributeError:  # torch without torch.compiler: eager only anyway
    _covers = _covers_impl


def covered(op: str, x: torch.Tensor, n: int | None, k: int) -> bool:
    """Whether the tables hold ``op`` for x's dtype and device at width (n, k), at some M: fixed per
    layer, so a constant of the traced graph."""
    # vLLM marks only the token dim dynamic, so widths are plain ints here; a
    # width that is symbolic (a caller compiling with every dim dynamic) can
    # not be decided per layer, and undecided means vLLM's own path.
    dtype = TABLE_DTYPES.get(x.dtype)
    if dtype is None or not isinstance(n, (int, type(None))) or not isinstance(k, int):
        return False
    return bool(_covers(op, dtype, n, k, str(x.device)))


_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def eager_above_tables(op: str, x: torch.Tensor, n: int | None, k: int, by_rows: bool = False) -> bool:
    """True for a call made outside tracing whose token count is above every M the tables hold for
    the layer's (op, dtype, N, K): vLLM's own path serves it then, with none of the op's Python.

    Eager calls know M: vLLM's logits (computed outside the compiled graph, at every step), an
    ``enforce_eager`` engine, a capture without compilation. Under tracing M is symbolic and never
    read here: the op decides per call, and the compile ranges keep the ops out of the graphs for
    token counts above the tables (``compile.install_compile_ranges``). ``by_rows``: for an op called in
    either row layout (the gated norm: vLLM 0.26's Qwen3.5 flattens [T, H, D] to [T * H, D], so T
    cannot be read), the call's K-wide rows against the most any entry serves in one call
    (``tunekit.ops.largest_rows``).
    """
    if _is_compiling():  # before any size is read: nothing of this enters a traced graph
        return False
    dtype = TABLE_DTYPES.get(x.dtype)
    if dtype is None:
        return False
    device = str(x.device)
    top = _ops().largest_rows(op, dtype, k, device) if by_rows else _ops().largest_m(op, dtype, n, k, device)
    return top is not None and x.numel() // k > top  # rows of K elements (every routed op's input): its M

