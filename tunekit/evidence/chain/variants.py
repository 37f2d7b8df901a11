"""A chain at one M: its weights and activations, and each variant bound as one callable per step.

Call protocol::

    chain = Chain(chain_steps(spec), m, device)
    chain.build(variant, vendor_elementwise(device), served, fused)   # for each variant to run
    logits = chain.forward(variant)                                   # graph-capturable

``build`` binds ``tuned_fused``'s fused pairs as the ``tunekit.evidence.chain`` module docstring tells;
``forward_fp32`` is the reference every variant's logits are measured against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from tunekit.dispatch.fused_gemv import joined_rows
from tunekit.errors import UserError
from tunekit.evidence.chain import kernels
from tunekit.evidence.chain.kernels import (
    fp32_impl,
    fused_norm_step,
    gemv_add_step,
    identity,
    launch_then_slice,
    on_prepared_weight,
    output_slice,
    plain_after_add,
    plain_norm_impl,
    tuned_impl,
    unnormed,
    vendor_impl,
)
from tunekit.evidence.chain.steps import (
    FOLDED_NORM_OP,
    FUSED_ACT_OP,
    FUSED_ADD_OP,
    GLU_OPS,
    LAYER_OUTPUTS,
    VARIANTS,
    FusedLookup,
    Step,
    is_norm_consumer,
)
from tunekit.problems.opspec_gemv import interleave_gate_up


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
            if step.op == "gemv" and is_norm_consumer(step) and after is not None and after.op == "gemv" \
                    and after.layer == step.layer and is_norm_consumer(after) and after.k == step.k:
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
            impls.append(tuned_impl(step) if tuned else vendor_impl(step, vendor_elementwise, self))
            kinds.append("tuned" if tuned else "vendor")
        self.fused[variant], self.retyped[variant], adds = [], [], set()
        if variant == "tuned_fused" and fused is not None:
            plain_impl = partial(plain_norm_impl, served=served, fns=vendor_elementwise, chain=self)
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
            if step.op == "gemv" and step.name.endswith(LAYER_OUTPUTS) and kinds[i] != "fused":
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
                    impls[i] = gemv_add_step(kernel, torch.empty(m, step.n, dtype=dtype, device=device))
                    impls[j] = plain_after_add(unnormed)  # the sum is both outputs: consumers normalise it
                    adds.add(i)
                    kinds[i] = kinds[j] = "fused"
                    folded.add(j)
                    used.append(Step(step.layer, f"{step.name}+{norm.name}", FUSED_ADD_OP, step.n, step.k))
                    continue
                kernel = fused(FUSED_ADD_OP, step.n, step.k, [step, norm], [plain])
                if kernel is None:
                    continue
                impls[i] = gemv_add_step(kernel, torch.empty(m, step.n, dtype=dtype, device=device))
                impls[j] = plain_after_add(plain_impl(plain))
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

                impls[i] = identity  # act_fn: the fused kernel reads gate_up_proj's output itself
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
                        impls[i] = plain_after_add(unnormed) if after_add else unnormed
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
                impls[i] = fused_norm_step(kernel, weight, y, residual_out)
                if plain_at.pop(i, None) is not None:  # the plain kernel in the fused add's place, run inside
                    impls[i] = plain_after_add(impls[i])  # it: the sum passes on as the residual
                start = 0
                for j in consumers:
                    rows = self.steps[j].n
                    impls[j] = output_slice(y, start, start + rows)
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
            if nxt.op != "gemv" or nxt.layer != norm.layer or not is_norm_consumer(nxt) or nxt.k != norm.n:
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
        and returns its columns of the output, the others return theirs (``output_slice``: no launch).
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
            launch = on_prepared_weight(kernel, folded, out)
            start = 0
            for c in span:
                stop = start + self.steps[c].n
                folded_weights[c] = folded[start:stop]
                if len(span) == 1:
                    impls[c] = launch
                elif c == span[0]:
                    impls[c] = launch_then_slice(launch, start, stop)
                else:
                    impls[c] = output_slice(out, start, stop)
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
        impls[j] = on_prepared_weight(kernel, paired, out)
        impls[i] = identity  # act_fn: gate_up's kernel applied it
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
        fns = kernels.vendor_elementwise(torch.device("cpu"))  # the eager compositions; fp32 in, fp32 out
        impls = [fp32_impl(step, fns, self) for step in self.steps]
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
                if step.name.endswith(LAYER_OUTPUTS):
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


def _folded(consumers: list[Step]) -> list[Step]:
    """The ``rms_gemv`` steps that a folded norm's consumer GEMVs become."""
    return [replace(c, op=FOLDED_NORM_OP) for c in consumers]
