"""Bound launchers: a built Triton kernel's launches replayed through Triton's own compiled-kernel launcher.

A built kernel (``backend.build(...) -> kernel(inputs, out)``) launches one
or more ``@triton.jit`` functions through ``kernel[grid](...)``: per call,
Triton binds the arguments, computes the specialization key, looks the
compiled kernel up and only then calls its launcher (tens of microseconds of
Python). For one argument layout all of that is fixed but the tensors' data
pointers and the stream. :func:`bind` runs the kernel once, recording every
``JITFunction.run`` it makes (the compiled kernel, grid, constexprs, scalar
arguments), and returns a :class:`Launcher` that replays them with the call's
tensors straight into ``CompiledKernel.run`` with the arguments
``JITFunction.run`` itself passes (Triton 3.6 to 3.9:
``run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *bound_args)``; the signature is checked in
Triton's source before anything is bound).

Never bound (:func:`bind` returns None and the caller keeps the normal
``kernel(inputs, out)`` call): interpreter mode, a Triton whose launch call
differs, a backend other than CUDA, a kernel that launches nothing through
Triton (HIP), a grid given as a function, pre-run hooks, a scratch tensor
that aliases an argument, or a replay that is not bit-identical to the
normal launch (checked once at bind time, into NaN-filled outputs and
scratch). The numerics are the kernel's own: same compiled binary, same
arguments.

A :class:`Launcher` guards each call (shapes, strides and 16-byte alignment
of every tensor as at bind time: what the compiled specialization and the
recorded scalars assume; the current device; no launch hooks set, such as
a profiler's) and returns False instead of launching when the guard fails:
the caller then makes the normal call.
"""

from __future__ import annotations

import inspect
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tunekit.measure.device import interpret_mode

#: the call JITFunction.run makes (Triton 3.6 - 3.9); a Triton without it is never bound
_LAUNCH_CALL = ("kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, "
                "launch_metadata,")

_BIND_LOCK = threading.Lock()
_SUPPORT: dict[str, str | None] = {}
#: built kernel -> its Launcher, or None once binding was tried and is not possible
_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unsupported_reason() -> str | None:
    """Why this process never binds (None: it may): interpreter mode, no Triton, an unknown launch call."""
    if interpret_mode():
        return "interpreter"
    if "triton" not in _SUPPORT:
        _SUPPORT["triton"] = _check_triton()
    return _SUPPORT["triton"]


def _check_triton() -> str | None:
    try:
        from triton.runtime.jit import JITFunction
        src = inspect.getsource(JITFunction.run)
    except Exception as exc:  # no Triton, or no source to check
        return f"triton not inspectable ({type(exc).__name__})"
    if "run" not in JITFunction.__dict__:
        return "JITFunction.run is inherited"
    flat = " ".join(src.split())
    if _LAUNCH_CALL not in flat or "*bound_args.values())" not in flat:
        return "unknown launcher signature"
    return None


def bound(kernel: Callable[..., Any]) -> tuple[bool, Launcher | None]:
    """(tried, launcher) for a built kernel: whether :func:`bind` ran for it, and what it gave."""
    try:
        if kernel in _BOUND:
            return True, _BOUND[kernel]
    except TypeError:  # not weak-referenceable: never bound
        return True, None
    return False, None


def bind(kernel: Callable[..., Any], inputs: Sequence[torch.Tensor], out: Any) -> Launcher | None:
    """Run ``kernel(inputs, out)`` (the call is served either way) and bind it, once per kernel.

    Returns the :class:`Launcher`, or None when binding is not possible
    (remembered: later calls keep the normal launch). Never call it under
    CUDA-graph capture (it launches the kernel three times and compares).
    """
    tried, launcher = bound(kernel)
    if tried:
        if launcher is None or not launcher(inputs, out):
            kernel(inputs, out)
        return launcher
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    tensors = (*inputs, *outs)
    why = unsupported_reason()
    if why is None and not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        why = "not CUDA tensors"
    if why is None and torch.version.hip:
        why = "HIP"
    launcher = None
    if why is None:
        with _BIND_LOCK:
            launcher = _bind(kernel, inputs, out, tensors)
    else:
        kernel(inputs, out)
    try:
        _BOUND[kernel] = launcher
    except TypeError:
        pass
    return launcher


