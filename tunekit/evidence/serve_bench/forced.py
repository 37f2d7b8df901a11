"""Teacher-forced decoding through vLLM's public ``generate``: every arm decodes vanilla #0's tokens.

A free-running comparison stops meaning anything at the first token two
arms choose differently: after it their contexts differ. Here every arm
gets the same contexts, the prompt followed by the forced tokens (vanilla
#0's greedy tokens, passed in the spec by the parent), and keeps the top-K
logprobs of every position (``tunekit.evidence.serve_bench.agreement``
compares them).

No logits processor forces the tokens (a custom one changes the engine
under test, and its interface differs between vLLM releases): each request
decodes greedily while its tokens equal the forced ones; where one
differs, that position is kept (its context was still the forced one) and
the request starts again from the prompt plus the forced tokens up to and
including it. So every position is decoded in the batch's decode steps
except the first of each start, which comes from a prefill (as the first
token of any request does); ``prefill_steps`` lists them. A run that agrees
needs one round; each round is one ``generate`` of the whole batch (the
requests not compared, and those done, run again as filler so that every
decode step keeps the batch's size).

Where no forced tokens are given (vanilla #0), a request's own greedy
tokens of its first round become its forced tokens, and the caller keeps
them for the same request at the next batch sizes (request r has the same
prompt at every batch size).

Call protocol::

    rec = teacher_forced(generate, sampling, prompts, requests=8, steps=8, topk=20, forced=None)
    # generate(list of token-id prompts, list of sampling params) -> vLLM RequestOutputs, in order
    # sampling(max_tokens, logprobs or None) -> SamplingParams
    rec["requests"][r]["forced"], rec["requests"][r]["top"][s]   # [[token id, logprob], ...] best first
    row["forced"] = forced_row(llm, sampling, TokensPrompt, ids, spec, batch, known)   # the runner's call
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def _top(step: Any) -> list[list[Any]]:
    """One position's logprobs as [[token id, logprob], ...], best first (any container vLLM uses)."""
    if step is None:
        return []
    items = step.items() if hasattr(step, "items") else step
    pairs = [[int(tid), float(getattr(lp, "logprob", lp))] for tid, lp in items]
    return sorted(pairs, key=lambda p: -p[1])


def teacher_forced(generate: Callable[[list[list[int]], list[Any]], list[Any]],
                   sampling: Callable[[int, int | None], Any], prompts: Sequence[Sequence[int]], requests: int,
                   steps: int, topk: int, forced: Sequence[Sequence[int] | None] | None = None,
                   forced_from: str = "spec") -> dict[str, Any]:
    """Decode the first ``requests`` prompts teacher-forced for ``steps`` positions (module docstring);
    ``forced[r]``: request r's tokens (None: its own greedy tokens of the first round)."""
    n = min(requests, len(prompts))
    given = list(forced or [])
    tokens: list[list[int] | None] = [list(given[r]) if r < len(given) and given[r] else None for r in range(n)]
    origin = [forced_from if tokens[r] is not None else "self" for r in range(n)]
    tops: list[list[list[list[Any]]]] = [[[] for _ in range(steps)] for _ in range(n)]
    prefill: list[list[int]] = [[] for _ in range(n)]
    start = [0] * n
    rounds = 0
    while rounds <= steps and any(s < steps for s in start):
        ids, params, active = [], [], []
        for r, prompt in enumerate(prompts):
            if r < n and start[r] < steps:
                ctx = list(prompt) + list((tokens[r] or [])[:start[r]])
                ids.append(ctx)
                params.append(sampling(steps - start[r], topk))
                active.append(r)
                prefill[r].append(start[r])
            else:
                ids.append(list(prompt))
                params.append(sampling(steps, None))
        outs = generate(ids, params)
        rounds += 1
        for r in active:
            comp = outs[r].outputs[0]
            got = [int(t) for t in comp.token_ids]
            if tokens[r] is None:
                tokens[r] = got[:steps]
            s0, start[r] = start[r], steps
            for j, (tid, step) in enumerate(zip(got, comp.logprobs or [], strict=False)):
                s = s0 + j
                if s >= steps or s >= len(tokens[r]):
                    break
                tops[r][s] = _top(step)[:max(topk, 1)]
                if tid != tokens[r][s]:
                    start[r] = s + 1  # this position's context was still the forced one; the next is not
                    break
    return {"steps": steps, "topk": topk, "rounds": rounds,
            "requests": [{"forced": tokens[r], "forced_from": origin[r], "top": tops[r],
                          "prefill_steps": prefill[r]} for r in range(n)]}


def forced_row(llm: Any, sampling: Any, tokens_prompt: Any, ids: list[list[int]], spec: dict[str, Any], batch: int,
                known: dict[int, list[int]]) -> dict[str, Any]:
    """The teacher-forced record at ``batch`` (``tunekit.evidence.serve_bench.forced``): forced with vanilla #0's
    tokens from the spec, else with the tokens a request got at an earlier batch size of this process, else with
    its own; ``known`` keeps them for the next batch sizes."""
    requests = min(batch, int(spec.get("agree_requests", 8)))
    given = (spec.get("forced") or {}).get(str(batch))
    forced = [given[r] if given and r < len(given) and given[r] else known.get(r) for r in range(requests)]

    def generate(prompts: list[list[int]], params: list[Any]) -> list[Any]:
        return llm.generate([tokens_prompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    rec = teacher_forced(generate, sampling, ids, requests, int(spec["agree_steps"]),
                         int(spec["logprobs"]), forced,
                         forced_from="vanilla-0" if given else "self")
    for r, req in enumerate(rec["requests"]):
        known.setdefault(r, req["forced"])
    return rec
