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

Every M a table serves (``every_m``): decode steps at M = 1 run the M = 1 entries only, while batch-B decode
serves the M = B entries and a speculative verify step runs 1 + k tokens of one sequence at once. So the same
positions are also decoded with B requests in one forward per step (``decode_record(..., batch=B)``: M = B
rows per GEMV; the requests of a batch need prompts of one length, ``same_length``) and fed ``width`` forced
tokens per forward (``verify_record``: M = width rows, as a verify step of k = width - 1 draft tokens). Each is
judged against the reference on its own (``per_m``), with vanilla run the same way as its spread: a defect
confined to one M fails there, named::

    prompts = same_length(prompts, 8)
    ref = decode_record(model, prompts, 6, 20); forced = forced_of(ref)
    vanilla = every_m(model, prompts, forced, 20, batches=(2, 4, 8), widths=(4,))
    tunekit.patch(model, table=...)
    arm = every_m(model, prompts, forced, 20, batches=(2, 4, 8), widths=(4,))
    doc = per_m(ref, arm, vanilla, [prefill_record(...)], dtype=...)   # {"M=2 (batch 2)": {...}, ..., "verdict"}
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
                  forced: Sequence[Sequence[int]] | None = None, batch: int = 1) -> dict[str, Any]:
    """Each prompt prefilled, then ``steps - 1`` decode steps of one token (module docstring); ``forced[r]``:
    request r's tokens (None: its own greedy tokens, which the record keeps as its forced ones). ``batch``: the
    requests taken ``batch`` at a time in order and decoded together, each step one forward of ``batch`` rows
    (M = batch); the prompts of a batch must have one length (``same_length``)."""
    import torch

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    name = _cache_kwarg(model)
    requests = []
    with torch.no_grad():
        for first in range(0, len(prompts), batch):
            group = [list(p) for p in prompts[first:first + batch]]
            if len({len(p) for p in group}) > 1:
                raise ValueError(f"the prompts of a batch need one length (same_length), got {[len(p) for p in group]}")
            given = [list(forced[r]) for r in range(first, first + len(group))] if forced is not None else None
            out = model(input_ids=torch.tensor(group, device=_device(model)), use_cache=True)
            tops: list[list[Any]] = [[] for _ in group]
            tokens: list[list[int]] = [[] for _ in group]
            for s in range(steps):
                for row in range(len(group)):
                    logits = out["logits"][row, -1]
                    tops[row].append(_top(logits, topk))
                    tokens[row].append(given[row][s] if given is not None else int(logits.argmax()))
                if s + 1 < steps:
                    step = torch.tensor([[t[s]] for t in tokens], device=_device(model))
                    out = model(input_ids=step, use_cache=True, **{name: _cache_of(out)})
            requests += [{"forced": tokens[row], "forced_from": "vanilla" if given is not None else "self",
                          "top": tops[row]} for row in range(len(group))]
    return {"steps": steps, "topk": topk, "requests": requests, "m": batch}


def verify_record(model: Any, prompts: Sequence[Sequence[int]], forced: Sequence[Sequence[int]], topk: int,
                  width: int) -> dict[str, Any]:
    """Each prompt prefilled (position 0), then its forced tokens fed ``width`` at a time with the KV cache, one
    forward of ``width`` rows each (M = width, as a speculative verify step of ``width - 1`` draft tokens runs),
    whose logits give the next ``width`` positions; the last forward takes what is left (fewer rows)."""
    import torch

    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    name = _cache_kwarg(model)
    requests = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, forced, strict=True):
            out = model(input_ids=torch.tensor([list(prompt)], device=_device(model)), use_cache=True)
            tops = [_top(out["logits"][0, -1], topk)]
            fed = 0
            while len(tops) < len(tokens):
                chunk = list(tokens[fed:min(fed + width, len(tokens) - 1)])
                out = model(input_ids=torch.tensor([chunk], device=_device(model)), use_cache=True,
                            **{name: _cache_of(out)})
                tops += [_top(out["logits"][0, i], topk) for i in range(len(chunk))]
                fed += len(chunk)
            requests.append({"forced": list(tokens), "forced_from": "vanilla", "top": tops})
    return {"steps": len(forced[0]) if forced else 0, "topk": topk, "requests": requests, "m": width}


def same_length(prompts: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """``count`` prompts of one length for batched decode: the given ones cut to the shortest's length (their
    last tokens dropped), taken in order and repeated where ``count`` exceeds them."""
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("same_length needs at least one non-empty prompt")
    shortest = min(len(p) for p in prompts)
    return [list(prompts[i % len(prompts)][:shortest]) for i in range(count)]


def every_m(model: Any, prompts: Sequence[Sequence[int]], forced: Sequence[Sequence[int]], topk: int,
            batches: Sequence[int] = (), widths: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
    """The forced positions at every M asked: ``"M=B (batch B)"`` per batch size (``decode_record`` with
    ``batch``; ``len(prompts)`` must be a multiple of each), ``"M=W (verify 1+k)"`` per width (``verify_record``);
    label -> record. Run on the patched model (the arm) and on the unpatched one (its spread, for :func:`per_m`)."""
    out = {}
    for b in batches:
        if len(prompts) % b:
            raise ValueError(f"{len(prompts)} prompts do not make whole batches of {b}")
        out[f"M={b} (batch {b})"] = decode_record(model, prompts, len(forced[0]), topk, forced=forced, batch=b)
    for w in widths:
        out[f"M={w} (verify 1+{w - 1})"] = verify_record(model, prompts, forced, topk, w)
    return out


def per_m(reference: dict[str, Any], arms: dict[str, dict[str, Any]], vanilla: dict[str, dict[str, Any]],
          spread: Iterable[dict[str, Any]] = (), caps: Caps | None = None, dtype: str = "bf16") -> dict[str, Any]:
    """Per label of ``arms`` (:func:`every_m`'s, and any other record of the same positions), the arm's record
    judged against ``reference`` (``agreement``), its spread ``spread`` plus vanilla run the same way where
    ``vanilla`` has the label (the rounding another M brings by itself); and ``"verdict"``, the worst of them
    (``verdict.overall``): a defect at one M fails the whole, and ``"failed_at"`` names where."""
    from tunekit.evidence.verdict import overall

    spread = list(spread)
    doc: dict[str, Any] = {label: agreement(reference, record, [*spread, *([vanilla[label]] if label in vanilla
                                                                          else [])], caps, dtype)
                           for label, record in arms.items()}
    doc["verdict"] = overall(d["verdict"] for d in list(doc.values()))
    doc["failed_at"] = [label for label, d in doc.items() if isinstance(d, dict) and d.get("verdict") == "fail"]
    return doc


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
