"""The ONE correctness path: every candidate passes here before it is timed.

Checks, in order, on fresh random inputs (never zeros):
1. the kernel runs and writes an output of the right shape, dtype and strides;
2. every element is written (the output is poisoned with NaN first) and finite;
3. every element is within the op's error bound of an fp64 reference
   (``OpSpec.error_bound``); the worst |err| / bound ratio is recorded;
4. a second run on the same inputs gives the same bits (determinism);
5. under ``numerics="exact"``: the bits equal those of the family's
   designated reference kernel on the same inputs.

An op with several outputs (``fused_add_rms_norm``: the normalised rows and
the updated residual) gets every check on every output: all are poisoned, each
is compared with its own reference under its own bound, and the recorded
error is the worst over all of them; messages name the output
(``OpSpec.output_names``) whenever there is more than one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tunekit.problems.opspec import OpSpec
from tunekit.problems.shapes import Problem

#: ``kernel(inputs, out)``: ``out`` is a tensor, or a tuple for multi-output ops (see tunekit.problems.opspec).
Kernel = Callable[[tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, ...]], None]
NUMERICS = ("bounded", "exact")


@dataclass
class VerifyResult:
    ok: bool
    reason: str  # "" when ok
    max_abs_err: float = float("nan")
    err_ratio: float = float("nan")  # max over elements of |err| / bound (<= 1 passes)

    def as_dict(self) -> dict:
        return asdict(self)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _poisoned(spec: OpSpec, problem: Problem, device: torch.device) -> torch.Tensor | tuple[torch.Tensor, ...]:
    out = spec.make_output(problem, device)
    for tensor in _as_tuple(out):
        tensor.fill_(float("nan"))
    return out


def _as_tuple(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _labels(spec: OpSpec, count: int) -> list[str]:
    """Message prefixes per output: empty for a single-output op (messages unchanged)."""
    if count == 1:
        return [""]
    names = list(spec.output_names) + [f"output {i}" for i in range(len(spec.output_names), count)]
    return [f"{name}: " for name in names[:count]]


def verify(
    kernel: Kernel,
    spec: OpSpec,
    problem: Problem,
    device: torch.device,
    seed: int,
    numerics: str = "bounded",
    reference_kernel: Kernel | None = None,
) -> VerifyResult:
    """Check ``kernel`` on ``problem``; never raises for a wrong kernel (only for misuse)."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, not {numerics!r}")
    if numerics == "exact" and reference_kernel is None:
        raise ValueError("numerics='exact' needs the family's reference kernel")
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = spec.make_inputs(problem, device, gen)

    out = _poisoned(spec, problem, device)
    expected = _as_tuple(spec.make_output(problem, device))
    kernel(inputs, out)
    _synchronize(device)
    outs = _as_tuple(out)
    labels = _labels(spec, len(expected))
    if len(outs) != len(expected):
        return VerifyResult(False, f"kernel returned {len(outs)} outputs, expected {len(expected)}")
    for label, o, e in zip(labels, outs, expected, strict=True):
        if o.shape != e.shape or o.dtype != e.dtype or o.stride() != e.stride():
            return VerifyResult(False, f"{label}output layout {tuple(o.shape)}/{o.stride()} changed")
    for label, o in zip(labels, outs, strict=True):
        unwritten = torch.isnan(o)
        if unwritten.any():
            return VerifyResult(False, f"{label}{int(unwritten.sum())} output elements not written (NaN poison left)")
        if not torch.isfinite(o).all():
            return VerifyResult(False, f"{label}non-finite output")

    worst = against_reference(spec, problem, inputs, outs, labels)
    if worst.ratio > 1.0:
        return VerifyResult(False, worst.failure, worst.max_err, worst.ratio)
    ratio, max_err = worst.ratio, worst.max_err

    again = _poisoned(spec, problem, device)
    kernel(inputs, again)
    _synchronize(device)
    for label, o, a in zip(labels, outs, _as_tuple(again), strict=True):
        if not torch.equal(_bits(o), _bits(a)):
            return VerifyResult(False, f"{label}two runs on the same inputs differ (nondeterministic)", max_err, ratio)

    if numerics == "exact":
        assert reference_kernel is not None
        golden = _poisoned(spec, problem, device)
        reference_kernel(inputs, golden)
        _synchronize(device)
        for label, o, g in zip(labels, outs, _as_tuple(golden), strict=True):
            if not torch.equal(_bits(o), _bits(g)):
                differ = int((_bits(o) != _bits(g)).sum())
                return VerifyResult(False, f"{label}not bit-identical to the reference config "
                                           f"({differ} elements differ)", max_err, ratio)
    return VerifyResult(True, "", max_err, ratio)