def _bind(kernel, inputs, out, tensors) -> Launcher | None:
    first = _record(kernel, inputs, out)  # the served launch
    try:
        second = _record(kernel, inputs, out)  # the same call again: tells cached scratch from per-call scratch
        steps = _steps(first, second, tensors)
        if steps is None:
            return None
        launcher = Launcher(steps, tensors, isinstance(out, (tuple, list)), len(inputs))
        return launcher if launcher.replays_exactly(inputs, out) else None
    except Exception:  # binding is an optimisation: anything odd keeps the normal launch
        return None


def _record(kernel, inputs, out) -> list[tuple] | None:
    """Run the kernel once, returning the launches this thread made through JITFunction.run."""
    from triton.runtime.jit import JITFunction

    calls: list[tuple] = []
    me = threading.get_ident()
    original = JITFunction.__dict__["run"]

    def recording_run(self, *args, grid, warmup, **kwargs):
        ret = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        if threading.get_ident() == me:
            calls.append((self, grid, args, dict(kwargs), warmup, ret))
        return ret

    JITFunction.run = recording_run
    try:
        kernel(inputs, out)
    finally:
        JITFunction.run = original
    return calls


def _steps(first, second, tensors) -> list[dict] | None:
    if not first or not second or len(first) != len(second):
        return None
    io_storage = {t.untyped_storage().data_ptr() for t in tensors}
    steps = []
    for a, b in zip(first, second, strict=True):  # lengths checked above
        fn, grid, args, kwargs, warmup, ret = a
        if warmup or b[0] is not fn or b[1] != grid or callable(grid) or getattr(fn, "pre_run_hooks", None):
            return None
        compiled = ret.result() if hasattr(ret, "result") else ret
        compiled_b = b[5].result() if hasattr(b[5], "result") else b[5]
        if compiled is None or compiled is not compiled_b:
            return None
        values_a, values_b = _bound_values(fn, args, kwargs), _bound_values(fn, b[2], b[3])
        if len(values_a) != len(values_b):
            return None
        slots = []
        for va, vb in zip(values_a, values_b, strict=True):
            if isinstance(va, torch.Tensor):
                if not isinstance(vb, torch.Tensor):
                    return None
                idx = next((i for i, t in enumerate(tensors) if t is va), None)
                if idx is not None:
                    if vb is not va:
                        return None
                    slots.append(("io", idx))
                elif va.untyped_storage().data_ptr() in io_storage:
                    return None  # a view of an argument made by the launcher: not replayable as scratch
                elif vb is va:
                    slots.append(("fixed", va))  # a buffer the launcher caches (ticket counters)
                elif (va.shape == vb.shape and va.dtype == vb.dtype and va.is_contiguous()
                      and vb.is_contiguous()):
                    slots.append(("scratch", (tuple(va.shape), va.dtype, va.device)))
                else:
                    return None
            elif isinstance(vb, torch.Tensor) or type(va) is not type(vb) or not _same(va, vb):
                return None
            else:
                slots.append(("const", va))
        g = tuple(grid) + (1, 1)
        steps.append({"compiled": compiled, "grid": (int(g[0]), int(g[1]), int(g[2])), "slots": slots})
    return steps


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
    except Exception:
        return False


def _bound_values(fn, args, kwargs) -> list[Any]:
    """The kernel's parameters in order (constexprs too), as JITFunction.run's binder passes them."""
    sig = inspect.signature(fn.fn)
    params = {k: v for k, v in kwargs.items() if k in sig.parameters}
    ba = sig.bind(*args, **params)
    ba.apply_defaults()
    return list(ba.arguments.values())


