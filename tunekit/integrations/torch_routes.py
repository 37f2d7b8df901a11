"""What every patched forward of ``tunekit.integrations.torch_patch`` shares: which HF modules route to which
op, how a forward calls an op (eager impl or the traced op), and the attributes ``patch`` leaves on a
module (so ``unpatch`` can undo it). The bottom of the torch integration: it imports none of its siblings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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
    # Gemma 3: x / rms(x) * (1 + w) in fp32, rounded once (its q_norm / k_norm too, per head)
    "Gemma3RMSNorm": "gemma_rms_norm",
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
    from tunekit import ops

    impl = ops.impl(op)
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


def _needs_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _set_forward(module: nn.Module, route: str, forward: Callable[..., Any]) -> None:
    # An instance attribute may already be there (accelerate hooks set one): keep it to restore,
    # and restore "no attribute" otherwise.
    previous = module.__dict__.get("forward")
    saved = ("instance", previous) if previous is not None else ("class", None)
    object.__setattr__(module, _SAVED, saved)
    object.__setattr__(module, _ROUTE, route)
    module.forward = forward
