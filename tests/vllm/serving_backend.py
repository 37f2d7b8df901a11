"""Test-only backend: the elementwise ops written in torch (``serving_backend:BACKEND``). The broken fused
GEMVs are ``fault_backend:WRONG`` (tests/fault_backend.py, on this tier's path too).

The plugin tests check routing (which vLLM layer reaches which tunekit op and
what the markers say), not kernels: these compute the ops' fp32 math and
take ``eps=`` like the real elementwise kernels do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class TorchElementwiseBackend:
    name = "torch-elementwise"
    kind = "tuned"
    ops = ("rms_norm", "gemma_rms_norm", "fused_add_rms_norm", "gemma_fused_add_rms_norm", "gated_rms_norm",
           "silu_and_mul")

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int]] = []

    def unavailable_reason(self, device):
        return None

    def kernel_name(self, problem):
        return "torch"

    def build(self, problem, params, device):
        op = problem.op

        def kernel(inputs, out, eps=1e-6):
            self.calls.append((op, problem.m, problem.n, problem.k))
            if op in ("rms_norm", "gemma_rms_norm"):
                x, w = inputs
                wf = w.float() + 1.0 if op == "gemma_rms_norm" else w.float()
                out.copy_(_norm(x, eps) * wf)
            elif op in ("fused_add_rms_norm", "gemma_fused_add_rms_norm"):
                x, r, w = inputs
                wf = w.float() + 1.0 if op.startswith("gemma") else w.float()
                s = x.float() + r.float()
                out[1].copy_(s)
                out[0].copy_(_norm(s, eps) * wf)
            elif op == "gated_rms_norm":
                x, z, w = inputs
                k = w.shape[0]
                g = _norm(x.reshape(x.shape[0], -1, k), eps) * w.float()
                out.copy_(g.reshape(x.shape) * F.silu(z.float()))
            else:
                (x,) = inputs
                d = x.shape[1] // 2
                out.copy_(F.silu(x[:, :d].float()) * x[:, d:].float())

        return kernel


BACKEND = TorchElementwiseBackend()
