"""GEMM routing of the vLLM plugin (hook ``linear``): vLLM's plain unquantized GEMM through ``tunekit::gemv``.

The function ``dispatch_unquantized_gemm`` is wrapped and the wrapper is
bound where vLLM imported it (``layers.utils``, ``layers.linear``,
``layers.vocab_parallel_embedding``), so both the per-call use (older vLLM,
the vocab embedding's ``dispatch_unquantized_gemm()(layer, x, w, b)``) and
the bind-at-construction use of vLLM 0.33 (``UnquantizedLinearMethod.
_gemm_impl``) go through tunekit. When vLLM picked its plain path
(``default_unquantized_gemm`` = ``F.linear`` on CUDA,
``rocm_unquantized_gemm`` on ROCm), the wrapped GEMM calls
``torch.ops.tunekit.gemv(x, weight, bias)`` for a weight whose (gemv, dtype,
N, K) the tables cover (``coverage``) and vLLM's ``impl(layer, x, weight,
bias)`` for any other. Inside the op, a call the table does not serve runs
the op's vendor path: ``F.linear``, and on ROCm vLLM's own
``torch.ops.vllm.rocm_unquantized_gemm`` (LLMM1 / wvSplitK kept). Other
paths vLLM may pick (FlashInfer mm_bf16 by ``--linear-backend``, the CPU
platform's prepacked oneDNN / SGL GEMMs, which drop the weight) are left as
they are. Off when vLLM's AITER linear path is enabled on ROCm.

A linear that holds a folded norm (``marks.FOLD_EPS``, set by the load-time
fold) computes ``rms_gemv`` where tabulated, else the unweighted norm then
vLLM's GEMM; a joined sibling (``marks.JOINED_N``) is decided by its joined
row count, for the compile pass to merge its GEMV with its siblings'.

Call protocol::

    done, why = install_linear()     # the plugin's hook; idempotent (MARK on the wrappers)
    wrap_gemm(impl, plain)           # the GEMM vLLM picked, routed when it is one of ``plain``
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from tunekit.integrations.vllm import coverage
from tunekit.integrations.vllm.marks import FOLD_EPS, JOINED_N
from tunekit.integrations.vllm.state import MARK, env_flag, logger

__all__ = ["GEMM_DISPATCH_MODULES", "install_linear", "wrap_gemm"]

#: Modules that bound ``dispatch_unquantized_gemm`` at import (``from ... import``).
GEMM_DISPATCH_MODULES: tuple[str, ...] = (
    "vllm.model_executor.layers.utils",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
)
_UTILS = GEMM_DISPATCH_MODULES[0]


def _aiter_linear_enabled() -> bool:
    return env_flag("VLLM_ROCM_USE_AITER", False) and env_flag("VLLM_ROCM_USE_AITER_LINEAR", True)


def install_linear() -> tuple[bool, str]:
    """The hook ``linear``: ``dispatch_unquantized_gemm`` wrapped wherever vLLM bound it. (installed, what it
    does) or (False, why not)."""
    is_rocm = torch.version.hip is not None
    if is_rocm and _aiter_linear_enabled():
        return False, "VLLM_ROCM_USE_AITER with AITER linear is on: vLLM's AITER GEMMs stay in charge"
    utils = importlib.import_module(_UTILS)
    original = getattr(utils, "dispatch_unquantized_gemm", None)
    if original is None:
        return False, f"this vLLM has no {_UTILS}.dispatch_unquantized_gemm (older fork?): linears stay vLLM's"
    plain = tuple(fn for fn in (getattr(utils, "default_unquantized_gemm", None),
                                getattr(utils, "rocm_unquantized_gemm", None)) if fn is not None)
    if not plain:
        return False, f"this vLLM has neither default_ nor rocm_unquantized_gemm in {_UTILS}"
    from tunekit import ops

    vendor = "F.linear"
    if is_rocm:
        # torch.ops.vllm.rocm_unquantized_gemm is defined when layers.utils is
        # imported (direct_register_custom_op); keep vLLM's skinny GEMMs.
        try:
            rocm_gemm = torch.ops.vllm.rocm_unquantized_gemm
        except (AttributeError, RuntimeError):
            rocm_gemm = None
        if rocm_gemm is not None:
            vendor = "torch.ops.vllm.rocm_unquantized_gemm"
            ops.set_vendor_gemm(lambda x, w, b: rocm_gemm(x, w, b), vendor)
    wrapped = _wrap_dispatch(getattr(original, "__wrapped__", original) if getattr(original, MARK, False)
                             else original, plain)
    places = []
    for module_name in GEMM_DISPATCH_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            logger.debug("tunekit vLLM plugin: %s not importable: %s", module_name, exc)
            continue
        if hasattr(module, "dispatch_unquantized_gemm"):
            module.dispatch_unquantized_gemm = wrapped
            places.append(module_name.rsplit(".", 1)[-1])
    return True, f"dispatch_unquantized_gemm wrapped in {', '.join(places)}; fallback {vendor}"


def _wrap_dispatch(original: Callable[..., Any], plain: tuple[Callable[..., Any], ...]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch_unquantized_gemm(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        impl = original(*args, **kwargs)
        try:
            return wrap_gemm(impl, plain)
        except Exception:  # never stand between vLLM and its own GEMM
            logger.debug("tunekit vLLM plugin: could not wrap %r", impl, exc_info=True)
            return impl

    setattr(dispatch_unquantized_gemm, MARK, True)
    return dispatch_unquantized_gemm


def wrap_gemm(impl: Callable[..., Any], plain: tuple[Callable[..., Any], ...]) -> Callable[..., Any]:
    """The GEMM vLLM picked, routed through ``torch.ops.tunekit.gemv`` when it is vLLM's plain path."""
    if getattr(impl, MARK, False):
        return impl
    if impl not in plain:
        # FlashInfer mm_bf16, the CPU platform's prepacked GEMMs (weight
        # removed after loading): the op's vendor path could not reproduce
        # them, so they stay vLLM's.
        return impl

    def tunekit_unquantized_gemm(
        layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Static per layer (dtype, N, K, device; traced once): no M here, the
        # op decides per call. A linear no loaded table covers runs vLLM's own
        # GEMM, untouched: an opaque op there would only cost (no tuned kernel
        # to gain, and vLLM's compiler passes lose sight of the matmul).
        fold_eps = getattr(layer, FOLD_EPS, None)
        if fold_eps is not None:  # its weight holds a folded norm's: the norm must be applied here
            return _folded_gemm(impl, layer, x, weight, bias, fold_eps)
        n = getattr(layer, JOINED_N, weight.shape[0])  # a joined sibling: the compile pass merges its GEMV
        if weight.dim() == 2 and weight.dtype == x.dtype and coverage.covered("gemv", x, n, weight.shape[1]) \
                and not coverage.eager_above_tables("gemv", x, n, weight.shape[1]):
            return torch.ops.tunekit.gemv(x, weight, bias)
        return impl(layer, x, weight, bias)

    setattr(tunekit_unquantized_gemm, MARK, True)
    tunekit_unquantized_gemm.__wrapped__ = impl  # type: ignore[attr-defined]
    return tunekit_unquantized_gemm


def _folded_gemm(impl: Callable[..., Any], layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A consumer of a folded norm (``tunekit.integrations.vllm.fold``): ``rms_gemv`` where the tables
    cover it, else the unweighted norm then vLLM's own GEMM; the same math either way."""
    k = weight.shape[1]
    n = getattr(layer, JOINED_N, weight.shape[0])  # a joined sibling: the compile pass merges its GEMV
    if coverage.covered("rms_gemv", x, n, k) and not coverage.eager_above_tables("rms_gemv", x, n, k):
        y = torch.ops.tunekit.rms_gemv(x, weight, eps)
        return y if bias is None else y + bias
    from tunekit.ops import unweighted_rms_norm

    return impl(layer, unweighted_rms_norm(x, eps), weight, bias)

