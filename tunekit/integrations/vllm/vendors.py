"""vLLM's own kernels as the vendor path of tunekit's elementwise ops, where the plugin serves a layer.

Inside a covered layer's op, per call (M is dynamic under vLLM's compile): a
tuned kernel where the table has one for this M, else the fallback (M above
the table under vLLM's dynamic-M graph, a capture before build, ...), which
runs what vLLM itself would have run: vLLM's own kernels for the elementwise
ops (``torch.ops._C.rms_norm``, ``torch.ops._C.silu_and_mul``, the FLA
gated-norm Triton kernel) where vLLM enables that custom op. Their PyTorch
composition would be several launches inside an opaque op, where vLLM runs
one kernel, so :func:`install_vendor_kernels` installs vLLM's kernels there
(``tunekit.ops.set_vendor_elementwise``). Each is feature-detected: names
differ between vLLM releases, and a vLLM without its ``_C`` extension (CPU
wheels) has none.

Where vLLM does not enable the custom op (the default under Inductor: vLLM
compiles the native math to one kernel) tunekit's default-config kernel
comes first and vLLM's kernel only after it (:func:`tell_engine_path`, told
by each CustomOp at construction). Where vLLM has none (GemmaRMSNorm runs
its native math, which vLLM's Inductor compiles to one kernel; CPU wheels
lack ``_C``) tunekit's own Triton kernel at the op's default config serves,
one launch as well (``vendor: "tunekit:triton-default"``, see
``tunekit.dispatch.elementwise_fallback._ew_default``), and the op's PyTorch
composition only where that cannot (``vendor: "eager:..."`` says why).
vLLM's fused add + RMSNorm works in place, so served functionally it is two
launches (an add, then ``_C.rms_norm``): there the default-config kernel
comes first and this path only where it cannot serve
(:data:`_MULTI_LAUNCH_VENDORS`). Every call is counted with its impl and the
vendor that served it.

Call protocol (``custom_ops`` calls both)::

    why = install_vendor_kernels(("rms_norm", "fused_add_rms_norm"))   # what was found, for the log
    tell_engine_path(("rms_norm", "fused_add_rms_norm"), custom_op_enabled)

No vLLM import at module level: each resolver imports what it looks for, at install.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from tunekit.integrations.vllm.state import logger

__all__ = ["VendorKernel", "install_vendor_kernels", "tell_engine_path"]


def tell_engine_path(ops_served: tuple[str, ...], custom_op_enabled: bool) -> None:
    """Tell tunekit's ops whether vLLM runs their vendor kernel in this process (its CustomOp's
    ``enabled()``, as ``dispatch_forward`` reads it). Never raises: a layer's construction must not fail."""
    try:
        from tunekit import ops

        for op in ops_served:
            ops.set_engine_runs_vendor(op, custom_op_enabled)
    except Exception as exc:  # the vendor kernel keeps serving first, as before this was known
        logger.warning("tunekit: could not record vLLM's custom-op choice for %s: %s: %s",
                       "/".join(ops_served), type(exc).__name__, exc)


#: torch device type -> the dispatch key whose kernel serves its tensors
_DISPATCH_KEYS: dict[str, str] = {"cuda": "CUDA", "cpu": "CPU"}

#: (function with the tunekit op's signature, the markers' name, device types it serves)
VendorKernel = tuple[Callable[..., Any], str, frozenset[str]]


def _torch_op(namespace: str, name: str) -> tuple[Any, frozenset[str]] | None:
    """``torch.ops.<namespace>.<name>`` and the device types it has a kernel for, or None."""
    try:
        op = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None
    qualname = f"{namespace}::{name}"
    devices = set()
    for device_type, key in _DISPATCH_KEYS.items():
        for dispatch_key in (key, "CompositeExplicitAutograd", "CompositeImplicitAutograd"):
            try:
                if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, dispatch_key):
                    devices.add(device_type)
                    break
            except Exception:  # a torch without this query: the op is not trusted on any device
                break
    return (op, frozenset(devices)) if devices else None


def _load_vllm_kernels() -> None:
    # Loads vLLM's compiled extensions (torch.ops._C.*): library loading only,
    # no CUDA context. Importing vllm.model_executor.layers.layernorm already
    # does it in the vLLM releases seen so far; this covers the others.
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()
    except Exception:
        logger.debug("tunekit vLLM plugin: vLLM's kernels not loaded", exc_info=True)


def _vllm_has_triton() -> bool:
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return importlib.util.find_spec("triton") is not None
    return bool(HAS_TRITON)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous [rows, width] (a view unless x has odd strides): vLLM's kernels index rows densely."""
    return (x if x.is_contiguous() else x.contiguous()).view(-1, x.shape[-1])


def _vllm_rms_norm() -> VendorKernel | str:
    found = _torch_op("_C", "rms_norm")
    if found is None:
        return "no torch.ops._C.rms_norm (vLLM's _C extension is not loaded here)"
    kernel, devices = found

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x)
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        kernel(out, rows, weight, eps)
        return out.view(x.shape)

    return rms_norm, "torch.ops._C.rms_norm", devices


