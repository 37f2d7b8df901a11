"""Programmatic dependent launch in the Triton GEMV family (``kernels_triton.pdl``, issue 55).

On the CPU: PDL is refused cleanly where it cannot run (the interpreter, a CPU or AMD device, a GPU below
sm_90, a Triton without ``gdc_wait``), it is off unless asked for (``TUNEKIT_PDL=1``, ``use_pdl=True``),
and a refused launch is the plain kernel with the plain launch (no ``launch_pdl``
keyword reaches Triton); where
it is on, the sm_90 PTX of every GEMV-family kernel holds the wait before any activation load, the release
after the K loop and the weight's L2 prefetch, each elementwise kernel (the norms and SiLU-and-mul before a
GEMV) the release at once and the wait before its loads, and the launch asks for the attribute. The GPU
side (a dependent chain bit-equal with and without PDL, and the chain's time) is
``benchmarks/probes/pdl_chain.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels_triton import gemv as g
from kernels_triton import pdl

REPO = Path(__file__).resolve().parents[1]


def test_pdl_is_refused_cleanly_where_it_cannot_run(monkeypatch) -> None:
    assert pdl.unsupported_reason(torch.device("cpu")) == "the Triton interpreter"  # conftest sets it
    monkeypatch.delenv("TRITON_INTERPRET")
    assert pdl.unsupported_reason(torch.device("cpu")) == "a cpu device"
    pdl._device_reason.cache_clear()
    try:
        monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
        assert "AMD" in pdl.unsupported_reason(torch.device("cuda", 0))
        pdl._device_reason.cache_clear()
        monkeypatch.setattr(torch.version, "hip", None, raising=False)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
        assert pdl.unsupported_reason(torch.device("cuda", 0)) == "sm_80 (PDL needs sm_90 or later)"
        pdl._device_reason.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
        assert pdl.unsupported_reason(torch.device("cuda", 0)) is None
        pdl._device_reason.cache_clear()
        import triton.language.extra.cuda as cuda_extra

        monkeypatch.delattr(cuda_extra, "gdc_wait")
        assert "has no gdc_wait" in pdl.unsupported_reason(torch.device("cuda", 0))
    finally:
        pdl._device_reason.cache_clear()
    # opt-in: off unless asked (TUNEKIT_PDL=1 or use_pdl=True); a request never makes an unsupported launch
    monkeypatch.setattr(pdl, "unsupported_reason", lambda device: None)  # as on an sm_90 GPU
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert not pdl.enabled(torch.device("cuda")) and pdl.enabled(torch.device("cuda"), True)
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.enabled(torch.device("cuda")) and not pdl.enabled(torch.device("cuda"), False)
    monkeypatch.undo()
    assert not pdl.enabled(torch.device("cpu"), True)
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}


def test_a_refused_pdl_launch_is_the_plain_kernel(monkeypatch) -> None:
    """Under the interpreter a PDL request runs the plain kernel: same bits, no launch keyword, PDL off."""
    seen = []
    original = g._gemv_kernel.run

    def spy(*args, **kwargs):
        seen.append((kwargs.get("PDL"), "launch_pdl" in kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(g._gemv_kernel, "run", spy)
    torch.manual_seed(0)
    x, w = torch.randn(2, 96).bfloat16(), torch.randn(24, 96).bfloat16()
    config = g.GemvConfig(BLOCK_K=32, M_MODE="rows")
    plain, asked = g.gemv(x, w, config, use_pdl=False), g.gemv(x, w, config, use_pdl=True)
    assert torch.equal(plain, asked)
    assert seen == [(False, False), (False, False)]


_PTX_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from tests import triton_targets as tt
from kernels_triton import gemv as g, pdl

pdl.unsupported_reason = lambda device: None  # as on an sm_90 GPU
pdl.default_on = lambda: True  # as with TUNEKIT_PDL=1
x, w, r = torch.randn(2, 384).bfloat16(), torch.randn(40, 384).bfloat16(), torch.randn(2, 40).bfloat16()
cases = {
    "gemv": lambda: g.gemv(x, w, g.GemvConfig(BLOCK_K=128, M_MODE="rows")),
    "gemv split-K reduce kernel": lambda: g.gemv(x, w, g.GemvConfig(BLOCK_K=64, SPLIT_K=3)),
    "gemv split-K fused": lambda: g.gemv(x, w, g.GemvConfig(BLOCK_K=64, SPLIT_K=3, SPLIT_REDUCE="fused")),
    "gemv_add": lambda: g.gemv(x, w, g.DEFAULT, residual=r),
    "rms_gemv": lambda: g.gemv(x, w, g.DEFAULT, rms_eps=1e-6),
    "gemv_silu_mul": lambda: g.gemv(x, w, g.GemvConfig(BLOCK_N=4), glu=True),
    "off": lambda: g.gemv(x, w, g.DEFAULT, use_pdl=False),
}
from kernels_triton import fused_add_rms_norm, gated_rms_norm, rms_norm, silu_and_mul

h, gw = torch.randn(2, 384).bfloat16(), torch.randn(384).bfloat16()
elementwise = {
    "rms_norm": lambda: rms_norm.rms_norm(h, gw),
    "fused_add_rms_norm": lambda: fused_add_rms_norm.fused_add_rms_norm(h, h.clone(), gw),
    "silu_and_mul": lambda: silu_and_mul.silu_and_mul(h),
    "gated_rms_norm": lambda: gated_rms_norm.gated_rms_norm(h, h.clone(), torch.randn(128).bfloat16()),
}
cases.update({f"elementwise {name}": call for name, call in elementwise.items()})
backend = make_backend(GPUTarget("cuda", 90, 32))
out = {}
for name, call in cases.items():
    rows = []
    for launch in tt.capture(call):
        bound = tt.bind(launch, backend)
        ptx = tt.lower(launch, bound, "cuda:sm_90")
        body = ptx[ptx.index(".entry"):]
        wait = body.find("griddepcontrol.wait")
        first_x = min((i for i in (body.find("ld.global"),) if i >= 0), default=-1)
        rows.append({"kernel": launch.name.rsplit(".", 1)[1], "launch_pdl": bool(bound.options.launch_pdl),
                     "wait": body.count("griddepcontrol.wait"),
                     "release": body.count("griddepcontrol.launch_dependents"),
                     "prefetch": body.count("prefetch.global.L2"),
                     "wait_before_loads": wait >= 0 and (first_x < 0 or wait < first_x)})
    out[name] = rows
print(json.dumps(out))
"""


