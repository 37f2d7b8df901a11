"""The serve A/B against running OpenAI-compatible servers (``vllm serve`` with and without a table).

    tunekit serve-bench --endpoint vanilla=http://h:8000 --endpoint tuned=http://h:8001 [--concurrency 1,4,8]

Per arm, concurrency C and round: C streaming ``/v1/completions`` requests
started together (token-id prompts: vLLM's completions API takes ``prompt``
as a list of ints; greedy, ``ignore_eos``, ``max_tokens``), each timed on
the client: TTFT = first streamed token - send; TPOT = (last token - first
token) / (tokens - 1), tokens from the final ``usage`` chunk when the server
sends one (``stream_options.include_usage``), else the streamed chunks.
Rounds alternate the arms (vanilla, passthrough, tuned, vanilla, ...) so a
drift of the machine charges every arm alike. A round's TPOT is the median
over its requests; an arm's, the median over rounds (min-max over rounds).

Standard library only (``urllib`` and threads): no HTTP client dependency.
Coverage and agreement are not measured here: the servers write their own
``TUNEKIT_DISPATCH_LOG`` at exit.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from tunekit.errors import UserError
from tunekit.evidence.serve_bench import ARMS, DEFAULT_ARMS
from tunekit.evidence.serve_bench.analysis import (
    FORMAT,
    coverage_at,
    load_json,
    merge_dispatch,
    merged_table,
    pair_ratios,
    predicted_saving_us,
)
from tunekit.evidence.serve_bench.provenance import git_commit
from tunekit.evidence.serve_bench.runner import make_prompts

#: The arms an endpoint run takes.
ENDPOINT_ARMS: tuple[str, ...] = DEFAULT_ARMS


def parse_endpoints(items: Sequence[str]) -> dict[str, str]:
    """``ARM=URL`` options -> {arm: base URL without a trailing ``/v1``}; vanilla and tuned required."""
    out: dict[str, str] = {}
    for item in items:
        arm, sep, url = item.partition("=")
        arm, url = arm.strip(), url.strip().rstrip("/")
        # the endpoint report compares vanilla, passthrough and tuned servers (a folded server is a tuned
        # one started with the fold on, the default: give it as tuned)
        if not sep or arm not in ENDPOINT_ARMS or not url.startswith(("http://", "https://")):
            raise UserError(f"--endpoint {item!r}: expected ARM=http://HOST:PORT with ARM one of "
                            f"{', '.join(ENDPOINT_ARMS)}")
        if arm in out:
            raise UserError(f"--endpoint {arm} given twice")
        out[arm] = url[: -len("/v1")] if url.endswith("/v1") else url
    missing = [a for a in ("vanilla", "tuned") if a not in out]
    if missing:
        raise UserError(f"--endpoint needs vanilla=URL and tuned=URL (missing: {', '.join(missing)})")
    return {a: out[a] for a in ENDPOINT_ARMS if a in out}


def served_model(base: str, timeout: float = 30.0) -> str:
    """The first model id the server lists (``GET /v1/models``): the ``model`` field of every request."""
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout) as resp:
            doc = json.loads(resp.read())
        return str(doc["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise UserError(f"{base}/v1/models: no model listed ({exc})") from None


def stream_completion(base: str, model: str, prompt: list[int], max_tokens: int,
                      timeout: float = 600.0) -> dict[str, Any]:
    """One streaming completion; client-side TTFT, TPOT and token count (``error`` set on failure)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    sent = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                doc = json.loads(data)
                if doc.get("usage"):
                    usage = doc["usage"]
                if doc.get("choices"):
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                    chunks += 1
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:300]
        return {"error": f"HTTP {exc.code}: {detail}"}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    n = int(usage.get("completion_tokens") or chunks) if usage else chunks
    if first is None:
        return {"error": "no token streamed"}
    return {"ttft_ms": (first - sent) * 1000.0, "latency_ms": (last - sent) * 1000.0, "tokens": n,
            "chunks": chunks, "tpot_ms": (last - first) / (n - 1) * 1000.0 if n > 1 else None}


def run_round(base: str, model: str, prompts: list[list[int]], max_tokens: int,
              timeout: float = 600.0) -> dict[str, Any]:
    """``len(prompts)`` requests started together (a barrier), one thread each."""
    results: list[dict[str, Any]] = [{} for _ in prompts]
    barrier = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        barrier.wait()
        results[i] = stream_completion(base, model, prompts[i], max_tokens, timeout)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    wall = time.perf_counter() - start
    errors = [r.get("error", "no answer") for r in results if "error" in r or not r]
    tpots = [r["tpot_ms"] for r in results if r.get("tpot_ms") is not None]
    tokens = sum(r.get("tokens", 0) for r in results)
    return {"concurrency": len(prompts), "requests": results, "wall_s": wall, "errors": errors,
            "tpot_ms_median": statistics.median(tpots) if tpots else None,
            "ttft_ms_median": statistics.median([r["ttft_ms"] for r in results if "ttft_ms" in r] or [0.0]),
            "throughput_tokens_per_s": tokens / wall if wall > 0 else None}


