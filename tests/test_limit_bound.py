"""The read (and copy) limit is a measured upper bound: a verified kernel faster than the probe raises it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from tunekit.evidence.compare import _limit_source
from tunekit.problems.shapes import Problem
from tunekit.search.common import limit_gbps, raise_limit

GEMV = Problem("gemv", "bf16", 1, 5120, 17408)
NORM = Problem("rms_norm", "bf16", 1, 5120, 5120)


def _run(kind: str = "graph") -> SimpleNamespace:
    return SimpleNamespace(probe={"kind": kind, "read_gbps": 3000.0, "copy_gbps": 2500.0}, lock=threading.Lock())


def test_a_faster_kernel_raises_its_kinds_limit_and_is_named() -> None:
    run = _run()
    raise_limit(run, GEMV, 2900.0, "triton trial 3 on gemv m1")  # below: nothing changes
    assert run.probe == {"kind": "graph", "read_gbps": 3000.0, "copy_gbps": 2500.0}
    raise_limit(run, GEMV, 3030.0, "hip trial 7 on gemv m1")
    raise_limit(run, GEMV, 3010.0, "triton trial 9 on gemv m1")  # faster than the probe, not than the best
    assert limit_gbps(GEMV, run.probe) == 3030.0 and run.probe["copy_gbps"] == 2500.0
    assert run.probe["read_probe_gbps"] == 3000.0 and run.probe["read_raised_by"] == "hip trial 7 on gemv m1"
    raise_limit(run, NORM, 2600.0, "triton trial 1 on rms_norm m1")  # elementwise ops: the copy limit
    assert limit_gbps(NORM, run.probe) == 2600.0 and run.probe["copy_probe_gbps"] == 2500.0
    assert _limit_source(run.probe, "read") == "the best measured: hip trial 7 on gemv m1, above the probe's 3000 GB/s"
    assert _limit_source({"read_gbps": 1.0}, "read") == "probe"


def test_no_limit_on_the_interpreter() -> None:
    run = _run("cpu")
    raise_limit(run, GEMV, 1e9, "triton trial 0")
    assert limit_gbps(GEMV, run.probe) is None and "read_raised_by" not in run.probe
