"""The vLLM plugin's out-of-tree CustomOps: vLLM's norms and activation served by tunekit's ops.

Hooks ``RMSNorm``, ``GemmaRMSNorm``, ``RMSNormGated`` and ``SiluAndMul``:
``CustomOp.register_oot`` subclasses of vLLM's classes (:data:`OOT_SPECS`).
Each keeps the forward vLLM's own class would use (``dispatch_forward`` with
vLLM's ``enabled()`` for the in-tree name: ``forward_cuda`` when the custom
op is on, ``forward_native`` - compiled where vLLM compiles it - when off, as
under inductor) and puts the coverage check (``coverage``) in front of it: a
covered layer (an entry for its op, dtype and width; a plain layout) calls
the tunekit op, on the platforms whose enabled forward is ``forward_cuda`` /
``forward_hip``; every other layer runs that stock forward. Installed only
for ops ``tunekit.ops`` defines. Inside a covered layer's op, the fallbacks
run vLLM's own kernels where it has them (``vendors``, installed with the
subclass). A norm the load-time fold folded (``marks.FOLDED``) passes x on.

Call protocol::

    done, why = oot_installer("RMSNorm")()   # the plugin's hook per name in OOT_SPECS; idempotent
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from tunekit.integrations.vllm import coverage
from tunekit.integrations.vllm.fold import folded_norm_forward
from tunekit.integrations.vllm.marks import FOLDED
from tunekit.integrations.vllm.state import MARK, env_flag
from tunekit.integrations.vllm.vendors import install_vendor_kernels, tell_engine_path
from tunekit.problems import oprecords

__all__ = ["OOT_SPECS", "oot_installer"]


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


def _same_rows(a: torch.Tensor, x: torch.Tensor) -> bool:
    """a matches x in dtype and in every dim but the token dim. That one is dynamic and never compared
    here, so no shape check enters the traced graph; the op itself rejects a token-count mismatch."""
    return a.dtype == x.dtype and a.dim() == x.dim() and a.shape[1:] == x.shape[1:]


def _norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                plain_op: str, fused_op: str) -> Any:
    """The tunekit op for a norm (``plain_op``) or fused add + norm (``fused_op``), or None (stock method).

    ``weight`` is the layer's parameter: only its static shape and dtype are
    read until the layer is known to be covered, so an uncovered layer adds
    nothing to the traced graph (not even a ``.data`` access).
    """
    n = weight.shape[0]
    op = plain_op if residual is None else fused_op
    # coverage first: an uncovered layer (the common case) leaves after the fewest checks in eager mode
    if x.shape[-1] != n or not coverage.covered(op, x, n, n) or not _x_ok(x, weight) or not _rows_even(x) \
            or coverage.eager_above_tables(op, x, n, n):
        return None
    eps = float(self.variance_epsilon)
    if residual is None:
        return getattr(torch.ops.tunekit, plain_op)(x, weight.data, eps)
    if not _same_rows(residual, x):
        return None
    out, res = getattr(torch.ops.tunekit, fused_op)(x, residual, weight.data, eps)
    return out, res


def _rms_norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """tunekit op for RMSNorm's plain cases, or None (the stock method runs)."""
    if (getattr(self, "variance_size_override", None) is not None or not getattr(self, "has_weight", True)
            or not isinstance(self.weight, torch.Tensor) or self._tunekit_batch_invariant):
        return None
    return _norm_route(self, x, residual, self.weight, "rms_norm", "fused_add_rms_norm")


def _gemma_rms_norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    return _norm_route(self, x, residual, self.weight, "gemma_rms_norm", "gemma_fused_add_rms_norm")


def _rms_norm_gated_route(self: Any, x: torch.Tensor, z: torch.Tensor | None = None) -> Any:
    # tunekit's gated_rms_norm: y = rms_norm(x) * w * silu(z), one group (norm before gate).
    hidden = self.weight.shape[0]
    if (z is None or not self.norm_before_gate or self.activation not in ("swish", "silu")
            or self.group_size not in (None, hidden) or x.shape[-1] != hidden):
        return None
    # Matched by row width (head_dim) alone, as the torch patch does: vLLM 0.26's Qwen3.5 passes
    # [T * H, D] (flattened before the norm; no head count left to form the table's N = H * D), the
    # 0.33 Qwen3-Next path [T, H, D]. The op serves either row layout from the table's entries per M;
    # the eager check above the tables counts rows of D, since that layout does not tell T.
    if (not coverage.covered("gated_rms_norm", x, None, hidden) or not _x_ok(x, self.weight) or not _same_rows(z, x)
            or not _rows_even(x, 2 if x.dim() >= 3 else 1) or not _rows_even(z, 2 if z.dim() >= 3 else 1)
            or coverage.eager_above_tables("gated_rms_norm", x, None, hidden, by_rows=True)):
        return None
    return torch.ops.tunekit.gated_rms_norm(x, z, self.weight, float(self.eps))


