"""The HIP elementwise families: predicates, defines and launchers of kernels_hip's
rms_norm.hip, fused_add_rms_norm.hip, gated_rms_norm.hip, silu_and_mul.hip, bias_gelu.hip.

``tunekit.backends.hip`` owns the protocol and routes every op through its
``FAMILIES`` (op -> ``Family``): these and the GEMV's, a ``Family`` too. Search-space keys are the
kernels' tunable defines (``search_spaces/<family>.toml``, ``[hip]``); the
backend adds ``WAVE`` (from the device) and the problem-derived defines
(``N_COLS`` = the row or group length, ``GEMMA`` from the op name), so every
row loop is unrolled for the shape being tuned.

Call protocol (through the HIP backend)::

    family = FAMILIES[problem.op]
    family.invalid_reason(params, problem)      # pure predicate, no compile
    defines = family.defines(params, problem, wave)
    module = rtc.compile_kernel(family.source, defines, device)
    launcher = family.build(module, defines, device_index, problem)
    launcher(inputs, out[, eps=eps])            # async, on torch's current stream

Kernel arguments are 8-byte integers (pointers, int64 scalars); the norms'
epsilon travels as the bits of its fp32 value.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tunekit import rtc
from tunekit.backends.base import BuildError, Params
from tunekit.problems import oprecords
from tunekit.problems.opspec import EPS
from tunekit.problems.shapes import Problem

#: Threads of a block fill whole waves on every target: 64 is the AMD gfx9/DCU
#: wave and a multiple of NVIDIA's 32 (full-mask shuffles need whole warps).
_BLOCK_MULTIPLE = 64
#: Values a silu/gelu thread holds in flight (UNROLL * VEC per operand, two operands).
_MAX_IN_FLIGHT = 64

NORM_PARAMS = ("THREADS_PER_ROW", "ROWS_PER_BLOCK", "VEC", "VLLM_ROUNDING")
GATED_PARAMS = ("THREADS_PER_ROW", "ROWS_PER_BLOCK", "VEC")
POINTWISE_PARAMS = ("THREADS", "VEC", "UNROLL", "ROWS_PER_BLOCK", "VLLM_ROUNDING")


def _pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def eps_bits(eps: float) -> int:
    """The IEEE-754 bits of ``eps`` as an fp32 (how the kernels take their epsilon)."""
    return struct.unpack("<I", struct.pack("<f", eps))[0]


def int_params(params: Params, names: Sequence[str]) -> dict[str, int] | str:
    """``params`` as exactly the integer defines ``names``, or why not (unknown, missing, non-integer)."""
    unknown = sorted(set(params) - set(names))
    if unknown:
        return f"unknown parameter(s) {unknown} (known: {', '.join(names)})"
    missing = [name for name in names if name not in params]
    if missing:
        return f"missing parameter(s) {missing}"
    try:
        return {name: int(params[name]) for name in names}
    except (TypeError, ValueError):
        return f"non-integer parameter in {params}"


def _rows_reason(p: dict[str, int]) -> str | None:
    """Rules of the row-reduction kernels (rms_norm.hip and its siblings)."""
    tpr, rpb, vec = p["THREADS_PER_ROW"], p["ROWS_PER_BLOCK"], p["VEC"]
    if vec not in (1, 2, 4, 8):
        return f"VEC={vec}: must be 1, 2, 4 or 8"
    if not _pow2(tpr) or tpr > 1024:
        return f"THREADS_PER_ROW={tpr}: must be a power of two <= 1024"
    if rpb < 1:
        return f"ROWS_PER_BLOCK={rpb} must be >= 1"
    threads = tpr * rpb
    if threads > 1024:
        return f"block of {threads} threads (ROWS_PER_BLOCK*THREADS_PER_ROW) exceeds 1024"
    if threads % _BLOCK_MULTIPLE:
        return f"block of {threads} threads is not a multiple of {_BLOCK_MULTIPLE} (whole waves everywhere)"
    if p.get("VLLM_ROUNDING", 0) not in (0, 1):
        return f"VLLM_ROUNDING={p['VLLM_ROUNDING']}: must be 0 or 1"
    return None


def norm_invalid_reason(params: Params, problem: Problem) -> str | None:
    """rms_norm.hip / fused_add_rms_norm.hip: None if buildable for ``problem``, else why not."""
    p = int_params(params, NORM_PARAMS)
    if isinstance(p, str):
        return p
    if problem.k != problem.n or problem.n < 1:
        return f"a norm of whole rows needs K == N >= 1 (got N={problem.n}, K={problem.k})"
    return _rows_reason(p)


def gated_invalid_reason(params: Params, problem: Problem) -> str | None:
    """gated_rms_norm.hip: None if buildable for ``problem`` (groups of K over rows of N), else why not."""
    p = int_params(params, GATED_PARAMS)
    if isinstance(p, str):
        return p
    if problem.k < 1 or problem.n % problem.k:
        return f"N={problem.n} is not a whole number of groups of K={problem.k}"
    return _rows_reason(p)


def pointwise_invalid_reason(params: Params, problem: Problem) -> str | None:
    """silu_and_mul.hip / bias_gelu.hip: None if buildable for ``problem``, else why not."""
    p = int_params(params, POINTWISE_PARAMS)
    if isinstance(p, str):
        return p
    if problem.n < 1:
        return f"{problem.op} needs N >= 1 (got N={problem.n})"
    want_k = oprecords.layout(problem.op).dims(problem.op, problem.n)[1]  # glu: K = 2N; a row: K = N
    if problem.k != want_k:
        return f"{problem.op} needs K={want_k} for N={problem.n} (got K={problem.k})"
    threads, vec, unroll, rpb = p["THREADS"], p["VEC"], p["UNROLL"], p["ROWS_PER_BLOCK"]
    if vec not in (1, 2, 4, 8):
        return f"VEC={vec}: must be 1, 2, 4 or 8"
    if not 1 <= threads <= 1024 or threads % _BLOCK_MULTIPLE:
        return f"THREADS={threads}: must be a multiple of {_BLOCK_MULTIPLE} and <= 1024"
    if not 1 <= unroll <= 16:
        return f"UNROLL={unroll}: must be 1..16"
    if 2 * unroll * vec > _MAX_IN_FLIGHT:
        return f"2*UNROLL*VEC={2 * unroll * vec} values in flight per thread > {_MAX_IN_FLIGHT}"
    if rpb < 1:
        return f"ROWS_PER_BLOCK={rpb} must be >= 1"
    if p["VLLM_ROUNDING"] not in (0, 1):
        return f"VLLM_ROUNDING={p['VLLM_ROUNDING']}: must be 0 or 1"
    return None


LaunchArgs = Callable[[dict[str, int], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], float],
                      tuple[tuple[int, int, int], tuple[int, int, int], list[int]]]


@dataclass(frozen=True)
class Family:
    """One kernels_hip source and how to build and launch it for an op."""

    source: str  # kernels_hip/<source>.hip
    kernel: str  # the extern "C" kernel name
    params: tuple[str, ...]  # tunable defines (search-space keys)
    invalid_reason: Callable[[Params, Problem], str | None]
    derived: Callable[[Problem], dict[str, int]]  # defines the backend sets from the problem
    launch_args: LaunchArgs | None  # (defines, inputs, outputs, eps) -> (grid, block, args); eps: the norms
    #: tunables added after tables were first written, with the value their absence means
    defaults: Mapping[str, int] = field(default_factory=dict)
    #: (family, module, defines, device index, problem) -> the launcher; None: ElementwiseLauncher
    launcher: Callable[..., Any] | None = None
    #: compiled for every M up to the problem's (a MAX_M define): one build serves each smaller M
    built_up_to_m: bool = False

    def defines(self, params: Params, problem: Problem, wave: int) -> dict[str, int]:
        """The full define set: tunables (absent later ones at their defaults) + WAVE + the problem-derived
        defines."""
        derived = self.derived(problem)
        overridden = sorted(set(params) & (set(derived) | {"WAVE"}))
        if overridden:
            raise BuildError(f"{overridden} are set by the backend (device wave, problem shape), not by params")
        params = {**self.defaults, **params}
        return {name: int(params[name]) for name in self.params} | {"WAVE": wave} | derived

    def build(self, module: rtc.CompiledModule, defines: dict[str, int], device_index: int,
              problem: Problem) -> Any:
        """The launcher of a compiled ``module``: ``launcher(inputs, out[, eps=eps])``."""
        make = self.launcher or ElementwiseLauncher
        return make(self, module, defines, device_index, problem)


def _rows_grid(rows: int, d: dict[str, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    rpb = d["ROWS_PER_BLOCK"]
    return (max(1, -(-rows // rpb)), 1, 1), (rpb * d["THREADS_PER_ROW"], 1, 1)


def _norm_args(d: dict[str, int], inputs: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...],
               eps: float = EPS):
    x, w = inputs
    (y,) = outs
    grid, block = _rows_grid(x.shape[0], d)
    return grid, block, [x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.stride(0), y.stride(0),
                         eps_bits(eps)]


def _fused_args(d: dict[str, int], inputs: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...],
                eps: float = EPS):
    x, r, w = inputs
    y, r_out = outs
    grid, block = _rows_grid(x.shape[0], d)
    return grid, block, [x.data_ptr(), r.data_ptr(), w.data_ptr(), y.data_ptr(), r_out.data_ptr(), x.shape[0],
                         x.stride(0), r.stride(0), y.stride(0), r_out.stride(0), eps_bits(eps)]


def _gated_args(d: dict[str, int], inputs: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...],
                eps: float = EPS):
    x, z, w = inputs
    (y,) = outs
    groups = x.shape[1] // w.shape[0]
    total = x.shape[0] * groups
    grid, block = _rows_grid(total, d)
    return grid, block, [x.data_ptr(), z.data_ptr(), w.data_ptr(), y.data_ptr(), total, groups, x.stride(0),
                         z.stride(0), y.stride(0), eps_bits(eps)]


def _pointwise_grid(m: int, n: int, d: dict[str, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    cols = d["THREADS"] * d["VEC"] * d["UNROLL"]
    return (max(1, -(-n // cols)), max(1, -(-m // d["ROWS_PER_BLOCK"])), 1), (d["THREADS"], 1, 1)


def _silu_args(d: dict[str, int], inputs: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...],
               eps: float = EPS):
    (x,) = inputs
    (y,) = outs
    m, n = y.shape
    grid, block = _pointwise_grid(m, n, d)
    return grid, block, [x.data_ptr(), y.data_ptr(), m, n, x.stride(0), y.stride(0)]


def _gelu_args(d: dict[str, int], inputs: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...],
               eps: float = EPS):
    x, b = inputs
    (y,) = outs
    m, n = y.shape
    grid, block = _pointwise_grid(m, n, d)
    return grid, block, [x.data_ptr(), b.data_ptr(), y.data_ptr(), m, n, x.stride(0), y.stride(0)]


def _norm_derived(problem: Problem) -> dict[str, int]:
    return {"N_COLS": problem.n, "GEMMA": int(problem.op.startswith("gemma_"))}


_NORM = Family("rms_norm", "tunekit_rms_norm", NORM_PARAMS, norm_invalid_reason, _norm_derived, _norm_args)
_FUSED = Family("fused_add_rms_norm", "tunekit_fused_add_rms_norm", NORM_PARAMS, norm_invalid_reason,
                _norm_derived, _fused_args)

#: kernels_hip source stem -> its family (the op records, ``kernels["hip"]``, name the source of each op).
_BY_SOURCE: dict[str, Family] = {family.source: family for family in (
    _NORM, _FUSED,
    Family("gated_rms_norm", "tunekit_gated_rms_norm", GATED_PARAMS, gated_invalid_reason,
           lambda p: {"N_COLS": p.k}, _gated_args),
    Family("silu_and_mul", "tunekit_silu_and_mul", POINTWISE_PARAMS, pointwise_invalid_reason, lambda p: {},
           _silu_args),
    Family("bias_gelu", "tunekit_bias_gelu", POINTWISE_PARAMS, pointwise_invalid_reason, lambda p: {}, _gelu_args),
)}

#: op -> the HIP family serving it (the hip backend's op -> source map for elementwise ops), from the op records.
FAMILIES: dict[str, Family] = {op: _BY_SOURCE[oprecords.kernel(op, "hip")]
                               for op in oprecords.names(kind="elementwise", backend="hip")}


class ElementwiseLauncher:
    """The built kernel: ``launcher(inputs, out)`` on torch's current stream (one launch, graph-capturable)."""

    def __init__(self, family: Family, module: rtc.CompiledModule, defines: dict[str, int], device_index: int,
                 problem: Problem) -> None:
        self.family = family
        self.module = module
        self.defines = defines
        self.compile_s = module.compile_s
        self.cache_hit = module.cache_hit
        self._problem = problem
        self._fn = module.kernel(family.kernel, device_index)

    def __call__(self, inputs: tuple[torch.Tensor, ...], out: torch.Tensor | tuple[torch.Tensor, ...],
                 eps: float = EPS) -> None:
        # eps travels as a kernel argument (its fp32 bits), so one build serves every model's epsilon
        outs = out if isinstance(out, tuple) else (out,)
        self._check(inputs, outs)
        if outs[0].shape[0] == 0:
            return
        grid, block, args = self.family.launch_args(self.defines, inputs, outs, eps)
        self._fn(grid, block, args, torch.cuda.current_stream(outs[0].device).cuda_stream)

    def _check(self, inputs: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...]) -> None:
        tensors = (*inputs, *outs)
        if any(t.dtype != torch.bfloat16 for t in tensors):
            raise ValueError(f"{self.family.source}.hip takes bf16 tensors")
        if not all(t.is_cuda for t in tensors):
            raise ValueError(f"{self.family.source}.hip runs on GPU tensors")
        if any(t.shape[-1] > 1 and t.stride(-1) != 1 for t in tensors):
            raise ValueError(f"{self.family.source}.hip needs unit stride along the last dim")
        n = self._problem.n
        if outs[0].shape[-1] != n or (self.family.source != "silu_and_mul" and inputs[0].shape[-1] != n):
            raise ValueError(f"shape mismatch: built for N={n}, got {[tuple(t.shape) for t in tensors]}")

    def __repr__(self) -> str:
        return f"hip {self.family.source} {self.defines}"
