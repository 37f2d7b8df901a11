"""vLLM general plugin: serve tunekit's dispatch tables inside vLLM.

Installed as the entry point ``tunekit`` of the group ``vllm.general_plugins``
(pyproject.toml), so ``vllm.plugins.load_general_plugins()`` calls
:func:`register` in every vLLM process (API server, engine core, workers).

Call protocol::

    TUNEKIT_TABLE=runs/x/table.json TUNEKIT_DISPATCH_LOG=/tmp/dispatch-{pid}.json vllm serve ...
    # or, in a script: import vllm.plugins; vllm.plugins.load_general_plugins()
    tunekit.integrations.vllm_plugin.installed()   # {"linear": "...", "RMSNorm": "...", ...} hook -> what it does

Guarantees (an exception escaping a general plugin stops vLLM's start-up):

* idempotent per process: a second :func:`register` is a no-op;
* catches its own exceptions: a hook that cannot be installed is skipped
  and logged, the others still go in;
* touches no GPU at load: ROCm is told by ``torch.version.hip`` and the
  tables are read at the first op call, not here;
* logs once, at INFO, which hooks it installed and which it skipped and why.

Hooks:

* ``linear``: the function ``dispatch_unquantized_gemm`` is wrapped and the
  wrapper is bound where vLLM imported it (``layers.utils``, ``layers.linear``,
  ``layers.vocab_parallel_embedding``), so both the per-call use (older vLLM,
  the vocab embedding's ``dispatch_unquantized_gemm()(layer, x, w, b)``) and
  the bind-at-construction use of vLLM 0.33 (``UnquantizedLinearMethod.
  _gemm_impl``) go through tunekit. The wrapped GEMM calls
  ``torch.ops.tunekit.gemv(x, weight, bias)`` when vLLM picked its plain
  path (``default_unquantized_gemm`` = ``F.linear`` on CUDA,
  ``rocm_unquantized_gemm`` on ROCm); the op chooses tuned kernel or vendor
  path inside, at run time. On ROCm the op's vendor path is vLLM's own
  ``torch.ops.vllm.rocm_unquantized_gemm`` (LLMM1 / wvSplitK kept). Other
  paths vLLM may pick (FlashInfer mm_bf16 by ``--linear-backend``, the CPU
  platform's prepacked oneDNN / SGL GEMMs, which drop the weight) are left
  as they are. Off when vLLM's AITER linear path is enabled on ROCm.
* norms and activation: ``CustomOp.register_oot`` subclasses of ``RMSNorm``,
  ``GemmaRMSNorm``, ``RMSNormGated`` and ``SiluAndMul`` whose
  ``forward_cuda`` / ``forward_hip`` call the tunekit elementwise op for the
  layers the loaded tables cover (an entry for the layer's dtype and width at
  some M; decided once per trace) and, for the others, what the stock class would have
  run (``super().forward_cuda`` when vLLM enables the op, else
  ``forward_native``, as under vLLM's default compile mode). ``enabled()``
  is True so that vLLM's compile mode (custom ops off by default) still
  reaches them. Installed only for ops ``tunekit.ops`` defines.

No hook branches on M: vLLM compiles with dynamic token counts and drops
shape guards, so every choice that depends on M is made inside the op. The
static checks here (dtype, hidden size, flags) are fixed per layer.

Every vLLM name is feature-detected; an older vLLM (the forks DCU users run)
missing one gets that hook skipped with a log line naming what is missing.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["installed", "register", "skipped"]

logger = logging.getLogger("tunekit.vllm")

#: Modules that bound ``dispatch_unquantized_gemm`` at import (``from ... import``).
GEMM_DISPATCH_MODULES: tuple[str, ...] = (
    "vllm.model_executor.layers.utils",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
)
_UTILS = GEMM_DISPATCH_MODULES[0]

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"registered": False, "installed": {}, "skipped": {}}
_MARK = "_tunekit_wrapped"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: install the hooks once per process; never raises."""
    with _LOCK:
        if _STATE["registered"]:
            return
        _STATE["registered"] = True
    try:
        installed, skipped = _install()
    except Exception as exc:  # nothing may escape a general plugin
        logger.exception("tunekit vLLM plugin: not installed (%s); vLLM runs without tunekit", exc)
        return
    _STATE["installed"], _STATE["skipped"] = installed, skipped
    logger.info(
        "tunekit vLLM plugin: installed %s; skipped %s; tables from %s=%r (read at the first call)",
        ", ".join(f"{k} ({v})" for k, v in installed.items()) or "nothing",
        ", ".join(f"{k} ({v})" for k, v in skipped.items()) or "nothing",
        "TUNEKIT_TABLE", os.environ.get("TUNEKIT_TABLE", ""),
    )


