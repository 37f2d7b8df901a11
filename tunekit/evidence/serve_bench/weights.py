"""Realistic weights without a checkpoint: a seeded re-initialisation of a model's parameters, in place.

vLLM's dummy loader fills every weight from one small uniform range, so the
logits are nearly uniform: every arm emits the same near-tie tokens and an
agreement check on them cannot fail. This recipe (``--weights realistic``)
gives each parameter the scale its kind has in real checkpoints of the
Llama / Qwen families:

* linear weights ~ N(0, 0.02) (input projections: q/k/v, gate/up, the
  Gated DeltaNet's in_proj), the output projections that write into the
  residual stream (o_proj, down_proj, out_proj) ~ N(0, 0.02 / sqrt(2 L))
  for L decoder layers (the scaled initialisation of GPT-2 and Megatron:
  without it the layers' sum drowns the current token, and a few tokens win
  the argmax whatever the context), biases ~ N(0, 0.02);
* the token embedding ~ N(0, 0.02); an untied lm_head ~ N(0, 0.02) (a tied
  one is the embedding, written once);
* norm gains ~ lognormal around 1 with outlier channels: a few in a
  thousand at 10-30, two in a hundred near 0 (0-0.05), as trained
  checkpoints have them (the final norm without the large ones: its gains
  are even in trained models). Zero-centred norms (Gemma's, Qwen3-Next's and
  Qwen3.5's, weight w, gain 1 + w) get w = gain - 1;
* the final norm's gains scaled so the logits' spread over the vocabulary
  is 1.5 x sqrt(2 ln V): above that level a softmax over V Gaussian logits
  puts its mass on a few tokens, so the next-token distribution is peaked
  and the greedy token moves from step to step with the context;
* Gated DeltaNet: A_log ~ U(0, ln 16), dt_bias = softplus^-1(dt) with dt
  log-uniform in [1e-3, 0.1] (the checkpoints' initialisation), the causal
  conv1d ~ N(0, 1 / sqrt(kernel)).

Anything else (buffers, rotary tables, unknown parameters) keeps what the
loader wrote. Each parameter draws from its own generator, seeded by the
recipe's seed and the parameter's name, on the parameter's device: the
values do not depend on the order of the walk, and every process with the
same model, device and seed holds the same weights. The recipe needs no
vLLM: it walks a plain ``torch.nn.Module`` tree (vLLM's module names and
Hugging Face's alike), so the CPU tests run it on a tiny model. The hooks
at the bottom import vLLM when called: the recipe runs at the end of vLLM's
dummy load (before tunekit's fold reads the weights and before the CUDA
graphs are captured), or, where that loader cannot be wrapped, in place on
the started engine.

Call protocol::

    counts = realistic_init_(model, seed=0)   # {"linear": 14, "norm": 5, "embedding": 1, ...}
    describe(counts)                          # one line for the log

    why_not = weights_before_start(spec)      # the runner, before LLM(...): the load hook where the spec asks
    doc = weights_after_start(spec, llm, why_not)   # {"mode", "seed", "applied", "counts"} for the result
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass
from typing import Any

from tunekit.evidence.serve_bench import TABLE_ARMS

#: Norm classes whose gain is 1 + weight (besides any class with "Gemma" in its name): Qwen3-Next and Qwen3.5 in
#: Hugging Face. Their gated norms (``...RMSNormGated``) are plain.
ZERO_CENTRED_NORMS = frozenset({"Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5TextRMSNorm"})
#: Name fragments of the projections that write into the residual stream.
OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj")


@dataclass(frozen=True)
class Recipe:
    """The scales of :func:`realistic_init_` (module docstring)."""

    seed: int = 0
    linear_std: float = 0.02
    out_std: float = 0.02
    embed_std: float = 0.02
    bias_std: float = 0.02
    #: lognormal sigma of the ordinary gains around 1
    gain_sigma: float = 0.2
    #: share of a norm's channels with a gain of 10-30, and of those near 0
    outlier_share: float = 0.004
    dead_share: float = 0.02
    #: the logits' target spread over the vocabulary, in units of sqrt(2 ln V)
    logit_peak: float = 1.5


def _seed(seed: int, name: str) -> int:
    return (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFF_FFFF_FFFF


def _generator(torch: Any, device: Any, seed: int, name: str) -> Any:
    gen = torch.Generator(device=device)
    gen.manual_seed(_seed(seed, name))
    return gen


def gains(torch: Any, n: int, gen: Any, recipe: Recipe, device: Any = "cpu", outliers: bool = True) -> Any:
    """``n`` norm gains in fp32: lognormal around 1, ``outlier_share`` of them (at least one for n >= 64) at
    10-30 unless ``outliers`` is False, and ``dead_share`` at 0-0.05, on channels the generator picks."""
    g = torch.exp(torch.randn(n, generator=gen, device=device) * recipe.gain_sigma)
    order = torch.randperm(n, generator=gen, device=device)
    n_out = max(1 if n >= 64 else 0, round(n * recipe.outlier_share)) if outliers else 0
    n_dead = round(n * recipe.dead_share)
    if n_out:
        g[order[:n_out]] = 10.0 + 20.0 * torch.rand(n_out, generator=gen, device=device)
    if n_dead:
        g[order[n_out:n_out + n_dead]] = 0.05 * torch.rand(n_dead, generator=gen, device=device)
    return g


def _is_zero_centred(module: Any) -> bool:
    names = [c.__name__ for c in type(module).__mro__]
    if any("Gated" in n for n in names):
        return False
    return any("Gemma" in n and "Norm" in n for n in names) or any(n in ZERO_CENTRED_NORMS for n in names)


def _is_norm(module: Any) -> bool:
    return any("Norm" in c.__name__ for c in type(module).__mro__[:-1])


def param_kind(name: str, module: Any, param: Any) -> str:
    """What the recipe does with one parameter: ``embedding``, ``lm_head``, ``final_norm``, ``norm``,
    ``norm_bias``, ``linear``, ``output_linear``, ``bias``, ``a_log``, ``dt_bias``, ``conv``, or ``kept``."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return "a_log"
    if leaf == "dt_bias":
        return "dt_bias"
    if _is_norm(module):
        if leaf == "bias":
            return "norm_bias"
        if leaf != "weight":
            return "kept"
        parts = name.split(".")
        inner = any(p in ("layers", "blocks", "h", "visual", "vision_tower", "vision_model") for p in parts)
        return "final_norm" if len(parts) >= 2 and parts[-2] == "norm" and not inner else "norm"
    if "embed_tokens" in name or "wte" in name:
        return "embedding" if param.dim() == 2 else "kept"
    if "lm_head" in name:
        return "lm_head" if param.dim() == 2 else "kept"
    if "conv1d" in name and leaf == "weight":
        return "conv"
    if leaf == "bias" and param.dim() == 1:
        return "bias"
    if leaf == "weight" and param.dim() == 2:
        return "output_linear" if any(p in name for p in OUTPUT_PROJECTIONS) else "linear"
    return "kept"


