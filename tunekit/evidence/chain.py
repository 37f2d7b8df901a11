"""A model's decode-step chain: its per-token GEMVs and fused elementwise ops in vLLM's order, timed as one graph.

The standalone microbenchmarks of a search time each kernel alone (weights
rotated through a cold L2, interleaved with the baseline); ``tunekit compare``
sums them into a per-token prediction. This module checks that prediction one
layer of evidence closer to the service: it builds every tuned problem of the
model as the decoder executes it, layer after layer, with the model's own
weight sizes (51 GB of distinct BF16 weights for Qwen3.5-27B: each is read
once per step, as in serving) and times the whole step as one CUDA graph, so
launch gaps, neighbour effects and L2 state are those of a real step.

Per layer, in vLLM's order (``chain_steps``):

* ``input_layernorm``: the first layer's a plain norm, every later one adds the
  residual (fused add + norm);
* full attention: ``qkv_proj`` -> [attention] -> ``o_proj``;
* linear attention (Qwen3.5 Gated DeltaNet): ``in_proj_qkvz``, ``in_proj_ba`` ->
  [conv + recurrence] -> gated norm ``linear_attn.norm`` -> ``out_proj``;
* ``post_attention_layernorm`` (fused add), ``gate_up_proj`` -> ``act_fn``
  (SiLU-and-mul, SiLU MLPs) -> ``down_proj``;

then the final norm and ``lm_head``. Shapes and names come from
``ModelSpec.linears`` / ``ModelSpec.elementwise``, so the chain holds exactly
the problems ``tunekit search --model`` tunes with their per-token counts.
Left out, identical in every variant: embedding, rotary, the token mixers in
brackets (their outputs are fixed buffers here), q/k norms (vLLM keeps its own
kernels for those per-head views), sampling. The measured figure is therefore
the time of the tuned part of a decode step, not of a whole step.

Variants (``VARIANTS``), on the same weights and inputs:

* ``vendor``: ``torch.nn.functional.linear`` (cuBLAS / hipBLASLt) and the
  elementwise compositions of ``tunekit.backends.vendor`` compiled by
  Inductor on a GPU (the faster baseline of the searches; eager on the CPU);
* ``tuned_gemv``: the ``tunekit.ops`` GEMV where a loaded table serves the
  shape at this M, the vendor elementwise ops;
* ``tuned``: every step a table serves goes through ``torch.ops.tunekit``;
* ``tuned_fused``: ``tuned``, except where a table holds a fused entry for a
  pair of steps (``FUSED_PAIRS``): a layer output's GEMV (``o_proj``,
  ``linear_attn.out_proj``, ``down_proj``) adds the residual in its epilogue
  (``gemv_add``), which turns the fused add + norm after it into a plain norm;
  ``input_layernorm`` -> its projection(s) and ``post_attention_layernorm`` ->
  ``gate_up_proj`` run as one ``rms_norm_gemv``-family kernel (the plain form
  where the add moved into the GEMV before); ``act_fn`` -> ``down_proj`` as one
  ``silu_mul_gemv`` kernel (``tunekit.problems.shapes.FUSED_GEMV_OPS``; built straight
  from the entry's backend, as ``tunekit.ops`` does not serve them). A plain
  norm (layer 0's, or one whose add moved into ``gemv_add``) can instead be
  folded into its consumers: each runs ``rms_gemv`` on its weight times the
  norm's (W diag(g), Gemma diag(1 + g), made once as a loader would) and the
  norm step passes its input on, so no norm kernel runs. ``in_proj_qkvz`` and
  ``in_proj_ba`` run as one ``rms_gemv`` on their joined folded weight (the
  problem ``ModelSpec.rms_gemvs`` lists, N = 16480 for Qwen3.5-27B; each is a
  column slice of its output) where a table has that entry, else as one
  ``rms_gemv`` each (the per-consumer entries of older tables). Tried first at
  a layer output, priced as gemv_add + the consumers' rms_gemv kernel(s)
  against the GEMV, the fused add + norm and the consumers' GEMVs (a plain
  norm: the rms_gemv kernel(s) against the norm and the consumers' GEMVs).
  ``gate_up_proj`` -> ``act_fn``
  can run as one GEMV with SiLU-and-mul in its epilogue (``GLU_OPS``: on the
  weight with its rows in (gate, up) pairs; the ``rms_`` form where gate_up
  is a folded consumer), tried before down_proj's prologue. Each only where the fused
  entries' standalone times (plus what they add: the plain norm, the folded
  consumers) beat the tuned entries of the steps they replace (otherwise the
  steps stay as ``tuned`` runs them). Standalone times can mislead in a
  chain (at M=2 on the H200 they chose fusions that lost 60 us a step), so on
  a GPU the choice is then checked as a whole (:func:`select_fusions`): each
  fused family is left out in turn, the chain timed against ``tuned`` in the
  same run, and a family dropped while leaving it out is measurably faster;
  if nothing fused is faster than ``tuned``, nothing is fused. Measured only
  at an M where at least one pair is fused (it equals ``tuned`` otherwise),
  in a timing of its own after the check.

A step no table serves keeps the vendor implementation in every variant (the
op's own fallback, eager PyTorch, would be slower than Inductor and charge the
table for it).

Fused pairs, and what each kernel must produce: the norm -> GEMV kernels
write y and (fused add) the updated residual, never the normalised x, so a
norm is fused only with *every* consumer of its output. In a Gated DeltaNet
layer input_layernorm feeds both ``in_proj_qkvz`` and ``in_proj_ba``: the
chain holds their weights as row slices of one [N_qkvz + N_ba, K] tensor
(the unfused variants read the slices), and the fused kernel runs on the
whole tensor, the problem ``ModelSpec.norm_gemvs`` lists (N = 16480 for
Qwen3.5-27B); qkvz and ba are then column slices of its output. A folded
input norm does the same with ``rms_gemv`` on the joined folded weight where
its entry (``ModelSpec.rms_gemvs``) is tabulated. The final
norm feeds lm_head only through the sampler's gather: never fused.

Numerics: every variant's logits are compared with those of the same chain in
fp32 (``Chain.forward_fp32``: fp32 activations, weights upcast per call). The
vendor variant's distance is the BF16 noise floor of this chain; a tuned
variant should be about as far, not farther (64 layers of random weights
amplify single-ulp differences, so tuned and vendor logits differ from each
other by far more than one GEMV's bound; each kernel's own bound was checked
at search time).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from tunekit.dispatch.fused_gemv import joined_rows
from tunekit.errors import UserError
from tunekit.measure.bench import release_memory
from tunekit.problems.models.spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec
from tunekit.problems.opspec import EPS, interleave_gate_up
from tunekit.problems.shapes import FUSED_GEMV_OPS, Problem
from tunekit.table import saving_us

VARIANTS = ("vendor", "tuned_gemv", "tuned", "tuned_fused")

#: Layer names whose GEMV reads the output of the norm step before them (``input_layernorm``:
#: qkv_proj, or in_proj_qkvz + in_proj_ba; ``post_attention_layernorm``: gate_up_proj).
_NORM_CONSUMERS = ("qkv_proj", "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "gate_up_proj")
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
_LAYER_OUTPUTS = ("o_proj", "out_proj", "down_proj")

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


# ---------------------------------------------------------------------------
# Running a chain
# ---------------------------------------------------------------------------


class Chain:
    """The weights and activations of one chain at one M, and its variants as callables.

    Every step owns distinct weights (N(0, 0.02) BF16, seeded), as every layer
    of a model does. The token mixers' outputs are fixed random buffers.
    ``forward(variant)`` runs one step and returns the logits; it allocates
    nothing outside the ops, so it can be captured in a CUDA graph.
    """

    def __init__(self, steps: Sequence[Step], m: int, device: torch.device | str, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, weights: list[torch.Tensor] | None = None):
        self.steps = list(steps)
        self.m = m
        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            # generated in fp32 chunks of rows: a 2.5 GB lm_head needs no 5 GB fp32 temporary
            out = torch.empty(shape, dtype=dtype, device=self.device)
            rows = max(1, (1 << 26) // max(1, out[0].numel()))
            for start in range(0, shape[0], rows):
                part = out[start:start + rows]
                part.copy_(torch.randn(part.shape, generator=gen, device=self.device) * scale)
            return out

        # another M of the same chain may lend its weights (51 GB for a 27B model are made once)
        self.weights: list[torch.Tensor] = list(weights or [])
        for index in range(len(self.weights), len(self.steps)):
            if index < len(self.weights):
                continue  # made with the step before (a joined pair)
            step = self.steps[index]
            after = self.steps[index + 1] if index + 1 < len(self.steps) else None
            if step.op == "gemv" and _norm_consumer(step) and after is not None and after.op == "gemv" \
                    and after.layer == step.layer and _norm_consumer(after) and after.k == step.k:
                # in_proj_qkvz + in_proj_ba read the same normed x: row slices of one tensor, so that the
                # fused norm kernel can run on both at once (module docstring)
                both = randn(step.n + after.n, step.k, scale=0.02)
                self.weights += [both[: step.n], both[step.n:]]
            elif step.op == "gemv":
                self.weights.append(randn(step.n, step.k, scale=0.02))
            elif step.op == "gated_rms_norm":
                self.weights.append(1.0 + randn(step.k, scale=0.1))
            elif step.op == "silu_and_mul":
                self.weights.append(torch.empty(0, dtype=dtype, device=self.device))
            elif "gemma" in step.op:
                self.weights.append(randn(step.n, scale=0.1))  # applied as (1 + w)
            else:
                self.weights.append(1.0 + randn(step.n, scale=0.1))
        hidden = self.steps[-1].k  # lm_head's K
        self.hidden = randn(m, hidden)  # the embedding of this step's tokens
        #: fixed outputs of the omitted token mixers, per width they feed
        self.mixer: dict[tuple[str, int], torch.Tensor] = {}
        for step in self.steps:
            if step.name in ("o_proj", "linear_attn.out_proj"):
                self.mixer.setdefault(("out", step.k), randn(m, step.k))
            if step.op == "gated_rms_norm":
                self.mixer.setdefault(("core", step.n), randn(m, step.n))
                self.mixer.setdefault(("z", step.n), randn(m, step.n))
        self._impls: dict[str, list[Callable[..., Any]]] = {}
        #: per bound variant, each step's "tuned" / "vendor" / "fused" (served by a fused kernel)
        self.kinds: dict[str, list[str]] = {}
        #: per bound variant, the fused problems it runs, one Step per fused kernel (op, n, k the fused op's)
        self.fused: dict[str, list[Step]] = {}
        #: per bound variant, the steps it runs as another op (a fused add + norm whose add moved into the
        #: GEMV before it runs as the plain norm), as that op's Step: the tables' entries for them
        self.retyped: dict[str, list[Step]] = {}
        #: per bound variant, the indices of the GEMV steps that add the residual (called with it)
        self.adds: dict[str, frozenset[int]] = {}

    # ------------------------------------------------------------ variants

    def build(self, variant: str, vendor_elementwise: dict[str, Callable[..., None]],
              served: Callable[[Step], bool], fused: FusedLookup | None = None) -> list[str]:
        """Bind ``variant``'s implementation of every step; returns each step's "tuned" / "vendor" /
        "fused".

        ``vendor_elementwise`` maps op -> ``fn(inputs, out)`` (``tunekit.backends.vendor``'s form,
        possibly compiled); ``served(step)`` says whether a loaded table serves the step at this M;
        ``fused(op, n, k, replaced, added)`` (tuned_fused only) returns the kernel ``fn(inputs, out)``
        (``tunekit.problems.opspec``'s form) of a fused op a table serves at this M in place of the steps
        ``replaced``, the fusion running ``added`` steps besides (the plain norm a ``gemv_add`` leaves),
        or None (no entry, or, in ``run``, one slower than those steps' tuned kernels).
        """
        if variant not in VARIANTS:
            raise UserError(f"unknown chain variant {variant!r} (known: {', '.join(VARIANTS)})")
        impls, kinds = [], []
        for step in self.steps:
            tuned = variant != "vendor" and (step.op == "gemv" or variant != "tuned_gemv") and served(step)
            impls.append(_tuned_impl(step) if tuned else _vendor_impl(step, vendor_elementwise, self))
            kinds.append("tuned" if tuned else "vendor")
        self.fused[variant], self.retyped[variant], adds = [], [], set()
        if variant == "tuned_fused" and fused is not None:
            plain_impl = partial(_plain_norm_impl, served=served, fns=vendor_elementwise, chain=self)
            self._bind_fused(impls, kinds, fused, self.fused[variant], self.retyped[variant], adds, plain_impl)
        self.adds[variant] = frozenset(adds)
        self._impls[variant] = impls
        self.kinds[variant] = kinds
        return kinds

    def _bind_fused(self, impls: list[Callable[..., Any]], kinds: list[str], fused: FusedLookup,
                    used: list[Step], retyped: list[Step], adds: set[int],
                    plain_impl: Callable[[Step], Callable[..., Any]]) -> None:
        """Replace every pair a fused entry serves by its fused kernel (``FUSED_PAIRS``), in place.

        In step order, so that a layer output's ``gemv_add`` has turned the norm after it into a plain
        norm before that norm is considered for fusion with its consumers."""
        m, dtype, device = self.m, self.dtype, self.device
        plain_at: dict[int, Step] = {}  # norm steps whose add moved into the GEMV before them
        folded: set[int] = set()  # norm steps folded into their consumers with that add
        folded_weights: dict[int, torch.Tensor] = {}  # consumer step -> its weight with the norm's folded in
        for i, step in enumerate(self.steps):
            if step.op == "gemv" and step.name.endswith(_LAYER_OUTPUTS) and kinds[i] != "fused":
                j = i + 1  # the fused add + norm that reads this output (the next layer's, or the final)
                norm = self.steps[j] if j < len(self.steps) else None
                if norm is None or "fused_add" not in norm.op:
                    continue
                plain = replace(norm, op=norm.op.replace("fused_add_", ""))
                consumers = self._norm_consumers(j)
                # the add in this GEMV and the plain norm it leaves folded into its consumers, priced
                # together against this GEMV, the fused add + norm and the consumers' GEMVs (the siblings'
                # one rms_gemv on their joined weight first, else one per consumer)
                for folds in self._fold_options(j, consumers):
                    kernel = fused(FUSED_ADD_OP, step.n, step.k, [step, norm, *consumers], folds)
                    if kernel is not None and self._fold(j, folds, fused, impls, kinds, used, folded_weights):
                        break
                else:
                    kernel = None
                if kernel is not None:
                    impls[i] = _gemv_add(kernel, torch.empty(m, step.n, dtype=dtype, device=device))
                    impls[j] = _plain_after_add(_unnormed)  # the sum is both outputs: consumers normalise it
                    adds.add(i)
                    kinds[i] = kinds[j] = "fused"
                    folded.add(j)
                    used.append(Step(step.layer, f"{step.name}+{norm.name}", FUSED_ADD_OP, step.n, step.k))
                    continue
                kernel = fused(FUSED_ADD_OP, step.n, step.k, [step, norm], [plain])
                if kernel is None:
                    continue
                impls[i] = _gemv_add(kernel, torch.empty(m, step.n, dtype=dtype, device=device))
                impls[j] = _plain_after_add(plain_impl(plain))
                adds.add(i)
                kinds[i] = kinds[j] = "fused"
                plain_at[j] = plain
                used.append(Step(step.layer, f"{step.name}+{norm.name}", FUSED_ADD_OP, step.n, step.k))
                continue
            if step.layer < 0:
                continue  # the final norm -> lm_head: not fused (module docstring)
            if step.op == "silu_and_mul":
                if self._glu(i, fused, impls, kinds, used, folded_weights):
                    continue
                j = i + 1
                down = self.steps[j] if j < len(self.steps) else None
                if down is None or down.op != "gemv" or not down.name.endswith("down_proj"):
                    continue
                kernel = fused(FUSED_ACT_OP, down.n, down.k, [step, down], [])
                if kernel is None:
                    continue
                out = torch.empty(m, down.n, dtype=dtype, device=device)

                def down_fused(src: torch.Tensor, w: torch.Tensor, kernel=kernel, out=out) -> torch.Tensor:
                    kernel((src, w), out)  # src: gate_up_proj's output, the activation is computed inside
                    return out

                impls[i] = _identity  # act_fn: the fused kernel reads gate_up_proj's output itself
                impls[j] = down_fused
                kinds[i] = kinds[j] = "fused"
                used.append(Step(down.layer, f"{step.name}+{down.name}", FUSED_ACT_OP, down.n, down.k))
            elif step.op.endswith("rms_norm") and step.op != "gated_rms_norm" and i not in folded:
                norm = plain_at.get(i, step)
                consumer_steps = self._norm_consumers(i)
                consumers = list(range(i + 1, i + 1 + len(consumer_steps)))  # their step indices
                if not consumers:
                    continue
                if "fused_add" not in norm.op:
                    # a plain norm folded into every consumer, priced against the norm and their GEMVs: the
                    # siblings' one rms_gemv on their joined weight first, else one per consumer
                    for folds in self._fold_options(i, consumer_steps):
                        first = fused(FOLDED_NORM_OP, folds[0].n, folds[0].k, [norm, *consumer_steps], folds[1:])
                        if first is not None and self._fold(i, folds, fused, impls, kinds, used, folded_weights,
                                                            first):
                            break
                    else:
                        first = None
                    if first is not None:
                        after_add = plain_at.pop(i, None) is not None
                        impls[i] = _plain_after_add(_unnormed) if after_add else _unnormed
                        kinds[i] = "fused"
                        continue
                weight = joined_rows([self.weights[j] for j in consumers])
                if weight is None:
                    continue  # the consumers' weights are not one tensor: the pair stays unfused
                op = f"{norm.op}_gemv"
                n = weight.shape[0]
                kernel = fused(op, n, step.n, [norm, *consumer_steps], [])
                if kernel is None:
                    continue
                y = torch.empty(m, n, dtype=dtype, device=device)
                with_residual = "fused_add" in norm.op
                residual_out = torch.empty(m, step.n, dtype=dtype, device=device) if with_residual else None
                impls[i] = _fused_norm(kernel, weight, y, residual_out)
                if plain_at.pop(i, None) is not None:  # the plain kernel in the fused add's place, run inside
                    impls[i] = _plain_after_add(impls[i])  # it: the sum passes on as the residual
                start = 0
                for j in consumers:
                    rows = self.steps[j].n
                    impls[j] = _output_slice(y, start, start + rows)
                    start += rows
                    kinds[j] = "fused"
                kinds[i] = "fused"
                names = "+".join([step.name] + [c.name for c in consumer_steps])
                used.append(Step(step.layer, names, op, n, step.n))
        retyped.extend(plain_at.values())  # the plain norms left as steps of their own

    def _norm_consumers(self, i: int) -> list[Step]:
        """The GEMV steps right after norm step ``i`` that read its output (same layer, same width)."""
        out: list[Step] = []
        norm = self.steps[i]
        for nxt in self.steps[i + 1:]:
            if nxt.op != "gemv" or nxt.layer != norm.layer or not _norm_consumer(nxt) or nxt.k != norm.n:
                break
            out.append(nxt)
        return out

    def _fold_options(self, i: int, consumers: list[Step]) -> list[list[Step]]:
        """The ``rms_gemv`` kernels that folding norm step ``i`` into its ``consumers`` may run, in order of
        preference: where the consumers are siblings whose weights are row blocks of one tensor
        (in_proj_qkvz + in_proj_ba), one kernel on that joined weight (the problem ``ModelSpec.rms_gemvs``
        lists: N = 16480 for Qwen3.5-27B), then one kernel per consumer (the per-consumer entries of older
        tables). Empty if there is no consumer."""
        if not consumers:
            return []
        per_consumer = _folded(consumers)
        weights = [self.weights[j] for j in range(i + 1, i + 1 + len(consumers))]
        if len(consumers) < 2 or joined_rows(weights) is None:
            return [per_consumer]
        merged = Step(consumers[0].layer, "+".join(c.name for c in consumers), FOLDED_NORM_OP,
                      sum(c.n for c in consumers), consumers[0].k)
        return [[merged], per_consumer]

    def _fold(self, i: int, folds: list[Step], fused: FusedLookup, impls: list[Callable[..., Any]],
              kinds: list[str], used: list[Step], folded_weights: dict[int, torch.Tensor],
              first: Callable[..., None] | None = None) -> bool:
        """Bind the consumers of norm step ``i`` as the ``rms_gemv`` kernels ``folds`` (one of
        ``_fold_options``) on their weights with the norm's folded in (W' = W diag(g), Gemma diag(1 + g),
        rounded to the chain's dtype once, as a model's weights would be when loaded; recorded in
        ``folded_weights``); ``first``: the first kernel, already built (and priced). A fold whose N spans
        several consumers runs on their joined weight, folded as one tensor: its first consumer launches it
        and returns its columns of the output, the others return theirs (``_output_slice``: no launch).
        False, with nothing bound, if a kernel is missing."""
        kernels = [first] if first is not None else []
        kernels += [fused(FOLDED_NORM_OP, f.n, f.k, [], []) for f in folds[len(kernels):]]
        if any(k is None for k in kernels):
            return False
        g = self.weights[i].float()
        scale = 1.0 + g if "gemma" in self.steps[i].op else g
        j = i + 1  # the first consumer the next fold serves
        for fold, kernel in zip(folds, kernels, strict=True):
            span = [j]  # the consumer steps this fold serves: its rows are theirs, in order
            while sum(self.steps[c].n for c in span) < fold.n:
                span.append(span[-1] + 1)
            weight = joined_rows([self.weights[c] for c in span])
            if weight is None or weight.shape[0] != fold.n:  # pragma: no cover - _fold_options checked it
                raise AssertionError(f"fold {fold} does not match its consumers' weights")
            folded = (weight.float() * scale).to(self.dtype)
            out = torch.empty(self.m, fold.n, dtype=self.dtype, device=self.device)
            launch = _on_prepared_weight(kernel, folded, out)
            start = 0
            for c in span:
                stop = start + self.steps[c].n
                folded_weights[c] = folded[start:stop]
                if len(span) == 1:
                    impls[c] = launch
                elif c == span[0]:
                    impls[c] = _launch_then_slice(launch, start, stop)
                else:
                    impls[c] = _output_slice(out, start, stop)
                kinds[c] = "fused"
                start = stop
            used.append(fold)
            j = span[-1] + 1
        return True

    def _glu(self, i: int, fused: FusedLookup, impls: list[Callable[..., Any]], kinds: list[str],
             used: list[Step], folded_weights: dict[int, torch.Tensor]) -> bool:
        """Bind gate_up_proj (step ``i - 1``) and act_fn (SiLU-and-mul, step ``i``) as one GEMV with the
        activation in its epilogue (``GLU_OPS``), on gate_up's weight (the folded one where the norm
        before it is folded) with its rows reordered into (gate, up) pairs once, as a loader would.
        Priced against what runs there now: gate_up's GEMV or rms_gemv, and the SiLU-and-mul. False,
        with nothing bound, where no entry serves it or it does not pay."""
        j = i - 1
        gate_up = self.steps[j] if j >= 0 else None
        if gate_up is None or gate_up.op != "gemv" or not gate_up.name.endswith("gate_up_proj"):
            return False
        weight = folded_weights.get(j)
        if kinds[j] == "fused" and weight is None:
            return False  # gate_up is a slice of a norm-prologue kernel's output
        current = gate_up if weight is None else replace(gate_up, op=FOLDED_NORM_OP)
        glu = replace(gate_up, op=GLU_OPS[current.op])
        kernel = fused(glu.op, glu.n, glu.k, [current, self.steps[i]], [])
        if kernel is None:
            return False
        paired = interleave_gate_up(self.weights[j] if weight is None else weight)
        out = torch.empty(self.m, glu.n // 2, dtype=self.dtype, device=self.device)
        impls[j] = _on_prepared_weight(kernel, paired, out)
        impls[i] = _identity  # act_fn: gate_up's kernel applied it
        kinds[j] = kinds[i] = "fused"
        if weight is not None:
            used.remove(current)  # the fold's rms_gemv of this step, replaced by its GLU form
        used.append(glu)
        return True

    def forward(self, variant: str) -> torch.Tensor:
        """One decode step through ``variant`` (bound by ``build``); returns the logits [m, vocab]."""
        impls = self._impls[variant]
        return self._forward(impls, self.hidden, self.mixer, self.adds.get(variant, frozenset()))

    def forward_fp32(self) -> torch.Tensor:
        """The same step with fp32 activations and fp32 math (weights upcast per call; eager, not for
        timing): the reference both BF16 variants are measured against."""
        fns = _vendor_elementwise(torch.device("cpu"))  # the eager compositions; fp32 in, fp32 out
        impls = [_fp32_impl(step, fns, self) for step in self.steps]
        mixer = {key: t.float() for key, t in self.mixer.items()}
        return self._forward(impls, self.hidden.float(), mixer)

    def _forward(self, impls: list[Callable[..., Any]], hidden: torch.Tensor,
                 mixer: dict[tuple[str, int], torch.Tensor], adds: frozenset[int] = frozenset()) -> torch.Tensor:
        """``adds``: the GEMV steps that add the residual themselves (called with it; the norm after
        them returns their output as the residual)."""
        x = hidden
        residual: torch.Tensor | None = None
        normed = x
        for index, (step, w, impl) in enumerate(zip(self.steps, self.weights, impls, strict=True)):
            if step.op == "gemv":
                if step.name in ("o_proj", "linear_attn.out_proj"):
                    src = mixer[("out", step.k)] if step.name == "o_proj" else normed
                elif step.name.endswith("down_proj"):
                    src = normed
                else:
                    src = x
                y = impl(src, w, residual) if index in adds else impl(src, w)
                if step.name.endswith(_LAYER_OUTPUTS):
                    x = y  # a layer's output: the next norm adds it to the residual (or, with adds, has it)
                elif step.name == "lm_head":
                    return y
                elif step.name.endswith("gate_up_proj"):
                    normed = y  # the MLP activation's input
            elif step.op == "gated_rms_norm":
                normed = impl(mixer[("core", step.n)], mixer[("z", step.n)], w)
            elif step.op == "silu_and_mul":
                normed = impl(normed)
            elif residual is None and "fused_add" not in step.op:
                residual = x
                x = impl(x, w)
            else:
                x, residual = impl(x, residual, w)
        raise AssertionError("the chain ends with lm_head")  # pragma: no cover


def _norm_consumer(step: Step) -> bool:
    return step.op == "gemv" and step.name.endswith(_NORM_CONSUMERS)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _fused_norm(kernel: Callable[..., None], weight: torch.Tensor, y: torch.Tensor,
                residual_out: torch.Tensor | None) -> Callable[..., Any]:
    """The norm step of a fused norm -> GEMV pair: launches the fused kernel on its consumers'
    weight; returns what the norm step returns in ``Chain._forward`` with y standing for the
    normed x (only the consumers read it, and they return slices of y)."""
    if residual_out is None:
        def plain(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            kernel((x, g, weight), y)
            return y
        return plain

    def with_residual(x: torch.Tensor, residual: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kernel((x, residual, g, weight), (y, residual_out))
        return y, residual_out
    return with_residual


def _folded(consumers: list[Step]) -> list[Step]:
    """The ``rms_gemv`` steps that a folded norm's consumer GEMVs become."""
    return [replace(c, op=FOLDED_NORM_OP) for c in consumers]