def installed() -> dict[str, str]:
    """Hook name -> what it does, for the hooks :func:`register` installed in this process."""
    return dict(_STATE["installed"])


def skipped() -> dict[str, str]:
    """Hook name -> why it was not installed."""
    return dict(_STATE["skipped"])


def _install() -> tuple[dict[str, str], dict[str, str]]:
    import tunekit.ops  # noqa: F401 - defines torch.ops.tunekit.* (no GPU work, no table read)

    installed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, hook in (("linear", _install_linear), *[(n, _oot_installer(n)) for n in _OOT_SPECS]):
        try:
            done, why = hook()
        except Exception as exc:  # one failing hook must not cost the others
            logger.debug("tunekit vLLM plugin: hook %s failed", name, exc_info=True)
            done, why = False, f"error: {type(exc).__name__}: {exc}"
        (installed if done else skipped)[name] = why
    return installed, skipped


# ---------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------


def _env_flag(name: str, default: bool) -> bool:
    """vLLM's parse of a boolean env var ("1"/"true"), read from vllm.envs when it knows the name."""
    try:
        import vllm.envs as envs

        return bool(getattr(envs, name))
    except Exception:
        value = os.environ.get(name)
        return default if value is None else value.strip().lower() in ("1", "true")


def _aiter_linear_enabled() -> bool:
    return _env_flag("VLLM_ROCM_USE_AITER", False) and _env_flag("VLLM_ROCM_USE_AITER_LINEAR", True)


