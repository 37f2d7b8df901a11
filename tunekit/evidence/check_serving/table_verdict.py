"""``tunekit verdict``: a table judged on the user's own checkpoint at every M it serves, through ``tunekit.patch``.

The checkpoint (a Hugging Face folder with its tokenizer) decodes its greedy tokens unpatched over built-in prompts
of four kinds (the reference), then the same positions teacher-forced with the tables served
(``forced_hf``): one request at a time (M = 1), as batches of each tabulated M from 2 to 16 (M = B), and fed
``widths`` forced tokens per forward (M = width, a speculative verify step). Each M is judged against the
reference by ``tunekit.evidence.verdict`` with the caps of the model's dtype; vanilla run the same way is part of
its spread. What served each M is counted from the dispatch markers, and a run where the tables served nothing
is an error, never a pass.

Call protocol::

    doc = run(Settings(model_dir=Path("ckpt"), tables=["table.json"]), log=print)   # doc["verdict"]: pass/fail/...
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunekit.errors import UserError

#: two prompts of each kind: prose, code, numbers, a list (cut to one length for batched decode)
PROMPTS = ("The capital of France is a city that", "Water boils at a temperature of one hundred",
           "def fibonacci(n):\n    if n < 2:\n        return", "for i in range(10):\n    total +=",
           "2, 3, 5, 7, 11, 13, 17, 19, 23,", "In 1969 the first people walked on the",
           "Ingredients: two eggs, flour, sugar, butter and", "The three primary colours are red,")
#: the most requests one run decodes (the least common multiple of the batch sizes)
MAX_REQUESTS = 48
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class Settings:
    model_dir: Path
    tables: Sequence[str]
    #: the dtype the checkpoint is loaded in; None: as saved. The tables serve only entries of this dtype.
    dtype: str | None = None
    steps: int = 6
    topk: int = 20
    #: speculative verify widths (1 + k draft tokens)
    widths: tuple[int, ...] = (4,)
    fold_norms: bool = True
    #: batch sizes; None: the tables' tabulated Ms from 2 to 16
    batches: tuple[int, ...] | None = field(default=None)
    #: how many of the built-in prompts (1 .. 8); the requests are the least multiple of every batch size
    #: at or above it, the prompts repeated where they are fewer
    prompts: int = len(PROMPTS)


def tabulated_ms(tables: Sequence[str]) -> list[int]:
    """The Ms the tables' entries are tabulated at."""
    from tunekit import table as table_mod

    return sorted({e.m for path in tables for e in table_mod.entries(table_mod.load(path))})


def validate(s: Settings) -> tuple[int, ...]:
    """The batch sizes the run decodes at; every bad input one ``UserError``."""
    if not (s.model_dir / "config.json").is_file():
        raise UserError(f"--model-dir {s.model_dir}: no config.json (a Hugging Face checkpoint folder)")
    if not s.tables:
        raise UserError("give at least one --table")
    if s.dtype is not None and s.dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, not {s.dtype!r}")
    if not 1 <= s.prompts <= len(PROMPTS):
        raise UserError(f"--prompts must be 1..{len(PROMPTS)}, got {s.prompts}")
    if s.steps < 2:
        raise UserError(f"--steps must be at least 2 (position 0 is the prefill's), got {s.steps}")
    if any(w < 2 or w > 16 for w in s.widths):
        raise UserError(f"--widths must be 2..16 (1 + k draft tokens), got {list(s.widths)}")
    batches = s.batches if s.batches is not None else tuple(m for m in tabulated_ms(s.tables) if 2 <= m <= 16)
    if any(b < 2 for b in batches):
        raise UserError(f"--batches must be 2 or more (M = 1 is always judged), got {list(batches)}")
    if batches and math.lcm(*batches) > MAX_REQUESTS:
        raise UserError(f"batch sizes {list(batches)} need {math.lcm(*batches)} requests (at most {MAX_REQUESTS})")
    return tuple(batches)


def _served(rows: list[dict[str, Any]]) -> dict[int, dict[str, int]]:
    """M -> impl -> calls, from the dispatch markers."""
    out: dict[int, dict[str, int]] = {}
    for r in rows:
        per = out.setdefault(int(r["m"]), {})
        per[r["impl"]] = per.get(r["impl"], 0) + int(r["calls"])
    return out


def run(s: Settings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Judge ``s.tables`` on ``s.model_dir`` at M = 1, each batch size and each verify width (module docstring)."""
    batches = validate(s)
    from tunekit.evidence.check_serving import hf_decode

    hf_decode.require_transformers()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tunekit
    from tunekit import ops
    from tunekit.evidence.check_serving import forced_hf

    kwargs = {"dtype": getattr(torch, DTYPES[s.dtype])} if s.dtype else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(s.model_dir)
        model = AutoModelForCausalLM.from_pretrained(s.model_dir, **kwargs).eval()
    except (OSError, ValueError) as exc:
        raise UserError(f"--model-dir {s.model_dir}: {exc}") from None
    dtype = forced_hf.model_dtype(model)
    whole = math.lcm(*batches) if batches else 1  # every batch size divides the requests
    count = whole * -(-s.prompts // whole)
    prompts = forced_hf.same_length([tokenizer(p)["input_ids"] for p in PROMPTS[:s.prompts]], count)
    log(f"verdict: {s.model_dir} in {dtype}, {len(prompts)} prompts x {s.steps} positions; M = 1, "
        f"batches {list(batches) or 'none'}, verify widths {list(s.widths) or 'none'}")
    ref = forced_hf.decode_record(model, prompts, s.steps, s.topk)
    forced = forced_hf.forced_of(ref)
    spread = forced_hf.prefill_record(model, prompts, forced, s.topk)
    vanilla = forced_hf.every_m(model, prompts, forced, s.topk, batches, s.widths)
    ops.reset_stats()
    tunekit.patch(model, table=list(s.tables), fold_norms=s.fold_norms)
    try:
        at_1 = forced_hf.decode_record(model, prompts, s.steps, s.topk, forced=forced)
        served_1 = _served(ops.dispatch_stats())
        arms = forced_hf.every_m(model, prompts, forced, s.topk, batches, s.widths)
        served = _served(ops.dispatch_stats())
    finally:
        tunekit.unpatch(model)
    if not any(impl.startswith("tuned:") for per in served.values() for impl in per):
        raise UserError(f"the tables served no call of this model in {dtype}: nothing to judge (are they tuned "
                        "for its shapes and dtype, on this device?)")
    labels = ["M=1 (decode)", *arms]
    doc = forced_hf.per_m(ref, {"M=1 (decode)": at_1, **arms}, vanilla, [spread], dtype=dtype)
    doc["served"] = {str(m): per for m, per in sorted(served.items())}
    doc["served_at_1"] = {str(m): per for m, per in sorted(served_1.items())}
    for label in labels:
        d = doc[label]
        m = int(label.split("=", 1)[1].split()[0])
        tuned = sum(c for impl, c in served.get(m, {}).items() if impl.startswith("tuned:"))
        log(f"  {label:<18} {d['verdict']:<12} max |dlogprob| {d['max_abs_logprob_diff']:.3g} nats, KL "
            f"{d['kl_max']:.3g}; {tuned} tuned calls at M={m}" + (f"  ({d['why']})" if d.get("why") else ""))
    log(f"verdict: {doc['verdict']}" + (f" at {', '.join(doc['failed_at'])}" if doc["failed_at"] else ""))
    return doc
