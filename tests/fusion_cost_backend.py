"""A backend of fixed, known costs per op and M (test-only), for the fusion decision's measurements.

Loaded by name as ``fusion_cost_backend:COSTED``. It serves ``gemv``, ``rms_gemv``, ``gemv_add`` and the RMS
norms: each kernel computes its op as the vendor path does (so it verifies) and then sleeps the cost
``TUNEKIT_TEST_FUSION_MS`` names for it, a JSON object {"OP@M": ms, "OP": ms} (the M-specific figure first;
default ``DEFAULT_MS``), read when the kernel is built, in whichever process builds it (the search's worker
inherits the variable). Paired with ``tests/slow_vendor`` (the vendor baseline slower than every candidate),
every candidate takes its table entry, and the fused and unfused sequences the fusion phase times cost what
the test says.
"""

from __future__ import annotations

import json
import os
import time

import torch

from tunekit.backends import vendor
from tunekit.backends.base import SearchSpace
from tunekit.backends.triton import TritonBackend

DEFAULT_MS = 2.0
OPS = ("gemv", "rms_gemv", "gemv_add", "rms_norm", "gemma_rms_norm", "fused_add_rms_norm", "gemma_fused_add_rms_norm")


def cost_ms(op: str, m: int) -> float:
    costs = json.loads(os.environ.get("TUNEKIT_TEST_FUSION_MS") or "{}")
    return float(costs.get(f"{op}@{m}", costs.get(op, DEFAULT_MS)))


def _compute(op: str):
    if op == "gemv":
        return lambda inputs, out: torch.mm(inputs[0], inputs[1].t(), out=out)
    # the vendor path's own functions (not its backend's build, which tests/slow_vendor slows down)
    return {"rms_gemv": vendor.rms_norm_then_mm, "gemv_add": vendor.addmm}.get(op) or getattr(vendor, op)


class CostedBackend(TritonBackend):
    name = "costed"
    ops = OPS

    def space(self, problem):
        return SearchSpace(op=problem.op, backend=self.name, domains={"COST": [1]}, default={"COST": 1},
                           reference={"COST": 1}, fixed={})

    def invalid_reason(self, problem, params):
        return None if problem.op in OPS else f"no costed kernel for {problem.op}"

    def source_hash(self) -> str:
        return "fusion-cost-1"

    def kernel_name(self, problem) -> str:
        return f"costed {problem.op}"

    def build(self, problem, params, device):
        compute, pause = _compute(problem.op), cost_ms(problem.op, problem.m) / 1000

        def kernel(inputs, out):
            compute(inputs, out)
            time.sleep(pause)

        return kernel


COSTED = CostedBackend()
