"""The ONE correctness path: every candidate passes here before it is timed.

Checks, in order, on fresh random inputs (never zeros):
1. the kernel runs and writes an output of the right shape, dtype and strides;
2. every element is written (the output is poisoned with NaN first) and finite;
3. every element is within the op's error bound of an fp64 reference
   (``OpSpec.error_bound``); the worst |err| / bound ratio is recorded;
4. a second run on the same inputs gives the same bits (determinism);
5. under ``numerics="exact"``: the bits equal those of the family's
   designated reference kernel on the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tunekit.opspec import OpSpec
from tunekit.shapes import Problem

Kernel = Callable[[tuple[torch.Tensor, ...], torch.Tensor], None]
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


def _poisoned(spec: OpSpec, problem: Problem, device: torch.device) -> torch.Tensor:
    out = spec.make_output(problem, device)
    out.fill_(float("nan"))
    return out


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
    expected = spec.make_output(problem, device)
    kernel(inputs, out)
    _synchronize(device)
    if out.shape != expected.shape or out.dtype != expected.dtype or out.stride() != expected.stride():
        return VerifyResult(False, f"output layout {tuple(out.shape)}/{out.stride()} changed")
    unwritten = torch.isnan(out)
    if unwritten.any():
        return VerifyResult(False, f"{int(unwritten.sum())} output elements not written (NaN poison left)")
    if not torch.isfinite(out).all():
        return VerifyResult(False, "non-finite output")

    ref = spec.reference(inputs)
    err = (out.double() - ref).abs()
    bound = spec.error_bound(problem, inputs, ref)
    ratio = float((err / bound).max())
    max_err = float(err.max())
    if ratio > 1.0:
        worst = int((err / bound).argmax())
        return VerifyResult(
            False,
            f"error {max_err:.3g} exceeds the bound (ratio {ratio:.3g}, flat index {worst})",
            max_err,
            ratio,
        )

    again = _poisoned(spec, problem, device)
    kernel(inputs, again)
    _synchronize(device)
    if not torch.equal(_bits(out), _bits(again)):
        return VerifyResult(False, "two runs on the same inputs differ (nondeterministic)", max_err, ratio)

    if numerics == "exact":
        assert reference_kernel is not None
        golden = _poisoned(spec, problem, device)
        reference_kernel(inputs, golden)
        _synchronize(device)
        if not torch.equal(_bits(out), _bits(golden)):
            differ = int((_bits(out) != _bits(golden)).sum())
            return VerifyResult(False, f"not bit-identical to the reference config ({differ} elements differ)",
                                max_err, ratio)
    return VerifyResult(True, "", max_err, ratio)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so that equality means equal bits (NaN-safe)."""
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.view(width)
