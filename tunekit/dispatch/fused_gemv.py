"""``tunekit::rms_gemv`` and ``tunekit::gemv_add``: the GEMV-family fused ops served from the tables.

* ``rms_gemv(x, weight, eps)``: y = (x / rms(x)) @ weight^T, rms per row of x
  over its K values: the GEMV of an RMSNorm whose weight was folded into
  ``weight`` (``tunekit.problems.opspec_gemv.RMS_GEMV``);
* ``gemv_add(x, weight, residual)``: y = x @ weight^T + residual, the residual
  add in the GEMV's epilogue (``tunekit.problems.opspec_gemv.GEMV_ADD``);
* ``sibling_gemv(x, weights, eps)``: the GEMVs of linears that read the same
  x (``in_proj_qkvz`` and ``in_proj_ba``), as one: y = x @ [W_1; W_2; ...]^T,
  their outputs side by side, ``rms_gemv``'s x / rms(x) where eps is given.
  One launch of the ``gemv`` / ``rms_gemv`` route on the joined weight when
  the weights are consecutive row blocks of one tensor (the load-time layout
  of ``tunekit.integrations.vllm.merge``), else one call per weight.

Call protocol: as ``tunekit::gemv`` (``tunekit.dispatch.gemv``). Per (op, x
shape, weight shape, dtype, device, eps) a :class:`_Route` resolves once: the
checks shapes, dtypes and devices decide, the decision (``resolve``, the M
rule of the tables), the marker rows' counters. Per call: the layout checks
(unit stride along K for x and the weight, x viewable as [M, K]; the
residual [.., N] viewable as [M, N] with unit stride), then the tuned kernel
or the vendor path; a Triton kernel's eager launches go through its bound
launcher from the second eager call on (``tunekit.dispatch.launch``, as the
GEMV's). The fallback is what these ops replace, unfused: the unweighted
norm (fp32, rounded to the activation dtype, as vLLM's native norm; one
launch of the Gemma norm kernel at its default config where a table serves
the device, :func:`_unweighted_norm`, else PyTorch's math) then the GEMV;
the GEMV then the add. The GEMV is ``tunekit::gemv``'s route (tuned where a
table holds the GEMV at this M, else the vendor GEMM: ``F.linear``, or the
GEMM ``set_vendor_gemm`` installed; it counts its own marker row), never
the default-config kernel the elementwise ops fall back to: a GEMV at a
default config loses to the vendor BLAS. Never raises for tunekit's sake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tunekit.dispatch import canary, launch
from tunekit.dispatch.decisions import is_capturing, kernel_takes_eps, mark_broken, resolve
from tunekit.dispatch.gemv import _layout_reason as gemv_layout_reason
from tunekit.dispatch.gemv import _static_reason, gemv_impl
from tunekit.dispatch.markers import count, counter, served_m
from tunekit.dispatch.state import DEFAULT_EPS, DTYPE_NAMES, STATE, dtype_name


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32, rounded to x's dtype: the norm a folded weight (W diag(g)) still needs.
    Plain torch ops, so autograd flows through it too."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)


def fold_pays(norm_ops: tuple[str, ...], norm_weight: torch.Tensor, consumer_shapes: list[tuple[int, int]],
              joined: bool = False) -> bool:
    """Whether the tables' M=1 entries say folding a norm into its consumers pays: ``rms_gemv`` on each
    consumer (N, K), or once on their joined rows (``joined``: sibling linears laid out as one weight,
    ``tunekit.integrations.vllm.merge``), against the norm (the first of ``norm_ops`` the tables hold)
    plus the consumers' GEMVs. An ``rms_gemv`` entry missing: False. A step no table serves counts
    0 us, so the vendor part is never the fold's excuse."""
    from tunekit.dispatch.tables import served_entry

    dtype, device, width = dtype_name(norm_weight.dtype), str(norm_weight.device), norm_weight.shape[0]
    norm_entry = next((e for op in norm_ops if (e := served_entry(op, dtype, 1, width, width, device))), None)
    unfused = norm_entry.time_us if norm_entry else 0.0
    for n, k in consumer_shapes:
        gemv = served_entry("gemv", dtype, 1, n, k, device)
        unfused += gemv.time_us if gemv else 0.0
    fused_shapes = [(sum(n for n, _ in consumer_shapes), consumer_shapes[0][1])] if joined else consumer_shapes
    fused = 0.0
    for n, k in fused_shapes:
        entry = served_entry("rms_gemv", dtype, 1, n, k, device)
        if entry is None:
            return False
        fused += entry.time_us
    return fused < unfused


