"""Model specs: a Hugging Face config -> the decode linears vLLM executes.

A :class:`ModelSpec` is built from a model's config (the text fields of a
Hugging Face ``config.json``), never from a table of shapes: ``linears(tp)``
derives each (N, K) the way vLLM 0.33 builds its layers (merged qkv / gate_up /
in_proj_qkvz, TP sharding, padded vocab), so any checkpoint of a supported
family works, not only the built-ins.

The built-in models live in ``configs/*.json``. Each file holds checked facts:
the config fields plus the expected ``decode_linears`` per TP, which the tests
compare the derivation against; this module reads only ``name``, ``hf_id`` and
``config`` from them.

Families:

* ``"dense"``: llama, mistral (llama.py in vLLM), qwen2, qwen3.
* ``"qwen3_5"``: the Qwen3.5 hybrid (Gated DeltaNet linear attention plus gated
  full attention, dense MLP), ``qwen3_5_text`` or ``qwen3_5`` with a nested
  ``text_config``; ``qwen3_next`` configs use the same fields and are accepted
  when their MLPs are dense.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from tunekit.errors import UserError
from tunekit.problems.shapes import (
    ACT_GEMV_OPS,
    DTYPE_BYTES,
    FUSED_GEMV_OPS,
    GEMV_ADD_OPS,
    GLU_GEMV_OPS,
    NORM_GEMV_OPS,
    OPS,
    RMS_GEMV_OPS,
    Problem,
    elementwise_problems,
    gemv_problems,
)

#: Model types whose decoder layer is attention + gated MLP (vLLM llama.py / qwen2.py / qwen3.py).
DENSE_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
#: Model types of the Qwen3.5 hybrid (vLLM qwen3_5.py; qwen3_next.py shares the layer code).
HYBRID_MODEL_TYPES: tuple[str, ...] = ("qwen3_5", "qwen3_5_text", "qwen3_next")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = DENSE_MODEL_TYPES + HYBRID_MODEL_TYPES

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"

#: ParallelLMHead pads the vocabulary to a multiple of this (vLLM DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64

# Config keys that mean the MLP is a mixture of experts (Qwen/Mixtral/DeepSeek spellings).
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")

# HF's own defaults for optional fields (LlamaConfig / Qwen2Config / Qwen3NextConfig).
_DEFAULT_RMS_NORM_EPS = 1e-6

_BUILTIN_PACKAGE = "tunekit.problems.models"
_BUILTIN_DIR = "configs"

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


@dataclass(frozen=True)
class ModelSpec:
    """One model's decode-relevant geometry, derived from its config.

    Build one with :func:`load_model` or :meth:`from_config`. ``config`` holds the
    text-model fields the spec was derived from (for a Qwen3.5 config with a
    nested ``text_config``, that nested dict); treat it as read-only.
    ``layer_types`` has one entry per decoder layer, ``"full_attention"`` or
    ``"linear_attention"`` (dense models: all full attention).
    """

    name: str
    family: str  # "dense" | "qwen3_5"
    hf_id: str | None
    config: dict[str, Any] = field(repr=False, compare=False)
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: tuple[str, ...] = field(repr=False)
    attn_output_gate: bool = False
    linear_attention: LinearAttention | None = None
    origin: str = field(default="", repr=False, compare=False)

    # ------------------------------------------------------------------ build

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        name: str,
        hf_id: str | None = None,
        origin: str = "<config>",
    ) -> ModelSpec:
        """Validate a Hugging Face config dict and derive the spec.

        ``origin`` names the file in error messages. Raises :class:`UserError`
        (one line naming the file and the field) for a missing or non-integer
        field, and for a model type that is not supported.
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
            return cls(family="dense", layer_types=layer_types, **common)

        layer_types = _hybrid_layer_types(read, common["num_layers"])
        linear = None
        if LINEAR_ATTENTION in layer_types:
            linear = LinearAttention(
                num_key_heads=read.positive_int("linear_num_key_heads"),
                num_value_heads=read.positive_int("linear_num_value_heads"),
                key_head_dim=read.positive_int("linear_key_head_dim"),
                value_head_dim=read.positive_int("linear_value_head_dim"),
            )
        return cls(
            family="qwen3_5",
            layer_types=layer_types,
            # vLLM Qwen3NextAttention: getattr(config, "attn_output_gate", True).
            attn_output_gate=read.flag("attn_output_gate", default=True),
            linear_attention=linear,
            **common,
        )

    # ------------------------------------------------------------- properties

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rows of ParallelLMHead: vocab_size rounded up to a multiple of 64."""
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING

    @property
    def mlp_prefix(self) -> str:
        """Prefix of the MLP layers' names in vLLM: ``"mlp."`` for Qwen3.5 (``mlp.gate_up_proj``), else none."""
        return "mlp." if self.family == "qwen3_5" else ""

    @property
    def num_full_attention_layers(self) -> int:
        return self.layer_types.count(FULL_ATTENTION)

    @property
    def num_linear_attention_layers(self) -> int:
        return self.layer_types.count(LINEAR_ATTENTION)

    @property
    def norm_style(self) -> str:
        """``"gemma"`` (y = x/rms * (1 + w), Qwen3.5 layer norms) or ``"plain"`` (y = x/rms * w)."""
        return "gemma" if self.family == "qwen3_5" else "plain"

    @property
    def gated_norm_groups(self) -> tuple[int, int] | None:
        """(groups, group size) of the Qwen3.5 gated RMSNorm at TP=1, None without one.

        RMSNormGated normalises each linear-attention value head on its own, so
        there are linear_num_value_heads groups of linear_value_head_dim; each
        rank holds groups/tp of them. Its weight is plain (w, not 1 + w).
        """
        if self.linear_attention is None:
            return None
        return (self.linear_attention.num_value_heads, self.linear_attention.value_head_dim)

    # ----------------------------------------------------------------- derive

    def tp_error(self, tp: int) -> str | None:
        """Why vLLM cannot shard this model ``tp`` ways, or None when it can."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            return f"tp must be a positive integer, got {tp!r}"
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        if nh % tp:
            return f"num_attention_heads={nh} not divisible by tp={tp}"
        # QKVParallelLinear: kv heads are split when there are enough, else replicated.
        if nkv >= tp and nkv % tp:
            return f"num_key_value_heads={nkv} not divisible by tp={tp}"
        if nkv < tp and tp % nkv:
            return f"tp={tp} not a multiple of num_key_value_heads={nkv} (kv heads cannot be replicated)"
        if self.intermediate_size % tp:
            return f"intermediate_size={self.intermediate_size} not divisible by tp={tp}"
        la = self.linear_attention
        if la is not None:
            if la.num_key_heads % tp:
                return f"linear_num_key_heads={la.num_key_heads} not divisible by tp={tp}"
            if la.num_value_heads % tp:
                return f"linear_num_value_heads={la.num_value_heads} not divisible by tp={tp}"
        if self.padded_vocab_size % tp:
            return f"padded vocab {self.padded_vocab_size} not divisible by tp={tp}"
        return None

    def check_tp(self, tp: int) -> None:
        """Raise :class:`UserError` with a one-line reason if ``tp`` is unsupported."""
        reason = self.tp_error(tp)
        if reason is not None:
            raise UserError(f"{self.name}: tp={tp} is not supported: {reason}")

    def linears(self, tp: int = 1) -> list[tuple[str, int, int, int]]:
        """The GEMV layers one rank executes per decoded token at tensor parallelism ``tp``.

        Each entry is (layer name, n, k, count per token), n = out_features and
        k = in_features of that rank's weight shard, with vLLM's merged layers
        (qkv_proj, gate_up_proj, in_proj_qkvz, in_proj_ba) as single entries.
        Column-parallel layers split n, row-parallel layers split k.
        """
        self.check_tp(tp)
        h, hd = self.hidden_size, self.head_dim
        kv_heads = max(1, self.num_key_value_heads // tp)  # replicated below one head per rank
        # With attn_output_gate, q_proj also emits the gate: twice the query heads.
        q_heads = self.num_attention_heads * (2 if self.attn_output_gate else 1) // tp
        n_full = self.num_full_attention_layers
        out: list[tuple[str, int, int, int]] = []
        if n_full:
            out.append(("qkv_proj", (q_heads + 2 * kv_heads) * hd, h, n_full))
            out.append(("o_proj", h, self.num_attention_heads * hd // tp, n_full))
        la, n_lin = self.linear_attention, self.num_linear_attention_layers
        if la is not None and n_lin:
            # MergedColumnParallelLinear output_sizes [key, key, value, value] and [nv, nv], each /tp.
            out.append(("linear_attn.in_proj_qkvz", (2 * la.key_dim + 2 * la.value_dim) // tp, h, n_lin))
            out.append(("linear_attn.in_proj_ba", 2 * la.num_value_heads // tp, h, n_lin))
            out.append(("linear_attn.out_proj", h, la.value_dim // tp, n_lin))
        mlp = self.mlp_prefix
        inter = self.intermediate_size
        out.append((f"{mlp}gate_up_proj", 2 * inter // tp, h, self.num_layers))
        out.append((f"{mlp}down_proj", h, inter // tp, self.num_layers))
        # Executed even with tied embeddings: the logits GEMV reads the embedding matrix.
        out.append(("lm_head", self.padded_vocab_size // tp, h, 1))
        return out

    def elementwise(self, tp: int = 1) -> list[tuple[str, str, int, int, int]]:
        """The fused elementwise ops one rank executes per decoded token at ``tp``.

        Each entry is (layer name, op, n, k, count per token) with n, k as in
        ``tunekit.problems.shapes.Problem``. As vLLM runs the decoder: layer 0's
        input_layernorm is a plain norm (no residual yet); every later
        input_layernorm, every post_attention_layernorm and the final norm add
        the residual (fused_add_rms_norm): 2 * layers - 1 + 1 calls. Qwen3.5
        norms are Gemma-style (x * (1 + w)). Hidden-size norms stay full size on
        every rank; the gated norm (one group per linear-attention value head)
        and silu_and_mul (intermediate / tp) shrink with tp. silu_and_mul is
        listed for SiLU MLPs (hidden_act silu/swish) only. No built-in model
        runs bias + GELU, so ``bias_gelu`` never appears here (tune it with an
        ad-hoc ``--shape bias_gelu:SIZE``).
        """
        self.check_tp(tp)
        h, layers = self.hidden_size, self.num_layers
        prefix = "gemma_" if self.norm_style == "gemma" else ""
        out: list[tuple[str, str, int, int, int]] = [("input_layernorm", f"{prefix}rms_norm", h, h, 1)]
        if layers > 1:
            out.append(("input_layernorm", f"{prefix}fused_add_rms_norm", h, h, layers - 1))
        out.append(("post_attention_layernorm", f"{prefix}fused_add_rms_norm", h, h, layers))
        out.append(("norm (final)", f"{prefix}fused_add_rms_norm", h, h, 1))
        groups = self.gated_norm_groups
        n_lin = self.num_linear_attention_layers
        if groups is not None and n_lin:
            count, size = groups
            out.append(("linear_attn.norm", "gated_rms_norm", count // tp * size, size, n_lin))
        if str(self.config.get("hidden_act", "silu")) in ("silu", "swish"):
            mlp = self.mlp_prefix
            d = self.intermediate_size // tp
            out.append((f"{mlp}act_fn", "silu_and_mul", d, 2 * d, layers))
        return out

    def norm_gemvs(self, tp: int = 1) -> list[tuple[str, str, int, int, int]]:
        """The norm -> GEMV pairs one rank executes per token, as the fused ops of
        ``tunekit.problems.shapes.NORM_GEMV_OPS`` (opt-in only: ``--ops rms_norm_gemv``).

        Entries as ``elementwise``'s: (names, op, n, k, count), n and k the
        GEMV's (k = hidden size, the norm width). input_layernorm feeds qkv_proj
        in full-attention layers; in linear-attention layers it feeds both
        in_proj_qkvz and in_proj_ba, so the fused problem is their concatenated
        rows (one kernel must produce every consumer of the norm to make its
        output unnecessary). Layer 0's input norm has no residual yet; every
        post_attention_layernorm feeds gate_up_proj. The final norm feeds
        lm_head only through the sampler's gather, so it is not listed.
        """
        n_of = {name: n for name, n, _, _ in self.linears(tp)}
        h = self.hidden_size
        prefix = "gemma_" if self.norm_style == "gemma" else ""
        out: list[tuple[str, str, int, int, int]] = []
        for index, layer_type in enumerate(self.layer_types):
            op = f"{prefix}{'rms_norm' if index == 0 else 'fused_add_rms_norm'}_gemv"
            if layer_type == FULL_ATTENTION:
                out.append(("input_layernorm+qkv_proj", op, n_of["qkv_proj"], h, 1))
            else:
                n = n_of["linear_attn.in_proj_qkvz"] + n_of["linear_attn.in_proj_ba"]
                out.append(("input_layernorm+linear_attn.in_proj_qkvz+in_proj_ba", op, n, h, 1))
        gate_up = f"{self.mlp_prefix}gate_up_proj"
        out.append((f"post_attention_layernorm+{gate_up}", f"{prefix}fused_add_rms_norm_gemv", n_of[gate_up], h,
                    self.num_layers))
        return out

    def act_gemvs(self, tp: int = 1) -> list[tuple[str, str, int, int, int]]:
        """The act_fn -> down_proj pairs one rank executes per token, as ``silu_mul_gemv``
        (opt-in only: ``--ops silu_mul_gemv`` or ``fused_gemv``); SiLU MLPs only.

        Entries as ``elementwise``'s: (names, op, n, k, count) with n, k down_proj's
        (k = intermediate / tp, the fused op reads gate_up_proj's [m, 2k] output).
        """
        if str(self.config.get("hidden_act", "silu")) not in ("silu", "swish"):
            return []
        n_of = {name: (n, k) for name, n, k, _ in self.linears(tp)}
        mlp = self.mlp_prefix
        n, k = n_of[f"{mlp}down_proj"]
        return [(f"{mlp}act_fn+{mlp}down_proj", "silu_mul_gemv", n, k, self.num_layers)]

    def residual_gemvs(self, tp: int = 1) -> list[tuple[str, str, int, int, int]]:
        """The GEMVs whose output the decoder adds to the residual stream next (o_proj,
        linear_attn.out_proj, down_proj: vLLM's fused_add_rms_norm does the add), as
        ``gemv_add`` (opt-in only: ``--ops gemv_add`` or ``fused_gemv``).

        Entries as ``elementwise``'s: (names, op, n, k, count), n and k the GEMV's. Only at
        tp = 1: a row-parallel layer's partial outputs are all-reduced before the add, so
        no rank's GEMV holds the sum the residual is added to.
        """
        if tp != 1:
            return []
        writes_residual = ("o_proj", "linear_attn.out_proj", f"{self.mlp_prefix}down_proj")
        return [(name, "gemv_add", n, k, count) for name, n, k, count in self.linears(tp)
                if name in writes_residual]

    def rms_gemvs(self, tp: int = 1) -> list[tuple[str, str, int, int, int]]:
        """Every GEMV that reads a decoder norm's output, as ``rms_gemv`` (opt-in only: ``--ops
        rms_gemv`` or ``fused_gemv``): the norm's weight folded into the GEMV's, its 1/rms
        computed by the GEMV itself, so the norm's launch is gone once each of its consumers is one.

        Entries as ``elementwise``'s: (names, op, n, k, count), n and k the GEMV's (k = hidden
        size): input_layernorm -> qkv_proj (full attention) or in_proj_qkvz and in_proj_ba
        (linear attention); post_attention_layernorm -> gate_up_proj. The two linear-attention
        siblings read the same x and are listed as one GEMV of their concatenated rows
        (``linear_attn.in_proj_qkvz+in_proj_ba``, N = 16480 for Qwen3.5-27B): tunekit serves a
        folded norm's sibling consumers as one launch on weights laid out as one tensor
        (``tunekit.integrations.vllm.merge``, the chain's ``tuned_fused``). The final norm ->
        lm_head is not listed (the sampler's gather is between them, and a tied lm_head is the
        embedding too).
        """
        n_of = {name: n for name, n, _, _ in self.linears(tp)}
        siblings = "linear_attn.in_proj_qkvz+in_proj_ba"
        if "linear_attn.in_proj_qkvz" in n_of:
            n_of[siblings] = n_of["linear_attn.in_proj_qkvz"] + n_of["linear_attn.in_proj_ba"]
        counts: dict[str, int] = {}
        for layer_type in self.layer_types:
            name = "qkv_proj" if layer_type == FULL_ATTENTION else siblings
            counts[name] = counts.get(name, 0) + 1
        out = [(f"input_layernorm+{name}", "rms_gemv", n_of[name], self.hidden_size, count)
               for name, count in counts.items()]
        gate_up = f"{self.mlp_prefix}gate_up_proj"
        out.append((f"post_attention_layernorm+{gate_up}", "rms_gemv", n_of[gate_up], self.hidden_size,
                    self.num_layers))
        return out

    def glu_gemvs(self, tp: int = 1) -> list[tuple[str, str, int, int, int]]:
        """gate_up_proj -> act_fn as one GEMV with SiLU-and-mul in its epilogue (opt-in only:
        ``--ops gemv_silu_mul`` or ``fused_gemv``); SiLU MLPs only. Both forms: ``gemv_silu_mul``,
        and ``rms_gemv_silu_mul`` where post_attention_layernorm is folded into gate_up_proj
        (``rms_gemvs``). Entries as ``elementwise``'s: (names, op, n, k, count), n and k gate_up's.
        """
        if str(self.config.get("hidden_act", "silu")) not in ("silu", "swish"):
            return []
        gate_up = f"{self.mlp_prefix}gate_up_proj"
        n, k = next((n, k) for name, n, k, _ in self.linears(tp) if name == gate_up)
        act = f"{self.mlp_prefix}act_fn"
        return [(f"{gate_up}+{act}", "gemv_silu_mul", n, k, self.num_layers),
                (f"post_attention_layernorm+{gate_up}+{act}", "rms_gemv_silu_mul", n, k, self.num_layers)]

    def problems(
        self,
        tp: int = 1,
        m_list: Sequence[int] = (1,),
        dtype: str = "bf16",
        ops: Sequence[str] = ("gemv",),
    ) -> list[Problem]:
        """Distinct problems per token, one per M: GEMVs (``linears(tp)`` merged by
        shape) when ``"gemv"`` is in ``ops``, then the elementwise ops of
        ``elementwise(tp)`` whose op name is in ``ops`` (merged by (op, n, k))."""
        if dtype not in DTYPE_BYTES:
            raise UserError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
        ms = list(m_list)
        if not ms or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in ms):
            raise UserError(f"bad m_list {m_list!r}: expected positive integers")
        unknown = sorted(set(ops) - set(OPS) - set(FUSED_GEMV_OPS))
        if unknown:
            raise UserError(f"unknown op(s) {unknown} (known: {', '.join(OPS + FUSED_GEMV_OPS)})")
        ms = sorted(set(ms))
        out = gemv_problems(self.linears(tp), ms, dtype) if "gemv" in ops else []
        wanted = [item for item in self.elementwise(tp) if item[1] in ops]
        if set(ops) & set(NORM_GEMV_OPS):
            wanted += [item for item in self.norm_gemvs(tp) if item[1] in ops]
        if set(ops) & set(ACT_GEMV_OPS):
            wanted += [item for item in self.act_gemvs(tp) if item[1] in ops]
        if set(ops) & set(GEMV_ADD_OPS):
            wanted += self.residual_gemvs(tp)
        if set(ops) & set(RMS_GEMV_OPS):
            wanted += self.rms_gemvs(tp)
        if set(ops) & set(GLU_GEMV_OPS):
            wanted += [item for item in self.glu_gemvs(tp) if item[1] in ops]
        return out + elementwise_problems(wanted, ms, dtype)


# ---------------------------------------------------------------- config parsing


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


# ----------------------------------------------------------------------- loading


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"model config not found: {path}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: cannot read: not UTF-8 text") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None


def _spec_from_document(doc: Any, origin: str, default_name: str) -> ModelSpec:
    """A HF config.json, or a tunekit model file ({"name", "hf_id", "config", ...})."""
    if not isinstance(doc, dict):
        raise UserError(f"{origin}: expected a JSON object, got {type(doc).__name__}")
    if "model_type" not in doc and isinstance(doc.get("config"), dict):
        name = doc.get("name") if isinstance(doc.get("name"), str) else default_name
        hf_id = doc.get("hf_id") if isinstance(doc.get("hf_id"), str) else None
        return ModelSpec.from_config(copy.deepcopy(doc["config"]), name=name, hf_id=hf_id, origin=origin)
    hf_id = doc.get("_name_or_path") if isinstance(doc.get("_name_or_path"), str) else None
    name = os.path.basename(hf_id.rstrip("/")) if hf_id else default_name
    return ModelSpec.from_config(doc, name=name or default_name, hf_id=hf_id, origin=origin)


def load_config_file(path: str | os.PathLike[str]) -> ModelSpec:
    """Load a Hugging Face ``config.json`` (or a checkpoint folder holding one)."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    # A snapshot folder's name is the model's; a stray file is named by its stem.
    default = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return _spec_from_document(_read_json(path), str(path), default)


@lru_cache(maxsize=1)
def _builtin_documents() -> tuple[tuple[str, str, dict[str, Any]], ...]:
    """(name, file, document) of every built-in model, sorted by name."""
    folder = resources.files(_BUILTIN_PACKAGE).joinpath(_BUILTIN_DIR)
    docs = []
    for entry in folder.iterdir():
        if entry.name.endswith(".json"):
            origin = f"tunekit/problems/models/{_BUILTIN_DIR}/{entry.name}"
            try:
                doc = json.loads(entry.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:  # a broken install, not user input
                raise UserError(f"{origin}: built-in model file unreadable: {exc}") from None
            docs.append((str(doc.get("name") or entry.name[: -len(".json")]), origin, doc))
    return tuple(sorted(docs, key=lambda item: item[0]))


def _builtin_spec(name: str, origin: str, doc: dict[str, Any]) -> ModelSpec:
    # Deep copy: callers get their own config dict, the cache stays pristine.
    return _spec_from_document(copy.deepcopy(doc), origin, name)


def list_models() -> list[ModelSpec]:
    """The built-in models, sorted by name."""
    return [_builtin_spec(*item) for item in _builtin_documents()]


def _builtin_index() -> dict[str, tuple[str, str, dict[str, Any]]]:
    """Lower-case lookup keys -> built-in: names, HF ids, and names without "-instruct"."""
    index: dict[str, tuple[str, str, dict[str, Any]]] = {}
    short: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for item in _builtin_documents():
        name, _, doc = item
        index[name.lower()] = item
        if isinstance(doc.get("hf_id"), str):
            index.setdefault(doc["hf_id"].lower(), item)
        short.setdefault(re.sub(r"-instruct$", "", name.lower()), []).append(item)
    for key, items in short.items():
        if len(items) == 1:  # only unambiguous aliases ("llama-3.1-8b")
            index.setdefault(key, items[0])
    return index


def load_model(name_or_path: str | os.PathLike[str]) -> ModelSpec:
    """A built-in model by name (case-insensitive; HF id or name without "-instruct"
    also work), else a path to a Hugging Face ``config.json`` or its folder.

    Raises :class:`UserError` for an unknown name, a missing file, or a config
    that cannot be used.
    """
    text = os.fspath(name_or_path).strip()
    if not text:
        raise UserError("no model given (a built-in name or a path to a config.json)")
    item = _builtin_index().get(text.lower())
    if item is not None:
        return _builtin_spec(*item)
    path = Path(text).expanduser()
    if path.exists() or text.endswith(".json"):
        return load_config_file(path)
    names = ", ".join(name for name, _, _ in _builtin_documents())
    raise UserError(
        f"unknown model {text!r}: not a built-in ({names}) and no such file "
        "(give a path to a Hugging Face config.json)"
    )
