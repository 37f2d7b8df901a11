"""The GEMV's spec and those of the fused GEMV families (``tunekit.problems.opspec_base``'s protocol).

* ``gemv``: inputs (x[m,k], W[n,k]) -> y[m,n] = x W^T, the weight rotated while timing;
* a norm in the GEMV's prologue (``rms_norm_gemv`` and its Gemma / fused-add forms,
  ``tunekit.problems.shapes.NORM_GEMV_OPS``) or SiLU-and-mul (``silu_mul_gemv``);
* in its epilogue: the residual add (``gemv_add``), the 1/rms scale of a norm folded
  into W (``rms_gemv``), SiLU-and-mul of gate_up's pairs of rows (``gemv_silu_mul``,
  ``rms_gemv_silu_mul``).

Every bound is the GEMV's (:func:`_gemv_bound`) carried through what the fused
op adds, plus the roundings of the unfused sequence it replaces, so a fused
kernel passes exactly where vLLM's sequence of kernels would. :data:`GEMV` and
:data:`FUSED_SPECS` are what the registry (``tunekit.problems.opspec.get``) lists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tunekit.problems.opspec_base import (
    EPS,
    FP32_U,
    TINY,
    TORCH_DTYPES,
    UNIT_ROUNDOFF,
    OpSpec,
    Outputs,
    rms_scaled,
    scaled_randn,
)
from tunekit.problems.shapes import (
    ACT_GEMV_OPS,
    DTYPE_BYTES,
    GEMV_ADD_OPS,
    GLU_GEMV_OPS,
    NORM_GEMV_OPS,
    RMS_GEMV_OPS,
    Problem,
)

#: rows of a weight made fp64 at a time by the references and bounds below: a whole lm_head of 248320 x 5120 is
#: 10 GB in fp64, more than a GPU serving a model has to spare (the load check runs these on it)
REF_ROWS = 4096


def _dot64(a: torch.Tensor, w: torch.Tensor, absolute: bool = False) -> torch.Tensor:
    """``a`` (fp64, [M, K]) @ ``w``^T in fp64 (``absolute``: of |w|), ``w`` made fp64 :data:`REF_ROWS` rows at a
    time: the same products as ``a @ w.double().T``, in bounded memory."""
    out = a.new_empty((a.shape[0], w.shape[0]))
    for i in range(0, w.shape[0], REF_ROWS):
        chunk = w[i:i + REF_ROWS].double()
        out[:, i:i + REF_ROWS] = a @ (chunk.abs() if absolute else chunk).T
    return out


def _gemv_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    dtype = TORCH_DTYPES[problem.dtype]
    # Scaled so that |y| ~ 1: keeps the BF16 output in its normal range while
    # every weight element still carries a random, nonzero value.
    x = torch.randn((problem.m, problem.k), generator=gen, device=device, dtype=torch.float32)
    w = torch.randn((problem.n, problem.k), generator=gen, device=device, dtype=torch.float32)
    w.mul_(problem.k**-0.5)
    return x.to(dtype), w.to(dtype)


def _gemv_output(problem: Problem, device: torch.device) -> torch.Tensor:
    return torch.empty((problem.m, problem.n), dtype=TORCH_DTYPES[problem.dtype], device=device)


def _gemv_reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, w = inputs
    return _dot64(x.double(), w)


def _gemv_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
    """Per-element bound: output rounding + worst-case fp32 accumulation.

    |y - ref| <= 2u_out |ref| + K * u_fp32 * (|x| @ |W|^T) + tiny absolute floor.
    The second term is the classic gamma_K bound for recursive summation in
    fp32, valid for any reduction order (tree, split-K, sequential). A kernel
    that drops or repeats a K chunk errs by O(|x_i w_i| sqrt(chunk)), orders of
    magnitude above this bound at the sizes we test.
    """
    x, w = inputs
    abs_dot = _dot64(x.double().abs(), w, absolute=True)
    u_out = UNIT_ROUNDOFF[problem.dtype]
    return 2 * u_out * ref.abs() + problem.k * FP32_U * abs_dot + 1e-30


def _gemv_bytes(problem: Problem) -> int:
    size = DTYPE_BYTES[problem.dtype]
    return problem.n * problem.k * size + problem.m * (problem.k + problem.n) * size


GEMV = OpSpec(
    name="gemv",
    make_inputs=_gemv_inputs,
    make_output=_gemv_output,
    reference=_gemv_reference,
    error_bound=_gemv_bound,
    bytes_moved=_gemv_bytes,
    rotated_input=1,
)

# ------------------------------------------------------------------ norm -> gemv
# RMSNorm in the GEMV prologue (kernels_triton/rms_norm_gemv.py): inputs
# (x[m,k], g[k], W[n,k]) -> y[m,n], or with a residual (x, residual[m,k], g, W)
# -> (y, residual_out[m,k]); the norm width is the GEMV's k.
_NORM_GEMV_ADD_OPS = ("fused_add_rms_norm_gemv", "gemma_fused_add_rms_norm_gemv")


def _norm_gemv_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    # Unit-variance rows, an N(0, 1) norm weight (a (1 + g) / g mix-up is O(1))
    # and W scaled by k^-0.5 as the GEMV's, so |y| ~ 1.
    dtype = TORCH_DTYPES[problem.dtype]
    m, n, k = problem.m, problem.n, problem.k
    x = scaled_randn((m, k), gen, device, dtype)
    residual = (scaled_randn((m, k), gen, device, dtype),) if problem.op in _NORM_GEMV_ADD_OPS else ()
    g = scaled_randn((k,), gen, device, dtype)
    w = scaled_randn((n, k), gen, device, dtype, scale=k**-0.5)
    return (x, *residual, g, w)


def _norm_gemv_output(problem: Problem, device: torch.device) -> Outputs:
    y = _gemv_output(problem, device)
    if problem.op in _NORM_GEMV_ADD_OPS:
        return y, torch.empty((problem.m, problem.k), dtype=TORCH_DTYPES[problem.dtype], device=device)
    return y


def _norm_gemv_activations(op: str, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, s) in fp64: the normalised activations the GEMV multiplies, and the row sum s."""
    if op in _NORM_GEMV_ADD_OPS:
        x, residual, g, _ = inputs
        s = x.double() + residual.double()
    else:
        x, g, _ = inputs
        s = x.double()
    g64 = g.double() + 1.0 if op.startswith("gemma_") else g.double()
    return rms_scaled(s, s.shape[1]) * g64, s


