"""A backend with fixed, known costs (test-only), for searches whose outcome must not depend on timing noise.

Loaded by name as ``fixed_time_backend:FIXED``. One tunable, COST = 1..8:
the candidate computes the GEMV exactly as the vendor path does (so it
verifies) and then sleeps COST x STEP_S; the fastest candidate is COST=1,
whatever the machine's load. Each build sleeps BUILD_S, like a compile (2 s;
``TUNEKIT_TEST_BUILD_S`` sets another); the build of COST =
``TUNEKIT_TEST_HANG_COST`` (set in one process only) never ends: the trial in
which the tests kill that worker. Paired with
``tests/slow_vendor`` (the vendor baseline made slower than every candidate),
a search's table is a pure function of the trials it measured.
"""

from __future__ import annotations

import os
import time

import torch

from tunekit.backends.base import SearchSpace
from tunekit.backends.triton import TritonBackend

STEP_S = 0.012  # COST=1 against COST=2: 12 ms apart per call, beyond a loaded CPU's sleep jitter (4 ms was not)
BUILD_S = float(os.environ.get("TUNEKIT_TEST_BUILD_S", "2.0"))
COSTS = [1, 2, 3, 4, 5, 6, 7, 8]


class FixedTimeBackend(TritonBackend):
    name = "fixed"

    def space(self, problem):
        return SearchSpace(op="gemv", backend=self.name, domains={"COST": list(COSTS)},
                           default={"COST": COSTS[-1]}, reference={"COST": COSTS[-1]}, fixed={})

    def invalid_reason(self, problem, params):
        return None

    def source_hash(self) -> str:
        return "fixed-time-1"

    def build(self, problem, params, device):
        if str(params["COST"]) == os.environ.get("TUNEKIT_TEST_HANG_COST"):
            time.sleep(3600)
        time.sleep(BUILD_S)
        pause = params["COST"] * STEP_S

        def kernel(inputs, out):
            x, w = inputs
            out.copy_(torch.nn.functional.linear(x, w))
            time.sleep(pause)

        return kernel


FIXED = FixedTimeBackend()
