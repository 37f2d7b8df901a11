"""The chain's steps: the tuned calls of one decode step in vLLM's order, from the model's spec, and the
names the fused variant pairs them by.

Plain data, no tensors: ``chain_steps(spec, tp, layers)`` lists the problems ``tunekit search --model``
tunes, each as often per token as it runs (the module docstring of ``tunekit.evidence.chain``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tunekit.errors import UserError
from tunekit.problems.models.hf_config import FULL_ATTENTION, LINEAR_ATTENTION
from tunekit.problems.models.spec import ModelSpec

#: The variants of a chain, in the order they are measured (the module docstring of the package).
VARIANTS = ("vendor", "tuned_gemv", "tuned", "tuned_fused")

#: Layer names whose GEMV reads the output of the norm step before them (``input_layernorm``:
#: qkv_proj, or in_proj_qkvz + in_proj_ba; ``post_attention_layernorm``: gate_up_proj).
NORM_CONSUMERS = ("qkv_proj", "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "gate_up_proj")
#: The fused families the tuned_fused variant uses: norm step -> norm op + "_gemv"; act_fn -> this op.
FUSED_ACT_OP = "silu_mul_gemv"
#: The residual epilogue: a layer output's GEMV writes x W^T + residual.
FUSED_ADD_OP = "gemv_add"
#: A plain norm folded into its consumers: each GEMV reads x with W' = W diag(g) and scales by 1/rms (sibling
#: consumers whose weights are one tensor, in_proj_qkvz + in_proj_ba: one such GEMV on the joined W').
FOLDED_NORM_OP = "rms_gemv"
#: gate_up_proj -> act_fn (SiLU-and-mul) as one GEMV with the activation in its epilogue, on W's rows
#: reordered into (gate, up) pairs; the second form when gate_up_proj is a folded norm's consumer.
GLU_OPS = {"gemv": "gemv_silu_mul", FOLDED_NORM_OP: "rms_gemv_silu_mul"}
FUSED_PAIRS = ("input_layernorm -> qkv_proj | in_proj_qkvz + in_proj_ba",
               "post_attention_layernorm -> gate_up_proj", "act_fn (silu_and_mul) -> down_proj",
               "o_proj | out_proj | down_proj -> the fused add + norm after it",
               "a plain norm -> every consumer GEMV, the norm's weight folded into theirs (siblings as one)",
               "gate_up_proj (plain or a folded norm's consumer) -> act_fn (silu_and_mul)")
#: The GEMVs whose output the next norm adds to the residual stream.
LAYER_OUTPUTS = ("o_proj", "out_proj", "down_proj")

#: ``ModelSpec.elementwise`` lists two input_layernorm entries: [0] the first layer's plain norm,
#: [1] the fused add + norm of every later layer.
_NORM_FIRST = "input_layernorm"


@dataclass(frozen=True)
class Step:
    """One call of the chain: ``layer`` (-1 after the last decoder layer), the model's layer name, the
    op and its (n, k) as in ``tunekit.problems.shapes.Problem``."""

    layer: int
    name: str
    op: str
    n: int
    k: int


#: ``Chain.build``'s ``fused(op, n, k, replaced, added)``: the kernel of a fused op that serves in place of the
#: steps ``replaced`` (running ``added`` besides), or None. An empty ``replaced``: the kernel is one of the
#: ``added`` steps of a fusion another call priced (built without a price of its own).
FusedLookup = Callable[[str, int, int, list[Step], list[Step]], Callable[..., None] | None]


def chain_steps(spec: ModelSpec, tp: int = 1, layers: int | None = None) -> list[Step]:
    """The tuned calls of one decode step at tensor parallelism ``tp``, in execution order.

    ``layers`` keeps the first that many decoder layers (all by default); the
    final norm and lm_head always close the chain.
    """
    total = spec.num_layers
    if layers is not None and not 1 <= layers <= total:
        raise UserError(f"--layers must be 1..{total} for {spec.name}, got {layers}")
    gemv = {name: (n, k) for name, n, k, _ in spec.linears(tp)}
    ew: dict[str, list[tuple[str, int, int]]] = {}
    for name, op, n, k, _ in spec.elementwise(tp):
        ew.setdefault(name, []).append((op, n, k))
    mlp = spec.mlp_prefix
    if f"{mlp}act_fn" not in ew:
        raise UserError(f"{spec.name}: the chain covers SiLU MLPs only (hidden_act "
                        f"{spec.config.get('hidden_act')!r})")

    def g(layer: int, name: str) -> Step:
        return Step(layer, name, "gemv", *gemv[name])

    def e(layer: int, name: str, index: int = 0) -> Step:
        op, n, k = ew[name][index]
        return Step(layer, name, op, n, k)

    steps: list[Step] = []
    for i, kind in enumerate(spec.layer_types[: layers or total]):
        steps.append(e(i, _NORM_FIRST, 0 if i == 0 else 1))
        if kind == FULL_ATTENTION:
            steps += [g(i, "qkv_proj"), g(i, "o_proj")]
        elif kind == LINEAR_ATTENTION:
            steps += [g(i, "linear_attn.in_proj_qkvz"), g(i, "linear_attn.in_proj_ba"),
                      e(i, "linear_attn.norm"), g(i, "linear_attn.out_proj")]
        else:  # pragma: no cover - ModelSpec admits only these two
            raise UserError(f"{spec.name}: unknown layer type {kind!r}")
        steps.append(e(i, "post_attention_layernorm"))
        steps += [g(i, f"{mlp}gate_up_proj"), e(i, f"{mlp}act_fn"), g(i, f"{mlp}down_proj")]
    steps += [e(-1, "norm (final)"), g(-1, "lm_head")]
    return steps


def is_norm_consumer(step: Step) -> bool:
    """Whether ``step`` is a GEMV that reads the output of the norm step before it."""
    return step.op == "gemv" and step.name.endswith(NORM_CONSUMERS)