def _norm_gemv_reference(op: str) -> Callable[[tuple[torch.Tensor, ...]], Outputs]:
    def reference(inputs: tuple[torch.Tensor, ...]) -> Outputs:
        """fp64 of the unfused sequence (norm, then GEMV), no intermediate rounding."""
        a, s = _norm_gemv_activations(op, inputs)
        y = _dot64(a, inputs[-1])
        return (y, s) if op in _NORM_GEMV_ADD_OPS else y

    return reference


def _norm_gemv_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: Outputs) -> Outputs:
    """The GEMV's bound on the activations a norm kernel would write, plus their own error.

    The unfused sequence (vLLM's norm kernel writes BF16 a-hat, the GEMV reads
    it) has a-hat_j = a_j (1 + d_j) with |d_j| <= c r + (k + 16) u32 (see
    ``opspec_elementwise._norm_bound`` / ``_fused_add_bound``; r = 2u): c = 2 without a residual
    (x*rstd rounded before the weight, the norm's output; Gemma: one allowed
    spare), c = 4 with one (the BF16 sum perturbs s_j and rstd by r each).
    The GEMV on a-hat errs by 2u |a-hat.W| + k u32 |a-hat|.|W| (``_gemv_bound``),
    and a-hat.W = y + sum_j a_j d_j W_ij. With |a|.|W| the fp64 ``abs_dot``:
      |y-hat - y| <= 2u|y| + (1.01 c r + (2k + 32) u32) abs_dot + tiny
    (1.01 covers the products of small terms). Mistakes it catches: a missing
    rstd or residual, or (1 + g) for g, change y by O(abs_dot / sqrt(k)) in
    every element; the tests also compare with the standalone norm + GEMV
    kernels. residual_out: as ``opspec_elementwise._fused_add_bound``'s, r |s| relative.
    """
    op = problem.op
    a, s = _norm_gemv_activations(op, inputs)
    abs_dot = _dot64(a.abs(), inputs[-1], absolute=True)
    u_out = UNIT_ROUNDOFF[problem.dtype]
    r = 2 * u_out
    c = 4 if op in _NORM_GEMV_ADD_OPS else 2
    y = ref[0] if isinstance(ref, tuple) else ref
    y_bound = 2 * u_out * y.abs() + (1.01 * c * r + (2 * problem.k + 32) * FP32_U) * abs_dot + TINY
    if op in _NORM_GEMV_ADD_OPS:
        return y_bound, (r + FP32_U) * s.abs() + TINY
    return y_bound


