"""What serves an elementwise call the lookup sent to the vendor path, and tunekit's default-config kernel.

Call protocol: :func:`_ew_vendor` picks (in this order but for the cases it
lists) the vendor kernel an integration installed (``tunekit.dispatch.vendors``), tunekit's Triton
kernel at a config valid for every M - "the default-config kernel": the
table's nearest-M Triton config for the shape (:func:`_nearest_config`),
else the op's default (:func:`_ew_default`, built by :func:`_build_default`
and cached per key like a tuned entry) - else the op's PyTorch composition
(the ``eager`` callable the op passes). ``tunekit.dispatch.fused_gemv``
serves its unweighted norm's fallbacks with :func:`_ew_default` too. Never
raises: what cannot serve is logged once and named in the marker's vendor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tunekit.dispatch import launch
from tunekit.dispatch.decisions import kernel_takes_eps
from tunekit.dispatch.elementwise_route import _at_eps, _EwRoute
from tunekit.dispatch.state import (
    DEFAULT_EPS,
    DEFAULT_VENDOR,
    STATE,
    DefaultKernel,
    VendorKernel,
    log_once,
)
from tunekit.dispatch.tables import tables_for
from tunekit.dispatch.vendors import vendor_serves_first
from tunekit.table import Entry


def _launch_ew(kernel: Callable[..., None], takes_eps: bool, inputs: tuple[torch.Tensor, ...], out: Any,
               eps: float | None) -> Any:
    """Run a built elementwise kernel into ``out`` (eps passed only to kernels that take it); returns ``out``."""
    if takes_eps and eps is not None:
        kernel(inputs, out, eps=eps)
    else:
        kernel(inputs, out)
    return out


def _ew_vendor(op: str, device: torch.device, args: tuple[Any, ...], eager: Callable[[], Any],
               default: Callable[[], tuple[Any, str | None]] | None = None) -> tuple[Any, str]:
    """(result, what served it) for a call the lookup sent to the vendor path.

    In this order: the installed vendor kernel when there is one for this
    device (the one kernel the integration would have run: preferred, it is
    what the engine runs without tunekit); else ``default`` (tunekit's
    default-config kernel, :func:`_ew_default`: one launch where the
    composition is several); else the PyTorch composition, with the reason
    in the vendor name. A vendor path of several launches (``single_launch``
    False), or one the engine itself would not run (``set_engine_runs_vendor``),
    comes after ``default`` and before the composition. A vendor
    kernel that raises is logged once and the composition serves: the
    serving path never raises for tunekit's sake.
    """
    vk = STATE.vendor_ew.get(op)  # lock-free read (atomic under the GIL): hot path
    usable = vk is not None and vk.fn is not None and device.type in vk.device_types
    if usable and (default is None or vendor_serves_first(op, vk)):
        return _call_vendor(op, vk, args, eager)
    if default is not None:
        out, why = default()
        if why is None and out is not None:
            return out, DEFAULT_VENDOR
        if usable:
            return _call_vendor(op, vk, args, eager)
        if why is not None:
            return eager(), why
    return eager(), "eager" if vk is None else "eager:no_vendor_kernel"


def _call_vendor(op: str, vk: VendorKernel, args: tuple[Any, ...], eager: Callable[[], Any]) -> tuple[Any, str]:
    try:
        return vk.fn(*args), vk.name
    except Exception as exc:
        log_once(f"vendor:{op}:{vk.name}", logging.WARNING,
                  "tunekit: %s: vendor kernel %s raised %s: %s; PyTorch composition instead",
                  op, vk.name, type(exc).__name__, exc)
        return eager(), "eager:vendor_error"


#: The backend whose default config serves fallbacks without a vendor kernel.
_DEFAULT_BACKEND = "triton"


def _ew_default(op: str, dtype: str, m: int, n: int, k: int, x: torch.Tensor, capturing: bool,
                inputs: tuple[torch.Tensor, ...], make_out: Callable[[int, int, torch.Tensor], Any],
                finish: Callable[[Any], Any], eps: float | None,
                key: tuple | None = None, route: _EwRoute | None = None) -> tuple[Any, str | None]:
    """Serve a fallback that has no vendor kernel with tunekit's Triton kernel at a config valid for every M.

    The config is that of the table's Triton entry for the same shape at
    the nearest M (:func:`_nearest_config`) where one exists and runs this
    M, else the op's default (the kernel module's ``DEFAULT`` config: the
    search space's ``default`` with its ``fixed`` numerics switches, as the
    search enqueues it first; ``TritonBackend.serving_space``, no TOML read).
    Either serves any M the table lacks in one launch, where the
    composition takes several. Its numerics are those of the tuned kernels
    of the family (``VLLM_ROUNDING=1``): within the op's BF16 error bound of
    the fp64 reference (``OpSpec.error_bound``, what ``tunekit.measure.verify``
    checks every tuned candidate against), and so within that bound of the
    composition's result too, not bit-equal to it.

    Built once per (op, dtype, M, N, K, device), like a tuned entry, and
    cached; never built under CUDA-graph capture (the composition serves,
    ``eager:default_not_built_at_capture``, and the next eager call builds
    it; :func:`prepare` builds it for the Ms it is given). A call with its
    ``route`` launches through a bound launcher from the key's second eager
    call on (:func:`_launch_default`). Returns
    ``(result, None)`` when it served, ``(None, why)`` with an
    :data:`EAGER_VENDORS` key when it could not, ``(None, None)`` where it
    does not apply (no table serves this device). Never raises.
    """
    device = x.device
    key = key or (op, dtype, m, n, k, str(device))  # the decision cache's key (a route passes its own)
    dk = STATE.defaults.get(key)  # lock-free read (atomic under the GIL): hot path
    if dk is None:
        if capturing:
            # Never compile or load a module inside a capture (as for tuned entries); not cached,
            # so the next eager call builds it.
            index, _ = tables_for(device, str(device))
            return None, (None if index is None else "eager:default_not_built_at_capture")
        dk = _build_default(op, dtype, m, n, k, device)
        with STATE.lock:
            dk = STATE.defaults.setdefault(key, dk)
    if dk.kernel is None:
        return None, dk.why
    if eps is not None and not dk.takes_eps and eps != DEFAULT_EPS:
        return None, "eager:default_eps"
    try:
        out = make_out(m, n, x)
        if route is None:
            _launch_ew(dk.kernel, dk.takes_eps, inputs, out, eps)
        else:
            _launch_default(route, dk, inputs, out, eps, capturing)
    except Exception as exc:  # the serving path never raises for tunekit's sake
        log_once(f"default-kernel:{op}:{dtype}:{m}:{n}:{k}:{device}", logging.WARNING,
                  "tunekit: %s %s M=%d N=%d K=%d: default-config kernel raised %s: %s; PyTorch composition "
                  "from now on", op, dtype, m, n, k, type(exc).__name__, exc)
        with STATE.lock:
            STATE.defaults[key] = DefaultKernel(None, "eager:default_kernel_error")
        return None, "eager:default_kernel_error"
    return finish(out), None


def _launch_default(route: _EwRoute, dk: DefaultKernel, inputs: tuple[torch.Tensor, ...], out: Any,
                    eps: float | None, capturing: bool) -> None:
    """Launch a route's default-config kernel, through a launcher bound at the key's second eager call.

    These calls are an eager prefill's (sizes above the captured ones), where
    Triton's own launch path costs the host tens of microseconds per call
    (``benchmarks/probes/fallback_overhead.py``). Binding costs three checked
    launches and a synchronization, so a size seen once (a prefill length
    that never comes back) does not bind; one that repeats does, and its
    later calls cost what a tuned call's do.
    """
    if route.default is not dk:  # first call, or the defaults were rebuilt (a table reload)
        route.default, route.drun, route.dlauncher, route.dseen = dk, _at_eps(dk.kernel, dk.takes_eps, eps), None, 0
    if route.dlauncher is not None and route.dlauncher(inputs, out, None, True):
        return
    if not capturing and route.dseen < 2:
        route.dseen += 1
        if route.dseen == 2:
            route.dlauncher = launch.bind(route.drun, inputs, out)  # serves this call either way
            return
    route.drun(inputs, out)


def _nearest_config(entries: Iterable[Entry], op: str, dtype: str, m: int, n: int, k: int,
                    backend: str) -> dict[str, Any] | None:
    """The params of the table's ``backend`` entry for (op, dtype, N, K) at the M nearest ``m`` (the
    largest M below it first), or None.

    The fallback kernel serves M the table lacks with this config rather
    than the family's generic default: a row op computes every row alone,
    so a config verified at one M gives the same per-row result at any M,
    and the searches measured the generic default slower than vLLM's
    Inductor kernels (BLOCK_N=1024 in two passes: 3.1-3.6 us against
    1.9-2.7 for the H200's Gemma norms at M=1..8), where the tuned configs,
    one pass over the row, beat them at every M they were tuned for.
    """
    found = [e for e in entries if e.shape_key == (op, dtype, n, k) and e.backend == backend]
    if not found:
        return None
    best = min(found, key=lambda e: (e.m > m, abs(e.m - m)))
    return dict(best.params)


def _build_default(op: str, dtype: str, m: int, n: int, k: int, device: torch.device) -> DefaultKernel:
    """Build the default-config kernel of one key (slow path: once per key). Never raises."""
    index, _ = tables_for(device, str(device))
    if index is None:
        # No table serves this device (none loaded, or tuned for another one, or Triton's
        # interpreter mode does not match the tensors): tunekit is not serving here at all.
        return DefaultKernel(None)
    if dtype != "bf16":
        return DefaultKernel(None, "eager:default_dtype")
    from tunekit import backends
    from tunekit.problems.shapes import Problem

    info = index.device
    name = _DEFAULT_BACKEND
    try:
        backend = backends.get(name)
        why = backend.unavailable_reason(info) if op in backend.ops else f"no {name} kernel for {op}"
        if why:
            log_once(f"default-unavailable:{name}:{op}:{info.arch}", logging.WARNING,
                      "tunekit: %s: no vendor kernel and backend %s unavailable here (%s); PyTorch composition "
                      "for its fallbacks", op, name, why)
            return DefaultKernel(None, "eager:default_unavailable")
        problem = Problem(op, dtype, m, n, k)
        # the kernel's own default (Python next to it, the search space's default and fixed values): no TOML read
        space = backend.serving_space(problem) if hasattr(backend, "serving_space") else backend.space(problem)
        params = dict(space.fixed) | dict(space.default)  # as the search enqueues the default
        tuned = _nearest_config(index.entries_of(op, dtype, n, k), op, dtype, m, n, k, name)
        if tuned is not None:
            candidate = params | tuned  # the default fills what the entry does not name (its fixed switches)
            if backend.invalid_reason(problem, candidate) is None:
                params = candidate
        invalid = backend.invalid_reason(problem, params)
        if invalid is not None:
            log_once(f"default-invalid:{op}:{dtype}:{m}:{n}:{k}", logging.WARNING,
                      "tunekit: %s %s M=%d N=%d K=%d: the default %s config does not run here (%s); PyTorch "
                      "composition", op, dtype, m, n, k, name, invalid)
            return DefaultKernel(None, "eager:default_invalid")
        build_key = (name, op, dtype, m, n, k, json.dumps(params, sort_keys=True), info.torch_device)
        with STATE.lock:
            kernel = STATE.built.get(build_key)
        if kernel is None:
            kernel = backend.build(problem, params, info)
            with STATE.lock:
                STATE.built[build_key] = kernel
        return DefaultKernel(kernel, takes_eps=kernel_takes_eps(kernel))
    except Exception as exc:  # a kernel that does not build is the composition, never an error
        log_once(f"default-build:{op}:{dtype}:{m}:{n}:{k}", logging.WARNING,
                  "tunekit: %s %s M=%d N=%d K=%d: default-config %s kernel did not build (%s); PyTorch "
                  "composition", op, dtype, m, n, k, name, exc)
        return DefaultKernel(None, "eager:default_build_error")
