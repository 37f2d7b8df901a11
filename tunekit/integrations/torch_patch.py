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
* the RMSNorm modules of Hugging Face Llama, Qwen2, Qwen3 and Qwen3.5 (plain,
  zero-centred and gated; matched by class name, so transformers is never
  imported here) -> ``torch.ops.tunekit.rms_norm`` / ``gemma_rms_norm`` /
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

__all__ = ["ELEMENTWISE_ROUTES", "FOLDABLE_LAYERS", "SIBLING_LINEARS", "fold_shapes", "linear_shapes", "merged_shapes",
           "patch", "unpatch"]

#: Attribute holding what ``patch`` replaced: ("instance", previous forward) or ("class", None).
_SAVED = "_tunekit_saved_forward"
#: Attribute naming the route that patched a module (for counts and tests).
_ROUTE = "_tunekit_route"

#: Hugging Face module class name -> tunekit elementwise op that serves it.
#: ``rms_norm``: w * (x / rms(x)).to(dtype) (Llama, Mistral, Qwen2, Qwen3);
#: ``gemma_rms_norm``: ((1 + w) * x / rms(x)).to(dtype) (Qwen3.5 / Qwen3-Next, zero-centred weight);
#: ``gated_rms_norm``: w * norm(x) * silu(z) (the Gated DeltaNet output norm).
#: Not routed: HF's MLPs (LlamaMLP ...) compute act(gate_proj(x)) * up_proj(x)
#: from two separate outputs, while ``tunekit::silu_and_mul`` takes them
#: adjacent ([..., 2I], vLLM's merged gate_up_proj): routing it would add a
#: concatenation copy per call. Extension point: a class name here plus a
#: forward factory in ``_ELEMENTWISE_FORWARDS``; routes whose op
#: ``torch.ops.tunekit`` does not define are skipped and counted as such.
ELEMENTWISE_ROUTES: dict[str, str] = {
    "LlamaRMSNorm": "rms_norm",
    "MistralRMSNorm": "rms_norm",
    "Qwen2RMSNorm": "rms_norm",
    "Qwen3RMSNorm": "rms_norm",
    "Qwen3_5RMSNorm": "gemma_rms_norm",
    "Qwen3NextRMSNorm": "gemma_rms_norm",
    "Qwen3_5RMSNormGated": "gated_rms_norm",
    "Qwen3NextRMSNormGated": "gated_rms_norm",
}


#: Decoder-layer class name -> (norm attribute, the linears that read its output), from the layer's
#: forward in transformers' modeling code: ``patch(fold_norms=True)`` folds a norm only into all of
#: them (a path a layer lacks, such as self_attn in a linear-attention layer, is skipped). HF adds
#: the residual itself, so each of these norms is a plain one.
_LLAMA_LIKE = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
               ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")))
FOLDABLE_LAYERS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "LlamaDecoderLayer": _LLAMA_LIKE,
    "MistralDecoderLayer": _LLAMA_LIKE,
    "Qwen2DecoderLayer": _LLAMA_LIKE,
    "Qwen3DecoderLayer": _LLAMA_LIKE,
    # full attention (self_attn) or Gated DeltaNet (linear_attn: its four input projections)
    "Qwen3_5DecoderLayer": (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "linear_attn.in_proj_qkv",
                             "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a")),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))),
}
#: Attribute holding a folded linear's original weight Parameter (``unpatch`` puts it back).
_FOLD_SAVED = "_tunekit_unfolded_weight"
#: Attribute holding a merged sibling's shared :class:`_MergedGemv` (``unpatch`` drops it).
_MERGED = "_tunekit_merged_gemv"