def _norm_gemv_bytes(problem: Problem) -> int:
    size = DTYPE_BYTES[problem.dtype]
    m, n, k = problem.m, problem.n, problem.k
    residual = 2 * m * k if problem.op in _NORM_GEMV_ADD_OPS else 0  # residual in + residual_out
    return (n * k + m * k + k + m * n + residual) * size  # W, x, g, y (+ residual in / out)


def _norm_gemv(name: str) -> OpSpec:
    add = name in _NORM_GEMV_ADD_OPS
    return OpSpec(
        name=name, make_inputs=_norm_gemv_inputs, make_output=_norm_gemv_output,
        reference=_norm_gemv_reference(name), error_bound=_norm_gemv_bound, bytes_moved=_norm_gemv_bytes,
        rotated_input=3 if add else 2, output_names=("out", "residual_out") if add else ("out",),
    )


# ------------------------------------------------------------ silu_and_mul -> gemv
# SiLU-and-mul in the GEMV prologue (kernels_triton/silu_mul_gemv.py): inputs
# (gate_up[m,2k], W[n,k]) -> y[m,n]; gate_up is vLLM's merged gate_up_proj output
# (gate in columns [0, k), up in [k, 2k)).


def _act_gemv_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    # gate_up with std 2 as silu_and_mul's (both SiLU regimes and its curved middle),
    # W scaled by k^-0.5 as the GEMV's, so |y| ~ 1.
    dtype = TORCH_DTYPES[problem.dtype]
    m, n, k = problem.m, problem.n, problem.k
    gate_up = scaled_randn((m, 2 * k), gen, device, dtype, scale=2.0)
    return gate_up, scaled_randn((n, k), gen, device, dtype, scale=k**-0.5)


