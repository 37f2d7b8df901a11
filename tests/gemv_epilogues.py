"""Shared check of the GEMV kernel's fused variants (``gemv_add``, ``rms_gemv``, the SiLU-and-mul
epilogue with and without the rms scale): one problem, verified by the op's own spec and bound on the
CPU under the Triton interpreter."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels_triton.gemv import GemvConfig, gemv
from tunekit.measure import verify
from tunekit.problems import opspec, opspec_gemv
from tunekit.problems.shapes import Problem

CPU = torch.device("cpu")

#: op -> (its spec, how the kernel is called on the spec's inputs)
VARIANTS: dict[str, tuple[opspec.OpSpec, Callable[..., None]]] = {
    "gemv_add": (opspec_gemv.GEMV_ADD,
                 lambda inputs, config, out: gemv(inputs[0], inputs[1], config, out=out, residual=inputs[2])),
    "rms_gemv": (opspec_gemv.RMS_GEMV,
                 lambda inputs, config, out: gemv(inputs[0], inputs[1], config, out=out, rms_eps=opspec.EPS)),
    "gemv_silu_mul": (opspec_gemv.GLU_GEMVS["gemv_silu_mul"],
                      lambda inputs, config, out: gemv(inputs[0], inputs[1], config, out=out, glu=True)),
    "rms_gemv_silu_mul": (opspec_gemv.GLU_GEMVS["rms_gemv_silu_mul"],
                          lambda inputs, config, out: gemv(inputs[0], inputs[1], config, out=out,
                                                           rms_eps=opspec.EPS, glu=True)),
}


def check(op: str, m: int, n: int, k: int, config: GemvConfig, seed: int = 0) -> float:
    """Assert that ``op`` at (m, n, k) with ``config`` passes verification; its error / bound ratio."""
    spec, call = VARIANTS[op]
    result = verify.verify(lambda inputs, out: call(inputs, config, out), spec, Problem(op, "bf16", m, n, k),
                           CPU, seed=seed)
    assert result.ok, result.reason
    return result.err_ratio