def run_endpoints(endpoints: dict[str, str], concurrency: Sequence[int], tokens: int = 128, prompt_len: int = 64,
                  repeats: int = 5, vocab_size: int = 10_100, timeout: float = 600.0,
                  log: Callable[[str], None] = print) -> dict[str, list[dict[str, Any]]]:
    """Warm every arm up once at the largest concurrency, then ``repeats`` rounds, arms alternated within
    each round and concurrency. Returns the rounds by arm."""
    if tokens < 2:
        raise UserError("--tokens must be at least 2 (TPOT needs a first and a last token)")
    models = {arm: served_model(base) for arm, base in endpoints.items()}
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in endpoints}
    top = max(concurrency)
    for arm, base in endpoints.items():
        warm = run_round(base, models[arm], make_prompts(top, prompt_len, vocab_size), tokens, timeout)
        if warm["errors"]:
            raise UserError(f"{arm} endpoint {base}: {warm['errors'][0]}")
        log(f"{arm} ({base}, model {models[arm]}): warmed up, TPOT {warm['tpot_ms_median']:.3f} ms at C={top}")
    for r in range(repeats):
        for c in concurrency:
            prompts = make_prompts(c, prompt_len, vocab_size)
            for arm, base in endpoints.items():
                res = run_round(base, models[arm], prompts, tokens, timeout)
                res.update({"round": r, "arm": arm, "model": models[arm]})
                if res["errors"]:
                    raise UserError(f"{arm} endpoint {base}, C={c}: {res['errors'][0]}")
                rounds[arm].append(res)
            log(f"round {r + 1}/{repeats} C={c}: " + ", ".join(
                f"{arm} {rounds[arm][-1]['tpot_ms_median']:.3f} ms" for arm in endpoints))
    return rounds


def _arm_figure(rounds: list[dict[str, Any]], c: int) -> dict[str, Any] | None:
    rows = [r for r in rounds if r["concurrency"] == c and r["tpot_ms_median"] is not None]
    if not rows:
        return None
    meds = [r["tpot_ms_median"] for r in rows]
    each = [q["tpot_ms"] for r in rows for q in r["requests"] if q.get("tpot_ms") is not None]
    med = statistics.median(meds)
    return {"median_ms": med, "min_ms": min(meds), "max_ms": max(meds), "repeat_min_ms": min(each),
            "repeat_max_ms": max(each), "per_process_ms": {str(r["round"]): r["tpot_ms_median"] for r in rows},
            "processes": len(rows), "tokens_per_s": c / (med / 1000.0) if med > 0 else None,
            "ttft_ms": statistics.median(r["ttft_ms_median"] for r in rows),
            "throughput_tokens_per_s": statistics.median(r["throughput_tokens_per_s"] for r in rows)}


def summarize_endpoints(rounds: dict[str, list[dict[str, Any]]], endpoints: dict[str, str],
                        settings: dict[str, Any], spec: Any | None = None,
                        tables: Sequence[tuple[str, dict[str, Any]]] = ()) -> dict[str, Any]:
    """``serve.json`` of the endpoint mode: the offline document's batch rows with C in place of B, plus
    TTFT and throughput; the prediction when a model and tables are given."""
    serving = merged_table(t for _, t in tables)
    batches = []
    for c in settings["concurrency"]:
        tpot = {arm: _arm_figure(rounds[arm], c) for arm in ARMS if arm in rounds}
        v, t, p = tpot.get("vanilla"), tpot.get("tuned"), tpot.get("passthrough")
        ratios, pratios = pair_ratios(v, t), pair_ratios(v, p)
        pred = predicted_saving_us(spec, serving, c) if spec is not None and tables else None
        vm = v["median_ms"] if v else None
        saving = pred["saving_us"] / 1000.0 if pred else None
        batches.append({
            "batch": c, "tpot": tpot,
            **{f"{arm}_tpot_ms": tpot[arm]["median_ms"] if tpot.get(arm) else None for arm in ARMS},
            "speedup": v["median_ms"] / t["median_ms"] if v and t else None,
            "speedup_min": min(ratios) if ratios else None, "speedup_max": max(ratios) if ratios else None,
            "passthrough_ratio": v["median_ms"] / p["median_ms"] if v and p else None,
            "passthrough_ratio_min": min(pratios) if pratios else None,
            "passthrough_ratio_max": max(pratios) if pratios else None,
            "predicted_saving_ms": saving,
            "predicted_served_calls": pred["served_calls"] if pred else None,
            "predicted_calls": pred["calls"] if pred else None,
            "predicted_speedup": vm / (vm - saving) if vm and saving is not None and vm > saving else None,
            "measured_saving_ms": vm - t["median_ms"] if v and t else None,
            "tokens_per_s": {arm: f["tokens_per_s"] for arm, f in tpot.items() if f},
            "ttft_ms": {arm: f["ttft_ms"] for arm, f in tpot.items() if f},
            "throughput_tokens_per_s": {arm: f["throughput_tokens_per_s"] for arm, f in tpot.items() if f},
            "coverage": None, "agreement": None,
        })
    return {"format": FORMAT, "mode": "endpoint", "model": settings.get("model"), "endpoints": endpoints,
            "served_model": {arm: rs[0]["model"] for arm, rs in rounds.items() if rs}, "device": None,
            "vllm": None, "torch": None, "tunekit_commit": settings.get("tunekit_commit"), "settings": settings,
            "tables": [p for p, _ in tables], "arms": rounds, "batches": batches,
            "notes": [NOTE_TPOT, NOTE_NO_COVERAGE]}


