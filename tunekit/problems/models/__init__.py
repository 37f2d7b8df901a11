"""Models: built-in configs (facts as data) and any HF config.json -> :class:`ModelSpec`.

Usage::

    from tunekit.problems.models import list_models, load_model

    spec = load_model("qwen3.5-27b")          # or a path to a config.json
    spec.linears(tp=4)                        # [(name, n, k, count per token), ...]
    spec.problems(tp=1, m_list=(1, 2, 4, 8, 16))  # tunekit.problems.shapes.Problem, merged by shape

Modules: ``hf_config`` (config fields, validated), ``spec`` (:class:`ModelSpec`: the
linears and fused ops per token), ``load`` (built-in models and config files).
"""

from __future__ import annotations

from tunekit.problems.models.hf_config import (
    DENSE_MODEL_TYPES,
    HYBRID_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    LinearAttention,
)
from tunekit.problems.models.load import list_models, load_config_file, load_model
from tunekit.problems.models.spec import ModelSpec

__all__ = [
    "DENSE_MODEL_TYPES",
    "HYBRID_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "LinearAttention",
    "ModelSpec",
    "list_models",
    "load_config_file",
    "load_model",
]
