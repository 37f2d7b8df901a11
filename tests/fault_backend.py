"""A backend whose candidates fail in every way a real one can (test-only).

Loaded by name as ``fault_backend:BACKEND`` (the registry imports any
``module:ATTR``), in the search worker too. BLOCK_N selects the fault:
2 -> the process dies, 4 -> a correct Triton kernel, 8 -> it hangs,
16 -> the build fails with a compiler log, 32 -> wrong results,
64 -> correct within the BF16 bound but one element rounded the other way
(passes "bounded", fails "exact").

``fault_backend:RAISE_AFTER`` and ``fault_backend:DRIFT`` serve right for a few
calls, then raise or drift (a kernel failing mid-serve, for the serving
fallback and the canary). ``fault_backend:WRONG`` is a table entry whose kernel is broken: Triton's fused
GEMV with outputs 25% off, for the load checks (``tunekit.patch``'s and the
vLLM plugin's) to catch.
"""

from __future__ import annotations

import itertools
import os
import time

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
    """Triton's fused GEMVs (rms_gemv, gemv_add) with outputs 25% off: a table entry whose kernel is broken
    (``fault_backend:WRONG``)."""

    name = "wrong"

    def build(self, problem, params, device):
        good = super().build(problem, params, device)

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


#: raises from its AFTER_CALLS + 1-th call on (``fault_backend:RAISE_AFTER``)
RAISE_AFTER = _AfterCalls("raise")
#: 6.25% off from its AFTER_CALLS + 1-th call on (``fault_backend:DRIFT``)
DRIFT = _AfterCalls("drift")
