"""Teacher-forced agreement of a patched Hugging Face model with the same model unpatched: the Hugging Face half of
the one agreement verdict (``tunekit.evidence.verdict``; serve-bench's teacher-forced check is the vLLM half).

The records are serve-bench's (``serve_bench.forced``): per request the forced tokens and, per position, the
top-K ``[token id, logprob]`` best first. Position 0 is the prompt's last logits (a prefill, as a served first
token is); each later position is one decode step at M = 1 with the model's KV cache, its input the forced
token before it, so every position of every variant is the next-token distribution after the same context,
and the decode steps run the kernels a table serves at M = 1. The reference decodes greedily and its tokens
become the forced ones.

The spread, in the same run: the reference's own positions computed a second way, by one forward over the
prompt and the forced tokens (M = the sequence length: other GEMM shapes, another reduction order: what a
served request meets when its batch changes). On the CPU two runs of one path agree bit for bit, so this is
the spread that gives the run's rounding a scale; past a cap it makes the verdict inconclusive.

Call protocol::

    ref = decode_record(model, prompts, steps=8, topk=20)                 # unpatched: its greedy tokens forced
    spread = prefill_record(model, prompts, forced_of(ref), topk=20)      # the same positions at M = length
    tunekit.patch(model, table=...)
    arm = decode_record(model, prompts, 8, 20, forced=forced_of(ref))
    doc = agreement(ref, arm, [spread], dtype=model_dtype(model))        # {"verdict": "pass", ...}
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from tunekit.evidence.verdict import CAPS, Caps, caps_for, compare_requests, judge, near_tie_margin, summarize


def _top(logits: Any, topk: int) -> list[list[Any]]:
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = lp.topk(topk)
    return [[int(i), float(v)] for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def _device(model: Any) -> Any:
    """Where the model's weights are: the token ids go there (a model on a GPU takes no CPU indices)."""
    return next(model.parameters()).device


def _cache_kwarg(model: Any) -> str:
    """The name this transformers gives the KV cache argument (``cache`` in 5.x, ``past_key_values`` before)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out: Any) -> Any:
    return out["cache"] if "cache" in out else out["past_key_values"]


def decode_record(model: Any, prompts: Sequence[Sequence[int]], steps: int, topk: int,
                  forced: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """Each prompt prefilled, then ``steps - 1`` decode steps of one token (module docstring); ``forced[r]``:
    request r's tokens (None: its own greedy tokens, which the record keeps as its forced ones)."""
    import torch

    name = _cache_kwarg(model)
    requests = []
    with torch.no_grad():
        for r, prompt in enumerate(prompts):
            given = list(forced[r]) if forced is not None else None
            out = model(input_ids=torch.tensor([list(prompt)], device=_device(model)), use_cache=True)
            tops, tokens = [], []
            for s in range(steps):
                logits = out["logits"][0, -1]
                tops.append(_top(logits, topk))
                token = given[s] if given is not None else int(logits.argmax())
                tokens.append(token)
                if s + 1 < steps:
                    step = torch.tensor([[token]], device=_device(model))
                    out = model(input_ids=step, use_cache=True, **{name: _cache_of(out)})
            requests.append({"forced": tokens, "forced_from": "vanilla" if given is not None else "self",
                             "top": tops})
    return {"steps": steps, "topk": topk, "requests": requests}


def prefill_record(model: Any, prompts: Sequence[Sequence[int]], forced: Sequence[Sequence[int]],
                   topk: int) -> dict[str, Any]:
    """The same positions from one forward over prompt + forced tokens (M = the sequence's length)."""
    import torch

    requests = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, forced, strict=True):
            ids = list(prompt) + list(tokens[:-1])
            logits = model(input_ids=torch.tensor([ids], device=_device(model)), use_cache=False)["logits"][0]
            tops = [_top(logits[len(prompt) - 1 + s], topk) for s in range(len(tokens))]
            requests.append({"forced": list(tokens), "forced_from": "vanilla", "top": tops})
    return {"steps": len(forced[0]) if forced else 0, "topk": topk, "requests": requests}


def forced_of(record: dict[str, Any]) -> list[list[int]]:
    """The forced tokens of each request of a record."""
    return [list(r["forced"]) for r in record["requests"]]


def figures(reference: dict[str, Any], other: dict[str, Any], caps: Caps = CAPS) -> dict[str, Any] | None:
    """``verdict.summarize`` of ``other`` against ``reference``, request by request."""
    pairs = [compare_requests(a, b) for a, b in zip(reference["requests"], other["requests"], strict=True)]
    return summarize(pairs, near_tie_margin(caps))


def model_dtype(model: Any) -> str:
    """The dtype name ("bf16", "fp16", "fp32") the model's floating-point weights have: the caps it is judged by."""
    from tunekit.dispatch.state import DTYPE_NAMES

    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return DTYPE_NAMES.get(param.dtype, "bf16") if param is not None else "bf16"


def agreement(reference: dict[str, Any], arm: dict[str, Any], spread: Iterable[dict[str, Any]] = (),
              caps: Caps | None = None, dtype: str = "bf16") -> dict[str, Any]:
    """The arm's figures against the reference and ``verdict.judge``'s verdict (``caps``, else the caps of
    ``dtype``: ``verdict.caps_for``), with the spread's figures (each spread record against the reference) and
    the caps."""
    caps = caps or caps_for(dtype)
    spreads = [figures(reference, s, caps) for s in spread]
    arm_figures = figures(reference, arm, caps)
    judged = judge(arm_figures, spreads, caps)
    return {**(arm_figures or {}), **judged, "spread": spreads, "caps": caps.as_dict()}
