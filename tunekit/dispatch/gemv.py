"""``tunekit::gemv``: ``F.linear`` served from the dispatch tables (the op's run-time and fake impls).

Call protocol: :func:`gemv_impl` is the kernel of both device keys
(registered by ``tunekit.dispatch.registry``). Per (x shape, W shape,
dtypes, device indices) it resolves once to a :class:`_Route`: the checks
shapes, dtypes and devices decide, the decision (``tunekit.dispatch.decisions``:
the tables, their TP check, a kernel the canary demoted), the marker rows'
counters (``tunekit.dispatch.markers``) and the tuned kernel's bound launcher
(``tunekit.dispatch.launch``). The route is stamped with the serving epoch
(``STATE.epoch``, bumped by every table load, TP change, vendor hook and
demotion); per call it looks the route up lock-free and compares the stamp
(a route of an older epoch is checked again once: its decision and vendor
hook still held, it is stamped anew, else made again). A route without a
tuned kernel (no table covers the call) then just ticks the call's counter
and runs the vendor path (``F.linear``, or the hook ``set_vendor_gemm``
installed, on GPU tensors); a tuned one runs the checks strides and the bias
decide and launches. No key or label string is formatted and no lock taken.
It never raises for tunekit's sake.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tunekit.dispatch import canary, launch
from tunekit.dispatch.decisions import _stream_capturing, is_capturing, mark_broken, resolve
from tunekit.dispatch.markers import count, counter, served_m
from tunekit.dispatch.state import DTYPE_NAMES, STATE, dtype_name


def _gemv_vendor_name(x: torch.Tensor) -> str:
    return STATE.vendor_gemm_name if STATE.vendor_gemm is not None and x.is_cuda else "F.linear"


def _vendor_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    fn = STATE.vendor_gemm
    out = fn(x, weight, bias) if fn is not None and x.is_cuda else F.linear(x, weight, bias)
    # The fake impl promises a contiguous result (compilers plan with it).
    return out if out.is_contiguous() else out.contiguous()


def _gemv_precheck(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Per-call checks that need no table: None if the tuned path may serve the call, else the reason."""
    return _static_reason(x, weight) or _layout_reason(x, weight, bias)


def _static_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """The checks that shapes, dtypes and devices decide (a route's key): once per route."""
    wshape, xshape = weight.shape, x.shape
    if len(wshape) != 2 or not xshape or xshape[-1] != wshape[1]:
        return "bad_input"
    xdtype, device = x.dtype, x.device
    if xdtype not in DTYPE_NAMES or weight.dtype != xdtype:
        return "dtype"
    if weight.device != device or device.type not in ("cuda", "cpu"):
        return "device"
    if wshape[0] == 0 or wshape[1] == 0 or x.numel() == 0:
        return "empty"
    return None