def _install_linear() -> tuple[bool, str]:
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
            ops.set_vendor_gemm(lambda x, w, b: rocm_gemm(x, w, b))
            vendor = "torch.ops.vllm.rocm_unquantized_gemm"
    wrapped = _wrap_dispatch(getattr(original, "__wrapped__", original) if getattr(original, _MARK, False)
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
            return _wrap_gemm(impl, plain)
        except Exception:  # never stand between vLLM and its own GEMM
            logger.debug("tunekit vLLM plugin: could not wrap %r", impl, exc_info=True)
            return impl

    setattr(dispatch_unquantized_gemm, _MARK, True)
    return dispatch_unquantized_gemm


def _wrap_gemm(impl: Callable[..., Any], plain: tuple[Callable[..., Any], ...]) -> Callable[..., Any]:
    """The GEMM vLLM picked, routed through ``torch.ops.tunekit.gemv`` when it is vLLM's plain path."""
    if getattr(impl, _MARK, False):
        return impl
    if impl not in plain:
        # FlashInfer mm_bf16, the CPU platform's prepacked GEMMs (weight
        # removed after loading): the op's vendor path could not reproduce
        # them, so they stay vLLM's.
        return impl

    def tunekit_unquantized_gemm(
        layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Static per layer (traced once): no M here; the op decides per call.
        if weight.dim() == 2:
            return torch.ops.tunekit.gemv(x, weight, bias)
        return impl(layer, x, weight, bias)

    setattr(tunekit_unquantized_gemm, _MARK, True)
    tunekit_unquantized_gemm.__wrapped__ = impl  # type: ignore[attr-defined]
    return tunekit_unquantized_gemm


# ---------------------------------------------------------------------------
# norms and activation (CustomOp.register_oot)
# ---------------------------------------------------------------------------


def _x_ok(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Static checks shared by the elementwise routes (dtype fixed per layer)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return weight is None or weight.dtype == x.dtype


def _rows_even(x: torch.Tensor, row_dims: int = 1) -> bool:
    """x views as evenly strided rows of its last ``row_dims`` dims, contiguous inside a row.

    That is the layout the tunekit ops serve with the kernels' row stride.
    vLLM's q/k norms get per-head views of the qkv split ([T, H, D], T stride
    = the qkv width): there the op would run its PyTorch fallback, so those
    layers keep vLLM's own kernel. Only the token dim's size (outermost) may
    vary between calls and it is never compared, so under compilation the
    answer is fixed per layer.
    """
    if x.dim() < row_dims or x.stride(-1) != 1:
        return False
    # inside a row, and the leading dims folded into one row index (all but the innermost leading dim)
    folded = [*range(x.dim() - row_dims, x.dim() - 1), *range(x.dim() - row_dims - 1)]
    return all(x.stride(d) == x.shape[d + 1] * x.stride(d + 1) for d in folded)


def _covers_impl(op: str, dtype: str, n: int, k: int, device: str) -> bool:
    from tunekit import ops

    return ops.covers(op, dtype, n, k, device)


# Evaluated once per trace and baked in as a constant: whether the tables hold
# (op, dtype, N, K) is fixed per layer (N, K are not the token dimension), and
# the table lookup itself (locks, file reads) must not be traced. Layers the
# tables do not cover keep vLLM's own path (its CUDA kernel, or the native
# code inductor fuses), which the op's vendor path would not match.
try:
    _covers = torch.compiler.assume_constant_result(_covers_impl)
except AttributeError:  # torch without torch.compiler: eager only anyway
    _covers = _covers_impl


def _covered(op: str, x: torch.Tensor, n: int, k: int) -> bool:
    from tunekit.ops import dtype_name

    return bool(_covers(op, dtype_name(x.dtype), int(n), int(k), str(x.device)))


def _norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                plain_op: str, fused_op: str) -> Any:
    """The tunekit op for a norm (``plain_op``) or fused add + norm (``fused_op``), or None (stock method)."""
    n = x.shape[-1]
    if n != weight.shape[0] or not _x_ok(x, weight) or not _rows_even(x):
        return None
    if residual is None:
        if not _covered(plain_op, x, n, n):
            return None
        return getattr(torch.ops.tunekit, plain_op)(x, weight, float(self.variance_epsilon))
    if residual.dtype != x.dtype or residual.shape != x.shape or not _covered(fused_op, x, n, n):
        return None
    out, res = getattr(torch.ops.tunekit, fused_op)(x, residual, weight, float(self.variance_epsilon))
    return out, res


def _rms_norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """tunekit op for RMSNorm's plain cases, or None (the stock method runs)."""
    if (getattr(self, "variance_size_override", None) is not None or not getattr(self, "has_weight", True)
            or _env_flag("VLLM_BATCH_INVARIANT", False)):
        return None
    weight = self.weight.data if isinstance(self.weight, torch.nn.Parameter) else self.weight
    return _norm_route(self, x, residual, weight, "rms_norm", "fused_add_rms_norm")


def _gemma_rms_norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    return _norm_route(self, x, residual, self.weight.data, "gemma_rms_norm", "gemma_fused_add_rms_norm")


def _rms_norm_gated_route(self: Any, x: torch.Tensor, z: torch.Tensor | None = None) -> Any:
    # tunekit's gated_rms_norm: y = rms_norm(x) * w * silu(z), one group (norm before gate).
    hidden = self.weight.shape[0]
    if (z is None or not self.norm_before_gate or self.activation not in ("swish", "silu")
            or self.group_size not in (None, hidden) or x.shape[-1] != hidden or z.shape != x.shape
            or z.dtype != x.dtype or not _x_ok(x, self.weight) or not _rows_even(x, 2 if x.dim() >= 3 else 1)
            or not _rows_even(z, 2 if z.dim() >= 3 else 1)):
        return None
    # The op's table key: rows = leading dims but [heads, head_dim] (vLLM passes [T, H, D]).
    n = hidden * (x.shape[-2] if x.dim() >= 3 else 1)
    if not _covered("gated_rms_norm", x, n, hidden):
        return None
    return torch.ops.tunekit.gated_rms_norm(x, z, self.weight, float(self.eps))


def _silu_and_mul_route(self: Any, x: torch.Tensor) -> Any:
    k = x.shape[-1]
    if k % 2 or not _x_ok(x, None) or not _covered("silu_and_mul", x, k // 2, k):
        return None
    return torch.ops.tunekit.silu_and_mul(x)


#: vLLM class -> (module, tunekit ops it needs, route). Extension point: a new
#: vLLM CustomOp is one line here plus a route returning None where the
#: tunekit op does not apply.
_OOT_SPECS: dict[str, tuple[str, tuple[str, ...], Callable[..., Any]]] = {
    "RMSNorm": ("vllm.model_executor.layers.layernorm", ("rms_norm", "fused_add_rms_norm"), _rms_norm_route),
    "GemmaRMSNorm": ("vllm.model_executor.layers.layernorm", ("gemma_rms_norm", "gemma_fused_add_rms_norm"),
                     _gemma_rms_norm_route),
    "RMSNormGated": ("vllm.model_executor.layers.layernorm", ("gated_rms_norm",), _rms_norm_gated_route),
    "SiluAndMul": ("vllm.model_executor.layers.activation", ("silu_and_mul",), _silu_and_mul_route),
}


def _tunekit_op_defined(op: str) -> bool:
    try:
        getattr(torch.ops.tunekit, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def _oot_installer(class_name: str) -> Callable[[], tuple[bool, str]]:
    def install() -> tuple[bool, str]:
        module_name, needed, route = _OOT_SPECS[class_name]
        missing_ops = [op for op in needed if not _tunekit_op_defined(op)]
        if missing_ops:
            return False, f"tunekit.ops has no {', '.join(missing_ops)} yet"
        try:
            custom_op = importlib.import_module("vllm.model_executor.custom_op")
            registry = custom_op.op_registry_oot
        except (ImportError, AttributeError):
            return False, "this vLLM has no CustomOp.register_oot / op_registry_oot (older fork?)"
        try:
            base = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            return False, f"this vLLM has no {module_name}.{class_name}"
        for method in ("forward_cuda", "forward_native", "enabled"):
            if not hasattr(base, method):
                return False, f"{class_name} has no {method} in this vLLM"
        current = registry.get(class_name)
        if current is not None:
            if getattr(current, _MARK, False):
                return True, "already registered in this process"
            return False, f"another plugin registered {class_name} ({current.__module__}.{current.__qualname__})"
        subclass = _make_oot_subclass(base, route)
        base.register_oot(subclass, name=class_name)
        return True, f"{subclass.__name__}: forward_cuda/forward_hip -> torch.ops.tunekit.{'/'.join(needed)}"

    return install


def _make_oot_subclass(base: type, route: Callable[..., Any]) -> type:
    """A subclass of vLLM's ``base`` that tries ``route`` first and otherwise runs what ``base`` would."""
    # The stock decision: vLLM asks the in-tree class (its registered name,
    # e.g. "rms_norm") whether the custom kernel is on; when it is not (the
    # default under compile mode) the stock class would run forward_native.
    stock_enabled = base.enabled

    def _stock(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._tunekit_stock_enabled:
            return getattr(super(subclass, self), method)(*args, **kwargs)
        return self.forward_native(*args, **kwargs)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        try:
            self._tunekit_stock_enabled = bool(getattr(self, "_enforce_enable", False) or stock_enabled())
        except Exception:  # no vLLM config in scope (unit construction): the custom kernel is vLLM's default
            self._tunekit_stock_enabled = True

    def forward_cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = route(self, *args, **kwargs)
        if out is not None:
            return out
        return _stock(self, "forward_cuda", *args, **kwargs)

    def forward_hip(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = route(self, *args, **kwargs)
        if out is not None:
            return out
        return _stock(self, "forward_hip", *args, **kwargs)

    def enabled(cls: type) -> bool:
        # vLLM's compile mode turns custom ops off by default ("none"); the
        # tunekit ops are opaque nodes that must still be reached.
        return True

    subclass = type(
        f"Tunekit{base.__name__}",
        (base,),
        {
            "__init__": __init__,
            "forward_cuda": forward_cuda,
            "forward_hip": forward_hip,
            "enabled": classmethod(enabled),
            "__module__": __name__,
            "__doc__": f"vLLM {base.__name__} served by tunekit's ops where they apply (tunekit vLLM plugin).",
            _MARK: True,
        },
    )
    return subclass
