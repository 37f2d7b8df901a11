"""Speculative decoding in serve-bench: the ``--speculative`` values, vLLM's engine argument for them, and the
figures a spec-decode run reports (acceptance from vLLM's own counters, the verify steps' M, dispatch coverage
at those M, the tables' prediction at those M).

A verify step runs the target model on each sequence's last token plus its k draft tokens, so every linear
sees M = sum over the step's sequences of (1 + drafts): B(1 + k) when every sequence has k drafts. That is
the GEMV shape the tables must cover; it is recorded two ways:

* per step, in the runner (:class:`StepShapes`): the engine core's scheduler output (``total_num_scheduled_tokens``,
  the M before any CUDA-graph padding), as a histogram over the steps without a new request (decode and verify
  steps; a step that admits a request prefills);
* per call, in the arms that load the plugin: the dispatch markers' M (:func:`verify_coverage`), which is the M
  the GEMV ran at (after padding to a captured size) and whether a table entry served it.

Acceptance comes from vLLM's metrics (``LLM.get_metrics()``, which needs ``disable_log_stats=False``; the
engine argument :meth:`engine_args` sets it): the counters ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens`` and the vector ``..._num_accepted_tokens_per_pos``
(vLLM 0.33's ``vllm/v1/spec_decode/metrics.py``; a ``_total`` suffix is accepted too). Acceptance rate =
accepted / draft tokens; mean accepted length = 1 + accepted / drafts (vLLM's own definition: the verified
token counts).

Standard library only: the runner imports it before vLLM, the parent without torch.

Call protocol::

    values = parse_speculative(["ngram:3,ngram:5"])       # ("ngram:3", "ngram:5"); UserError otherwise
    engine_args("ngram:3")                                # {"speculative_config": {...}, "disable_log_stats": False}
    before = counters(llm.get_metrics())                  # in the runner, around a batch size's generates
    with StepShapes(llm) as shapes: ...
    row = {"counters": delta(before, counters(llm.get_metrics())), "steps": shapes.record()}
    arm_figures(rows)                                     # the parent: acceptance and M histogram of an arm
    step_prediction(arm_figures(vanilla_rows), tpot_ms, saving_at)  # the tables' prediction at those M
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tunekit.errors import UserError
from tunekit.evidence.serve_bench.tpot import InstanceHook

#: The methods ``--speculative`` takes: n-gram lookup needs no draft model, so dummy weights serve.
METHODS = ("ngram",)
#: k draft tokens: 1..15 (the verify step then runs M = 1 + k <= 16 per sequence; Settings.max_model_len keeps a
#: margin of 16 tokens past the longest output, which holds the k drafts of the last step)
MAX_K = 15
#: The n-gram proposer's window: the last 2..4 tokens are looked up in the sequence so far. vLLM's default is
#: 5..5; a shorter window finds a match sooner after a token that breaks the prompt's pattern.
LOOKUP_MIN, LOOKUP_MAX = 2, 4
_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
             "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def parse_one(value: str) -> tuple[str, int]:
    """``"ngram:3"`` -> ("ngram", 3); UserError (one line) for an unknown method or k outside 1..MAX_K."""
    method, sep, k_text = value.strip().partition(":")
    if method not in METHODS:
        raise UserError(f"--speculative {value!r}: unknown method {method!r} (known: {', '.join(METHODS)}; "
                        "written METHOD:K, e.g. ngram:3)")
    try:
        k = int(k_text) if sep else 0
    except ValueError:
        k = 0
    if not 1 <= k <= MAX_K:
        raise UserError(f"--speculative {value!r}: k (draft tokens) must be an integer 1..{MAX_K}, e.g. ngram:3")
    return method, k


def parse_speculative(values: Iterable[str]) -> tuple[str, ...]:
    """Repeated options and comma lists -> distinct canonical values (``"ngram:3"``), in the order given."""
    out: list[str] = []
    for text in values:
        for part in text.split(","):
            if not part.strip():
                continue
            method, k = parse_one(part)
            canon = f"{method}:{k}"
            if canon in out:
                raise UserError(f"--speculative names {canon} twice")
            out.append(canon)
    return tuple(out)


def draft_tokens(value: str) -> int:
    return parse_one(value)[1]


def folder(value: str) -> str:
    """The sub-folder of a serve-bench run that holds one speculative setting's run (``ngram-3``)."""
    method, k = parse_one(value)
    return f"{method}-{k}"