def _layout_reason(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """The checks that strides and the bias decide: per call (after :func:`_static_reason` passed)."""
    n, k = weight.shape
    ws0, ws1 = weight.stride()
    if (k > 1 and (ws1 != 1 or x.stride(-1) != 1)) or ws0 < k:
        return "strided"
    if bias is not None and (
        bias.dim() != 1 or bias.shape[0] != n or bias.dtype != x.dtype or bias.device != x.device
        or not bias.is_contiguous()
    ):
        return "bias"
    return None


class _Route:
    """What serves one (x shape, W shape, dtypes, devices), resolved once: the hot path's whole state.

    Valid while the decision cache still holds its choice and the vendor
    hook is the one it was made with (:meth:`valid`); ``epoch`` is the serving
    epoch in which that was last checked, so per call one comparison suffices.
    """

    __slots__ = ("epoch", "static", "ckey", "choice", "vendor_fn", "vendor_name", "dtype", "shape", "m", "n", "k",
                 "x2d", "out_shape", "final_shape", "out_dtype", "device", "kernel", "launcher", "bind", "ticks",
                 "impl", "vcall")

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, capturing: bool, epoch: int) -> None:
        self.epoch = epoch  # read before the decision below: a change meanwhile makes the next call check
        self.vendor_fn, self.vendor_name = STATE.vendor_gemm, STATE.vendor_gemm_name
        self.dtype = dtype_name(x.dtype)
        wshape = weight.shape
        self.shape = f"{wshape[0]}x{wshape[1]}" if len(wshape) == 2 else "x".join(map(str, wshape))
        self.static = _static_reason(x, weight)
        k = x.shape[-1] if x.dim() else 0
        self.m, self.k = (x.numel() // k if k else 0), k
        self.n = wshape[0] if len(wshape) == 2 else 0
        self.x2d = x.dim() == 2
        self.out_shape, self.final_shape = (self.m, self.n), (*x.shape[:-1], self.n)
        self.out_dtype, self.device = x.dtype, x.device
        self.ckey = ("gemv", self.dtype, self.m, self.n, self.k, str(x.device))
        self.choice = self.kernel = self.launcher = None
        self.bind = False
        if self.static is None:
            self.choice = STATE.choices.get(self.ckey) or resolve(
                "gemv", self.dtype, self.m, self.n, self.k, x.device, capturing)
            self.kernel = kernel = self.choice.kernel
            if kernel is not None:
                # the canary's check wraps the kernel (TUNEKIT_CANARY; off: the kernel itself, bound as ever)
                self.kernel = canary.guard("gemv", self.dtype, self.m, self.n, self.k, x.device, kernel)
            if self.kernel is kernel and kernel is not None and self.choice.impl == "tuned:triton":
                tried, self.launcher = launch.bound(self.kernel)
                self.bind = not tried
        self.impl = self.choice.impl if self.static is None else f"fallback:{self.static}"
        vendor = None if self.kernel is not None else _gemv_vendor_name(x)
        #: what _vendor_gemv calls for this device
        self.vcall = self.vendor_fn if self.vendor_fn is not None and x.is_cuda else F.linear
        # ticks[bias][capturing]: the marker rows of what this route serves
        served = served_m(self.choice) if self.static is None and self.kernel is not None else None
        self.ticks = [[counter("gemv", self.dtype, self.shape, self.m, b, self.impl, c, vendor, served).tick
                       for c in (False, True)] for b in (False, True)]

    def valid(self) -> bool:
        return (STATE.vendor_gemm is self.vendor_fn and STATE.vendor_gemm_name is self.vendor_name
                and (self.static is not None or STATE.choices.get(self.ckey) is self.choice))


#: (x shape, W shape, x dtype, W dtype, x device index, W device index) -> _Route. The device index
#: (``Tensor.get_device()``: -1 on the CPU; cheaper than a ``torch.device`` made and hashed per call)
#: tells the devices apart, as in :class:`EagerLinear`: through torch's dispatcher this impl is the
#: kernel of the CPU and CUDA keys only, and routes are kept only for CPU and CUDA (HIP) tensors. A
#: direct call with tensors of another device type (a patched module on "meta" or "xpu") takes the
#: vendor path through a route of the same index, if one is kept, counted in that route's row.
_ROUTES: dict[tuple, _Route] = {}


def gemv_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA/HIP and CPU kernel of ``tunekit::gemv``: tuned kernel or vendor path, counted."""
    capturing = is_capturing(x)  # a module global: the CPU tests simulate a capture through it
    # lock-free read (atomic under the GIL), as for the decision cache
    route = _ROUTES.get((x.shape, weight.shape, x.dtype, weight.dtype, x.get_device(), weight.get_device()))
    if route is None or route.epoch != STATE.epoch:
        route = _check_route(route, x, weight, capturing)
    if route.kernel is None:
        # No tuned kernel for this route (no table covers it; bad inputs too: the vendor's own error,
        # as without tunekit): the layout is the vendor's business, so no stride checks.
        # _vendor_gemv, inlined.
        route.ticks[bias is not None][capturing]()
        out = route.vcall(x, weight, bias)
        return out if out.is_contiguous() else out.contiguous()
    return _serve_tuned(route, x, weight, bias, capturing)


def _serve_tuned(route: _Route, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 capturing: bool) -> torch.Tensor:
    """A call of a valid route with a tuned kernel: the layout checks, then the launch (or the vendor path)."""
    kernel = route.kernel
    # _layout_reason, inlined (every tuned call runs it)
    k = route.k
    ws0, ws1 = weight.stride()
    if (k > 1 and (ws1 != 1 or x.stride(-1) != 1)) or ws0 < k:
        reason = "strided"
    elif bias is not None:
        reason = _layout_reason(x, weight, bias)
    else:
        reason = None
    x2 = x
    if reason is None and not route.x2d:
        try:
            x2 = x.view(route.m, route.k)
        except RuntimeError:  # leading dims not flattenable without a copy
            reason = "strided"
    if reason is not None:
        count("gemv", route.dtype, route.shape, route.m, bias is not None, f"fallback:{reason}", capturing,
              _gemv_vendor_name(x))
        return _vendor_gemv(x, weight, bias)
    try:
        out = x.new_empty(route.out_shape)  # torch.empty of x's dtype and device, with less argument parsing
        launcher = route.launcher
        if launcher is None or not launcher((x2, weight), out, None, True):
            if route.bind and not capturing:
                # The first eager launch of a Triton kernel binds it (tunekit.dispatch.launch).
                route.launcher, route.bind = launch.bind(kernel, (x2, weight), out), False
            else:
                kernel((x2, weight), out)
        if bias is not None:
            # A separate add (one small elementwise launch): the tables time
            # the GEMV alone; a fused bias epilogue is not a tuned family yet.
            out.add_(bias)
    except Exception as exc:  # the serving path never raises for tunekit's sake
        impl = mark_broken("gemv", route.dtype, route.m, route.n, route.k, x.device, exc)
        count("gemv", route.dtype, route.shape, route.m, bias is not None, impl, capturing, _gemv_vendor_name(x))
        return _vendor_gemv(x, weight, bias)
    route.ticks[bias is not None][capturing]()
    return out if route.x2d else out.view(route.final_shape)


def _check_route(route: _Route | None, x: torch.Tensor, weight: torch.Tensor, capturing: bool) -> _Route:
    """The slow path of a call whose route is missing or of an older serving epoch: the route checked
    again (still valid: stamped with the epoch, read before the check) or made anew and kept."""
    epoch = STATE.epoch
    if route is not None and route.valid():
        route.epoch = epoch
        return route
    route = _Route(x, weight, capturing, epoch)
    # a choice not cached (met under capture) is not a route either; nor is the "device" fallback of a
    # device type the key's index does not tell from the CPU's or CUDA's (a meta tensor's index is -1)
    if (route.static is not None or STATE.choices.get(route.ckey) is route.choice) \
            and x.device.type in _KEPT_DEVICES and weight.device.type in _KEPT_DEVICES:
        _ROUTES[(x.shape, weight.shape, x.dtype, weight.dtype, x.get_device(), weight.get_device())] = route
    return route


_KEPT_DEVICES = ("cpu", "cuda")


class EagerLinear:
    """One patched ``nn.Linear``'s eager calls into the op's impl, with its routes at hand.

    ``tunekit.patch`` gives each routed linear its own instance. The first call of an x shape
    runs :func:`gemv_impl` whole and keeps the route it resolved; later calls of that shape check
    only what the route's key would (the weight's shape, both dtypes and devices) and the
    serving epoch (tables, vendor hook and broken kernels unchanged, ``STATE.epoch``), then go
    straight to the route's vendor call or tuned launch: no key tuple is built or hashed. So an
    uncovered M costs about what ``F.linear`` does and a tuned one about the bound launcher
    (budgets: 1-2 and 8 us per call in eager decode).
    """

    __slots__ = ("epoch", "routes")

    def __init__(self) -> None:
        self.epoch = -1
        #: x shape -> (route, weight shape, dtype, device index): routes valid in ``epoch``
        self.routes: dict[torch.Size, tuple] = {}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        epoch = STATE.epoch
        if self.epoch != epoch:
            self.routes.clear()
            self.epoch = epoch
        hit = self.routes.get(x.shape)
        if hit is not None:
            route = hit[0]
            if route.kernel is None:
                # The vendor call is right for any weight; x's dtype, the weight's shape and the device
                # keep the counted row's labels and the vendor hook's device type true.
                if x.dtype is hit[2] and weight.shape == hit[1] and x.get_device() == hit[3]:
                    route.ticks[bias is not None][x.is_cuda and _stream_capturing()]()  # is_capturing, inlined
                    out = route.vcall(x, weight, bias)
                    return out if out.is_contiguous() else out.contiguous()
            elif x.dtype is hit[2] and weight.dtype is hit[2] and weight.shape == hit[1] \
                    and x.get_device() == hit[3] and weight.get_device() == hit[3]:
                return _serve_tuned(route, x, weight, bias, x.is_cuda and _stream_capturing())
        out = gemv_impl(x, weight, bias)
        # the route gemv_impl served, if it is still the one the decision cache holds (a route resolved
        # under capture is not kept there, and an earlier table's route may still be)
        route = _ROUTES.get((x.shape, weight.shape, x.dtype, weight.dtype, x.get_device(), weight.get_device()))
        if route is not None and route.static is None and route.valid() and STATE.epoch == epoch:
            self.routes[x.shape] = (route, weight.shape, x.dtype, x.get_device())
        return out


def gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.tunekit.gemv(x, weight, bias)``: ``F.linear`` served from the dispatch tables."""
    return torch.ops.tunekit.gemv(x, weight, bias)