def _unnormed(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A norm folded into its consumers: it passes x on (each consumer computes 1/rms itself)."""
    return x


def _on_prepared_weight(kernel: Callable[..., None], weight: torch.Tensor, out: torch.Tensor) -> Callable[..., Any]:
    """A GEMV-family kernel on a weight prepared once (a folded norm's consumer: ``rms_gemv`` on the
    un-normalised x; gate_up with its rows paired: the ``GLU_OPS``); the step's own weight is unused."""
    def prepared(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        kernel((x, weight), out)
        return out
    return prepared


def _gemv_add(kernel: Callable[..., None], out: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A layer output's GEMV with the residual add in its epilogue: returns x W^T + residual."""
    def layer_output(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        kernel((x, w, residual), out)
        return out
    return layer_output


def _plain_after_add(norm: Callable[..., torch.Tensor]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The fused add + norm step after a ``gemv_add``: its input already is the sum, so the plain norm
    ``norm(s, g)`` runs, and the sum passes on as the residual (the fused add's two outputs)."""
    def after_add(s: torch.Tensor, residual: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return norm(s, g), s
    return after_add


def _plain_norm_impl(step: Step, served: Callable[[Step], bool], fns: dict[str, Callable[..., None]],
                     chain: Chain) -> Callable[..., torch.Tensor]:
    """The plain norm ``step`` as the tuned variant would run it: tunekit's op where a table serves it."""
    return _tuned_impl(step) if served(step) else _vendor_impl(step, fns, chain)


def _output_slice(y: torch.Tensor, start: int, stop: int) -> Callable[..., torch.Tensor]:
    """A consumer GEMV of a fused norm: its columns of the fused kernel's output."""
    def consumer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return y[:, start:stop]
    return consumer


def _launch_then_slice(launch: Callable[..., torch.Tensor], start: int, stop: int) -> Callable[..., torch.Tensor]:
    """The first consumer of a kernel several consumers share (a folded norm's siblings): it launches the
    kernel, ``launch(x, w)``, and returns its columns of the output (the others: ``_output_slice``)."""
    def consumer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return launch(x, w)[:, start:stop]
    return consumer


def _tuned_impl(step: Step) -> Callable[..., Any]:
    op = getattr(torch.ops.tunekit, step.op)
    if step.op == "gemv":
        return lambda x, w: op(x, w, None)
    if step.op == "silu_and_mul":
        return op
    return lambda *args: op(*args, EPS)


def _fp32_impl(step: Step, fns: dict[str, Callable[..., None]], chain: Chain) -> Callable[..., Any]:
    if step.op == "gemv":
        return lambda x, w: F.linear(x, w.float())
    return _vendor_impl(step, fns, chain, torch.float32)


def _vendor_impl(step: Step, fns: dict[str, Callable[..., None]], chain: Chain,
                 dtype: torch.dtype | None = None) -> Callable[..., Any]:
    if step.op == "gemv":
        return lambda x, w: F.linear(x, w)
    fn = fns[step.op]
    m, dtype, device = chain.m, dtype or chain.dtype, chain.device
    # outputs preallocated once per step (graph-safe, as the vendor compositions write into ``out``)
    if "fused_add" in step.op:
        outs = (torch.empty(m, step.n, dtype=dtype, device=device), torch.empty(m, step.n, dtype=dtype, device=device))

        def fused(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            fn((x, residual, w), outs)
            return outs
        return fused
    out = torch.empty(m, step.n, dtype=dtype, device=device)

    def call(*inputs: torch.Tensor) -> torch.Tensor:
        fn(inputs, out)
        return out
    return call


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------


@dataclass
class VariantResult:
    variant: str
    step_us: float  # median over repeats of the mean replay time
    spread: float  # (p75 - p25) / median over repeats
    tuned_steps: int
    vendor_steps: int
    max_abs_diff: float | None = None  # vs the vendor variant's logits
    rel_diff: float | None = None  # max_abs_diff / std(vendor logits)
    rms_err_fp32: float | None = None  # rms |logits - the fp32 chain's logits| (vendor's is the BF16 noise floor)
    fused_steps: int = 0  # steps served by a fused kernel (tuned_fused): two or three per kernel
    fused_kernels: int = 0
    #: with ``profile_replays``: one replay read as serve-bench reads a served step (per launch shape and
    #: predecessor: ``tunekit.evidence.serve_bench.profile.launch_totals``), divided by the replays profiled
    by_launch: dict[str, dict[str, float]] | None = None


def measure(chain: Chain, variants: Sequence[str], iters: int = 20, repeats: int = 15,
            profile_replays: int = 0) -> list[VariantResult]:
    """Capture each bound variant as one CUDA graph and time the replays interleaved (A B C A B C ...).

    Needs a GPU. Each variant is run eagerly twice first (compiles, builds and
    caches every kernel outside the capture), and its logits are compared with
    the vendor variant's. With ``profile_replays``, after the timing each graph's
    replays are also read by torch's profiler with serve-bench's key (the same
    GEMV problem is then the same row here and in a served step's ``by_launch``).
    Returns one result per variant, in order.
    """
    if chain.device.type != "cuda":
        raise UserError("timing a chain needs a GPU (CUDA / ROCm); on the CPU use compare_eager")
    logits = {}
    for v in variants:
        for _ in range(2):
            logits[v] = chain.forward(v).float().clone()
    torch.cuda.synchronize(chain.device)
    graphs = {}
    for v in variants:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain.forward(v)
        graphs[v] = graph
    for v in variants:  # warm replays
        graphs[v].replay()
    torch.cuda.synchronize(chain.device)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(repeats):
        for v in variants:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                graphs[v].replay()
            end.record()
            end.synchronize()
            times[v].append(start.elapsed_time(end) * 1000.0 / iters)
    launches = {v: _profiled_launches(graphs[v], profile_replays) for v in variants} if profile_replays else {}
    base = logits.get("vendor")
    ref = chain.forward_fp32()
    return [replace(_result(v, times[v], chain.kinds[v], logits[v], base, ref, len(chain.fused.get(v, ()))),
                    by_launch=launches.get(v)) for v in variants]


def _profiled_launches(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, dict[str, float]]:
    """``replays`` replays of ``graph`` under torch's profiler, per launch shape and predecessor, per replay
    (largest time first)."""
    from tunekit.evidence.serve_bench.profile import launch_totals, traced

    trace = traced(lambda: [graph.replay() for _ in range(replays)], "CUDA")
    rows = {key: {f: v / replays for f, v in row.items()} for key, row in launch_totals(trace).items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["us"]))


def _result(variant: str, times: list[float], kinds: list[str], logits: torch.Tensor,
            base: torch.Tensor | None, ref: torch.Tensor, fused_kernels: int = 0) -> VariantResult:
    med = statistics.median(times) if times else float("nan")
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [med, med, med]
    diff = rel = None
    if base is not None:
        diff = float((logits - base).abs().max())
        std = float(base.std())
        rel = diff / std if std > 0 else None
    rms = float((logits - ref.float()).pow(2).mean().sqrt())
    return VariantResult(variant, med, (q[2] - q[0]) / med if times else float("nan"),
                         kinds.count("tuned"), kinds.count("vendor"), diff, rel, rms, kinds.count("fused"),
                         fused_kernels)


def predicted_saving_us(chain: Chain, entry_for: Callable[[Step], dict[str, Any]], variant: str) -> float:
    """Sum over the steps the bound ``variant`` serves tuned, and its fused kernels, of (baseline -
    tuned) standalone time, from the table entries: what the microbenchmarks predict the step saves
    (a fused entry's baseline is the unfused eager sequence it replaces)."""
    total = 0.0
    tuned = [step for step, kind in zip(chain.steps, chain.kinds[variant], strict=True) if kind == "tuned"]
    # bound because a table entry serves each (a retyped plain norm: its entry was required for the fusion)
    for step in tuned + chain.fused.get(variant, []) + chain.retyped.get(variant, []):
        entry = entry_for(step)
        total += saving_us(entry)
    return total


def compare_eager(chain: Chain, variants: Sequence[str]) -> list[VariantResult]:
    """Without a GPU: run each bound variant once eagerly and compare its logits with vendor's (no timing)."""
    logits = {v: chain.forward(v).float().clone() for v in variants}
    base = logits.get("vendor")
    ref = chain.forward_fp32()
    return [_result(v, [], chain.kinds[v], logits[v], base, ref, len(chain.fused.get(v, ()))) for v in variants]


#: Selection timings of the fused-family check: short (the chain's replays spread ~0.1%), and the
#: margin by which leaving a family out must beat keeping it (a fraction of the step time).
SELECT_ITERS, SELECT_REPEATS, SELECT_MARGIN = 10, 5, 0.002


def select_fusions(families: Sequence[str], ratio: Callable[[frozenset[str]], float],
                   margin: float = SELECT_MARGIN) -> tuple[frozenset[str], list[dict[str, Any]]]:
    """The fused families to leave out, chosen by measurement, and the trace of what was measured.

    ``ratio(excluded)`` times the chain's ``tuned_fused`` with the ``excluded`` families unfused against
    ``tuned`` in the same run (time over time). Backward elimination from what the standalone prices chose:
    each round leaves out each remaining family in turn and drops the one whose absence is fastest, if
    that beats the current ratio by more than ``margin``. If the final ratio is not below 1 (fusing is not
    faster than ``tuned``), every family is left out."""
    excluded: frozenset[str] = frozenset()
    current = ratio(excluded)
    trace = [{"excluded": [], "ratio": current}]
    while len(excluded) < len(families):
        trials = {f: ratio(excluded | {f}) for f in families if f not in excluded}
        trace += [{"excluded": sorted(excluded | {f}), "ratio": r} for f, r in trials.items()]
        best = min(trials, key=lambda f: trials[f])
        if trials[best] >= current - margin:
            break
        excluded, current = excluded | {best}, trials[best]
    if current >= 1.0:
        excluded = frozenset(families)
    return excluded, trace


def excluding(fused: FusedLookup, excluded: frozenset[str]) -> FusedLookup:
    """``fused`` with the ``excluded`` fused ops unserved (the chain binds those steps as ``tuned`` does)."""
    def lookup(op: str, n: int, k: int, replaced: list[Step], added: list[Step]) -> Callable[..., None] | None:
        return None if op in excluded else fused(op, n, k, replaced, added)

    return lookup


def _vendor_elementwise(device: torch.device) -> dict[str, Callable[..., None]]:
    """The vendor compositions, compiled by Inductor on a GPU (the searches' faster baseline), eager on the CPU."""
    from tunekit.backends.vendor import ELEMENTWISE

    if device.type != "cuda":
        return dict(ELEMENTWISE)
    # one compile per op and shape; a fresh Dynamo keeps every M under the recompile limit
    torch._dynamo.reset()
    return {op: torch.compile(fn, fullgraph=True, dynamic=False) for op, fn in ELEMENTWISE.items()}


def run(spec: ModelSpec, tables: Sequence[str], m_list: Sequence[int], tp: int = 1, layers: int | None = None,
        iters: int = 20, repeats: int = 15, seed: int = 0, log: Callable[[str], None] = print,
        profile_replays: int = 0) -> dict[str, Any]:
    """Build the chain of ``spec`` and measure every variant at each M (or, without a GPU, compare the
    variants' logits eagerly). Returns the report as a JSON-ready dict (``tunekit chain`` writes it).
    ``profile_replays``: each variant's row also holds ``by_launch`` (:func:`measure`)."""
    from tunekit import ops
    from tunekit.measure.device import detect

    if not tables:
        raise UserError("give at least one --table")
    ops.load_tables(list(tables))
    broken = [f"{t['path']}: {t['error']}" for t in ops.loaded_tables() if t.get("error")]
    if broken:
        raise UserError("table not usable: " + "; ".join(broken))
    info = detect()
    device = torch.device("cuda", torch.cuda.current_device()) if info.is_gpu else torch.device("cpu")
    steps = chain_steps(spec, tp, layers)
    prepared = ops.prepare(device, ms=m_list)
    # tunekit.ops does not serve the fused ops (no torch.ops.tunekit.*_gemv): prepare reports their
    # entries as errors; the chain builds them itself (``fused_kernel`` below)
    errors = [e for e in prepared["errors"] if e.split(" ", 1)[0] not in FUSED_GEMV_OPS]
    if errors:
        raise UserError("building the tabulated kernels failed: " + "; ".join(errors[:3]))
    fallback = ", ".join(f"{k} x{v}" for k, v in prepared["fallback"].items())
    log(f"{spec.name}: {len(steps)} calls per step ({len(spec.layer_types[: layers or spec.num_layers])} layers), "
        f"device {info.name}; tables: {prepared['tuned']} tuned kernels ready"
        + (f", vendor path for {fallback}" if fallback else ""))
    report: dict[str, Any] = {
        "model": spec.name, "tp": tp, "layers": layers or spec.num_layers, "calls_per_step": len(steps),
        "device": info.as_dict(), "tables": list(tables), "timed": device.type == "cuda",
        "iters": iters, "repeats": repeats, "results": [],
    }
    weights = None
    dtype = "bf16"
    unpaid: set[tuple] = set()  # fused entries slower than the tuned steps they would replace (logged once)
    for m in m_list:
        chain = Chain(steps, m, device, seed, weights=weights)
        weights = chain.weights

        def entry_for(step: Step, m: int = m) -> dict[str, Any] | None:
            return ops.served_entry(step.op, dtype, m, step.n, step.k, str(device))

        def fused_kernel(op: str, n: int, k: int, replaced: list[Step], added: list[Step],
                         m: int = m) -> Callable[..., None] | None:
            entry = ops.served_entry(op, dtype, m, n, k, str(device))
            extra = [entry_for(step) for step in added]
            if entry is None or None in extra:
                return None  # a step the fusion adds (gemv_add's plain norm) must be tuned: its cost is known
            # Fuse only where it pays: the fused kernel (and what it adds) must beat the tuned kernels
            # of the steps it replaces (standalone times of the tables; a step no table serves counts 0
            # here, so the vendor part of the pair is the fused kernel's margin, never its excuse).
            fused_us = entry["time_us"] + sum(e["time_us"] for e in extra)
            tuned_us = sum(e["time_us"] for e in map(entry_for, replaced) if e is not None)
            if tuned_us and fused_us >= tuned_us:
                key = (m, op, n, k)
                if key not in unpaid:
                    unpaid.add(key)
                    plus = "".join(f" + {s.op} {e['time_us']:.2f}" for s, e in zip(added, extra, strict=True))
                    log(f"M={m} {op} {n}x{k}: fused {entry['time_us']:.2f} us{plus} >= the tuned steps it "
                        f"replaces {tuned_us:.2f} us ({'+'.join(s.name for s in replaced)}): left unfused")
                return None
            return _build_fused(entry, Problem(op, dtype, m, n, k), info)

        fns = _vendor_elementwise(device)

        def served(step: Step) -> bool:
            return entry_for(step) is not None

        for variant in VARIANTS:
            chain.build(variant, fns, served, fused_kernel)
        families = sorted({step.op for step in chain.fused["tuned_fused"]})
        excluded: frozenset[str] = frozenset()
        if families and device.type == "cuda":
            excluded = _check_fusions(chain, families, fns, served, fused_kernel, m, report, log)
            chain.build("tuned_fused", fns, served, excluding(fused_kernel, excluded))
        # tuned_fused equals tuned where nothing is fused at this M: not measured twice
        variants = [v for v in VARIANTS if v != "tuned_fused" or chain.fused[v]]
        if len(variants) < len(VARIANTS):
            log(f"M={m} tuned_fused: " + ("the fusion check left every family out" if families else
                                          "no fused entry serves this M") + " (same as tuned), not measured")
        results = measure(chain, variants, iters, repeats, profile_replays) if device.type == "cuda" \
            else compare_eager(chain, variants)
        vendor_us = results[0].step_us
        for r in results:
            row = asdict(r) | {"m": m, "predicted_saving_us": predicted_saving_us(chain, entry_for, r.variant)}
            if r.variant == "tuned_fused":
                row["left_out"] = sorted(excluded)  # fused families the check left unfused
            if device.type == "cuda":
                row["measured_saving_us"] = vendor_us - r.step_us
                row["speedup"] = vendor_us / r.step_us
            report["results"].append(row)
            log(_line(row, device.type == "cuda"))
        del chain
        if device.type == "cuda":
            release_memory()  # the next M's chain is timed after the driver has cleared this one's weights
    return report


def _check_fusions(chain: Chain, families: list[str], fns: dict[str, Callable[..., None]],
                   served: Callable[[Step], bool], fused: FusedLookup, m: int, report: dict[str, Any],
                   log: Callable[[str], None]) -> frozenset[str]:
    """:func:`select_fusions` on the GPU: each candidate bound as ``tuned_fused`` and timed against ``tuned``
    (short timings); the trace goes into ``report["fusion_check"]``. Returns the families to leave out."""
    def ratio(excluded: frozenset[str]) -> float:
        chain.build("tuned_fused", fns, served, excluding(fused, excluded))
        if not chain.fused["tuned_fused"]:
            return 1.0  # nothing left to fuse: tuned_fused is tuned
        tuned, candidate = measure(chain, ["tuned", "tuned_fused"], SELECT_ITERS, SELECT_REPEATS)
        value = candidate.step_us / tuned.step_us
        log(f"M={m} fusion check: {', '.join(sorted(excluded)) or 'nothing'} left out: tuned_fused / tuned "
            f"{value:.4f}")
        return value

    excluded, trace = select_fusions(families, ratio)
    report.setdefault("fusion_check", []).append({"m": m, "families": families, "excluded": sorted(excluded),
                                                  "trace": trace})
    log(f"M={m} fusion check: fused families {', '.join(f for f in families if f not in excluded) or 'none'}"
        + (f"; left out {', '.join(sorted(excluded))}" if excluded else ""))
    return excluded


def _build_fused(entry: dict[str, Any], problem: Problem, device: Any) -> Callable[..., None]:
    """The kernel of a fused op's table entry, built through its backend for this M (a UserError if
    it does not build: the table promised it)."""
    from tunekit import backends

    params = entry["params"]
    if isinstance(params, str):
        params = json.loads(params)
    try:
        return backends.get(entry["backend"]).build(problem, params, device)
    except Exception as exc:  # noqa: BLE001 - named in one line
        raise UserError(f"building the fused kernel {problem.key} ({entry['backend']}) failed: {exc}") from None


def _line(row: dict[str, Any], timed: bool) -> str:
    text = f"M={row['m']} {row['variant']:<11} tuned calls {row['tuned_steps']:>4}"
    if row.get("fused_kernels"):
        text += f" + {row['fused_kernels']} fused kernels ({row['fused_steps']} calls)"
    if timed:
        text += (f"  {row['step_us'] / 1000:.3f} ms/step (spread {row['spread']:.1%})  x{row['speedup']:.4f}"
                 f"  saving {row['measured_saving_us']:.0f} us, predicted {row['predicted_saving_us']:.0f} us")
    if row.get("rel_diff") is not None:
        text += f"  max |logits - vendor| {row['max_abs_diff']:.3g} ({row['rel_diff']:.2%} of their std)"
    text += f"  rms |logits - fp32| {row['rms_err_fp32']:.3g}"
    return text