#: Module class name -> the groups of its linears that its forward calls on one input tensor, each in
#: call order (transformers' modeling code). ``patch(merge_siblings=True)`` serves each group with one
#: GEMV over the stacked weights: vLLM's merged projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj,
#: Gated DeltaNet's qkv/z -> in_proj_qkvz and b/a -> in_proj_ba), so a table tuned with
#: ``tunekit search --model`` covers them, and a decode step launches one GEMV where HF launches two to
#: three (the small ones, k/v and b/a, run far from the read limit on their own).
_QKV = (("q_proj", "k_proj", "v_proj"),)
_GATE_UP = (("gate_proj", "up_proj"),)
SIBLING_LINEARS: dict[str, tuple[tuple[str, ...], ...]] = {
    "LlamaAttention": _QKV, "MistralAttention": _QKV, "Qwen2Attention": _QKV, "Qwen3Attention": _QKV,
    "Qwen3_5Attention": _QKV,
    "LlamaMLP": _GATE_UP, "MistralMLP": _GATE_UP, "Qwen2MLP": _GATE_UP, "Qwen3MLP": _GATE_UP, "Qwen3_5MLP": _GATE_UP,
    "Qwen3_5GatedDeltaNet": (("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a")),
}

#: (is_compiling, is_tracing): a patched forward in eager mode runs when neither is true
_TRACING = (torch.compiler.is_compiling, torch._C._is_tracing)


def _op_call(op: str) -> Callable[..., Any]:
    """How a patched forward calls ``torch.ops.tunekit.<op>``: in eager mode, the op's own
    run-time impl directly; under ``torch.compile``/export/``jit.trace``, the op.

    The impl is what torch's dispatcher would run for a CUDA or CPU tensor (the op is registered
    with one Python impl for both keys, ``tunekit.dispatch.registry``); calling it directly skips
    only the dispatch itself, which costs ~3-4 us per call (H200 host, h200-decode-944f424)
    against a ~4 us tuned GEMV. Traced code must see the opaque op (one node, no branch on M),
    so a tensor subclass (fake, functional, proxy) or any tracing takes the op. (The linears
    inline this, with an :class:`~tunekit.dispatch.gemv.EagerLinear` per module as the impl.)
    """
    from tunekit.dispatch.elementwise import ELEMENTWISE_IMPLS

    impl = ELEMENTWISE_IMPLS[op][0]
    traced = getattr(torch.ops.tunekit, op)
    (is_compiling, is_tracing), plain = _TRACING, torch.Tensor

    def call(x: torch.Tensor, *args: Any) -> Any:
        if type(x) is plain and not is_compiling() and not is_tracing():
            return impl(x, *args)
        return traced(x, *args)

    return call


def _eps(module: nn.Module) -> float:
    # HF spells it variance_epsilon (Llama, Qwen2/3, the gated norms) or eps (Qwen3.5 / Qwen3-Next).
    return float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))


def _norm_forward(op: str) -> Callable[[nn.Module], Callable[..., Any]]:
    def factory(module: nn.Module) -> Callable[..., Any]:
        from tunekit.dispatch.elementwise import EagerNorm

        original = module.forward
        eps = _eps(module)
        # _op_call(op), inlined, with this module's own EagerNorm as the impl
        eager, traced = EagerNorm(op == "gemma_rms_norm", eps), getattr(torch.ops.tunekit, op)
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


def _needs_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _linear_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    from tunekit.dispatch.gemv import EagerLinear

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


def _folded_norm_forward(hidden_states: torch.Tensor) -> torch.Tensor:
    """A norm folded into its consumers: x passes on; each consumer computes 1/rms itself."""
    return hidden_states