def repeated_calls(kernel: Kernel, spec: OpSpec, problem: Problem, inputs: tuple[torch.Tensor, ...],
                   device: torch.device, calls: int) -> str | None:
    """``calls`` calls of ``kernel`` on the same ``inputs``, each into a NaN-poisoned output and each checked on
    its own: every element written, finite where the reference is, within the op's bound of the fp64
    reference. Why the first failing call fails ("call 2: ..."), None where every call passes: a kernel that
    goes wrong only after its first call, or only on these inputs, is caught here."""
    reference = reference_of(spec, problem, inputs)
    labels = _labels(spec, len(reference[0]))
    for call in range(1, calls + 1):
        out = _poisoned(spec, problem, device)
        kernel(inputs, out)
        _synchronize(device)
        outs = _as_tuple(out)
        for label, o, ref in zip(labels, outs, reference[0], strict=True):
            if o.shape != ref.shape:
                return f"call {call}: {label}output shape {tuple(o.shape)}, expected {tuple(ref.shape)}"
            finite = torch.isfinite(ref)
            bad = ~torch.isfinite(o) & finite
            if bad.any():
                what = "not written (NaN poison left)" if torch.isnan(o[bad]).all() else "non-finite"
                return f"call {call}: {label}{int(bad.sum())} output elements {what}"
        worst = against_reference(spec, problem, inputs, outs, labels, reference)
        if worst.ratio > 1.0:
            return f"call {call}: {worst.failure}"
    return None


@dataclass(frozen=True)
class Worst:
    """The outputs against the fp64 reference: the worst |err| / bound over every element (<= 1 passes), the
    largest |err| of all outputs, and of the output with the worst ratio its |err| and the failure message."""

    ratio: float
    max_err: float
    worst_err: float
    failure: str


def reference_of(spec: OpSpec, problem: Problem, inputs: tuple[torch.Tensor, ...]
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(the fp64 reference outputs of ``inputs``, their error bounds): computed once for several calls."""
    ref_value = spec.reference(inputs)
    return _as_tuple(ref_value), _as_tuple(spec.error_bound(problem, inputs, ref_value))


def against_reference(spec: OpSpec, problem: Problem, inputs: tuple[torch.Tensor, ...],
                      outs: tuple[torch.Tensor, ...], labels: list[str] | None = None,
                      reference: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None) -> Worst:
    """Every output of one call against ``spec``'s fp64 reference of ``inputs`` under its error bound: the
    one comparison of the search's check (:func:`verify`), the serving canary (``tunekit.dispatch.canary``)
    and the load check (``tunekit.dispatch.load_check``). ``outs`` must have the reference's shapes;
    ``reference``: :func:`reference_of` of these inputs, where the caller compares several calls."""
    refs, bounds = reference if reference is not None else reference_of(spec, problem, inputs)
    labels = labels or _labels(spec, len(refs))
    ratio, max_err, worst_err, failure = float("-inf"), 0.0, 0.0, ""
    for label, o, ref, bound in zip(labels, outs, refs, bounds, strict=True):
        err = (o.reshape(ref.shape).double() - ref).abs()  # a served output may be a view of another shape
        rel = err / bound
        this_ratio, this_err = float(rel.max()), float(err.max())
        max_err = max(max_err, this_err)
        if this_ratio > ratio:  # the message names the output with the worst ratio
            ratio, worst_err = this_ratio, this_err
            failure = f"{label}error {this_err:.3g} exceeds the bound (ratio {this_ratio:.3g}, flat index " \
                      f"{int(rel.argmax())})"
    return Worst(ratio, max_err, worst_err, failure)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so that equality means equal bits (NaN-safe)."""
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.view(width)