#: (width, dtype, device) -> the weight that makes an RMSNorm kernel unweighted (zeros: Gemma's x * (1 + w))
_UNIT_WEIGHTS: dict[tuple, torch.Tensor] = {}


def _unweighted_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) rounded to x's dtype, for the vendor path of ``rms_gemv``: in one launch of tunekit's
    Gemma RMSNorm kernel with a zero weight (x * (1 + 0)) at its default config (the table's Triton
    config of that width at the nearest M, else the family's default: ``elementwise_fallback._ew_default``)
    wherever a table serves the device; else :func:`unweighted_rms_norm`'s PyTorch composition.

    Why: the fold rewrote the weights for every M, so above the M its ``rms_gemv`` entries cover (a
    fused table searched at M=1 next to a main table at M=1..8) every folded norm runs here, inside an
    op Inductor cannot fuse into, once per norm per decode step: the composition is seven kernels
    where vLLM's unfolded layer runs one. Same numerics class: fp32 math, one rounding (within the
    norm's bound of the composition, not bit-equal to it). The zero weight is made at an eager call
    only (never inside a CUDA-graph capture, whose pool may hand its memory on)."""
    from tunekit.dispatch.elementwise_fallback import _ew_default

    k = x.shape[-1] if x.dim() else 0
    dtype = DTYPE_NAMES.get(x.dtype)
    if k and dtype is not None and x.is_contiguous():
        m = x.numel() // k
        capturing = is_capturing(x)
        key = (k, x.dtype, x.device)
        zero = _UNIT_WEIGHTS.get(key)
        if zero is None and not capturing:
            zero = _UNIT_WEIGHTS.setdefault(key, torch.zeros(k, dtype=x.dtype, device=x.device))
        if zero is not None:
            out, why = _ew_default("gemma_rms_norm", dtype, m, k, k, x, capturing, (x.view(m, k), zero),
                                   lambda rows, width, like: like.new_empty((rows, width)), lambda out: out, eps)
            if why is None and out is not None:
                return out.view(x.shape)
    return unweighted_rms_norm(x, eps)


# The fused ops' fallbacks are their unfused sequence at its best: the GEMV goes through tunekit's own
# GEMV route, tuned where a table holds the GEMV at this M (a fused table searched at fewer Ms than the
# main one: the folded weights are in place at every M), else the vendor GEMM.


def _vendor_rms_gemv(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return gemv_impl(_unweighted_norm(x, eps), weight, None)


def _vendor_gemv_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return gemv_impl(x, weight, None).add_(residual)  # a fresh output: the add may run in place


def _layout_reason(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> str | None:
    """The checks strides decide (per call, after :func:`_static_reason` passed for the route)."""
    reason = gemv_layout_reason(x, weight, None)
    if reason is not None or residual is None:
        return reason
    n, k = weight.shape
    if residual.shape[-1] != n or residual.numel() != x.numel() // k * n:
        return "bad_input"
    if n > 1 and residual.stride(-1) != 1:
        return "strided"
    return None


class _Route:
    """What serves one (op, x shape, weight shape, dtype, device, eps), resolved once."""

    __slots__ = ("ckey", "choice", "static", "shape", "m", "n", "k", "dtype", "ticks", "run", "launcher", "bind")

    def __init__(self, op: str, x: torch.Tensor, weight: torch.Tensor, extra: torch.Tensor | None,
                 eps: float | None, capturing: bool) -> None:
        self.dtype = dtype_name(x.dtype)
        wshape = weight.shape
        self.shape = "x".join(map(str, wshape))
        self.static = _static_reason(x, weight)
        if self.static is None and extra is not None and (extra.dtype != x.dtype or extra.device != x.device):
            self.static = "dtype" if extra.dtype != x.dtype else "device"
        self.k = x.shape[-1] if x.dim() else 0
        self.m = x.numel() // self.k if self.k else 0
        self.n = wshape[0] if len(wshape) == 2 else 0
        self.ckey = (op, self.dtype, self.m, self.n, self.k, str(x.device))
        self.choice, self.run, self.launcher, self.bind = None, None, None, False
        impl = f"fallback:{self.static}"
        if self.static is None:
            self.choice = STATE.choices.get(self.ckey) or resolve(op, self.dtype, self.m, self.n, self.k,
                                                                  x.device, capturing)
            impl = self.choice.impl
            kernel = self.choice.kernel
            if kernel is not None:
                if eps is None or eps == DEFAULT_EPS:
                    self.run = kernel
                elif kernel_takes_eps(kernel):
                    self.run = lambda inputs, out, kernel=kernel, eps=eps: kernel(inputs, out, eps=eps)
                else:  # a kernel built for the default epsilon only
                    impl = "fallback:eps"
            if self.run is not None:
                # the canary's check wraps the call (TUNEKIT_CANARY; off: the call itself, bound as ever)
                run = self.run
                self.run = canary.guard(op, self.dtype, self.m, self.n, self.k, x.device, run, eps)
            if self.run is not None and self.run is run and impl == "tuned:triton":
                tried, self.launcher = launch.bound(self.run)
                self.bind = not tried
        vendor = None if self.run is not None else _vendor_name(op)
        # the marker rows of what this route serves (tuned, or its fallback's vendor path), per capturing
        served = served_m(self.choice) if self.run is not None else None
        self.ticks = [counter(op, self.dtype, self.shape, self.m, False, impl, c, vendor, served).tick
                      for c in (False, True)]

    def valid(self) -> bool:
        return self.static is not None or STATE.choices.get(self.ckey) is self.choice


def _vendor_name(op: str) -> str:
    # the GEMV of a fallback counts its own marker row (tuned, or the vendor GEMM and why)
    return "rms_norm+gemv" if op == "rms_gemv" else "gemv+add"


#: (op, x shape, weight shape, x dtype, weight dtype, devices, eps) -> _Route
_ROUTES: dict[tuple, _Route] = {}


def _serve(op: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float | None,
           vendor: Callable[[], torch.Tensor]) -> torch.Tensor:
    capturing = is_capturing(x)
    key = (op, x.shape, weight.shape, x.dtype, weight.dtype, x.device, weight.device, eps,
           None if residual is None else (residual.dtype, residual.device))
    route = _ROUTES.get(key)  # lock-free read (atomic under the GIL), as for the decision cache
    if route is None or not route.valid():
        route = _Route(op, x, weight, residual, eps, capturing)
        if route.valid():
            _ROUTES[key] = route  # a choice met under capture is not cached, so neither is its route
    if route.run is None:
        route.ticks[capturing]()
        out = vendor()
        return out if out.is_contiguous() else out.contiguous()
    reason = _layout_reason(x, weight, residual)
    inputs: tuple[torch.Tensor, ...] = ()
    if reason is None:
        try:
            inputs = (x.view(route.m, route.k), weight)
            if residual is not None:
                inputs += (residual.view(route.m, route.n),)
        except RuntimeError:  # leading dims not flattenable without a copy
            reason = "strided"
    if reason is not None:
        count(op, route.dtype, route.shape, route.m, False, f"fallback:{reason}", capturing, _vendor_name(op))
        out = vendor()
        return out if out.is_contiguous() else out.contiguous()
    try:
        out = x.new_empty((route.m, route.n))
        launcher = route.launcher
        if launcher is None or not launcher(inputs, out, None, True):
            if route.bind and not capturing:
                # the first eager launch binds the kernel (at the route's epsilon: route.run carries it)
                route.launcher, route.bind = launch.bind(route.run, inputs, out), False
            else:
                route.run(inputs, out)
    except Exception as exc:  # the serving path never raises for tunekit's sake
        impl = mark_broken(op, route.dtype, route.m, route.n, route.k, x.device, exc)
        count(op, route.dtype, route.shape, route.m, False, impl, capturing, _vendor_name(op))
        out = vendor()
        return out if out.is_contiguous() else out.contiguous()
    route.ticks[capturing]()
    return out.view(*x.shape[:-1], route.n)


def rms_gemv_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The CUDA/HIP and CPU kernel of ``tunekit::rms_gemv``: tuned kernel or norm + vendor GEMM, counted."""
    return _serve("rms_gemv", x, weight, None, eps, lambda: _vendor_rms_gemv(x, weight, eps))


def gemv_add_impl(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The CUDA/HIP and CPU kernel of ``tunekit::gemv_add``: tuned kernel or vendor GEMM + add, counted."""
    return _serve("gemv_add", x, weight, residual, None, lambda: _vendor_gemv_add(x, weight, residual))


def joined_rows(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The one [sum N, K] tensor whose consecutive row blocks are ``weights`` (each contiguous, one
    storage, one dtype and device, each starting where the one before ends), or None."""
    if not weights:
        return None
    first = weights[0]
    if first.dim() != 2 or not first.is_contiguous():
        return None
    k, rows = first.shape[1], 0
    storage = first.untyped_storage().data_ptr()
    for w in weights:
        if (w.dim() != 2 or w.shape[1] != k or w.dtype != first.dtype or w.device != first.device
                or not w.is_contiguous() or w.untyped_storage().data_ptr() != storage
                or w.storage_offset() != first.storage_offset() + rows * k):
            return None
        rows += w.shape[0]
    return first.as_strided((rows, k), (k, 1))  # bounds-checked against the storage


def sibling_gemv_impl(x: torch.Tensor, weights: list[torch.Tensor], eps: float | None) -> torch.Tensor:
    """The CUDA/HIP and CPU kernel of ``tunekit::sibling_gemv``: one ``gemv`` / ``rms_gemv`` call on the
    joined weight (its route counts it at the joined shape), else one per weight, concatenated and
    counted as ``sibling_gemv`` ``fallback:not_joined`` (the layout the load step made is gone)."""
    joined = joined_rows(list(weights))
    if joined is not None:
        return gemv_impl(x, joined, None) if eps is None else rms_gemv_impl(x, joined, eps)
    shape = "+".join("x".join(map(str, w.shape)) for w in weights)
    k = x.shape[-1] if x.dim() else 0
    count("sibling_gemv", dtype_name(x.dtype), shape, x.numel() // k if k else 0, False, "fallback:not_joined",
          is_capturing(x), "per sibling")
    parts = [gemv_impl(x, w, None) if eps is None else rms_gemv_impl(x, w, eps) for w in weights]
    return torch.cat(parts, dim=-1)


def fake_gemv_shaped(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def fake_sibling_gemv(x: torch.Tensor, weights: list[torch.Tensor], eps: float | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


# The stock compositions the op records name (``tunekit.problems.oprecords``: ``stock``), called as the op is:
# what each fused op replaces, in plain torch ops a compile pass can splice in and Inductor fuse.


def stock_rms_gemv(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.linear(unweighted_rms_norm(x, eps), weight)


def stock_gemv_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight) + residual  # functional: a spliced trace must not mutate
