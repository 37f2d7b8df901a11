"""``tunekit::gemv``: ``F.linear`` served from the dispatch tables (the op's run-time and fake impls).

Call protocol: :func:`gemv_impl` is the kernel of both device keys
(registered by ``tunekit.serving.registry``). Per call it runs the cheap
checks that need no table (:func:`_gemv_precheck`), reads the decision
cache lock-free (``tunekit.serving.decisions``), launches the tuned kernel
or the vendor path (``F.linear``, or the hook ``set_vendor_gemm``
installed, on GPU tensors), and counts the call once
(``tunekit.serving.markers``). It never raises for tunekit's sake.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunekit.serving.decisions import is_capturing, mark_broken, resolve
from tunekit.serving.markers import count
from tunekit.serving.state import DTYPE_NAMES, STATE, dtype_name


def _gemv_vendor_name(x: torch.Tensor) -> str:
    return STATE.vendor_gemm_name if STATE.vendor_gemm is not None and x.is_cuda else "F.linear"


def _vendor_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    fn = STATE.vendor_gemm
    out = fn(x, weight, bias) if fn is not None and x.is_cuda else F.linear(x, weight, bias)
    # The fake impl promises a contiguous result (compilers plan with it).
    return out if out.is_contiguous() else out.contiguous()


def _gemv_precheck(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Per-call checks that need no table: None if the tuned path may serve the call, else the reason.

    Written for the hot path (every linear of every step runs it in eager
    mode): each tensor attribute is read once.
    """
    wshape, xshape = weight.shape, x.shape
    if len(wshape) != 2 or not xshape or xshape[-1] != wshape[1]:
        return "bad_input"
    xdtype, device = x.dtype, x.device
    if xdtype not in DTYPE_NAMES or weight.dtype != xdtype:
        return "dtype"
    if weight.device != device or device.type not in ("cuda", "cpu"):
        return "device"
    n, k = wshape
    if n == 0 or k == 0 or x.numel() == 0:
        return "empty"
    ws0, ws1 = weight.stride()
    if (k > 1 and (ws1 != 1 or x.stride(-1) != 1)) or ws0 < k:
        return "strided"
    if bias is not None and (
        bias.dim() != 1 or bias.shape[0] != n or bias.dtype != xdtype or bias.device != device
        or not bias.is_contiguous()
    ):
        return "bias"
    return None


def gemv_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA/HIP and CPU kernel of ``tunekit::gemv``: tuned kernel or vendor path, counted."""
    capturing = is_capturing(x)
    has_bias = bias is not None
    dtype = dtype_name(x.dtype)
    wshape = weight.shape
    shape = f"{wshape[0]}x{wshape[1]}" if len(wshape) == 2 else "x".join(map(str, wshape))
    reason = _gemv_precheck(x, weight, bias)
    k = x.shape[-1] if x.dim() else 0
    m = x.numel() // k if k else 0
    x2 = None
    if reason is None:
        try:
            x2 = x.view(m, k)
        except RuntimeError:  # leading dims not flattenable without a copy
            reason = "strided"
    if reason is not None:
        count("gemv", dtype, shape, m, has_bias, f"fallback:{reason}", capturing, _gemv_vendor_name(x))
        return _vendor_gemv(x, weight, bias)
    n = wshape[0]
    # Lock-free read of the decision cache (a dict read is atomic under the GIL);
    # resolve takes the lock only to fill it.
    choice = STATE.choices.get(("gemv", dtype, m, n, k, str(x.device))) or resolve(
        "gemv", dtype, m, n, k, x.device, capturing)
    if choice.kernel is None:
        count("gemv", dtype, shape, m, has_bias, choice.impl, capturing, _gemv_vendor_name(x))
        return _vendor_gemv(x, weight, bias)
    try:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        choice.kernel((x2, weight), out)
        if bias is not None:
            # A separate add (one small elementwise launch): the tables time
            # the GEMV alone; a fused bias epilogue is not a tuned family yet.
            out.add_(bias)
    except Exception as exc:  # the serving path never raises for tunekit's sake
        mark_broken("gemv", dtype, m, n, k, x.device, exc)
        count("gemv", dtype, shape, m, has_bias, "fallback:kernel_error", capturing, _gemv_vendor_name(x))
        return _vendor_gemv(x, weight, bias)
    count("gemv", dtype, shape, m, has_bias, choice.impl, capturing)
    return out.view(*x.shape[:-1], n)


def gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.tunekit.gemv(x, weight, bias)``: ``F.linear`` served from the dispatch tables."""
    return torch.ops.tunekit.gemv(x, weight, bias)

