"""A backend whose candidates fail in every way a real one can (test-only).

Loaded by name as ``fault_backend:BACKEND`` (the registry imports any
``module:ATTR``), in the search worker too. BLOCK_N selects the fault:
2 -> the process dies, 4 -> a correct Triton kernel, 8 -> it hangs,
16 -> the build fails with a compiler log, 32 -> wrong results,
64 -> correct within the BF16 bound but one element rounded the other way
(passes "bounded", fails "exact").

``fault_backend:RAISE_AFTER`` and ``fault_backend:DRIFT`` serve right for a few
calls, then raise or drift (a kernel failing mid-serve, for the serving
fallback and the canary). ``fault_backend:WRONG`` is a table entry whose kernel is broken: Triton's
GEMV (fused or plain) with outputs 25% off, for the load checks (``tunekit.patch``'s and the
vLLM plugin's) to catch.
"""

from __future__ import annotations

import itertools
import os
import time
import weakref

import torch

from tunekit.backends.base import BuildError, SearchSpace
from tunekit.backends.triton import TritonBackend


class FaultBackend(TritonBackend):
    name = "fault"

    def __init__(self, block_ns: list[int]) -> None:
        self.block_ns = block_ns

    def space(self, problem):
        return SearchSpace(
            op="gemv", backend=self.name,
            domains={"BLOCK_N": list(self.block_ns)},
            default={"BLOCK_N": 4},
            reference={"BLOCK_N": 4},
            fixed={"BLOCK_K": 64, "num_warps": 1, "num_stages": 1, "SPLIT_K": 1},
        )

    def build(self, problem, params, device):
        block_n = params["BLOCK_N"]
        if block_n == 16:
            raise BuildError("compile failed", log="gemv.hip:12: error: injected compiler error")
        good = super().build(problem, dict(params, BLOCK_N=4), device)

        def kernel(inputs, out):
            if block_n == 2:
                os._exit(3)  # like an illegal memory access killing the process
            if block_n == 8:
                time.sleep(3600)
            good(inputs, out)
            if block_n == 32:
                out.mul_(1.5)
            if block_n == 64:
                _round_the_other_way(inputs, out)

        return kernel


def _round_the_other_way(inputs, out) -> None:
    """Replace y[0, 0] by the other BF16 neighbour of its exact value: still
    within one ulp (inside the bound) but different bits."""
    x, w = inputs
    exact = float(x[0].double() @ w[0].double())
    y = float(out[0, 0])
    step_up = y <= exact
    out.view(torch.int16)[0, 0] += 1 if (y >= 0) == step_up else -1


#: every fault; for the isolation test
BACKEND = FaultBackend([2, 4, 8, 16, 32])
#: the reference config and its 1-ulp twin; for the numerics test
EXACT = FaultBackend([4, 64])


class _PinnedFaultBackend(FaultBackend):
    def pinned_params(self, device):
        return {"BLOCK_N": 4}  # as if BLOCK_N changed nothing on this device


#: for the pinned-parameter test: only BLOCK_N=4 may ever be measured
PINNED = _PinnedFaultBackend([4, 32])


class _SlowBackend(FaultBackend):
    """Every candidate is correct and takes ``SLOW_BUILD_S`` to build, so a trial stays RUNNING
    that long: for the test of two searches sharing a storage."""

    def build(self, problem, params, device):
        time.sleep(float(os.environ.get("TUNEKIT_TEST_SLOW_BUILD_S", "12")))
        return super().build(problem, dict(params, BLOCK_N=4), device)


#: slow but correct candidates (three names of one kernel)
SLOW = _SlowBackend([4, 32, 64])


class _WrongFusedGemv(TritonBackend):
    """Triton's GEMVs (the fused rms_gemv, gemv_add; the plain gemv) with outputs 25% off: a table entry whose
    kernel is broken (``fault_backend:WRONG``)."""

    name = "wrong"

    def build(self, problem, params, device):
        good = super().build(problem, params, device)
        if problem.op == "gemv":  # the plain GEMV's kernel takes no eps
            def plain(inputs, out):
                good(inputs, out)
                out.mul_(1.25)

            return plain

        def kernel(inputs, out, eps: float = 1e-6):
            good(inputs, out, eps=eps)
            out.mul_(1.25)

        return kernel


#: Triton's fused GEMV with outputs 25% off (the load checks' broken kernel)
WRONG = _WrongFusedGemv()


