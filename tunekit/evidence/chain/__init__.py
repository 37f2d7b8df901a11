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

Modules, each importing only those listed before it:

* ``steps``: ``Step``, the variants' and fused families' names, ``chain_steps`` (plain data);
* ``kernels``: the per-step implementations (vendor, tuned, fp32, the fused pieces);
* ``variants``: ``Chain``, the weights of one M and each variant bound;
* ``results``: ``VariantResult``, the logits comparison, ``compare_eager``, the predicted saving;
* ``timing``: ``measure``, the CUDA-graph timing;
* ``select``: the measured check of the fused families (``select_fusions``);
* ``runner``: ``run``, the command.
"""

from __future__ import annotations

from tunekit.evidence.chain.kernels import vendor_elementwise
from tunekit.evidence.chain.results import VariantResult, compare_eager, predicted_saving_us
from tunekit.evidence.chain.runner import run
from tunekit.evidence.chain.select import excluding, select_fusions
from tunekit.evidence.chain.steps import (
    FOLDED_NORM_OP,
    FUSED_ACT_OP,
    FUSED_ADD_OP,
    FUSED_PAIRS,
    GLU_OPS,
    VARIANTS,
    FusedLookup,
    Step,
    chain_steps,
)
from tunekit.evidence.chain.timing import measure
from tunekit.evidence.chain.variants import Chain

__all__ = ["FOLDED_NORM_OP", "FUSED_ACT_OP", "FUSED_ADD_OP", "FUSED_PAIRS", "GLU_OPS", "VARIANTS", "Chain",
           "FusedLookup", "Step", "VariantResult", "chain_steps", "compare_eager", "excluding", "measure",
           "predicted_saving_us", "run", "select_fusions", "vendor_elementwise"]