def _folded_linear_forward(module: nn.Linear, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """A consumer of a folded norm: ``rms_gemv`` on its input and its folded weight W diag(g')."""
    from tunekit.dispatch.fused_gemv import rms_gemv_impl, unweighted_rms_norm

    traced = torch.ops.tunekit.rms_gemv
    (is_compiling, is_tracing), plain, grad_enabled = _TRACING, torch.Tensor, torch.is_grad_enabled

    def forward(input: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if grad_enabled() and _needs_autograd(input, weight):
            return F.linear(unweighted_rms_norm(input, eps), weight)
        if type(input) is plain and not is_compiling() and not is_tracing():
            return rms_gemv_impl(input, weight, eps)
        return traced(input, weight, eps)

    return forward


def _fold_plan(model: nn.Module) -> list[tuple[nn.Module, str, list[nn.Linear]]]:
    """(norm, its op, its consumers) for every norm of a ``FOLDABLE_LAYERS`` layer that can be folded:
    a plain or zero-centred RMSNorm whose consumers are all bias-free linears of its dtype and width."""
    plan = []
    for layer in model.modules():
        for norm_name, paths in FOLDABLE_LAYERS.get(type(layer).__name__, ()):
            norm = getattr(layer, norm_name, None)
            op = ELEMENTWISE_ROUTES.get(type(norm).__name__)
            if op not in ("rms_norm", "gemma_rms_norm") or getattr(norm, _ROUTE, None):
                continue
            consumers = [layer.get_submodule(p) for p in paths if _has_submodule(layer, p)]
            weight = norm.weight
            if not consumers or any(
                    not isinstance(c, nn.Linear) or c.bias is not None or getattr(c, _ROUTE, None)
                    or c.weight.dtype != weight.dtype or c.weight.shape[1] != weight.shape[0]
                    or c.weight.device != weight.device for c in consumers):
                continue
            plan.append((norm, op, consumers))
    return plan


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _fold_pays(op: str, norm: nn.Module, consumers: list[nn.Linear]) -> bool:
    """Whether the tables' M=1 entries say the folded consumers beat the tuned norm and GEMVs (a step
    no table serves counts 0 us, so the vendor part is never the fold's excuse)."""
    from tunekit.dispatch.fused_gemv import fold_pays

    return fold_pays((op,), norm.weight, [tuple(c.weight.shape) for c in consumers])


def _fold(norm: nn.Module, op: str, consumers: list[nn.Linear]) -> None:
    """Fold ``norm``'s weight into each consumer's (W diag(g), Gemma diag(1 + g), rounded once to the
    weight's dtype) and route the norm to the identity and the consumers to ``rms_gemv``.

    The folded weight is a new Parameter on the consumer (the original one is kept for ``unpatch``, so
    a module tree sharing the original parameters, as ``tunekit check-serving``'s unpatched twin, is
    untouched): the consumers' weights take twice their memory while patched."""
    g = norm.weight.detach().float()
    scale = 1.0 + g if op == "gemma_rms_norm" else g
    eps = _eps(norm)
    for c in consumers:
        original = c.weight
        object.__setattr__(c, _FOLD_SAVED, original)
        c.weight = nn.Parameter((original.detach().float() * scale).to(original.dtype), requires_grad=False)
        _set_forward(c, "rms_gemv", _folded_linear_forward(c, eps))
    _set_forward(norm, f"{op} folded", _folded_norm_forward)


def _set_forward(module: nn.Module, route: str, forward: Callable[..., Any]) -> None:
    # An instance attribute may already be there (accelerate hooks set one): keep it to restore,
    # and restore "no attribute" otherwise.
    previous = module.__dict__.get("forward")
    saved = ("instance", previous) if previous is not None else ("class", None)
    object.__setattr__(module, _SAVED, saved)
    object.__setattr__(module, _ROUTE, route)
    module.forward = forward


class _MergedGemv:
    """The one GEMV a group of sibling linears shares: the first sibling called on an input runs it over
    the stacked weights and keeps the output; the others return their slices of it.

    A kept output is reused only for the very tensor it was computed from (``is``), and, in eager mode,
    only while that tensor is unmodified (its version counter; an inference-mode tensor has none, so
    there identity alone decides, as in traced code); it is dropped once every other sibling has taken
    its slice. So a sibling called alone, out of order, or on another input still gets its
    right rows (at the cost of the whole GEMV). Under ``torch.compile`` the bookkeeping is traced away:
    the graph holds one ``tunekit.gemv`` per group and the slices."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, members: int) -> None:
        from tunekit.dispatch.gemv import EagerLinear

        self.weight, self.bias, self.members = weight, bias, members
        self.eager = EagerLinear()
        self.input: torch.Tensor | None = None
        self.version = -1
        self.output: torch.Tensor | None = None
        self.pending = 0  # siblings still to take their slice of ``output``

    def __call__(self, input: torch.Tensor, eager: bool) -> torch.Tensor:
        if self.input is input and self.pending > 0 and (not eager or self.version == _version(input)):
            output = self.output
            self.pending -= 1
            if self.pending == 0:
                self.input = self.output = None
            return output
        output = (self.eager(input, self.weight, self.bias) if eager
                  else torch.ops.tunekit.gemv(input, self.weight, self.bias))
        self.input, self.output, self.pending = input, output, self.members - 1
        if eager:
            self.version = _version(input)
        return output


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place change), -1 for an inference-mode tensor (none)."""
    return -1 if t.is_inference() else t._version


def _sibling_forward(module: nn.Linear, merged: _MergedGemv, rows: slice) -> Callable[[torch.Tensor], torch.Tensor]:
    """A merged sibling's forward: its rows of the group's GEMV (a view: the group's output, last dim
    sliced)."""
    (is_compiling, is_tracing), plain, grad_enabled = _TRACING, torch.Tensor, torch.is_grad_enabled

    def forward(input: torch.Tensor) -> torch.Tensor:
        if grad_enabled() and _needs_autograd(input, module.weight, module.bias):
            return F.linear(input, module.weight, module.bias)
        eager = type(input) is plain and not is_compiling() and not is_tracing()
        return merged(input, eager)[..., rows]

    return forward


def _merge_plan(model: nn.Module) -> list[tuple[str, list[nn.Linear]]]:
    """(group label, its linears) for every ``SIBLING_LINEARS`` group that can be merged: unrouted linears of
    one dtype, device and input width, all with a bias or none."""
    plan = []
    for name, owner in model.named_modules():
        for paths in SIBLING_LINEARS.get(type(owner).__name__, ()):
            linears = [getattr(owner, p, None) for p in paths]
            if not all(isinstance(c, nn.Linear) and not getattr(c, _ROUTE, None) for c in linears):
                continue
            first = linears[0].weight
            if any(c.weight.dtype != first.dtype or c.weight.device != first.device
                   or c.weight.shape[1] != first.shape[1] or (c.bias is None) != (linears[0].bias is None)
                   for c in linears):
                continue
            plan.append((f"{name}.{'+'.join(paths)}" if name else "+".join(paths), linears))
    return plan


def _merged_shape(linears: Sequence[nn.Linear]) -> tuple[int, int]:
    return sum(c.weight.shape[0] for c in linears), linears[0].weight.shape[1]


def _merge_pays(linears: Sequence[nn.Linear], only_covered: bool) -> bool:
    """Whether a table serves the merged shape (any M) and, where every sibling has an M=1 entry of its
    own, the merged entry at M=1 is no slower than theirs together. Without ``only_covered`` (every
    module routed anyway) an uncovered merged shape is merged too."""
    from tunekit import ops

    weight = linears[0].weight
    dtype, device = ops.dtype_name(weight.dtype), str(weight.device)
    n, k = _merged_shape(linears)
    if not ops.covers("gemv", dtype, n, k, device):
        return not only_covered
    merged = ops.served_entry("gemv", dtype, 1, n, k, device)
    apart = [ops.served_entry("gemv", dtype, 1, c.weight.shape[0], k, device) for c in linears]
    if merged is None or any(e is None for e in apart):
        return True
    return merged["time_us"] <= sum(e["time_us"] for e in apart)


def _merge(linears: Sequence[nn.Linear]) -> None:
    """Stack the siblings' weights (and biases) into one tensor, make each sibling's parameters views of its
    rows (the values stay the same and the model's memory does not grow; ``unpatch`` copies them out again)
    and route each sibling to its slice of the shared GEMV."""
    with torch.no_grad():
        weight = torch.cat([c.weight.detach() for c in linears])
        bias = None if linears[0].bias is None else torch.cat([c.bias.detach() for c in linears])
    merged = _MergedGemv(weight, bias, len(linears))
    row = 0
    for c in linears:
        rows = slice(row, row + c.weight.shape[0])
        c.weight = nn.Parameter(weight[rows], requires_grad=c.weight.requires_grad)
        if bias is not None:
            c.bias = nn.Parameter(bias[rows], requires_grad=c.bias.requires_grad)
        object.__setattr__(c, _MERGED, merged)
        _set_forward(c, "linear merged", _sibling_forward(c, merged, rows))
        row = rows.stop


def _own_storage(module: nn.Linear) -> None:
    """A merged sibling's parameters back in tensors of their own (copies of its rows: the same values), so
    that the unpatched model shares no storage between linears (safetensors refuses to save that) and the
    stacked tensor is freed with the last sibling."""
    with torch.no_grad():
        module.weight = nn.Parameter(module.weight.detach().clone(), requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            module.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)


def merged_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The (N, K) of every merged GEMV ``patch(merge_siblings=True)`` could run (vLLM's merged shapes,
    what a table needs ``--shape NxK`` entries for), sorted and unique."""
    return sorted({_merged_shape(linears) for _, linears in _merge_plan(model)})


def fold_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The (N, K) of every linear ``patch(fold_norms=True)`` could serve with ``rms_gemv`` (what a
    table needs ``--shape rms_gemv:NxK`` entries for), sorted and unique."""
    return sorted({tuple(c.weight.shape) for _, _, consumers in _fold_plan(model) for c in consumers})


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
    from tunekit.dispatch.state import DTYPE_NAMES

    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in DTYPE_NAMES:
        return False
    dtype, device = ops.dtype_name(weight.dtype), str(weight.device)
    if route == "linear":
        n, k = weight.shape
        return ops.covers("gemv", dtype, n, k, device)
    width = weight.shape[0]
    return ops.covers(route, dtype, None if route == "gated_rms_norm" else width, width, device)


def patch(model: nn.Module, table: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
          only_covered: bool = True, fold_norms: bool = False, merge_siblings: bool = True) -> dict[str, int]:
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

    ``fold_norms``: first, each decoder norm of a ``FOLDABLE_LAYERS`` layer
    whose consumers all have ``rms_gemv`` entries, and whose entries at M=1
    beat the tuned norm and GEMVs they replace, is folded: its weight goes
    into the consumers' weights (W diag(g), or diag(1 + g) for Qwen3.5's
    zero-centred norm; new weight tensors, the originals kept for ``unpatch``),
    the norm passes its input on and each consumer runs
    ``rms_gemv``, which computes 1/rms itself: no norm kernel runs. The
    numerics move by one BF16 rounding of W diag(g') instead of one of the
    normalised activation. Counted as ``"rms_gemv"`` and
    ``"<norm op> folded"``; a token count the table lacks runs the norm's
    math then the vendor GEMM per consumer.

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
        loaded = ops.load_tables(table)
        errors = [row for row in loaded if row.get("error")]
        if errors:
            from tunekit.table import TableError

            raise TableError(errors[0]["error"])
    counts: dict[str, int] = {}
    if fold_norms:
        for norm, op, consumers in _fold_plan(model):
            if not _fold_pays(op, norm, consumers):
                counts[f"{op} (fold not in the tables or not paying)"] = counts.get(
                    f"{op} (fold not in the tables or not paying)", 0) + 1
                continue
            _fold(norm, op, consumers)
            counts[f"{op} folded"] = counts.get(f"{op} folded", 0) + 1
            counts["rms_gemv"] = counts.get("rms_gemv", 0) + len(consumers)
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
    for module in model.modules():
        saved = module.__dict__.get(_SAVED)
        if saved is None:
            continue
        kind, previous = saved
        if kind == "instance":
            module.forward = previous
        else:
            module.__dict__.pop("forward", None)
        unfolded = module.__dict__.pop(_FOLD_SAVED, None)
        if unfolded is not None:
            module.weight = unfolded
        if module.__dict__.pop(_MERGED, None) is not None:
            _own_storage(module)
        module.__dict__.pop(_SAVED, None)
        module.__dict__.pop(_ROUTE, None)
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
