"""The elementwise ops (the fused decode ops of ``tunekit.problems.opspec``): run-time impls, fake impls, compositions.

Call protocol: each op's impl computes its table key (m, n, k), rejects
inputs that are not the op at all (``fallback:bad_input``) and hands the
rest to :func:`_ew_serve`, which checks dtypes, devices and row layouts,
reads the decision cache (``tunekit.dispatch.decisions``) through the key's
route (``tunekit.dispatch.elementwise_route``), launches the tuned kernel,
and counts the call (``tunekit.dispatch.markers``). The lookup's fallbacks
are served, in this order, by the vendor kernel an integration installed,
by tunekit's default-config kernel (both ``tunekit.dispatch.elementwise_fallback``),
else by the PyTorch composition of vLLM's native math (``_vendor_*``, here).
A call that a bound launcher served before takes the op's express route
(:func:`_express`). The op records (``tunekit.problems.oprecords``) name each
op's run-time impl, fake impl and stock composition here (``rms_norm_impl``,
``fake_like``, ``stock_rms_norm`` ...); ``tunekit.dispatch.registry`` registers them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tunekit.dispatch import launch
from tunekit.dispatch.decisions import _stream_capturing, is_capturing, mark_broken
from tunekit.dispatch.elementwise_fallback import _ew_default, _ew_vendor
from tunekit.dispatch.elementwise_route import _EwRoute
from tunekit.dispatch.markers import count, counter
from tunekit.dispatch.state import DEFAULT_EPS, DTYPE_NAMES, STATE, Choice, dtype_name
from tunekit.dispatch.tables import tables_for

# Vendor paths: the PyTorch math of vLLM's native implementations
# (vllm.ir.ops.rms_norm / fused_add_rms_norm, GemmaRMSNorm.forward_native,
# RMSNormGated.forward_static with norm_before_gate=True, SiluAndMul.forward_native),
# rounding where they round.


def _vendor_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    w = weight.float() + 1.0 if gemma else weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf.to(w.dtype) * w).to(x.dtype)


def _vendor_fused_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      gemma: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float() + 1.0 if gemma else weight
    s = x.float() + residual.float()
    residual_out = s.to(x.dtype)
    s = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (s.to(w.dtype) * w).to(x.dtype), residual_out


def _vendor_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    k = weight.shape[0]
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // k, k)
    normed = (g * torch.rsqrt(g.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).reshape(x.shape)
    return (normed * F.silu(z.float())).to(x.dtype)


def _vendor_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _vendor_bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")


def _ew_serve(
    op: str,
    tensors: tuple[torch.Tensor, ...],
    weight: torch.Tensor | None,
    mnk: tuple[int, int, int],
    eps: float | None,
    make_out: Callable[[int, int, torch.Tensor], Any],
    kernel_inputs: Callable[[int, int], tuple[torch.Tensor, ...]],
    vendor: Callable[[], Any],
    finish: Callable[[Any], Any],
    vendor_args: tuple[Any, ...] = (),
    express_key: tuple | None = None,
) -> Any:
    """Shared body of the elementwise ops: checks, lookup, tuned launch or vendor path, marker.

    ``express_key``: the op's :data:`_EXPRESS` key for these arguments; a call
    served by a bound launcher registers its route there (see :func:`_express`).

    ``vendor`` is the PyTorch composition; ``vendor_args`` the op's arguments
    for an installed vendor kernel (:func:`set_vendor_elementwise`), which
    serves the lookup's fallbacks in its place; without one, the op's
    default-config kernel does where it can (:func:`_ew_vendor`).
    """
    x = tensors[0]
    capturing = is_capturing(x)
    dtype = dtype_name(x.dtype)
    m, n, k = mnk
    reason = None
    # Plain loops, not any(<generator>): every norm of every eager step runs these checks.
    xdtype, device = x.dtype, x.device
    for t in tensors:
        if t.dtype != xdtype:
            reason = "dtype"
    if reason is None and xdtype not in DTYPE_NAMES:
        reason = "dtype"
    if reason is not None:
        pass
    elif weight is not None and (weight.dtype != xdtype or weight.dim() != 1 or not weight.is_contiguous()):
        reason = "dtype" if weight.dtype != xdtype else "strided"
    elif device.type not in ("cuda", "cpu") or (weight is not None and weight.device != device) or \
            _other_device(tensors, device):
        reason = "device"
    elif m == 0 or n == 0 or k == 0:
        reason = "empty"
    else:
        # Rows may be strided (HF's q_norm gets every other head_dim slice of q):
        # the kernels take a row stride. Each tensor must view as [m, width]
        # rows with unit stride inside a row; anything else is the vendor's.
        inputs = _row_views(kernel_inputs, m, n)
        if inputs is None:
            reason = "strided"
    if reason is not None:
        # inputs a vendor kernel may not take either (odd strides, dtypes, devices): the composition
        count(op, dtype, f"{n}x{k}", m, False, f"fallback:{reason}", capturing, "eager")
        return _dense(vendor())
    # one route per epsilon: its launchers replay the calls they recorded, eps included
    rkey = (op, m, n, k, xdtype, device, eps)
    route = _EW_ROUTES.get(rkey)  # lock-free read (atomic under the GIL), as for the decision cache
    if route is None or STATE.choices.get(route.ckey) is not route.choice:
        route = _EwRoute(op, dtype, m, n, k, x.device, capturing, eps)
        if STATE.choices.get(route.ckey) is route.choice:  # a choice met under capture is not cached
            _EW_ROUTES[rkey] = route
    choice = route.choice
    if choice.kernel is not None and eps is not None and not choice.takes_eps and eps != DEFAULT_EPS:
        choice = Choice("fallback:eps")
    if choice.kernel is None:
        out, served_by = _ew_vendor(op, device, vendor_args, vendor, lambda: _ew_default(
            op, dtype, m, n, k, x, capturing, inputs, make_out, finish, eps, route.ckey, route))
        # the fallback's rows by what served it: counters kept on the route (no key built per call)
        tick = route.vticks.get((choice.impl, served_by, capturing))
        if tick is None:
            tick = route.vticks[(choice.impl, served_by, capturing)] = counter(
                op, dtype, route.shape, m, False, choice.impl, capturing, served_by).tick
        tick()
        return _dense(out)
    try:
        out = make_out(m, n, x)
        if route.launcher is None or not route.launcher(inputs, out, None, True):
            if route.bind and not capturing:
                # The first eager launch of a Triton kernel binds it (tunekit.dispatch.launch), at
                # the route's epsilon (route.run carries it).
                route.launcher, route.bind = launch.bind(route.run, inputs, out), False
            else:
                route.run(inputs, out)
    except Exception as exc:  # the serving path never raises for tunekit's sake
        impl = mark_broken(op, dtype, m, n, k, x.device, exc)
        out, served_by = _ew_vendor(op, x.device, vendor_args, vendor, lambda: _ew_default(
            op, dtype, m, n, k, x, capturing, inputs, make_out, finish, eps))
        count(op, dtype, route.shape, m, False, impl, capturing, served_by)
        return _dense(out)
    route.ticks[capturing]()
    if express_key is not None and route.launcher is not None:
        _EXPRESS[express_key] = route  # (re)registered: a reload leaves the old route stale
    return finish(out)


#: The public name of the shared body: an op whose inputs view as rows (a plug-in op's impl, a test's)
#: is served by calling it as the built-in elementwise ops do (``tunekit.ops.serve_elementwise``).
serve_elementwise = _ew_serve

#: an op's express key (op, x shape, dtypes, devices, eps) -> the _EwRoute whose bound launcher serves it
_EXPRESS: dict[tuple, Any] = {}


def _express(key: tuple, inputs: Callable[[], tuple[torch.Tensor, ...]], x: torch.Tensor,
             m: int, n: int) -> torch.Tensor | None:
    """The tuned launch of a call whose express key a bound launcher served before, or None (then the
    op's full path serves it). The key holds every shape, dtype, device and eps the full path checks;
    the launcher's guard checks the rows' strides and alignment, so a guarded launch is exactly a
    call that would pass the full path's checks and take the same kernel."""
    route = _EXPRESS.get(key)
    if route is None or STATE.choices.get(route.ckey) is not route.choice:
        return None
    try:
        views = inputs()
    except RuntimeError:  # rows not viewable: the full path says why
        return None
    out = x.new_empty((m, n))
    try:
        if not route.launcher(views, out, None, True):
            return None
    except Exception:  # noqa: BLE001 - the full path launches again and puts a raising kernel on its fallback
        return None
    route.ticks[is_capturing(x)]()
    return out


def _other_device(tensors: tuple[torch.Tensor, ...], device: torch.device) -> bool:
    for t in tensors:
        if t.device != device:
            return True
    return False


#: (op, m, n, k, torch dtype, device, eps) -> _EwRoute
_EW_ROUTES: dict[tuple, _EwRoute] = {}


def _row_views(kernel_inputs: Callable[[int, int], tuple[torch.Tensor, ...]], m: int,
               n: int) -> tuple[torch.Tensor, ...] | None:
    """The kernel's [rows, width] views of the inputs, or None if some input has no such view
    (rows not evenly strided, or a stride inside a row)."""
    try:
        views = kernel_inputs(m, n)
    except RuntimeError:  # .view() of a layout that needs a copy
        return None
    for t in views:
        if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
            return None
    return views


def _dense(out: Any) -> Any:
    """Contiguous result(s), as the fake impls promise (a non-contiguous input keeps its strides in eager math)."""
    if isinstance(out, tuple):
        return tuple(t if t.is_contiguous() else t.contiguous() for t in out)
    return out if out.is_contiguous() else out.contiguous()


def _rows(x: torch.Tensor, width: int) -> int:
    return x.numel() // width if width else 0


def _rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    op = "gemma_rms_norm" if gemma else "rms_norm"
    n = x.shape[-1] if x.dim() else 0
    m = _rows(x, n)
    ekey = (op, x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device, eps)
    if ekey in _EXPRESS:
        out = _express(ekey, lambda: (x.view(m, n), weight), x, m, n)
        if out is not None:
            return out if x.dim() == 2 else out.view(x.shape)
    if weight.dim() != 1 or weight.shape[0] != n:
        count(op, dtype_name(x.dtype), f"{n}x{n}", m, False, "fallback:bad_input", is_capturing(x), "eager")
        return _dense(_vendor_rms_norm(x, weight, eps, gemma))
    return _ew_serve(
        op, (x,), weight, (m, n, n), eps,
        make_out=lambda m, n, x: x.new_empty((m, n)),
        kernel_inputs=lambda m, n: (x.view(m, n), weight),
        vendor=lambda: _vendor_rms_norm(x, weight, eps, gemma),
        finish=lambda out: out.view(x.shape),
        vendor_args=(x, weight, eps),
        express_key=ekey,
    )


def _fused_add_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                    gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    op = "gemma_fused_add_rms_norm" if gemma else "fused_add_rms_norm"
    n = x.shape[-1] if x.dim() else 0
    m = _rows(x, n)
    if weight.dim() != 1 or weight.shape[0] != n or residual.shape != x.shape:
        count(op, dtype_name(x.dtype), f"{n}x{n}", m, False, "fallback:bad_input", is_capturing(x), "eager")
        return _dense(_vendor_fused_add(x, residual, weight, eps, gemma))

    def make_out(m: int, n: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x.new_empty((m, n)),
                x.new_empty((m, n)))

    return _ew_serve(
        op, (x, residual), weight, (m, n, n), eps, make_out=make_out,
        kernel_inputs=lambda m, n: (x.view(m, n), residual.view(m, n), weight),
        vendor=lambda: _vendor_fused_add(x, residual, weight, eps, gemma),
        finish=lambda out: (out[0].view(x.shape), out[1].view(x.shape)),
        vendor_args=(x, residual, weight, eps),
    )


class EagerNorm:
    """One patched RMSNorm module's eager calls (``rms_norm`` / ``gemma_rms_norm``, the module's eps).

    ``tunekit.patch`` gives each routed norm its own instance. A call whose x shape was served
    before by a bound launcher (the op's express route) checks only what that route's key
    would (the weight's shape, both dtypes and devices) and the serving epoch, then launches:
    no key tuple is built or hashed. Everything else, and any launch the launcher's guard
    refuses (another row stride), runs the op's impl whole.
    """

    __slots__ = ("gemma", "eps", "epoch", "routes")

    def __init__(self, gemma: bool, eps: float) -> None:
        self.gemma, self.eps, self.epoch = gemma, eps, -1
        #: x shape -> (express route, dtype, weight shape, device index, (m, n)): valid in ``epoch``
        self.routes: dict[torch.Size, tuple] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        epoch = STATE.epoch
        if self.epoch != epoch:
            self.routes.clear()
            self.epoch = epoch
        hit = self.routes.get(x.shape)
        if hit is not None and x.dtype is hit[1] and weight.dtype is hit[1] and weight.shape == hit[2] \
                and x.get_device() == hit[3] and weight.get_device() == hit[3]:
            route, shape = hit[0], hit[4]
            try:
                rows = x.view(shape)
            except RuntimeError:  # rows not viewable: the full path says why
                rows = None
            if rows is not None:
                out = x.new_empty(shape)
                if route.launcher((rows, weight), out, None, True):
                    route.ticks[x.is_cuda and _stream_capturing()]()
                    return out if x.dim() == 2 else out.view(x.shape)
        out = _rms_norm_impl(x, weight, self.eps, self.gemma)
        op = "gemma_rms_norm" if self.gemma else "rms_norm"
        route = _EXPRESS.get((op, x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device, self.eps))
        # kept only while the decision cache holds its choice: an earlier table's route stays in _EXPRESS
        if route is not None and route.launcher is not None and STATE.choices.get(route.ckey) is route.choice \
                and STATE.epoch == epoch:
            n = x.shape[-1]
            self.routes[x.shape] = (route, x.dtype, weight.shape, x.get_device(), (_rows(x, n), n))
        return out


def _gated_impl(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Rows are the leading dims but the last two: vLLM's Qwen3.5 passes
    # [tokens, heads, head_dim], the table's problem is m = tokens, n = heads * head_dim.
    k = weight.shape[0] if weight.dim() == 1 else 0
    n = x.shape[-1] * (x.shape[-2] if x.dim() >= 3 else 1) if x.dim() else 0
    m = _rows(x, n)
    if k == 0 or z.shape != x.shape or x.shape[-1] % k:
        count("gated_rms_norm", dtype_name(x.dtype), f"{n}x{k}", m, False, "fallback:bad_input", is_capturing(x),
               "eager")
        return _dense(_vendor_gated(x, z, weight, eps))
    if m and n:
        m, n = _gated_layout(dtype_name(x.dtype), m, n, k, x.device)
    return _ew_serve(
        "gated_rms_norm", (x, z), weight, (m, n, k), eps,
        make_out=lambda m, n, x: x.new_empty((m, n)),
        kernel_inputs=lambda m, n: (x.view(m, n), z.view(m, n), weight),
        vendor=lambda: _vendor_gated(x, z, weight, eps),
        finish=lambda out: out.view(x.shape),
        vendor_args=(x, z, weight, eps),
    )


def _gated_layout(dtype: str, m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """The [rows, width] a gated_rms_norm call of m x n is served as (cached per key).

    The norm works per group of k, so how groups are cut into rows does not
    change the result: when the table holds no entry for (m, n) it may hold
    one for the same groups as [m * n / n', n']. Hugging Face passes
    [tokens * heads, head_dim] where vLLM (whose layout ``tunekit search
    --model`` tunes) passes [tokens, heads * head_dim].
    """
    key = (dtype, m, n, k, str(device))
    with STATE.lock:
        layout = STATE.gated_layouts.get(key)
    if layout is not None:
        return layout
    layout = (m, n)
    index, _ = tables_for(device, str(device))
    if index is not None and index.lookup("gated_rms_norm", dtype, m, n, k) is None:
        widths = [w for w in index.widths("gated_rms_norm", dtype, k) if w != n and w % k == 0 and (m * n) % w == 0]
        for width in widths:
            if index.lookup("gated_rms_norm", dtype, m * n // width, width, k) is not None:
                layout = (m * n // width, width)
                break
    with STATE.lock:
        STATE.gated_layouts.setdefault(key, layout)
        return STATE.gated_layouts[key]


def _silu_and_mul_impl(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1] if x.dim() else 0
    n = k // 2
    m = _rows(x, k)
    if k % 2:
        count("silu_and_mul", dtype_name(x.dtype), f"{n}x{k}", m, False, "fallback:bad_input", is_capturing(x),
               "eager")
        return _dense(_vendor_silu_and_mul(x))
    return _ew_serve(
        "silu_and_mul", (x,), None, (m, n, k), None,
        make_out=lambda m, n, x: x.new_empty((m, n)),
        kernel_inputs=lambda m, n: (x.view(m, 2 * n),),
        vendor=lambda: _vendor_silu_and_mul(x),
        finish=lambda out: out.view(*x.shape[:-1], n),
        vendor_args=(x,),
    )


def _bias_gelu_impl(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] if x.dim() else 0
    m = _rows(x, n)
    if bias.dim() != 1 or bias.shape[0] != n:
        count("bias_gelu", dtype_name(x.dtype), f"{n}x{n}", m, False, "fallback:bad_input", is_capturing(x),
               "eager")
        return _dense(_vendor_bias_gelu(x, bias))
    return _ew_serve(
        "bias_gelu", (x,), bias, (m, n, n), None,
        make_out=lambda m, n, x: x.new_empty((m, n)),
        kernel_inputs=lambda m, n: (x.view(m, n), bias),
        vendor=lambda: _vendor_bias_gelu(x, bias),
        finish=lambda out: out.view(x.shape),
        vendor_args=(x, bias),
    )


def fake_like(x: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def fake_pair(x: torch.Tensor, residual: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(x, memory_format=torch.contiguous_format))


def fake_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


# The run-time impls the op records name (``tunekit.problems.oprecords``: ``impl``), one per op, called as
# the op is; ``tunekit.dispatch.registry`` registers them for the CUDA and CPU keys.


def rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_impl(x, weight, eps, False)


def gemma_rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_impl(x, weight, eps, True)


def fused_add_rms_norm_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fused_add_impl(x, residual, weight, eps, False)


def gemma_fused_add_rms_norm_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fused_add_impl(x, residual, weight, eps, True)


gated_rms_norm_impl = _gated_impl
silu_and_mul_impl = _silu_and_mul_impl
bias_gelu_impl = _bias_gelu_impl


# The stock compositions the op records name (``stock``), called as the op is: the PyTorch math of vLLM's
# native implementations, what each op's own fallback computes (``tunekit.integrations.vllm.graph_routes``
# splices them into graph ranges no table serves).


def stock_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _vendor_rms_norm(x, weight, eps, False)


def stock_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _vendor_rms_norm(x, weight, eps, True)


def stock_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _vendor_fused_add(x, residual, weight, eps, False)


def stock_gemma_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _vendor_fused_add(x, residual, weight, eps, True)


stock_gated_rms_norm = _vendor_gated
stock_silu_and_mul = _vendor_silu_and_mul
stock_bias_gelu = _vendor_bias_gelu
