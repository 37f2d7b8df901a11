"""``patch(merge_siblings=True)``: the linears a Hugging Face module calls on one input (q/k/v, gate/up ...)
served as one GEMV of vLLM's merged shape, each sibling returning its rows of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tunekit.integrations.torch_routes import _ROUTE, _TRACING, _needs_autograd, _set_forward

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
        from tunekit.ops import EagerLinear

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
    return merged.time_us <= sum(e.time_us for e in apart)


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