NOTE_TPOT = "endpoint mode: no logprob agreement here; TPOT is client-side, streaming chunks may group tokens"
NOTE_NO_COVERAGE = ("no dispatch coverage yet: each server writes its TUNEKIT_DISPATCH_LOG at exit; stop the "
                    "servers, then `tunekit serve-bench --report-only --out DIR` adds it (benchmarks/endpoint_ab.sh "
                    "does)")


def add_coverage(out_dir: Any, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Rebuild an endpoint folder's report with the dispatch coverage of the tuned server(s): the
    ``DIR/dispatch/tuned-*.json`` files the servers wrote at exit, merged, at M = C per concurrency
    (C concurrent requests decode at M <= C: the M = C rows are the full-batch steps)."""
    from pathlib import Path

    from tunekit.evidence.serve_bench.report import write_reports

    out = Path(out_dir)
    serve = load_json(out / "serve.json", "serve-bench endpoint report")
    logs = [load_json(p, "dispatch log") for p in sorted((out / "dispatch").glob("tuned-*.json"))]
    coverage = merge_dispatch(logs) if logs else None
    notes = [n for n in serve.get("notes", []) if n not in (NOTE_NO_COVERAGE,) and not n.startswith("dispatch log")]
    if coverage is None:
        notes.append(NOTE_NO_COVERAGE)
    elif not coverage["rows"]:
        notes.append(f"dispatch logs: {len(logs)} file(s), no call counted: the process that ran the model (vLLM's "
                     "engine core, a forked child) wrote none: it must stop through multiprocessing's exit path "
                     "(SIGINT to the server; a killed core writes nothing)")
    else:
        notes.append(f"dispatch logs: {len(logs)} file(s) of the tuned server merged; coverage at M = C")
    for row in serve["batches"]:
        row["coverage"] = {"tuned": coverage_at(coverage, int(row["batch"]))} if coverage and coverage["rows"] \
            else None
    serve["coverage"] = {"tuned": coverage} if coverage else {}
    serve["notes"] = notes
    doc, md, _ = write_reports(serve, out)
    log(f"{notes[-1]}; wrote {doc}, {md}")
    return serve


def run(endpoints: dict[str, str], out_dir: Any, concurrency: Sequence[int] = (1, 4, 8), tokens: int = 128,
        prompt_len: int = 64, repeats: int = 5, model: str | None = None, config: Any = None,
        tables: Sequence[Any] = (), timeout: float = 600.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The endpoint A/B end to end: checks, rounds, ``serve.json`` / ``serve.md`` / ``serve.png`` in ``out_dir``."""
    from pathlib import Path

    from tunekit import table as table_mod
    from tunekit.evidence.serve_bench.report import write_reports

    if not concurrency or any(c < 1 or c > 1024 for c in concurrency):
        raise UserError(f"--concurrency takes sizes 1..1024, got {list(concurrency)}")
    if repeats < 1 or prompt_len < 1:
        raise UserError("--repeats and --prompt-len must be at least 1")
    loaded = [(str(Path(t).resolve()), table_mod.load(t)) for t in tables]
    spec = None
    if model or config:
        from tunekit.problems.models import load_model

        if model and config:
            raise UserError("give either --model or --config, not both")
        spec = load_model(str(config) if config else model)
    vocab = min(spec.vocab_size, 10_100) if spec is not None else 10_100
    settings = {"mode": "endpoint", "model": spec.name if spec else None, "concurrency": list(concurrency),
                "tokens": tokens, "prompt_len": prompt_len, "repeats": repeats, "arms": list(endpoints),
                "tunekit_commit": git_commit()}
    rounds = run_endpoints(endpoints, concurrency, tokens, prompt_len, repeats, vocab, timeout, log)
    serve = summarize_endpoints(rounds, endpoints, settings, spec, loaded)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc, md, png = write_reports(serve, out)
    for row in serve["batches"]:
        log(f"C={row['batch']}: " + ", ".join(f"{a} TPOT {f['median_ms']:.3f} ms TTFT {f['ttft_ms']:.1f} ms"
                                              for a, f in row["tpot"].items() if f)
            + (f"; speedup x{row['speedup']:.4f}" if row["speedup"] else ""))
    log(f"wrote {doc}, {md}" + (f", {png}" if png else ""))
    return serve