#: how many calls each built kernel of RAISE_AFTER and DRIFT serves right before its fault
AFTER_CALLS = 3


class _AfterCalls(TritonBackend):
    """Triton's kernels (every op it serves), right for the first ``AFTER_CALLS`` calls of each built kernel, then
    faulty: ``raise`` raises at every later launch, ``drift`` writes outputs 6.25% off (far outside any op's
    BF16 bound, still finite): a kernel that fails in the middle of serving, after its warm-up."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.name = f"after-calls-{fault}"

    def build(self, problem, params, device):
        good = super().build(problem, params, device)
        calls = itertools.count(1)

        def kernel(inputs, out, **kwargs):
            served = next(calls)
            if self.fault == "raise" and served > AFTER_CALLS:
                raise RuntimeError(f"injected fault after {AFTER_CALLS} calls")
            good(inputs, out, **kwargs)
            if self.fault == "drift" and served > AFTER_CALLS:
                for t in out if isinstance(out, tuple) else (out,):
                    t.mul_(1.0625)

        return kernel


class _WrongWhen(TritonBackend):
    """Triton's plain GEMV, right except where ``when(x, call)`` holds (x: the call's activation, call: the built
    kernel's call count from 1): then its output is zeroed. The defects a load check on the tabulated M alone,
    unit-scale inputs or one call would pass (``tunekit.dispatch.load_check``)."""

    def __init__(self, name: str, when) -> None:
        self.name, self.when = name, when

    def build(self, problem, params, device):
        good = super().build(problem, params, device)
        calls = itertools.count(1)

        def kernel(inputs, out):
            good(inputs, out)
            if self.when(inputs[0], next(calls)):
                out.zero_()

        return kernel


#: zero output at M = 3 only: an M between two tabulated ones, served by the larger one's entry
ZERO_AT_M3 = _WrongWhen("zero-at-m3", lambda x, call: x.shape[0] == 3)
#: zero output where max |x| > 8 (real activations reach 10^3-10^4; unit randoms stay below 6)
ZERO_ABOVE_8 = _WrongWhen("zero-above-8", lambda x, call: float(x.abs().max()) > 8)
#: zero output from its second call on
ZERO_AFTER_FIRST = _WrongWhen("zero-after-first", lambda x, call: call > 1)


#: raises from its AFTER_CALLS + 1-th call on (``fault_backend:RAISE_AFTER``)
RAISE_AFTER = _AfterCalls("raise")
#: 6.25% off from its AFTER_CALLS + 1-th call on (``fault_backend:DRIFT``)
DRIFT = _AfterCalls("drift")


# ----------------------------------------------------------------------------- the agreement verdict's subjects
# A correct BF16 kernel in another order, and the defects the verdict must fail (tests/test_real_verdict.py, on
# real checkpoints): ``fault_backend:REORDERED`` serves gemv, rms_gemv, gemv_add and the (Gemma) RMS norms in
# PyTorch with fp32 sums in another order than the vendor's (the two halves of K summed second first; the fold's
# 1/rms applied after the dot), rounded to the activation dtype once, as a tuned kernel is. Where ``FAULTS`` names
# the weight a call reads (by its data pointer), that call is wrong in the named way; every other call is right.
# The hooks below (``misfold``, ``drop_residual``) do what no table entry can.

#: weight.data_ptr() -> the fault of the calls reading it: "gain" (the norm's gain 1% off), "drop_k_block" (the
#: GEMV's first K block of 64 left out of the sum), "bf16_acc" (the K blocks accumulated in BF16), "no_residual"
#: (gemv_add, or the fused add + norm, without its residual)
FAULTS: dict[int, str] = {}
#: the K block of the reordered sums
K_BLOCK = 64
#: the Ms (rows of the call) at which every GEMV-family call of ``REORDERED`` zeroes its output: a defect confined to
#: some M (batch-B decode at B, a speculative verify step at 1 + k) that the M = 1 decode never runs
FAULT_MS: set[int] = set()


#: fp32 copies of the weights the reordered kernels read: id(weight) -> (a weak reference to it, its version, the
#: copy), made once per weight and dropped with it (an id or a data pointer alone would be reused by a later tensor)
_FP32: dict[int, tuple] = {}


def _fp32(w: torch.Tensor) -> torch.Tensor:
    if w.dtype == torch.float32:
        return w
    hit = _FP32.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    copy = w.float()
    _FP32[id(w)] = (weakref.ref(w, lambda _, key=id(w): _FP32.pop(key, None)), w._version, copy)
    return copy


def _dot(x: torch.Tensor, w: torch.Tensor, fault: str | None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T in fp32, K in blocks of K_BLOCK summed last to first (``fault``: the defect)."""
    k = x.shape[1]
    blocks = list(range(0, k, K_BLOCK))[::-1]
    if fault == "drop_k_block":
        blocks = blocks[:-1]
    xf, wf = x.float(), _fp32(w)
    if fault is None:  # two halves of K, the second first: another order than one BLAS call, at its speed
        half = (k // 2 // K_BLOCK) * K_BLOCK or k
        out = xf[:, half:] @ wf[:, half:].T if half < k else torch.zeros(x.shape[0], w.shape[0])
        return out + xf[:, :half] @ wf[:, :half].T
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    for k0 in blocks:
        acc += xf[:, k0:k0 + K_BLOCK] @ wf[:, k0:k0 + K_BLOCK].T
        if fault == "bf16_acc":
            acc = acc.bfloat16().float()
    return acc


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class _Reordered(TritonBackend):
    """Correct kernels in another order than the vendor's, with per-weight faults (``FAULTS``)."""

    name = "reordered"

    def build(self, problem, params, device):
        from tunekit.problems.opspec import EPS

        op = problem.op

        def kernel(inputs, out, eps: float = EPS):
            x, w = inputs[0], inputs[-1] if op in ("fused_add_rms_norm", "gemma_fused_add_rms_norm") else inputs[1]
            fault = FAULTS.get(w.data_ptr())
            if op in ("fused_add_rms_norm", "gemma_fused_add_rms_norm"):
                # the residual stream's add, then the norm of the sum (rounded once, as it is stored)
                summed = (x if fault == "no_residual" else x.float() + inputs[1].float()).to(x.dtype)
                scale = w.float() + (1.0 if op.startswith("gemma") else 0.0)
                out[1].copy_(summed)
                out[0].copy_(summed.float() * _rstd(summed, eps) * scale)
            elif op in ("rms_norm", "gemma_rms_norm"):
                g = w.float() * (1.01 if fault == "gain" else 1.0)
                scale = 1.0 + g if op == "gemma_rms_norm" else g
                out.copy_(x.float() * _rstd(x, eps) * scale)
            elif op == "gemv":
                out.copy_(_dot(x, w, fault))
            elif op == "rms_gemv":
                out.copy_(_dot(x, w, fault) * _rstd(x, eps))
            elif op == "gemv_add":
                y = _dot(x, w, fault)
                out.copy_(y if fault == "no_residual" else y + inputs[2].float())
            else:
                raise NotImplementedError(f"reordered: no {op}")
            if x.shape[0] in FAULT_MS and op in ("gemv", "rms_gemv", "gemv_add"):
                out.zero_()

        return kernel


#: correct kernels in another order (gemv, rms_gemv, gemv_add, the (Gemma) RMS norms and fused add + norms), faults
#: per weight
REORDERED = _Reordered()


def misfold(linear, norm, gemma: bool) -> int:
    """A fold that scales the wrong channel: ``linear`` (a consumer ``tunekit.patch`` folded) gets, in the channel of
    the norm's largest gain, its neighbour's gain instead (an off-by-one in W diag(g)). Returns the channel."""
    original = linear.__dict__["_tunekit_unfolded_weight"]
    scale = norm.weight.detach().float() + (1.0 if gemma else 0.0)
    j = int(scale.abs().argmax())
    wrong = j + 1 if j + 1 < scale.numel() else j - 1
    with torch.no_grad():
        linear.weight[:, j] = (original[:, j].float() * scale[wrong]).to(linear.weight.dtype)
    return j


def drop_residual(layer, attention: str = "self_attn"):
    """A gemv_add that drops the residual, on a Hugging Face decoder layer (which adds the residual itself): the
    attention's output projection returns its output minus the layer's input, so the layer's first residual add
    yields the projection alone. Returns the hook handles (``handle.remove()`` undoes it)."""
    seen = {}

    def keep_input(module, args, kwargs):
        seen["residual"] = kwargs.get("hidden_states", args[0] if args else None)

    def minus_residual(module, args, output):
        return output - seen["residual"]

    proj = getattr(layer, attention).o_proj
    return [layer.register_forward_pre_hook(keep_input, with_kwargs=True), proj.register_forward_hook(minus_residual)]