def _vllm_fused_add_rms_norm() -> VendorKernel | str:
    found = _torch_op("_C", "rms_norm")
    if found is None:
        return "no torch.ops._C.rms_norm (vLLM's _C extension is not loaded here)"
    kernel, devices = found

    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's _C.fused_add_rms_norm works in place on x and residual, and
        # the tunekit op is functional: copying both first would cost more
        # than this add. That kernel rounds the sum to x's dtype before
        # normalising, as this add does, so the results agree.
        total = _rows(x + residual)
        out = torch.empty(total.shape, dtype=x.dtype, device=x.device)
        kernel(out, total, weight, eps)
        return out.view(x.shape), total.view(x.shape)

    return fused_add_rms_norm, "torch.ops._C.rms_norm(x + residual)", devices


def _vllm_silu_and_mul() -> VendorKernel | str:
    found = _torch_op("_C", "silu_and_mul")
    if found is None:
        return "no torch.ops._C.silu_and_mul (vLLM's _C extension is not loaded here)"
    kernel, devices = found

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        x = x if x.is_contiguous() else x.contiguous()
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        kernel(out, x)
        return out

    return silu_and_mul, "torch.ops._C.silu_and_mul", devices


def _vllm_gated_rms_norm() -> VendorKernel | str:
    # What vLLM's RMSNormGated.forward_cuda runs: the FLA Triton kernel,
    # wrapped as torch.ops.vllm.fla_rms_norm_gated in newer releases and
    # called as layernorm_guard.rmsnorm_fn in older ones.
    if not _vllm_has_triton():
        return "vLLM has no Triton here (its gated norm is the FLA Triton kernel)"
    found = _torch_op("vllm", "fla_rms_norm_gated")
    if found is not None:
        kernel, devices = found

        def gated_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            k = weight.shape[0]  # one group of len(weight) per row, norm before the gate, as the tunekit op
            return kernel(x.reshape(-1, k), z.reshape(-1, k), weight, eps, None, True, "silu").view(x.shape)

        return gated_op, "torch.ops.vllm.fla_rms_norm_gated", devices
    try:
        from vllm.third_party.flash_linear_attention.ops.layernorm_guard import rmsnorm_fn
    except Exception:
        return "neither torch.ops.vllm.fla_rms_norm_gated nor layernorm_guard.rmsnorm_fn in this vLLM"

    def gated_fn(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        k = weight.shape[0]
        return rmsnorm_fn(x.reshape(-1, k), weight, None, z=z.reshape(-1, k), eps=eps, group_size=None,
                          norm_before_gate=True, activation="silu").view(x.shape)

    return gated_fn, "vllm layernorm_guard.rmsnorm_fn", frozenset({"cuda"})


def _no_gemma_kernel() -> str:
    return "vLLM's GemmaRMSNorm has no kernel of its own: its forward_cuda runs the native math"


#: tunekit elementwise op -> how to find vLLM's kernel for its fallbacks (or why there is none)
_VENDOR_RESOLVERS: dict[str, Callable[[], VendorKernel | str]] = {
    "rms_norm": _vllm_rms_norm,
    "fused_add_rms_norm": _vllm_fused_add_rms_norm,
    "gemma_rms_norm": _no_gemma_kernel,
    "gemma_fused_add_rms_norm": _no_gemma_kernel,
    "gated_rms_norm": _vllm_gated_rms_norm,
    "silu_and_mul": _vllm_silu_and_mul,
}


#: Ops whose vLLM path above is several launches: the op serves its fallbacks with tunekit's
#: default-config kernel (one launch) first, and this path only where that cannot serve.
_MULTI_LAUNCH_VENDORS = frozenset({"fused_add_rms_norm"})


def install_vendor_kernels(ops_needed: tuple[str, ...]) -> str:
    """Install vLLM's kernel as the vendor path of each op in ``ops_needed``; returns what was found."""
    from tunekit import ops

    _load_vllm_kernels()
    found_parts = []
    for op in ops_needed:
        resolver = _VENDOR_RESOLVERS.get(op)
        try:
            found = resolver() if resolver is not None else "no vLLM kernel known for this op"
        except Exception as exc:  # a detection that fails is "no vLLM kernel", never a lost hook
            found = f"detection failed: {type(exc).__name__}: {exc}"
        if isinstance(found, str):
            ops.set_vendor_elementwise(op, None, found)
            found_parts.append(f"{op}: no vLLM kernel ({found}): tunekit's default-config Triton kernel, "
                               "else the PyTorch composition")
        else:
            fn, name, devices = found
            single = op not in _MULTI_LAUNCH_VENDORS
            ops.set_vendor_elementwise(op, fn, name, devices, single_launch=single)
            found_parts.append(f"{op}: {name} on {'/'.join(sorted(devices))}"
                               + ("" if single else " (after tunekit's default-config Triton kernel, one launch)"))
    return "; ".join(found_parts)