def _silu_and_mul_route(self: Any, x: torch.Tensor) -> Any:
    k = x.shape[-1]
    if k % 2 or not coverage.covered("silu_and_mul", x, k // 2, k) \
            or coverage.eager_above_tables("silu_and_mul", x, k // 2, k):  # covered: tabulated dtypes only
        return None
    return torch.ops.tunekit.silu_and_mul(x)


#: vLLM class -> (its module, its route). Extension point: a new vLLM CustomOp is one line here, a route
#: returning None where the tunekit op does not apply, and the class as ``vllm_hook`` of its ops' records.
_OOT_CLASSES: dict[str, tuple[str, Callable[..., Any]]] = {
    "RMSNorm": ("vllm.model_executor.layers.layernorm", _rms_norm_route),
    "GemmaRMSNorm": ("vllm.model_executor.layers.layernorm", _gemma_rms_norm_route),
    "RMSNormGated": ("vllm.model_executor.layers.layernorm", _rms_norm_gated_route),
    "SiluAndMul": ("vllm.model_executor.layers.activation", _silu_and_mul_route),
}

#: vLLM class -> (module, tunekit ops it needs: the ops whose record names the class as its vLLM hook, route)
OOT_SPECS: dict[str, tuple[str, tuple[str, ...], Callable[..., Any]]] = {
    name: (module, oprecords.names(hook=name), route) for name, (module, route) in _OOT_CLASSES.items()}


def _tunekit_op_defined(op: str) -> bool:
    try:
        getattr(torch.ops.tunekit, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def oot_installer(class_name: str) -> Callable[[], tuple[bool, str]]:
    """The hook of vLLM's CustomOp ``class_name``: registers its tunekit subclass and vLLM's kernels as its
    ops' vendor path. The installer returns (installed, what it does) or (False, why not)."""

    def install() -> tuple[bool, str]:
        module_name, needed, route = OOT_SPECS[class_name]
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
        for method in ("forward_cuda", "forward_native", "enabled", "dispatch_forward"):
            if not hasattr(base, method):
                return False, f"{class_name} has no {method} in this vLLM"
        current = registry.get(class_name)
        if current is not None:
            if getattr(current, MARK, False):
                return True, "already registered in this process"
            return False, f"another plugin registered {class_name} ({current.__module__}.{current.__qualname__})"
        subclass = _make_oot_subclass(base, route, needed)
        base.register_oot(subclass, name=class_name)
        try:
            fallbacks = install_vendor_kernels(needed)
        except Exception as exc:  # the subclass is in: report it, with tunekit's own fallbacks
            fallbacks = (f"tunekit's default-config Triton kernel, else the PyTorch composition (looking for "
                         f"vLLM's kernels failed: {type(exc).__name__}: {exc})")
        return True, (f"{subclass.__name__}: covered layers -> torch.ops.tunekit.{'/'.join(needed)}, the others "
                      f"vLLM's own forward; fallback {fallbacks}")

    return install


def _make_oot_subclass(base: type, route: Callable[..., Any], ops_served: tuple[str, ...] = ()) -> type:
    """A subclass of vLLM's ``base`` that serves covered layers by ``route`` and is ``base`` for the others.

    vLLM picks a CustomOp's forward once, at construction
    (``dispatch_forward``: the platform's ``forward_cuda`` when the op is
    enabled, else ``forward_native``, compiled where vLLM compiles it). The
    subclass keeps that choice, made by vLLM's own rule for the in-tree class,
    as the stock forward and puts in front of it a check of static facts
    (width, dtype, layout, tables: fixed per layer, so decided once per
    trace): a layer the tables cover reaches the tunekit op; any other runs
    the stock forward, exactly what ``base`` would have run, so its traced
    graph is the stock one (vLLM's kernel, or the native math inductor fuses).

    The same choice tells the ops in ``ops_served`` whether vLLM itself
    would run their vendor kernel (``tunekit.ops.set_engine_runs_vendor``):
    with the custom op off, a covered layer's fallbacks are served by
    tunekit's default-config kernel first, as fast as the kernel Inductor
    makes of the native math, not by vLLM's ``_C`` kernel, which vLLM would
    not have run there.
    """
    # vLLM's decision for the in-tree class: its registered name ("rms_norm")
    # is what custom_ops spells ("+rms_norm"); the subclass is registered
    # under the class name ("RMSNorm"), which CustomOp.enabled would look up.
    stock_enabled = base.enabled

    def enabled(cls: type) -> bool:
        return stock_enabled()

    def dispatch_forward(self: Any, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        self._tunekit_stock_forward = super(subclass, self).dispatch_forward(*args, **kwargs)
        tell_engine_path(ops_served, bool(getattr(self, "_enforce_enable", False) or type(self).enabled()))
        self._tunekit_routes = _routes_on_platform()
        # Read once per layer, not per call (vLLM's env lookup costs microseconds; it is fixed per process).
        self._tunekit_batch_invariant = env_flag("VLLM_BATCH_INVARIANT", False)
        return self._tunekit_forward

    def _tunekit_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, FOLDED, False):  # its weight lives in its consumers' now: never the stock forward
            return folded_norm_forward(*args, **kwargs)
        if self._tunekit_routes:
            out = route(self, *args, **kwargs)
            if out is not None:
                return out
        return self._tunekit_stock_forward(*args, **kwargs)

    subclass = type(
        f"Tunekit{base.__name__}",
        (base,),
        {
            "dispatch_forward": dispatch_forward,
            "_tunekit_forward": _tunekit_forward,
            "enabled": classmethod(enabled),
            "__module__": __name__,
            "__doc__": f"vLLM {base.__name__} served by tunekit's ops where the tables cover the layer "
                       f"(tunekit vLLM plugin); vLLM's own {base.__name__} elsewhere.",
            MARK: True,
        },
    )
    return subclass


def _routes_on_platform() -> bool:
    """True where vLLM runs an enabled CustomOp's forward_cuda / forward_hip: the platforms tunekit's ops serve."""
    try:
        from vllm.platforms import current_platform
    except Exception:
        return False
    for probe in ("is_cpu", "is_tpu", "is_xpu", "is_out_of_tree"):
        check = getattr(current_platform, probe, None)
        try:
            if check is not None and check():
                return False
        except Exception:
            return False
    return True
