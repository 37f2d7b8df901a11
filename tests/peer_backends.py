"""Stand-in peer baselines (test-only), loaded by name as ``peer_backends:ATTR`` (the registry imports any
``module:ATTR``), with the Backend protocol's signatures.

``SKINNY``: a GEMV peer that runs where the device is a GPU and N is a multiple of 64 (vLLM's skinny GEMM
has divisibility rules of this kind); its kernel is ``torch.mm``. ``MISSING``: a peer whose package is not
installed. ``BROKEN``: a peer whose availability check raises. ``FAILS_BUILD``: available, but its build
raises (the worker drops it). ``WRONG``: available and fast, but its results are 10% off (the worker's
check drops it before it is timed).
"""

from __future__ import annotations

import torch

from tunekit.backends.base import BuildError, SearchSpace


class StandInPeer:
    kind = "baseline"
    ops = ("gemv",)

    def __init__(self, name: str, unavailable: str | None = None, raises: bool = False,
                 build_fails: bool = False, off_by: float = 0.0) -> None:
        self.name = name
        self._unavailable = unavailable
        self._raises = raises
        self._build_fails = build_fails
        self._off_by = off_by

    def unavailable_reason(self, device) -> str | None:
        if self._raises:
            raise RuntimeError("driver query failed")
        return self._unavailable

    def space(self, problem) -> SearchSpace:
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})

    def invalid_reason(self, problem, params) -> str | None:
        if problem.op not in self.ops:
            return f"no kernel for {problem.op}"
        return None if problem.n % 64 == 0 else f"N={problem.n} is not a multiple of 64"

    def build(self, problem, params, device):
        if self._build_fails:
            raise BuildError("stand-in peer: injected build failure")

        def kernel(inputs, out):
            x, w = inputs
            torch.mm(x, w.t(), out=out)
            if self._off_by:
                out.mul_(1.0 + self._off_by)

        return kernel

    def source_hash(self) -> str:
        return "stand-in"

    def kernel_name(self, problem) -> str:
        return f"{self.name}_gemv"


SKINNY = StandInPeer("peer_backends:SKINNY")
MISSING = StandInPeer("peer_backends:MISSING", unavailable="package missing: stand-in-peers is not installed")
BROKEN = StandInPeer("peer_backends:BROKEN", raises=True)
FAILS_BUILD = StandInPeer("peer_backends:FAILS_BUILD", build_fails=True)
WRONG = StandInPeer("peer_backends:WRONG", off_by=0.1)
