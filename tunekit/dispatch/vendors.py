"""Vendor paths that integrations install: the GEMM hook and the elementwise vendor kernels.

Call protocol: an integration calls :func:`set_vendor_gemm` (gemv's vendor
path on GPU tensors, default ``F.linear``) and :func:`set_vendor_elementwise`
per op (the kernel that serves the op's fallbacks, or ``fn=None`` with why
none was found); :func:`vendor_kernels` reports what is installed (the
dispatch log embeds it). The op impls read ``STATE.vendor_gemm`` /
``STATE.vendor_ew`` directly on their hot paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from tunekit.dispatch.state import STATE, VendorKernel
from tunekit.problems import oprecords


def set_vendor_gemm(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None,
                    name: str = "custom") -> None:
    """Use ``fn(x, weight, bias)`` as the vendor path for GPU tensors (None: ``F.linear``).

    The vLLM plugin sets vLLM's ``torch.ops.vllm.rocm_unquantized_gemm`` on
    ROCm, so that shapes the table does not cover keep vLLM's skinny GEMMs
    (LLMM1 / wvSplitK). CPU tensors always use ``F.linear``. ``name`` is the
    markers' ``vendor`` for the calls it serves.
    """
    with STATE.lock:
        STATE.vendor_gemm = fn
        STATE.vendor_gemm_name = "F.linear" if fn is None else name
        STATE.epoch += 1


def _check_elementwise(op: str) -> None:
    known = oprecords.names(kind="elementwise", served=True)
    if op not in known:
        raise ValueError(f"unknown elementwise op {op!r}; one of {sorted(known)}")


def set_vendor_elementwise(op: str, fn: Callable[..., Any] | None, name: str,
                           device_types: Iterable[str] = ("cuda",), single_launch: bool = True) -> None:
    """Serve the fallbacks of elementwise ``op`` with ``fn`` on tensors of ``device_types``.

    ``fn`` takes the op's arguments (``rms_norm``: x, weight, eps; the fused
    adds: x, residual, weight, eps; ``gated_rms_norm``: x, z, weight, eps;
    ``silu_and_mul``: x) and returns what the op returns, without modifying
    its inputs. It serves every call the lookup sends to the vendor path (no
    table entry, M above the table, eps, capture before build, ...) once the
    per-call input checks passed; inputs that failed them keep the PyTorch
    composition. The vLLM plugin installs vLLM's own kernels here, so that a
    covered layer at an M the table lacks runs what vLLM would have run
    instead of several eager launches. ``fn=None`` records that an integration
    looked and found none (``name`` says why): those fallbacks are served as
    with nothing installed, by the op's default-config Triton kernel where a
    table serves the device (markers: ``tunekit:triton-default``, see
    :func:`_ew_default`), else by the composition (``eager:no_vendor_kernel``).
    ``name`` is the markers' ``vendor``. ``single_launch=False`` says ``fn`` takes
    several launches: the default-config kernel (one) serves first where it can,
    ``fn`` where it cannot, as it still beats the composition.
    """
    _check_elementwise(op)
    with STATE.lock:
        STATE.vendor_ew[op] = VendorKernel(fn, name, frozenset(device_types), single_launch)


def set_engine_runs_vendor(op: str, runs: bool) -> None:
    """Say whether the engine, without tunekit, would itself run ``op``'s installed vendor kernel.

    The vendor kernel serves a routed layer's fallbacks first because it is
    what the engine would have run. vLLM runs its kernel (``_C.silu_and_mul``,
    ``_C.rms_norm``) only where the op's CustomOp is enabled; under its
    default Inductor compile the op is off and vLLM compiles the native math
    into one bandwidth kernel instead. There the vendor kernel is no longer
    the path to match, and it can be much slower: on the H200 vLLM's
    ``_C.silu_and_mul`` (one block per token) took ~4.5 us per call at
    M=2..8 inside the decode graph, against 1.4-2.1 us for Inductor's kernel
    and for tunekit's default-config kernel (within 2% of Inductor in the
    searches). So with ``runs=False`` tunekit's default-config kernel serves
    the fallbacks first, and the vendor kernel only where that cannot.
    """
    _check_elementwise(op)
    with STATE.lock:
        if runs:
            STATE.vendor_off_engine_path.discard(op)
        else:
            STATE.vendor_off_engine_path.add(op)


def vendor_serves_first(op: str, vk: VendorKernel) -> bool:
    """True if ``vk`` serves ``op``'s fallbacks before tunekit's default-config kernel: one launch, and
    what the engine itself runs (lock-free reads: hot path)."""
    return vk.single_launch and op not in STATE.vendor_off_engine_path


def clear_vendor_elementwise() -> None:
    """Forget every vendor kernel :func:`set_vendor_elementwise` installed (the composition serves again)."""
    with STATE.lock:
        STATE.vendor_ew.clear()
        STATE.vendor_off_engine_path.clear()


def vendor_kernels() -> dict[str, Any]:
    """What serves each op's fallbacks: gemv's vendor and, per elementwise op, the installed kernel."""
    with STATE.lock:
        out: dict[str, Any] = {"gemv": {"name": STATE.vendor_gemm_name if STATE.vendor_gemm else "F.linear",
                                        "device_types": ["cuda"] if STATE.vendor_gemm else ["cuda", "cpu"]}}
        for op, vk in sorted(STATE.vendor_ew.items()):
            out[op] = {"name": vk.name if vk.fn is not None else "eager:no_vendor_kernel",
                       "device_types": sorted(vk.device_types) if vk.fn is not None else [],
                       **({} if vk.fn is not None else {"why": vk.name}),
                       # False: tunekit's default-config kernel serves this op's fallbacks first
                       **({"serves_first": vendor_serves_first(op, vk)} if vk.fn is not None else {})}
    return out


def has_vendor_kernel(op: str, device: torch.device) -> bool:
    """True if an integration installed a vendor kernel for elementwise ``op`` on ``device``'s type that
    serves before the default-config kernel (:func:`vendor_serves_first`)."""
    vk = STATE.vendor_ew.get(op)
    return vk is not None and vk.fn is not None and device.type in vk.device_types and vendor_serves_first(op, vk)

