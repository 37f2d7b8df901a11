"""Is a fold safe on the weights it folds? The folded GEMV and the residual epilogue checked at load.

A folded norm moves one BF16 rounding: the model rounds W diag(g) once
where the unfolded one rounds the normalised activations x / rms(x) * g.
The search verified each kernel on random weights with gains near 1; a
checkpoint's own weights (gains above 10 and near 0, hidden states with a
few channels 50-100x the rest) are checked here, through the kernels the
tables serve, before a fold is kept:

* :func:`check_norm_fold`: ``rms_gemv`` on the folded weight (tuned where a
  table holds it, at every M it is tabulated for, and its fallback one M
  above) against the fp64 reference of the unfolded sequence (the norm,
  then the GEMV on the original weight), under the bound the search's
  correctness gate holds a norm-in-the-prologue GEMV to
  (``tunekit.problems.opspec_gemv``'s ``rms_norm_gemv`` /
  ``gemma_rms_norm_gemv`` spec: a fused kernel passes exactly where vLLM's
  norm kernel, BF16 rounding, then GEMV would);
* :func:`check_residual_add`: ``gemv_add`` on a layer's real weight against
  the fp64 GEMV plus residual, under the ``gemv_add`` spec's bound.

Inputs are seeded, rows of N(0, 1) activations, every other row (the first
included) with a few channels scaled 50-100x. The served calls go through
the ops' own run-time impls (the routes, kernels and fallbacks serving
uses); the dispatch markers they add are put back, as ``prepare`` does. The
unfused sequence run in the weights' dtype on the same inputs is reported
beside (``unfolded_ratio``): the floor the bound was derived from.

The reference of the norm spec uses the verification epsilon
(``opspec_base.EPS``, 1e-6); a layer's own (Llama: 1e-5) moves 1/rms of rows
of mean square >= 1 by under 5e-6 relative, some 3000x below the bound's
activation term (4.04 u = 2^-6 relative for BF16).

Call protocol::

    result = check_norm_fold("gemma_rms_norm", gain, eps, raw_weight, folded_weight)  # CheckResult
    result = check_residual_add(weight)
    result.ok, result.ratio, result.error, result.bound, result.m
    refuse_kernels("rms_gemv", "bf16", n, k, "cuda:0")   # a key whose kernel failed: its fallback from now on

No vLLM import: both integrations (``tunekit.integrations.vllm.verify_fold``,
``tunekit.integrations.torch_fold``) call it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tunekit.problems import oprecords

__all__ = ["CheckResult", "activations", "check_norm_fold", "check_residual_add", "checked_ms", "fold_scale",
           "quiet_markers", "refuse_kernels", "tables_hold"]

#: the channels of a row with large-magnitude activations, and their scale range
OUTLIER_CHANNELS, OUTLIER_SCALE = 4, (50.0, 100.0)
#: elements of W per fp64 reference chunk (its rows): 2^24 x 8 bytes = 128 MB, twice (the |.| sums)
_CHUNK_ELEMENTS = 1 << 24
_SEED = 20240917


@dataclass(frozen=True)
class CheckResult:
    """The worst element of a check: |err| / bound (<= 1 passes), the error and bound there, its call's M."""

    ok: bool
    ratio: float = 0.0
    error: float = 0.0
    bound: float = 0.0
    m: int = 0
    #: the unfused sequence's worst ratio on the same inputs (vLLM's norm, BF16 rounding, GEMV)
    unfolded_ratio: float = 0.0
    #: why not ok where no element comparison says it (an unsupported dtype, a non-finite output)
    reason: str = ""

    def worst(self, other: CheckResult) -> CheckResult:
        """The failing one, else the one of the larger ratio (the unfused floor kept at its worst)."""
        floor = max(self.unfolded_ratio, other.unfolded_ratio)
        first = self if (not self.ok, self.ratio) >= (not other.ok, other.ratio) else other
        return replace(first, unfolded_ratio=floor)

    def describe(self) -> str:
        if self.reason:
            return self.reason
        return (f"worst error {self.error:.3g} against a bound of {self.bound:.3g} (ratio {self.ratio:.3g}, "
                f"M={self.m}; the unfolded sequence: ratio {self.unfolded_ratio:.3g})")


