"""BF16 rounding inside the elementwise kernels, identical on GPUs and on the CPU interpreter.

``round_bf16(v, BY_BITS)`` returns the fp32 value of the BF16 nearest to ``v``
(ties to even). The kernels call it where an intermediate is rounded on
purpose (the vLLM-matching numerics, ``VLLM_ROUNDING=1``) and on every output
before its store, so that the store's own conversion is exact.

Why not just ``.to(tl.bfloat16)``: on GPUs it rounds to nearest, but Triton
3.6's CPU interpreter truncates, which would make the CPU test tier measure a
different rounding than the GPU runs (and the rounding-location tests
meaningless). Under the interpreter (``RNE_BY_BITS``) the rounding is done on
the bits instead: the same round-to-nearest-even as tunekit_hip.h's
tk_f32_to_bf16. Inputs are finite (NaN payloads are not preserved).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: True under TRITON_INTERPRET=1: round by bit arithmetic (the interpreter truncates in .to(bfloat16)).
RNE_BY_BITS = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def round_bf16(v, BY_BITS: tl.constexpr):
    """fp32 ``v`` rounded to the nearest BF16 (ties to even), returned as fp32."""
    if BY_BITS:
        u = v.to(tl.uint32, bitcast=True)
        u = u + ((u >> 16) & 1) + 0x7FFF
        out = ((u >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        out = v.to(tl.bfloat16).to(tl.float32)
    return out
