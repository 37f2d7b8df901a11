"""Model specs: a model's decode geometry -> the GEMVs and fused ops vLLM executes per token.

A :class:`ModelSpec` is built from a model's config (the text fields of a
Hugging Face ``config.json``, read by ``hf_config``), never from a table of
shapes: ``linears(tp)`` derives each (N, K) the way vLLM 0.33 builds its
layers (merged qkv / gate_up / in_proj_qkvz, TP sharding, padded vocab), so
any checkpoint of a supported family works, not only the built-ins
(``load``: ``configs/*.json``, whose checked ``decode_linears`` per TP the
tests compare this derivation against). ``elementwise``, ``norm_gemvs``,
``act_gemvs``, ``residual_gemvs``, ``rms_gemvs`` and ``glu_gemvs`` list the
fused ops around those GEMVs; :meth:`ModelSpec.problems` turns them into
``tunekit.problems.shapes.Problem``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tunekit.errors import UserError
from tunekit.problems.models.hf_config import FULL_ATTENTION, LINEAR_ATTENTION, LinearAttention, spec_fields
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

#: ParallelLMHead pads the vocabulary to a multiple of this (vLLM DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64


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
        field, and for a model type that is not supported
        (``tunekit.problems.models.hf_config.spec_fields`` reads the fields).
        """
        return cls(**spec_fields(config, name=name, hf_id=hf_id, origin=origin))

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
        """Raise :class:`UserError` with a one-line reason if ``tp`` is unsupported, naming the model and the
        config file its numbers come from."""
        reason = self.tp_error(tp)
        if reason is not None:
            where = f" (config {self.origin})" if self.origin and self.origin != self.name else ""
            raise UserError(f"{self.name}{where}: tp={tp} is not supported: {reason}")

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
        ``gemv_add`` (served: in ``search --model``'s default, ``shapes.MODEL_OPS``; ``--ops gemv_add``).

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
        """Every GEMV that reads a decoder norm's output, as ``rms_gemv`` (served: in ``search
        --model``'s default, ``shapes.MODEL_OPS``; ``--ops rms_gemv``): the norm's weight folded into
        the GEMV's, its 1/rms computed by the GEMV itself, so the norm's launch is gone once each of
        its consumers is one.

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
        ``elementwise(tp)`` and the fused GEMVs (``norm_gemvs`` ... ``glu_gemvs``) whose op name
        is in ``ops`` (merged by (op, n, k)). ``shapes.MODEL_OPS``: what ``search --model`` tunes."""
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
