"""Hugging Face ``config.json`` fields -> the fields of a ``tunekit.problems.models.spec.ModelSpec``.

:func:`spec_fields` validates a config dict (the text fields of a
``config.json``) and reads what the decode linears depend on: the layer
counts and widths, the attention heads, the norm epsilon and, for the
Qwen3.5 hybrid, each layer's kind and the linear-attention head geometry.
Every error is a :class:`~tunekit.errors.UserError` of one line naming the
file and the (nested) field. ``ModelSpec.from_config`` is the entry point;
this module imports no spec.

Families:

* ``"dense"``: llama, mistral (llama.py in vLLM), qwen2, qwen3.
* ``"qwen3_5"``: the Qwen3.5 hybrid (Gated DeltaNet linear attention plus gated
  full attention, dense MLP), ``qwen3_5_text`` or ``qwen3_5`` with a nested
  ``text_config``; ``qwen3_next`` configs use the same fields and are accepted
  when their MLPs are dense.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tunekit.errors import UserError

#: Model types whose decoder layer is attention + gated MLP (vLLM llama.py / qwen2.py / qwen3.py).
DENSE_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
#: Model types of the Qwen3.5 hybrid (vLLM qwen3_5.py; qwen3_next.py shares the layer code).
HYBRID_MODEL_TYPES: tuple[str, ...] = ("qwen3_5", "qwen3_5_text", "qwen3_next")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = DENSE_MODEL_TYPES + HYBRID_MODEL_TYPES

#: The kinds of decoder layer (``ModelSpec.layer_types``).
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

# Config keys that mean the MLP is a mixture of experts (Qwen/Mixtral/DeepSeek spellings).
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# HF's own defaults for optional fields (LlamaConfig / Qwen2Config / Qwen3NextConfig).
_DEFAULT_RMS_NORM_EPS = 1e-6

# Marks a required field in _Reader.positive_int (None is a legal default there).
_REQUIRED = object()


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet head geometry of a Qwen3.5 linear-attention layer (TP=1)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def key_dim(self) -> int:
        """Width of q and of k (linear_num_key_heads * linear_key_head_dim)."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of v, of z and of the gated-norm input."""
        return self.num_value_heads * self.value_head_dim