def realistic_init_(model: Any, seed: int = 0, recipe: Recipe | None = None) -> dict[str, int]:
    """Re-initialise ``model``'s parameters in place with the recipe (module docstring); returns how many
    tensors of each kind were written (``kept``: left as they were). Shared tensors (a tied lm_head) are
    written once, under their first name."""
    import torch

    recipe = recipe or Recipe(seed=seed)
    modules = dict(model.named_modules())
    layers = {p for name, _ in model.named_parameters() for prev, p in zip(name.split("."), name.split(".")[1:],
                                                                           strict=False)
              if prev == "layers" and p.isdigit()}
    out_std = recipe.out_std / math.sqrt(2 * len(layers)) if layers else recipe.out_std
    counts: dict[str, int] = {}
    seen: set[int] = set()
    final: list[tuple[Any, Any]] = []
    lm_std = None
    vocab = None
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            key = id(param)
            if key in seen:
                continue
            seen.add(key)
            module = modules.get(name.rsplit(".", 1)[0] if "." in name else "", model)
            kind = param_kind(name, module, param)
            counts[kind] = counts.get(kind, 0) + 1
            if kind == "kept":
                continue
            gen = _generator(torch, param.device, recipe.seed, name)
            data = param.data
            if kind in ("linear", "output_linear", "embedding", "lm_head", "bias"):
                std = {"linear": recipe.linear_std, "output_linear": out_std, "embedding": recipe.embed_std,
                       "lm_head": recipe.embed_std, "bias": recipe.bias_std}[kind]
                _normal_(torch, data, std, gen)
                if kind in ("embedding", "lm_head"):
                    # the vocabulary and the logit scale: an lm_head (tied or not) is the last one met
                    vocab, lm_std = data.shape[0], std
            elif kind == "conv":
                _normal_(torch, data, 1.0 / math.sqrt(max(1, data.shape[-1])), gen)
            elif kind == "a_log":
                data.copy_(torch.rand(data.shape, generator=gen, device=data.device) * math.log(16.0))
            elif kind == "dt_bias":
                dt = torch.exp(torch.rand(data.shape, generator=gen, device=data.device)
                               * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                data.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif kind == "norm_bias":
                data.zero_()
            else:  # norm, final_norm
                # the final norm without outliers: a channel 20x the others would make one direction of the
                # hidden state decide every logit, and the greedy token would never change
                g = gains(torch, data.numel(), gen, recipe, data.device, outliers=kind == "norm").reshape(data.shape)
                if kind == "final_norm":
                    final.append((module, g))
                    continue
                data.copy_(g - 1.0 if _is_zero_centred(module) else g)
        for module, g in final:
            param = dict(module.named_parameters())["weight"]
            if vocab and lm_std:
                # logit std ~ lm_std x |g * x/rms(x)| ~ lm_std x sqrt(sum g^2): scaled to the target spread
                target = recipe.logit_peak * math.sqrt(2.0 * math.log(vocab))
                g = g * (target / (lm_std * float(torch.sqrt((g.float() ** 2).sum()))))
            param.data.copy_(g - 1.0 if _is_zero_centred(module) else g)
    return counts


#: Elements drawn at a time: a 248k x 5120 embedding drawn whole would take a 5 GB fp32 temporary during the load.
_CHUNK = 1 << 26


def _normal_(torch: Any, data: Any, std: float, gen: Any) -> None:
    # drawn in fp32 and rounded once, in blocks of rows (one generator drawn in order, a fixed block size: the
    # same values in every process)
    if not data.is_contiguous():
        data.copy_(torch.randn(data.shape, generator=gen, device=data.device, dtype=torch.float32) * std)
        return
    rows = data.view(data.shape[0], -1) if data.dim() > 1 else data.view(1, -1)
    step = max(1, _CHUNK // max(1, rows.shape[1]))
    for r in range(0, rows.shape[0], step):
        block = rows[r:r + step]
        block.copy_(torch.randn(block.shape, generator=gen, device=data.device, dtype=torch.float32) * std)


def describe(counts: dict[str, int]) -> str:
    """``counts`` as one line: ``linear 448, norm 129, ...``."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------
# In vLLM (imported lazily: the recipe above needs none of it)
# ---------------------------------------------------------------------------

#: What the last hook did in this process: {"applied": "at load" | "after engine start", "counts": {...}}.
APPLIED: dict[str, Any] = {}


def install_load_hook(seed: int = 0) -> str | None:
    """Make vLLM's dummy loader end with the recipe: ``DummyModelLoader.load_weights`` fills the weights,
    then :func:`realistic_init_` rewrites them, inside ``BaseModelLoader.load_model`` and so before
    anything that reads them (tunekit's load-time fold and merge, vLLM's weight post-processing, the
    compile and the CUDA graph capture). Needs the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    None, or why not (then :func:`apply_after_start`)."""
    try:
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    except ImportError as exc:
        return f"no DummyModelLoader in this vLLM ({exc})"
    load_weights = getattr(DummyModelLoader, "load_weights", None)
    if load_weights is None:
        return "this vLLM's DummyModelLoader has no load_weights"
    if getattr(load_weights, "_tunekit_realistic", False):
        return None

    def load_then_init(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        out = load_weights(self, model, *args, **kwargs)
        APPLIED.update({"applied": "at load", "counts": realistic_init_(model, seed)})
        return out

    load_then_init._tunekit_realistic = True  # type: ignore[attr-defined]
    DummyModelLoader.load_weights = load_then_init
    return None


def apply_after_start(llm: Any, seed: int = 0) -> dict[str, int]:
    """The recipe on a started engine's model, in place (the fallback of :func:`install_load_hook`).

    vLLM captured its CUDA graphs at engine start with the weights' addresses; writing into the same
    tensors (``copy_`` of fresh values) keeps every address, so the graphs stay valid and replay the new
    values. Anything computed from the weights at load (tunekit's folded norms: W diag(g)) is not redone:
    an arm whose plugin folds must not use this (:func:`weights_before_start` refuses it). The model is
    reached by ``LLM.apply_model`` where this vLLM has it, else by ``LLM.collective_rpc`` with a function
    of the worker (its model runner's model)."""
    def init_worker(worker: Any) -> dict[str, int]:
        runner = getattr(worker, "worker", worker).model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return realistic_init_(model, seed)

    apply = getattr(llm, "apply_model", None)
    if apply is not None:
        counts = apply(lambda model: realistic_init_(model, seed))[0]
    else:
        counts = llm.collective_rpc(init_worker)[0]
    APPLIED.update({"applied": "after engine start", "counts": counts})
    return counts


def weights_before_start(spec: dict[str, Any]) -> str | None:
    """``--weights realistic``: the recipe at the end of the dummy load, before the plugin's load-time steps and
    the graph capture (``weights.install_load_hook``); None, or why not (then after the start)."""
    if spec.get("weights", "dummy") != "realistic":
        return None
    why = install_load_hook(int(spec.get("weights_seed", 0)))
    # the plugin's fold (on unless TUNEKIT_FOLD_NORMS is 0) reads the weights at load: they must be final by then
    folds = spec["arm"] in TABLE_ARMS and os.environ.get("TUNEKIT_FOLD_NORMS", "1").strip().lower() not in ("0",
                                                                                                          "false")
    if why is not None and folds:
        raise RuntimeError(f"--weights realistic where the plugin folds norms at load needs the recipe at load: {why}")
    return why


def weights_after_start(spec: dict[str, Any], llm: Any, why_not: str | None) -> dict[str, Any]:
    """What the engine's weights are: ``{"mode": "dummy" | "realistic" | "checkpoint", ...}``."""
    mode = spec.get("weights", "dummy")
    doc: dict[str, Any] = {"mode": mode}
    if mode == "realistic":
        if why_not is not None:
            apply_after_start(llm, int(spec.get("weights_seed", 0)))
            doc["load_hook"] = why_not
        doc.update({"seed": int(spec.get("weights_seed", 0)), **APPLIED})
        if "counts" not in doc:
            raise RuntimeError("--weights realistic: the dummy loader never ran the recipe")
    return doc
