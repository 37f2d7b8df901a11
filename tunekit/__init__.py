"""tunekit: a kernel autotuner for LLM decode (BF16 small-M GEMV and fused elementwise ops).

Main use::

    tunekit search --model qwen3.5-27b      # verified, timed winners -> runs/qwen3.5-27b/table.json
    tunekit show runs/qwen3.5-27b/table.json
"""

from __future__ import annotations

__version__ = "0.1.0"
