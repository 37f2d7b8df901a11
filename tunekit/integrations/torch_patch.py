"""Route a plain PyTorch / Hugging Face model through the tunekit ops.

Call protocol::

    import tunekit
    counts = tunekit.patch(model, table="runs/x/table.json")   # {"linear": 224, ...}
    with torch.no_grad():
        logits = model(ids).logits                               # served by torch.ops.tunekit.*
    tunekit.dispatch_stats()                                     # which kernel served which call
    tunekit.unpatch(model)                                       # original forwards back

``patch`` sets an instance ``forward`` on each routed module (the class is not
touched, other instances stay as they were) and remembers what it replaced;
a module is routed only where a loaded table holds an entry for its problem
(op, dtype, N, K) on the device its weight is on: every other module keeps
its own forward and pays nothing. In eager mode a patched forward calls the
op's run-time impl directly (torch's custom-op dispatch alone costs several
microseconds per call); traced and compiled code gets the op itself. So patch after
moving the model to its device; ``only_covered=False`` routes every
supported module (to see every call in the dispatch log).
``unpatch`` puts that back. Patch before ``torch.compile``: compiled code keeps
what it traced. The table, when given, is loaded process-wide (it replaces
``TUNEKIT_TABLE``'s); without one the tables of ``TUNEKIT_TABLE`` serve.

Routed modules:

* every ``nn.Linear`` (bias or not) -> ``torch.ops.tunekit.gemv``; a call that
  needs autograd (grad mode on and a tensor requiring grad) runs the original
  forward, since the tunekit ops have no backward.
* the RMSNorm modules of Hugging Face Llama, Qwen2, Qwen3, Qwen3.5 and Gemma 3
  (plain, zero-centred and gated; matched by class name, so transformers is
  never imported here) -> ``torch.ops.tunekit.rms_norm`` / ``gemma_rms_norm`` /
  ``gated_rms_norm`` (:data:`ELEMENTWISE_ROUTES`). HF's MLPs are not routed
  (see there). The op's vendor path is vLLM's native norm math, which equals
  HF's except that HF's gated norm rounds to the activation dtype before the
  weight multiply (one BF16 rounding apart).

Shapes: Hugging Face keeps q/k/v and gate/up as separate linears, where vLLM
merges them (``qkv_proj``, ``gate_up_proj``), so a table tuned on vLLM's
shapes (``tunekit search --model``) covers only the unmerged ones (o_proj,
down_proj, lm_head ...), unless ``patch`` runs each such group
(:data:`SIBLING_LINEARS`) as one GEMV of the merged shape (:func:`merged_shapes`),
which it does by default where a table covers that shape (``merge_siblings``).
:func:`linear_shapes` lists the (N, K) an unmerged patched model runs, to tune
those with ``--shape NxK``. HF reshapes the gated
norm's input to [tokens * heads, head_dim] (vLLM: [tokens, heads,
head_dim]), so its calls have M = tokens * heads and N = head_dim; the op
serves them from an entry of either layout (the norm is per head, so the
rows may be regrouped). HF adds the residual itself, so only ``rms_norm``
(not ``fused_add_rms_norm``) entries serve its norms.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tunekit.integrations.torch_fold import _FOLD_HOOKS, _FOLDS, fold_shapes, unroute
from tunekit.integrations.torch_fold import fold_norms as fold_norms_of
from tunekit.integrations.torch_merge import (
    _MERGED,
    SIBLING_LINEARS,
    _merge,
    _merge_pays,
    _merge_plan,
    _own_storage,
    merged_shapes,
)
from tunekit.integrations.torch_routes import (
    _ROUTE,
    _SAVED,
    _TRACING,
    ELEMENTWISE_ROUTES,
    _eps,
    _needs_autograd,
    _op_call,
    _set_forward,
)
from tunekit.problems import oprecords

__all__ = ["ELEMENTWISE_ROUTES", "SIBLING_LINEARS", "fold_shapes", "linear_shapes", "merged_shapes",
           "patch", "unpatch"]


def _norm_forward(op: str) -> Callable[[nn.Module], Callable[..., Any]]:
    def factory(module: nn.Module) -> Callable[..., Any]:
        from tunekit.ops import EagerNorm

        original = module.forward
        eps = _eps(module)
        # _op_call(op), inlined, with this module's own EagerNorm as the impl
        eager, traced = EagerNorm(oprecords.get(op).gain_offset == 1.0, eps), getattr(torch.ops.tunekit, op)
        (is_compiling, is_tracing), plain = _TRACING, torch.Tensor

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            # Mixed dtypes (an fp32 weight on bf16 activations) promote in HF's
            # math; the op keeps the activation dtype, so those stay HF's.
            if _needs_autograd(hidden_states, weight) or weight.dtype != hidden_states.dtype:
                return original(hidden_states)
            if type(hidden_states) is plain and not is_compiling() and not is_tracing():
                return eager(hidden_states, weight)
            return traced(hidden_states, weight, eps)

        return forward

    return factory


def _gated_norm_forward(module: nn.Module) -> Callable[..., Any]:
    original = module.forward
    eps = _eps(module)
    fn = _op_call("gated_rms_norm")

    def forward(hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        weight = module.weight
        if (gate is None or getattr(module, "activation", "silu") not in ("silu", "swish")
                or _needs_autograd(hidden_states, gate, weight) or weight.dtype != hidden_states.dtype
                or gate.dtype != hidden_states.dtype):
            return original(hidden_states, gate)
        return fn(hidden_states, gate, weight, eps)

    return forward


#: op -> factory(module) returning the module's new forward.
_ELEMENTWISE_FORWARDS: dict[str, Callable[[nn.Module], Callable[..., Any]]] = {
    "rms_norm": _norm_forward("rms_norm"),
    "gemma_rms_norm": _norm_forward("gemma_rms_norm"),
    "gated_rms_norm": _gated_norm_forward,
}


def _linear_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    from tunekit.ops import EagerLinear

    # _op_call("gemv"), inlined: every linear of every eager decode step runs this
    eager, traced = EagerLinear(), torch.ops.tunekit.gemv
    (is_compiling, is_tracing), plain, grad_enabled = _TRACING, torch.Tensor, torch.is_grad_enabled

    def forward(input: torch.Tensor) -> torch.Tensor:
        weight, bias = module.weight, module.bias
        if grad_enabled() and _needs_autograd(input, weight, bias):
            return F.linear(input, weight, bias)
        # The tuned-or-vendor choice (on M, dtype, strides) happens inside the
        # op, so a traced graph holds one opaque node and no M branch.
        if type(input) is plain and not is_compiling() and not is_tracing():
            return eager(input, weight, bias)
        return traced(input, weight, bias)

    return forward


def _op_defined(op: str) -> bool:
    try:
        getattr(torch.ops.tunekit, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def _route(module: nn.Module) -> tuple[str, Callable[[nn.Module], Callable[..., Any]] | None]:
    """(route name, forward factory or None) for ``module``; ("", None) if not routed."""
    if isinstance(module, nn.Linear):
        return "linear", _linear_forward
    op = ELEMENTWISE_ROUTES.get(type(module).__name__)
    if op is None:
        return "", None
    factory = _ELEMENTWISE_FORWARDS.get(op)
    if factory is None or not _op_defined(op):
        return f"{op} (no tunekit op yet)", None
    return op, factory


def _covered(route: str, module: nn.Module) -> bool:
    """Whether a loaded table holds an entry for the module's problem on its weight's device
    (any M: the op picks per call). The gated norm is matched by its row width (head_dim), as the
    op serves either row layout."""
    from tunekit import ops

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in ops.DTYPE_NAMES:
        return False
    dtype, device = ops.dtype_name(weight.dtype), str(weight.device)
    if route == "linear":
        n, k = weight.shape
        return ops.covers("gemv", dtype, n, k, device)
    width = weight.shape[0]
    return ops.covers(route, dtype, None if route == "gated_rms_norm" else width, width, device)


def patch(model: nn.Module, table: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
          only_covered: bool = True, fold_norms: bool = True, merge_siblings: bool = True) -> dict[str, int]:
    """Route ``model``'s linears (and supported norms/activations) through the tunekit ops.

    ``table``: a path, a ``:``-separated string or a list of paths, loaded
    process-wide; a table that cannot be loaded raises ``tunekit.table.TableError``
    here (set-up time), unlike in serving. Already patched modules are left
    alone. With ``only_covered`` (the default) a module is routed only where
    a loaded table has an entry for its problem on its weight's device (no
    table: nothing is routed). Returns per route how many modules were
    patched, per route how many were kept because no table covers them
    (``"<route> (not in the tables)"``), and per module kind with no tunekit
    op yet how many were left as they are.

    ``fold_norms`` (on by default; ``False`` keeps every norm a norm): first,
    each decoder norm whose readers (``fold_graph``: from the layer's
    forward) are all linears that have ``rms_gemv`` entries, whose entries at M=1 beat the tuned norm and GEMVs
    they replace, and whose fold passes its check on the model's own weights
    (``rms_gemv`` through the served kernels against the unfolded sequence,
    the search's BF16 bound: ``tunekit.integrations.torch_fold``), is folded:
    its weight goes into the consumers' weights (W diag(g), or diag(1 + g)
    for Qwen3.5's zero-centred norm; new weight tensors, the originals kept
    for ``unpatch``, for ``state_dict`` and for ``load_state_dict``, which
    folds and checks again), the norm passes its input on and each consumer
    runs ``rms_gemv``, which computes 1/rms itself: no norm kernel runs. The
    numerics move by one BF16 rounding of W diag(g') instead of one of the
    normalised activation. Counted as ``"rms_gemv"`` and ``"<norm op>
    folded"``, ``"<op> (kept unfolded: failed the check)"`` and ``"<op> (not
    folded: <reason>)"`` (LoRA, a quantized consumer, or what else the
    layer's forward does with the norm's output); a token count the table
    lacks runs the norm's math then the vendor GEMM per consumer. With no table paying for a fold, nothing folds.

    ``merge_siblings`` (on by default): then, each group of ``SIBLING_LINEARS`` (the linears
    a module calls on one input: q/k/v, gate/up, Gated DeltaNet's qkv/z and
    b/a) whose stacked shape a table covers runs as one GEMV of that shape,
    vLLM's merged projection; where every sibling has an M=1 entry too, only
    if the merged one is no slower than theirs together. Each sibling returns
    its rows of that output (a view). The siblings' weights become views of
    the stacked tensor (same values; ``unpatch`` gives them their own storage
    again; a folded sibling is not merged).
    Counted as ``"linear merged"`` per sibling and
    ``"linear (merge not in the tables or not paying)"`` per group left apart.
    """
    from tunekit import ops

    if table is not None:
        ops.load_tables(table, strict=True)  # an unreadable table raises here, its one message
    counts: dict[str, int] = {}
    if fold_norms:
        fold_norms_of(model, counts)
    if merge_siblings:
        for _, linears in _merge_plan(model):
            if not _merge_pays(linears, only_covered):
                key = "linear (merge not in the tables or not paying)"
                counts[key] = counts.get(key, 0) + 1
                continue
            _merge(linears)
            counts["linear merged"] = counts.get("linear merged", 0) + len(linears)
    for module in model.modules():
        if getattr(module, _ROUTE, None):
            continue
        name, factory = _route(module)
        if not name:
            continue
        if factory is not None and only_covered and not _covered(name, module):
            name, factory = f"{name} (not in the tables)", None
        counts[name] = counts.get(name, 0) + 1
        if factory is None:
            continue
        _set_forward(module, name, factory(module))
    return counts


def unpatch(model: nn.Module) -> int:
    """Restore every module ``patch`` changed in ``model``; returns how many."""
    restored = 0
    model.__dict__.pop(_FOLDS, None)
    for module in model.modules():
        for handle in module.__dict__.pop(_FOLD_HOOKS, []):
            handle.remove()  # a folded consumer's state_dict hook; the model's load_state_dict refold
        if module.__dict__.get(_SAVED) is None:
            continue
        merged = module.__dict__.pop(_MERGED, None) is not None
        unroute(module)
        if merged:
            _own_storage(module)
        restored += 1
    return restored


def linear_shapes(model: nn.Module) -> list[dict[str, Any]]:
    """The (N, K, dtype) of the model's ``nn.Linear`` modules with how many share each, largest first.

    What a table must hold for a patched model to hit tuned kernels: feed
    them to ``tunekit search --shape NxK`` (Hugging Face layouts differ from
    vLLM's merged ones).
    """
    from tunekit.ops import dtype_name

    shapes: dict[tuple[int, int, str], list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            n, k = module.weight.shape
            shapes.setdefault((n, k, dtype_name(module.weight.dtype)), []).append(name)
    rows = [{"n": n, "k": k, "dtype": dt, "count": len(names), "names": names}
            for (n, k, dt), names in shapes.items()]
    return sorted(rows, key=lambda r: (-r["n"] * r["k"], r["n"], r["k"]))