def fold_scale(gain: torch.Tensor, norm_op: str) -> torch.Tensor:
    """The fp32 column scale a fold multiplies the consumers' weights by: g, or 1 + g (zero-centred norms: the
    op record's ``gain_offset``)."""
    g, offset = gain.detach().float(), oprecords.get(norm_op).gain_offset
    return g + offset if offset else g  # g + 0.0 would turn a gain of -0.0 into +0.0


@contextlib.contextmanager
def quiet_markers() -> Iterator[None]:
    """Calls made inside are not service calls: the dispatch markers are put back afterwards."""
    from tunekit import ops

    with ops.uncounted():
        yield


def refuse_kernels(op: str, dtype: str, n: int, k: int, device: str) -> int:
    """Serve (op, dtype, N, K) on ``device`` by the op's fallback at every M up to the tables' largest, from
    now on (until tables are loaded again): for a kernel that failed a check on real weights where the
    graph calling it can no longer change. Its marker rows read ``fallback:kernel_error``. Returns that M."""
    from tunekit import ops

    return ops.refuse(op, dtype, n, k, device)


def tables_hold(op: str, device: str) -> bool:
    """Whether a table serving ``device`` holds any entry of ``op`` (no ``rms_gemv`` entry: no fold can pay,
    and none is considered)."""
    from tunekit import ops

    return ops.holds(op, device)


def checked_ms(op: str, dtype: str, n: int, k: int, device: str) -> list[int]:
    """The Ms a check calls ``op`` at: every M a serving table tabulates for (op, dtype, N, K) (each may be
    another kernel) and one above the largest (the op's fallback)."""
    from tunekit import ops

    ms = ops.tabulated_ms(op, dtype, n, k, device)
    return [*ms, (ms[-1] if ms else 0) + 1]