def spec_fields(config: Mapping[str, Any], *, name: str, hf_id: str | None, origin: str) -> dict[str, Any]:
    """Validate a Hugging Face config dict: the keyword arguments of a ``ModelSpec``.

    ``origin`` names the file in error messages. Raises :class:`UserError`
    (one line naming the file and the field) for a missing or non-integer
    field, for head counts that do not divide (query heads by KV heads, linear
    value heads by key heads), and for a model type that is not supported.
    """
    if not isinstance(config, Mapping):
        raise UserError(f"{origin}: expected a JSON object, got {type(config).__name__}")
    model_type = _model_type(config, origin, "")
    text, prefix = dict(config), ""
    if model_type == "qwen3_5" and "text_config" in config:
        # Qwen3.5 checkpoints are vision-language: the decoder fields sit in
        # text_config; tie_word_embeddings may live only at the top level.
        nested = config["text_config"]
        if not isinstance(nested, Mapping):
            raise UserError(f"{origin}: field 'text_config' must be an object")
        text, prefix = dict(nested), "text_config."
        if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        if "model_type" in text:
            inner = _model_type(text, origin, prefix)
            if inner not in HYBRID_MODEL_TYPES:
                raise _unsupported(inner, origin, text)
    read = _Reader(text, origin, prefix)
    moe = _moe_field(text)
    if model_type not in SUPPORTED_MODEL_TYPES or moe:
        raise _unsupported(model_type, origin, text)

    hidden = read.positive_int("hidden_size")
    num_heads = read.positive_int("num_attention_heads")
    num_kv_heads = read.positive_int("num_key_value_heads", default=num_heads)
    if num_heads % num_kv_heads:
        # vLLM's attention shares each KV head among a whole group of query heads
        raise UserError(
            f"{origin}: {prefix}num_attention_heads={num_heads} is not divisible by "
            f"{prefix}num_key_value_heads={num_kv_heads} (each KV head serves a whole group of query heads)"
        )
    head_dim = read.positive_int("head_dim", default=None)
    if head_dim is None:
        if hidden % num_heads:
            raise UserError(
                f"{origin}: no {prefix}head_dim and hidden_size={hidden} is not divisible by "
                f"num_attention_heads={num_heads}"
            )
        head_dim = hidden // num_heads
    common: dict[str, Any] = {
        "name": name,
        "hf_id": hf_id,
        "config": text,
        "num_layers": read.positive_int("num_hidden_layers"),
        "hidden_size": hidden,
        "intermediate_size": read.positive_int("intermediate_size"),
        "vocab_size": read.positive_int("vocab_size"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": read.positive_float("rms_norm_eps", default=_DEFAULT_RMS_NORM_EPS),
        "origin": origin,
    }
    if model_type in DENSE_MODEL_TYPES:
        # Sliding-window layer_types of qwen2/qwen3 do not change any GEMV shape.
        layer_types = (FULL_ATTENTION,) * common["num_layers"]
        return {"family": "dense", "layer_types": layer_types, **common}

    layer_types = _hybrid_layer_types(read, common["num_layers"])
    linear = None
    if LINEAR_ATTENTION in layer_types:
        linear = LinearAttention(
            num_key_heads=read.positive_int("linear_num_key_heads"),
            num_value_heads=read.positive_int("linear_num_value_heads"),
            key_head_dim=read.positive_int("linear_key_head_dim"),
            value_head_dim=read.positive_int("linear_value_head_dim"),
        )
        if linear.num_value_heads % linear.num_key_heads:
            # Gated DeltaNet repeats each key head over a whole group of value heads
            raise UserError(
                f"{origin}: {prefix}linear_num_value_heads={linear.num_value_heads} is not divisible by "
                f"{prefix}linear_num_key_heads={linear.num_key_heads} (each key head serves a whole group "
                "of value heads)"
            )
    return {
        "family": "qwen3_5",
        "layer_types": layer_types,
        # vLLM Qwen3NextAttention: getattr(config, "attn_output_gate", True).
        "attn_output_gate": read.flag("attn_output_gate", default=True),
        "linear_attention": linear,
        **common,
    }


class _Reader:
    """Typed access to config fields; errors name the file and the (nested) field."""

    def __init__(self, config: Mapping[str, Any], origin: str, prefix: str) -> None:
        self.config, self.origin, self.prefix = config, origin, prefix

    def _field(self, key: str) -> str:
        return f"{self.origin}: field {self.prefix}{key!r}"

    def positive_int(self, key: str, default: int | None | object = _REQUIRED) -> Any:
        """A positive integer; ``default`` (may be None) when absent or null, else required."""
        value = self.config.get(key)
        if value is None:  # HF writes null for "use the default" (e.g. mistral head_dim)
            if default is _REQUIRED:
                raise UserError(f"{self.origin}: missing required field {self.prefix}{key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{self._field(key)} must be a positive integer, got {value!r}")
        return value

    def positive_float(self, key: str, default: float) -> float:
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise UserError(f"{self._field(key)} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise UserError(f"{self._field(key)} must be true or false, got {value!r}")
        return value


def _model_type(config: Mapping[str, Any], origin: str, prefix: str) -> str:
    value = config.get("model_type")
    if value is None:
        raise UserError(f"{origin}: missing required field {prefix}'model_type'")
    if not isinstance(value, str):
        raise UserError(f"{origin}: field {prefix}'model_type' must be a string, got {value!r}")
    return value


def _moe_field(config: Mapping[str, Any]) -> str | None:
    for key in _MOE_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return f"{key}={value}"
    return None


def _unsupported(model_type: str, origin: str, config: Mapping[str, Any]) -> UserError:
    moe = _moe_field(config)
    detail = f"; this config has MoE MLPs: {moe}" if moe else ""
    return UserError(
        f"{origin}: model_type {model_type} is not supported yet "
        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}, with dense MLPs only{detail})"
    )


def _hybrid_layer_types(read: _Reader, num_layers: int) -> tuple[str, ...]:
    """Per-layer kinds from ``layer_types``, else from ``full_attention_interval``."""
    types = read.config.get("layer_types")
    if types is not None:
        where = f"{read.origin}: field {read.prefix}'layer_types'"
        if not isinstance(types, list) or len(types) != num_layers:
            raise UserError(f"{where} must list {num_layers} layers (num_hidden_layers)")
        bad = sorted({t for t in types if t not in (FULL_ATTENTION, LINEAR_ATTENTION)}, key=str)
        if bad:
            raise UserError(f"{where} has unknown kinds {bad} (known: {FULL_ATTENTION}, {LINEAR_ATTENTION})")
        return tuple(types)
    if read.config.get("full_attention_interval") is None:
        raise UserError(
            f"{read.origin}: missing required field {read.prefix}'layer_types' "
            f"(or {read.prefix}'full_attention_interval')"
        )
    interval = read.positive_int("full_attention_interval")
    # As HF Qwen3NextConfig / Qwen3_5TextConfig: every interval-th layer (1-based) is full attention.
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))