class Launcher:
    """A built kernel bound to one argument layout: ``launcher(inputs, out) -> bool`` (False: not launched)."""

    def __init__(self, steps: list[dict], tensors: Sequence[torch.Tensor], multi_out: bool, n_inputs: int) -> None:
        import triton
        from triton import knobs

        drv = triton.runtime.driver.active
        self.device = drv.get_current_device()
        # what the driver's get_current_device (torch.cuda.current_device) returns, without its Python wrapper
        self._get_device = getattr(torch._C, "_cuda_getDevice", None) or drv.get_current_device
        self._get_stream = drv.get_current_stream
        self._rt = knobs.runtime
        self._enter, self._exit = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if not (hasattr(self._enter, "calls") and hasattr(self._exit, "calls")):
            raise TypeError("launch hooks are not HookChains")  # another Triton: not bound
        self.multi_out = multi_out
        self.launches = len(steps)
        self.n_inputs = n_inputs
        ns: dict[str, Any] = {}
        # [the inputs' strides and alignment: always; the inputs' shapes and the outputs: unless trusted]
        guards: list[list[str]] = [[], []]
        for i, t in enumerate(tensors):
            ns[f"_sh{i}"], ns[f"_st{i}"] = t.shape, t.stride()
            if i < self.n_inputs:
                guards[1].append(f"ts[{i}].shape != _sh{i}")
                guards[0].append(f"ts[{i}].stride() != _st{i}")
                g = guards[0]
            else:
                g = guards[1]
                g.append(f"ts[{i}].shape != _sh{i} or ts[{i}].stride() != _st{i}")
            if t.data_ptr() % 16 == 0:  # Triton specialized the pointer as 16-byte aligned
                g.append(f"ts[{i}].data_ptr() & 15")
        body = ["    if not trusted:", f"        if {' or '.join(guards[1]) or 'False'}:", "            return False",
                f"    if {' or '.join(guards[0]) or 'False'}:", "        return False"]
        for s, step in enumerate(steps):
            compiled = step["compiled"]
            ns[f"_run{s}"], ns[f"_fn{s}"], ns[f"_md{s}"] = compiled.run, compiled.function, compiled.packed_metadata
            args = []
            for p, (kind, val) in enumerate(step["slots"]):
                name = f"_c{s}_{p}"
                if kind == "io":
                    args.append(f"ts[{val}]")
                elif kind == "scratch":
                    ns[name] = val
                    body.append(f"    {name}_t = _scratch(*{name})")
                    args.append(f"{name}_t")
                else:
                    ns[name] = val
                    args.append(name)
            gx, gy, gz = step["grid"]
            body.append(f"    _run{s}({gx}, {gy}, {gz}, stream, _fn{s}, _md{s}, None, None, None, {', '.join(args)})")
        body.append("    return True")
        src = "def _launch(ts, stream, _scratch, trusted):\n" + "\n".join(body) + "\n"
        exec(compile(src, f"<tunekit bound launch: {len(steps)} kernel(s)>", "exec"), ns)
        self._launch = ns["_launch"]
        self.source = src

    def __call__(self, inputs: Sequence[torch.Tensor], out: Any, _scratch=None, trusted: bool = False) -> bool:
        """Launch into ``out``; False (nothing launched) when the guard fails: the caller launches normally.

        ``trusted=True``: the caller allocated ``out`` itself as at bind time
        (``new_empty`` of the same shape and dtype: contiguous, allocator-aligned)
        and its route's key holds the inputs' shapes, so only the inputs'
        strides and alignment are checked.
        """
        rt = self._rt
        enter, exit_ = self._enter, self._exit
        # a launch hook (a profiler's) gets launch metadata from the normal path, so that path serves then
        if rt.launch_enter_hook is not enter or rt.launch_exit_hook is not exit_ or enter.calls or exit_.calls:
            return False
        dev = self._get_device()
        if dev != self.device:
            return False
        ts = (*inputs, *out) if self.multi_out else (*inputs, out)
        return self._launch(ts, self._get_stream(dev), _scratch or _empty_scratch, trusted)

    def replays_exactly(self, inputs: Sequence[torch.Tensor], out: Any) -> bool:
        """Replay into NaN-filled outputs and scratch; True when bit-identical to the normal launch in ``out``."""
        outs = tuple(out) if self.multi_out else (out,)
        fresh = tuple(_filled(torch.empty_like(o)) for o in outs)
        ok = self(inputs, fresh if self.multi_out else fresh[0], _scratch=_filled_scratch)
        if not ok:
            return False
        return all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, fresh, strict=True))


def _empty_scratch(shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _filled_scratch(shape, dtype, device) -> torch.Tensor:
    return _filled(torch.empty(shape, dtype=dtype, device=device))


def _filled(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan") if t.is_floating_point() else -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)