@pytest.mark.slow  # the compile-check tier: no GPU, Triton's own compiler to PTX (~20 s)
def test_pdl_kernels_compile_for_sm90_with_the_wait_first_and_the_release_after_the_loop() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, str(REPO)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name, rows in got.items():
        if name == "off":
            assert rows == [{"kernel": "_gemv_kernel", "launch_pdl": False, "wait": 0, "release": 0, "prefetch": 0,
                             "wait_before_loads": False}], rows
            continue
        main = rows[0]
        if name.startswith("elementwise"):  # released at once, then the wait before any load
            assert len(rows) == 1 and main["launch_pdl"] and main["wait"] == 1 and main["release"] == 1, rows
            assert main["wait_before_loads"], (name, main)
            continue
        assert main["kernel"] == "_gemv_kernel" and main["launch_pdl"], (name, rows)
        assert main["wait"] == 1 and main["release"] == 1 and main["prefetch"] >= 1, (name, main)
        assert main["wait_before_loads"], (name, main)  # nothing is read from global memory before the wait
        for reduce in rows[1:]:  # the split-K reduce kernel waits for the partials too
            assert reduce["launch_pdl"] and reduce["wait"] == 1 and reduce["wait_before_loads"], (name, reduce)


def test_the_search_worker_times_without_pdl_unless_asked(monkeypatch) -> None:
    """Candidates are timed without PDL (the standalone bench would credit every launch with an overlap a
    served step keeps only between two PDL kernels); TUNEKIT_PDL=1 in the search's environment keeps it."""
    from tunekit.search.worker import Worker

    monkeypatch.delenv(pdl.ENV, raising=False)
    assert Worker()._env[pdl.ENV] == "0"
    monkeypatch.setenv(pdl.ENV, "1")
    assert Worker()._env[pdl.ENV] == "1"
    assert Worker({"OTHER": "x"})._env == {pdl.ENV: "1", "OTHER": "x"}