def activations(m: int, k: int, dtype: torch.dtype, device: torch.device, seed: int, first_outlier: bool = True
                ) -> torch.Tensor:
    """[m, k] seeded N(0, 1) rows in ``dtype``; every other row, from the first (``first_outlier``) or the
    second, has :data:`OUTLIER_CHANNELS` channels scaled by 50-100 (as LLM hidden states have)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((m, k), generator=gen, device=device, dtype=torch.float32)
    count = min(OUTLIER_CHANNELS, k)
    channels = torch.randperm(k, generator=gen, device=device)[:count]
    low, high = OUTLIER_SCALE
    scales = low + (high - low) * torch.rand(count, generator=gen, device=device)
    rows = torch.arange(0 if first_outlier else 1, m, 2, device=device)
    x[rows[:, None], channels[None, :]] *= scales
    return x.to(dtype)


def _samples(m: int, k: int, dtype: torch.dtype, device: torch.device, seed: int) -> list[torch.Tensor]:
    """One call of m rows (both kinds of row), or at M=1 two: a row with outlier channels, a plain one."""
    if m == 1:
        return [activations(1, k, dtype, device, seed), activations(1, k, dtype, device, seed + 1, False)]
    return [activations(m, k, dtype, device, seed)]


def _compare(spec_name: str, dtype: str, inputs: Callable[[slice], tuple[torch.Tensor, ...]], n: int, k: int,
             outs: list[tuple[int, torch.Tensor, torch.Tensor]]) -> CheckResult:
    """Every output of ``outs`` ((m, served, unfused) per call, rows stacked along ``inputs``' rows) against the
    spec's fp64 reference and bound, W's rows in chunks."""
    from tunekit.problems import opspec
    from tunekit.problems.shapes import Problem

    spec = opspec.get(spec_name)
    served = torch.cat([o for _, o, _ in outs]).reshape(-1, n)
    unfused = torch.cat([u for _, _, u in outs]).reshape(-1, n)
    row_m = torch.cat([torch.full((o.numel() // n,), m, dtype=torch.int64) for m, o, _ in outs])
    if not torch.isfinite(served).all():
        return CheckResult(False, math.inf, math.inf, 0.0, int(row_m[0]), reason="the served kernel wrote "
                           "non-finite values on finite inputs")
    chunk = max(1, _CHUNK_ELEMENTS // max(k, 1))
    worst = CheckResult(True, -1.0)
    floor = 0.0
    for start in range(0, n, chunk):
        cols = slice(start, min(n, start + chunk))
        chunk_inputs = inputs(cols)
        problem = Problem(spec_name, dtype, served.shape[0], cols.stop - cols.start, k)
        ref = spec.reference(chunk_inputs)
        bound = spec.error_bound(problem, chunk_inputs, ref)
        err = (served[:, cols].double() - ref).abs()
        rel = err / bound
        at = int(rel.argmax())
        row, col = divmod(at, rel.shape[1])
        ratio = float(rel.reshape(-1)[at])
        floor = max(floor, float(((unfused[:, cols].double() - ref).abs() / bound).max()))
        if ratio > worst.ratio:
            worst = CheckResult(ratio <= 1.0, ratio, float(err[row, col]), float(bound[row, col]), int(row_m[row]))
    return replace(worst, unfolded_ratio=floor)


def _dtype_name(dtype: torch.dtype) -> str | None:
    from tunekit.problems.opspec_base import TORCH_DTYPES

    return next((name for name, t in TORCH_DTYPES.items() if t == dtype), None)


@torch.no_grad()
def check_norm_fold(norm_op: str, gain: torch.Tensor, eps: float, raw: torch.Tensor, folded: torch.Tensor,
                    seed: int = _SEED) -> CheckResult:
    """``rms_gemv(x, folded, eps)`` as served against the unfolded sequence on ``raw``: the norm of convention
    ``norm_op`` (``rms_norm``: x / rms * g; ``gemma_rms_norm``: * (1 + g)) with weight ``gain``, then the GEMV.
    At every M :func:`checked_ms` lists; the worst element decides (``CheckResult.ok``: within the bound)."""
    from tunekit import ops

    rms_gemv_impl = ops.impl("rms_gemv")
    dtype = _dtype_name(raw.dtype)
    if dtype is None or folded.dtype != raw.dtype or gain.dtype != raw.dtype:
        return CheckResult(False, reason=f"no correctness bound for {raw.dtype} weights")
    n, k = raw.shape
    scale = fold_scale(gain, norm_op)
    outs, xs = [], []
    with quiet_markers():
        for i, m in enumerate(checked_ms("rms_gemv", dtype, n, k, str(raw.device))):
            for x in _samples(m, k, raw.dtype, raw.device, seed + 7 * i):
                served = rms_gemv_impl(x, folded, eps)
                xf = x.float()
                normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(raw.dtype)
                outs.append((m, served, F.linear(normed, raw)))
                xs.append(x)
    x_all = torch.cat(xs)
    spec = f"{norm_op}_gemv"  # the norm in the GEMV's prologue: the unfolded sequence's bound
    return _compare(spec, dtype, lambda cols: (x_all, gain, raw[cols]), n, k, outs)


@torch.no_grad()
def check_residual_add(weight: torch.Tensor, seed: int = _SEED) -> CheckResult:
    """``gemv_add(x, weight, residual)`` as served against the GEMV plus the residual, the residual stream's
    rows with outlier channels as the activations'. At every M :func:`checked_ms` lists."""
    from tunekit import ops

    gemv_add_impl = ops.impl("gemv_add")
    dtype = _dtype_name(weight.dtype)
    if dtype is None:
        return CheckResult(False, reason=f"no correctness bound for {weight.dtype} weights")
    n, k = weight.shape
    outs, xs, rs = [], [], []
    with quiet_markers():
        for i, m in enumerate(checked_ms("gemv_add", dtype, n, k, str(weight.device))):
            for j, x in enumerate(_samples(m, k, weight.dtype, weight.device, seed + 7 * i)):
                residual = activations(x.shape[0], n, weight.dtype, weight.device, seed + 7 * i + 3 + j, j == 0)
                served = gemv_add_impl(x, weight, residual)
                outs.append((m, served, F.linear(x, weight) + residual))
                xs.append(x)
                rs.append(residual)
    x_all, r_all = torch.cat(xs), torch.cat(rs)
    return _compare("gemv_add", dtype, lambda cols: (x_all, weight[cols], r_all[:, cols]), n, k, outs)
