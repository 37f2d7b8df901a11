"""A tuned family that lacks one of the problems' ops gets no study for it (HIP has no ``gemv_add``).

The default search of a model lists the fused families next to the plain ops, and every tuned backend
available joins it: on a GPU that is Triton and HIP, and HIP implements ``gemv`` and the elementwise ops but
not ``gemv_add``. Each problem is paired only with the backends that implement its op.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from tunekit.backends.triton import TritonBackend
from tunekit.problems.shapes import Problem
from tunekit.search.engine import SearchConfig, run_search


class GemvOnly(TritonBackend):
    """Triton's kernels under another name, declaring only ``gemv``: a family with a gap in its ops."""

    name = "gemv_only"
    ops = ("gemv",)

    def space(self, problem):
        return dataclasses.replace(TritonBackend().space(problem), backend=self.name)


#: loaded by name in the search worker: ``test_search_backend_ops:GEMV_ONLY``
GEMV_ONLY = GemvOnly()


@pytest.mark.slow  # a search under the interpreter: ~50 s on 2 cores
def test_a_backend_without_the_op_gets_no_study_and_the_search_finishes(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gemv, norm = Problem("gemv", "bf16", 1, 24, 64), Problem("rms_norm", "bf16", 1, 1, 64)
    cfg = SearchConfig(problems=[gemv, norm], backends=["triton", "test_search_backend_ops:GEMV_ONLY"],
                       out_dir=tmp_path, trials=1)
    outcome = run_search(cfg, progress=False, log=lambda s: None)
    trials = pd.read_csv(outcome.trials_path)
    studies = set(zip(trials["op"], trials["backend"], strict=True))
    assert studies == {("gemv", "triton"), ("gemv", "test_search_backend_ops:GEMV_ONLY"), ("rms_norm", "triton")}
    final_backends = {(r["op"], r["backend"]) for r in outcome.final_rows}
    assert ("rms_norm", "test_search_backend_ops:GEMV_ONLY") not in final_backends
    assert ("rms_norm", "vendor") in final_backends