def _act_gemv_activations(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """silu(gate) * up in fp64: the activations the GEMV multiplies."""
    gate_up, w = inputs
    k = w.shape[1]
    gate, up = gate_up[:, :k].double(), gate_up[:, k:].double()
    return gate * torch.sigmoid(gate) * up


def _act_gemv_reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """fp64 of the unfused sequence (SiLU-and-mul, then GEMV), no intermediate rounding."""
    return _dot64(_act_gemv_activations(inputs), inputs[1])


def _act_gemv_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
    """The GEMV's bound on the activations vLLM's silu_and_mul writes, plus their own error.

    As ``_norm_gemv_bound``: the unfused sequence (vLLM's silu_and_mul writes
    BF16 a-hat, the GEMV reads it) has a-hat_j = a_j (1 + d_j) with |d_j| <=
    2r + 64 u32 (``opspec_elementwise._silu_and_mul_bound``: silu rounded before the multiply and
    the product, r = 2u; fp32 exp / divide / multiply). The GEMV on a-hat errs
    by 2u |a-hat.W| + k u32 |a-hat|.|W|, and a-hat.W = y + sum_j a_j d_j W_ij.
    With abs_dot = |a|.|W| in fp64:
      |y-hat - y| <= 2u|y| + (1.01 * 2r + (2k + 64) u32) abs_dot + tiny.
    The fused kernel rounds a exactly where vLLM does (bit-identical a-hat),
    so only the fp32 sum order differs from the unfused path; a kernel that
    skipped the BF16 rounding of a stays inside the bound too (it is closer
    to the fp64 reference). Mistakes it catches: gate and up swapped, a
    missing SiLU, or the wrong half of gate_up change y by O(abs_dot /
    sqrt(k)) in every element; a dropped or repeated K chunk as the GEMV's.
    """
    abs_dot = _dot64(_act_gemv_activations(inputs).abs(), inputs[1], absolute=True)
    u_out = UNIT_ROUNDOFF[problem.dtype]
    r = 2 * u_out
    return 2 * u_out * ref.abs() + (1.01 * 2 * r + (2 * problem.k + 64) * FP32_U) * abs_dot + TINY


def _act_gemv_bytes(problem: Problem) -> int:
    m, n, k = problem.m, problem.n, problem.k
    return (n * k + 2 * m * k + m * n) * DTYPE_BYTES[problem.dtype]  # W, gate_up, y


SILU_MUL_GEMV = OpSpec(
    name="silu_mul_gemv", make_inputs=_act_gemv_inputs, make_output=_gemv_output, reference=_act_gemv_reference,
    error_bound=_act_gemv_bound, bytes_moved=_act_gemv_bytes, rotated_input=1,
)
assert ACT_GEMV_OPS == (SILU_MUL_GEMV.name,)

# ------------------------------------------------------------ gemv + residual
# The residual add in the GEMV epilogue (kernels_triton/gemv.py, residual=): inputs
# (x[m,k], W[n,k], residual[m,n]) -> y[m,n] = x W^T + residual, the updated residual
# stream of o_proj / out_proj / down_proj (vLLM adds their output to it in the next norm).


def _gemv_add_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    # x and W as the GEMV's (|x W^T| ~ 1) and a unit-variance residual: a missing, doubled or
    # misplaced residual changes every output by O(1).
    x, w = _gemv_inputs(problem, device, gen)
    return x, w, scaled_randn((problem.m, problem.n), gen, device, TORCH_DTYPES[problem.dtype])


def _gemv_add_reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """fp64 of x W^T + residual on the same BF16 values, no intermediate rounding."""
    return _gemv_reference(inputs[:2]) + inputs[2].double()


def _gemv_add_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
    """The GEMV's bound with the residual as one more fp32 term of the sum, and the rounding of
    the sequence it replaces.

    The kernel adds the residual to the fp32 dot (error <= k u32 |x|.|W|, any
    order) in fp32 and rounds once. vLLM's unfused path (the GEMV writes BF16
    h, its next norm adds h to the residual in fp32 and rounds again) errs by
    2u |h| more, which matters where h and the residual cancel. Both are held
    to |y - ref| <= 2u (|ref| + |x W^T|) + 1.01 (k + 1) u32 (|x|.|W| + |r|) +
    tiny (1.01 covers the output rounding of the fp32 error). A missing,
    doubled or misplaced residual errs by O(|r|) ~ 1 in every element.
    """
    x, w, residual = inputs
    dot = ref - residual.double()  # x W^T, already in the reference
    abs_terms = _dot64(x.double().abs(), w, absolute=True) + residual.double().abs()
    u_out = UNIT_ROUNDOFF[problem.dtype]
    return 2 * u_out * (ref.abs() + dot.abs()) + 1.01 * (problem.k + 1) * FP32_U * abs_terms + TINY


def _gemv_add_bytes(problem: Problem) -> int:
    return _gemv_bytes(problem) + problem.m * problem.n * DTYPE_BYTES[problem.dtype]  # + the residual read


GEMV_ADD = OpSpec(
    name="gemv_add", make_inputs=_gemv_add_inputs, make_output=_gemv_output, reference=_gemv_add_reference,
    error_bound=_gemv_add_bound, bytes_moved=_gemv_add_bytes, rotated_input=1,
)
assert GEMV_ADD_OPS == (GEMV_ADD.name,)

# ------------------------------------------------------------ rms-scaled gemv
# An RMSNorm whose weight is folded into the consumer's W (kernels_triton/gemv.py, rms_eps=):
# inputs (x[m,k], W'[n,k]) -> y[m,n] = (x / rms(x)) W'^T, rms per row of x over its k values.
# W' = W diag(g) (diag(1 + g), Gemma) is made once, when the model's weights are prepared.


def _rms_gemv_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    # rows of x at rms 2, 3, 4, ...: a missing or misplaced scale (the wrong row's, the square
    # root left out) changes every output by a factor >= 1.5
    x, w = _gemv_inputs(problem, device, gen)
    scale = torch.arange(2, problem.m + 2, device=device, dtype=torch.float32)[:, None]
    return (x.float() * scale).to(x.dtype), w


def _rms_gemv_reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """fp64 of (x / sqrt(mean(x^2) + EPS)) W^T on the same BF16 values."""
    x, w = inputs
    xd = x.double()
    rstd = torch.rsqrt(xd.square().mean(dim=-1, keepdim=True) + EPS)
    return _dot64(xd * rstd, w)


def _rms_gemv_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
    """The GEMV's bound on the scaled dot, the error of the fp32 scale, and the rounding of the
    sequence it replaces.

    The kernel sums x^2 in fp32 (relative error <= k u32, positive terms, any
    order), takes rsqrt (hardware approximation: <= 4 u32 relative, with
    the division by k) and multiplies the fp32 dot (error <= k u32 |x|.|W|,
    the GEMV's) by it, then rounds once. The unfused sequence (the norm
    writes BF16 a = x rstd, then the GEMV) errs by u rstd |x|.|W| more. Both
    are held to |y - ref| <= 2u |ref| + 1.01 ((u + k u32) rstd |x|.|W| +
    (k + 8) u32 |ref|) + tiny. A dropped or wrong scale errs by a factor of
    the row's rms (2 and up, ``_rms_gemv_inputs``).
    """
    x, w = inputs
    xd = x.double()
    rstd = torch.rsqrt(xd.square().mean(dim=-1, keepdim=True) + EPS)
    abs_dot = _dot64(xd.abs(), w, absolute=True)
    u_out = UNIT_ROUNDOFF[problem.dtype]
    return (2 * u_out * ref.abs() + 1.01 * (u_out + problem.k * FP32_U) * rstd * abs_dot
            + 1.01 * (problem.k + 8) * FP32_U * ref.abs() + TINY)


RMS_GEMV = OpSpec(
    name="rms_gemv", make_inputs=_rms_gemv_inputs, make_output=_gemv_output, reference=_rms_gemv_reference,
    error_bound=_rms_gemv_bound, bytes_moved=_gemv_bytes, rotated_input=1,
)
assert RMS_GEMV_OPS == (RMS_GEMV.name,)

# ------------------------------------------------------- gemv + silu-and-mul
# SiLU-and-mul in gate_up_proj's epilogue (kernels_triton/gemv.py, glu=): inputs (x[m,k],
# W[n,k]) with W's rows (gate_i, up_i) pairs (``interleave_gate_up``, made once when the weights
# are prepared) -> y[m, n/2] = silu(g) * u, (g, u) the pairs' dots. The rms_
# form is the same of x / rms(x) (a folded norm before gate_up_proj, as rms_gemv).
def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """A merged gate_up weight [gate; up] ([2I, K], vLLM's layout) with its rows reordered into (gate_i,
    up_i) pairs: the weight the gemv_silu_mul ops read, made once when the weights are prepared."""
    n, k = w.shape
    if n % 2:
        raise ValueError(f"a gate_up weight has an even number of rows, got {n}")
    return w.view(2, n // 2, k).transpose(0, 1).reshape(n, k)


_SILU_SLOPE = 1.0999  # max |silu'(t)| over all t (1.09984 at t ~ 2.3994): silu is 1.1-Lipschitz


def _glu_dots(inputs: tuple[torch.Tensor, ...], rms: bool, u_out: float) -> tuple[torch.Tensor, ...]:
    """fp64 (g, u, bound on the unfused sequence's error in g, in u) of the pairs of rows; ``rms``: of
    x / rms(x); ``u_out``: the unit roundoff of the GEMV's output type."""
    x, w = inputs
    k = x.shape[-1]
    xd = x.double()
    abs_dot = _dot64(xd.abs(), w, absolute=True)
    if rms:
        rstd = torch.rsqrt(xd.square().mean(dim=-1, keepdim=True) + EPS)
        dots = _dot64(xd * rstd, w)
        # rms_gemv's bound (the norm's BF16 output in the unfused sequence included), then the GEMV's
        # BF16 output before silu-and-mul
        err = 1.01 * (u_out + k * FP32_U) * rstd * abs_dot + (1.01 * (k + 8) * FP32_U + u_out) * dots.abs()
    else:
        dots = _dot64(xd, w)
        err = 1.01 * k * FP32_U * abs_dot + u_out * dots.abs()
    return dots[:, 0::2], dots[:, 1::2], err[:, 0::2], err[:, 1::2]


def _glu_inputs(problem: Problem, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    if problem.n % 2:
        raise ValueError(f"{problem.op}: N = {problem.n} is a gate_up width, it must be even")
    # the rms_ form: rows of x at rms 2, 3, ... as rms_gemv's (a missing scale errs by >= 1.5x)
    make = _rms_gemv_inputs if problem.op.startswith("rms_") else _gemv_inputs
    return make(problem, device, gen)


def _glu_output(problem: Problem, device: torch.device) -> torch.Tensor:
    return torch.empty((problem.m, problem.n // 2), dtype=TORCH_DTYPES[problem.dtype], device=device)


def _glu_reference(rms: bool) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    def reference(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """fp64 silu(g) * u of the pairs' dots on the same BF16 values (no rounding: u_out unused)."""
        g, u, _, _ = _glu_dots(inputs, rms, 0.0)
        return torch.nn.functional.silu(g) * u
    return reference


def _glu_bound(problem: Problem, inputs: tuple[torch.Tensor, ...], ref: torch.Tensor) -> torch.Tensor:
    """The dots' bound (the GEMV's, or rms_gemv's), carried through silu(g) * u, plus the roundings of
    the unfused sequence it replaces.

    With |g' - g| <= Eg and |u' - u| <= Eu (the unfused sequence: the GEMV
    rounds g and u to BF16 on top of its fp32 error; the fused kernel keeps
    them in fp32), |silu(g') u' - silu(g) u| <= 1.1 Eg (|u| + Eu) + |silu(g)|
    Eu, silu being 1.1-Lipschitz. The fp32 silu and product add a few u32
    relative; the output rounding (twice in vLLM's BF16 silu, then mul) 2u.
    Held to 2u |ref| + 1.01 (1.1 Eg (|u| + Eu) + |silu(g)| Eu) + 16 u32 |ref| +
    tiny. Pairing the wrong rows (gate with gate, the [gate; up] order), a
    missing SiLU or scale, or gate and up swapped errs by O(|ref|) ~ 1.
    """
    u_out = UNIT_ROUNDOFF[problem.dtype]
    g, u, err_g, err_u = _glu_dots(inputs, problem.op.startswith("rms_"), u_out)
    carried = _SILU_SLOPE * err_g * (u.abs() + err_u) + torch.nn.functional.silu(g).abs() * err_u
    return 2 * u_out * ref.abs() + 1.01 * carried + 16 * FP32_U * ref.abs() + TINY


def _glu_bytes(problem: Problem) -> int:
    size = DTYPE_BYTES[problem.dtype]
    return problem.n * problem.k * size + problem.m * (problem.k + problem.n // 2) * size


def _glu_gemv(op: str) -> OpSpec:
    return OpSpec(name=op, make_inputs=_glu_inputs, make_output=_glu_output,
                  reference=_glu_reference(op.startswith("rms_")), error_bound=_glu_bound, bytes_moved=_glu_bytes,
                  rotated_input=1)


GLU_GEMVS = {op: _glu_gemv(op) for op in GLU_GEMV_OPS}

NORM_GEMVS = {name: _norm_gemv(name) for name in NORM_GEMV_OPS}

#: the fused GEMV families (the op records, ``tunekit.problems.oprecords``, name each one's spec)
FUSED_SPECS: tuple[OpSpec, ...] = (*NORM_GEMVS.values(), SILU_MUL_GEMV, GEMV_ADD, RMS_GEMV, *GLU_GEMVS.values())