def engine_args(value: str | None) -> dict[str, Any]:
    """The ``LLM(**kwargs)`` additions for ``value`` (none for None): ``speculative_config`` with only the
    fields vLLM 0.26 and 0.33 both take, and the stats logging ``LLM.get_metrics()`` needs (both arms alike)."""
    if value is None:
        return {}
    method, k = parse_one(value)
    return {"speculative_config": {"method": method, "num_speculative_tokens": k,
                                   "prompt_lookup_max": LOOKUP_MAX, "prompt_lookup_min": LOOKUP_MIN},
            "disable_log_stats": False}


# ---------------------------------------------------------------------------
# The runner's side: vLLM's counters and the scheduler's steps
# ---------------------------------------------------------------------------


def _name(metric: Any) -> str:
    name = str(getattr(metric, "name", ""))
    return name[: -len("_total")] if name.endswith("_total") else name


def counters(metrics: Iterable[Any] | None) -> dict[str, Any]:
    """vLLM's spec-decode counters from ``LLM.get_metrics()`` (``Counter``: ``name``, ``value``; ``Vector``:
    ``values``), summed over their labels (one engine per label set): ``{"drafts", "draft_tokens",
    "accepted_tokens", "accepted_per_pos"}``, None for a counter this vLLM did not report."""
    out: dict[str, Any] = {key: None for key in _COUNTERS}
    out["accepted_per_pos"] = None
    wanted = {name: key for key, name in _COUNTERS.items()}
    for metric in metrics or ():
        name = _name(metric)
        if name in wanted:
            key = wanted[name]
            out[key] = (out[key] or 0) + int(getattr(metric, "value", 0) or 0)
        elif name == _PER_POS:
            values = [int(v) for v in getattr(metric, "values", None) or []]
            prev = out["accepted_per_pos"] or []
            width = max(len(prev), len(values))
            out["accepted_per_pos"] = [(prev[i] if i < len(prev) else 0) + (values[i] if i < len(values) else 0)
                                       for i in range(width)]
    return out


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``after - before`` per counter (the counters are the engine's totals since it started); None where
    either side lacks it."""
    out: dict[str, Any] = {}
    for key in (*_COUNTERS, "accepted_per_pos"):
        a, b = after.get(key), before.get(key)
        if a is None or b is None:
            out[key] = None
        elif key == "accepted_per_pos":
            out[key] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        else:
            out[key] = a - b
    return out


def acceptance(c: dict[str, Any]) -> dict[str, Any]:
    """Acceptance rate (accepted / draft tokens), mean accepted length (1 + accepted / drafts) and the
    acceptance per draft position (accepted there / drafts); None where the counters cannot give it."""
    drafts, proposed, accepted = c.get("drafts"), c.get("draft_tokens"), c.get("accepted_tokens")
    per_pos = c.get("accepted_per_pos")
    return {"acceptance_rate": accepted / proposed if proposed and accepted is not None else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts and accepted is not None else None,
            "per_position": [p / drafts for p in per_pos] if drafts and per_pos else None}


class StepShapes(InstanceHook):
    """The M of every engine step during a block (module docstring): wraps the in-process scheduler's
    ``schedule`` on the instance (``llm.llm_engine.engine_core.engine_core.scheduler``, present when the engine
    core runs in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and restores it on exit. Where this vLLM
    has no such scheduler it records nothing (``record()`` -> None)."""

    METHOD = "schedule"

    def __init__(self, llm: Any) -> None:
        core = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
        super().__init__(getattr(core, "scheduler", None))
        self.decode: dict[int, int] = {}
        self.prefill_steps = 0
        self.spec_tokens = 0

    def _wrapped(self, *args: Any, **kwargs: Any) -> Any:
        out = self._orig(*args, **kwargs)
        m = int(getattr(out, "total_num_scheduled_tokens", 0) or 0)
        if m:
            if getattr(out, "scheduled_new_reqs", None):
                self.prefill_steps += 1
            else:
                self.decode[m] = self.decode.get(m, 0) + 1
                spec = getattr(out, "scheduled_spec_decode_tokens", None) or {}
                self.spec_tokens += sum(len(t) for t in spec.values())
        return out

    def record(self) -> dict[str, Any] | None:
        """``{"decode_m": {M: steps}, "prefill_steps", "spec_tokens"}`` (M as text: JSON keys)."""
        if self._orig is None:
            return None
        return {"decode_m": {str(m): n for m, n in sorted(self.decode.items())},
                "prefill_steps": self.prefill_steps, "spec_tokens": self.spec_tokens}


# ---------------------------------------------------------------------------
# The parent's side: an arm's figures, the coverage at the verify steps' M
# ---------------------------------------------------------------------------


def arm_figures(rows: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One arm at one batch size over its processes (each a runner row's ``spec_decode``): the counters
    summed, the acceptance from the sums, each process's acceptance rate, and the decode steps' M histogram
    summed with its mean M. None when no process recorded any."""
    rows = [r for r in rows if r]
    if not rows:
        return None
    total: dict[str, Any] = {}
    for key in (*_COUNTERS, "accepted_per_pos"):
        values = [r["counters"].get(key) for r in rows if r.get("counters")]
        if not values or any(v is None for v in values):
            total[key] = None
        elif key == "accepted_per_pos":
            width = max(len(v) for v in values)
            total[key] = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        else:
            total[key] = sum(values)
    hist: dict[int, int] = {}
    for r in rows:
        for m, n in ((r.get("steps") or {}).get("decode_m") or {}).items():
            hist[int(m)] = hist.get(int(m), 0) + int(n)
    steps = sum(hist.values())
    out = {"counters": total, **acceptance(total),
           "per_process_acceptance": [acceptance(r.get("counters") or {})["acceptance_rate"] for r in rows],
           "decode_m": {str(m): n for m, n in sorted(hist.items())},
           "mean_m": sum(m * n for m, n in hist.items()) / steps if steps else None, "decode_steps": steps,
           "errors": sorted({r["error"] for r in rows if r.get("error")})}
    return out


def verify_bound(batches: Sequence[int], value: str) -> int:
    """The largest M a verify step can run: every sequence of the largest batch with its k drafts."""
    return max(batches) * (1 + draft_tokens(value))


def verify_coverage(coverage: dict[str, Any] | None, bound: int) -> dict[str, Any] | None:
    """Calls per M up to ``bound`` from an arm's merged dispatch markers (``analysis.merge_dispatch``), tuned
    and fallback, summed over ops: ``{"by_m": {M: {"tuned", "fallback", "ops": {op: {impl: calls}}}},
    "tuned_calls", "fallback_calls"}``. Markers carry no step, so this is over every batch size of the run."""
    if coverage is None:
        return None
    by_m: dict[int, dict[str, Any]] = {}
    for r in coverage.get("rows", []):
        m = int(r["m"])
        if m > bound:
            continue
        cell = by_m.setdefault(m, {"tuned": 0, "fallback": 0, "ops": {}})
        kind = "tuned" if str(r["impl"]).startswith("tuned:") else "fallback"
        cell[kind] += int(r["calls"])
        ops = cell["ops"].setdefault(r["op"], {})
        ops[r["impl"]] = ops.get(r["impl"], 0) + int(r["calls"])
    return {"by_m": {str(m): by_m[m] for m in sorted(by_m)},
            "tuned_calls": sum(c["tuned"] for c in by_m.values()),
            "fallback_calls": sum(c["fallback"] for c in by_m.values())}


def step_prediction(figures: dict[str, Any] | None, tpot_ms: float | None,
                    saving_at: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """The tables' prediction for decode steps that run at the verify steps' M, not at M = B.

    ``figures``: vanilla's :func:`arm_figures` at one batch size; ``tpot_ms``: vanilla's TPOT there (per
    output token); ``saving_at(M)``: ``analysis.predicted_saving_us`` at M (the saving of one forward at M,
    in us). With p(M) = the share of vanilla's decode steps that ran at M (its ``decode_m`` histogram) and
    L = its mean accepted length (the tokens one step yields per sequence):

    * saving per step S = sum over M of p(M) x saving_at(M);
    * vanilla's time per decode step T = TPOT x L (a step yields L tokens of every sequence);
    * ``predicted_speedup`` = T / (T - S), the same as TPOT / (TPOT - S / L);
      ``predicted_saving_ms`` = S / L, per output token like the measured saving it is checked against.

    L is vLLM's ``1 + accepted / drafts``: a sequence that drafted nothing in a step yields one token, which L
    does not count. Without vanilla's histogram or L: ``unavailable`` says why and no figure is given (never
    the prediction at M = B, which these steps do not run)."""
    hist = {int(m): int(n) for m, n in ((figures or {}).get("decode_m") or {}).items() if int(n) > 0}
    length = (figures or {}).get("mean_accepted_length")
    out: dict[str, Any] = {"unavailable": None, "predicted_saving_ms": None, "predicted_step_saving_ms": None,
                           "vanilla_step_ms": None, "tokens_per_step": length, "predicted_speedup": None,
                           "predicted_served_calls": None, "predicted_calls": None, "by_op": {}, "by_m": {}}
    if not hist:
        out["unavailable"] = "vanilla recorded no decode steps' M (no in-process scheduler, or no vanilla arm)"
        return out
    if not length:
        out["unavailable"] = "vanilla's spec-decode counters give no mean accepted length (tokens per step)"
        return out
    steps = sum(hist.values())
    step_us = served = calls = 0.0
    for m, n in sorted(hist.items()):
        pred = saving_at(m)
        share = n / steps
        step_us += share * pred["saving_us"]
        served += share * pred["served_calls"]
        calls += share * pred["calls"]
        for op, us in pred["by_op"].items():
            out["by_op"][op] = out["by_op"].get(op, 0.0) + share * us
        out["by_m"][str(m)] = {"steps": n, "saving_us": pred["saving_us"], "served_calls": pred["served_calls"]}
    out.update(predicted_step_saving_ms=step_us / 1000.0, predicted_saving_ms=step_us / 1000.0 / length,
               predicted_served_calls=round(served, 2), predicted_calls=round(calls, 2))
    if tpot_ms:
        step_ms = tpot_ms * length
        out["vanilla_step_ms"] = step_ms
        if step_ms > out["predicted_step_saving_ms"]:
            out["predicted_speedup"] = step_ms / (step_ms - out["predicted_step_saving_ms"])
    return out


#: tuned and vanilla acceptance rates further apart than this make their TPOTs compare different work
ACCEPTANCE_GAP = 0.02


def acceptance_note(batch: int, figures: dict[str, dict[str, Any] | None]) -> str | None:
    """The report's note where an arm's acceptance rate differs from vanilla's by more than ACCEPTANCE_GAP."""
    base = (figures.get("vanilla") or {}).get("acceptance_rate")
    if base is None:
        return None
    off = [f"{arm} {f['acceptance_rate']:.3f}" for arm, f in figures.items()
           if arm != "vanilla" and f and f.get("acceptance_rate") is not None
           and abs(f["acceptance_rate"] - base) > ACCEPTANCE_GAP]
    if not off:
        return None
    return (f"B={batch}: acceptance rate differs from vanilla's {base:.3f} ({', '.join(off)}): the arms verified "
            "different numbers of tokens per step, so their TPOTs compare different work")
