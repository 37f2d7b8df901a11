"""Thin CLI verbs; the library does the work.

User errors (unknown model, malformed config, corrupt table, bad option) are
one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tunekit.errors import UserError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tunekit: tune decode GEMVs per real model shape and serve the winners.")
console = Console()


def _problems(model: str | None, shape: list[str], tp: int, m: str, config: Path | None, ops: str = "gemv"):
    from tunekit import shapes
    from tunekit.models import load_model

    selected = shapes.parse_ops(ops)
    # the M limits depend on the ops that will get problems: GEMV takes 1..8
    in_play = (selected if (model or config) else ()) + tuple(shapes.shape_op(text) for text in shape)
    m_list = shapes.parse_m_list(m, in_play or selected)
    problems = []
    spec = None
    if model and config:
        raise UserError("give either --model or --config, not both")
    if model or config:
        spec = load_model(str(config) if config else model)
        spec.check_tp(tp)
        problems.extend(spec.problems(tp=tp, m_list=m_list, ops=selected))
    if shape:
        problems.extend(shapes.adhoc_problems(shape, m_list))
    if not problems:
        if spec is not None:
            raise UserError(f"no problems: {spec.name} runs none of --ops {ops} "
                            "(bias_gelu: use --shape bias_gelu:SIZE)")
        raise UserError("no problems: give --model NAME, --config PATH or --shape NxK")
    unique = {}
    for p in problems:
        if p.key in unique:
            old = unique[p.key]
            unique[p.key] = type(p)(p.op, p.dtype, p.m, p.n, p.k, old.count + p.count, old.names + p.names)
        else:
            unique[p.key] = p
    return spec, list(unique.values())


@app.command()
def models() -> None:
    """List the built-in models."""
    from tunekit.models import list_models

    table = Table("model", "family", "hf id", "layers", "hidden")
    for spec in list_models():
        table.add_row(spec.name, spec.family, spec.hf_id or "", str(spec.num_layers), str(spec.hidden_size))
    console.print(table)


_SHAPE_HELP = ("ad-hoc problem (repeatable): NxK is a GEMV; OP:SIZE an elementwise op, e.g. bias_gelu:4096, "
               "gemma_rms_norm:5120, silu_and_mul:17408, gated_rms_norm:48x128 (groups x size)")
_OPS_HELP = ("ops of the model to list / tune: gemv, rms_norm, fused_add_rms_norm, gated_rms_norm, silu_and_mul, "
             "bias_gelu (norm families follow the model's weight convention)")
_M_HELP = "batch sizes (tokens per step), e.g. 1,2,4,8; gemv takes 1..8, elementwise ops up to 65536"


@app.command()
def shapes(
    model: Annotated[str | None, typer.Option(help="built-in model name")] = None,
    config: Annotated[Path | None, typer.Option(help="path to a Hugging Face config.json")] = None,
    shape: Annotated[list[str], typer.Option(help=_SHAPE_HELP)] = [],  # noqa: B006
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    m: Annotated[str, typer.Option(help=_M_HELP)] = "1",
    ops: Annotated[str, typer.Option(help=_OPS_HELP)] = "gemv",
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List the per-token problems of a model as vLLM executes them."""
    _, problems = _problems(model, shape, tp, m, config, ops)
    gemvs = [p for p in problems if p.op == "gemv"]
    others = [p for p in problems if p.op != "gemv"]
    moved = _moved_bytes(others)
    if as_json:
        rows = [p.as_dict() | {"bytes_per_token": p.weight_bytes * p.count}
                | ({"bytes_moved_per_call": moved[p.key]} if p.key in moved else {}) for p in problems]
        print(json.dumps(rows, indent=2))
        return
    if gemvs:
        table = Table("op", "dtype", "M", "N", "K", "count/token", "MB/token", "layers")
        total_calls = total_bytes = 0
        for p in gemvs:
            per_token = p.weight_bytes * p.count
            table.add_row(p.op, p.dtype, str(p.m), str(p.n), str(p.k), str(p.count), f"{per_token / 1e6:.1f}",
                          ", ".join(p.names))
            if p.m == gemvs[0].m:
                total_calls += p.count
                total_bytes += per_token
        console.print(table)
        console.print(f"per token at M={gemvs[0].m}: {total_calls} GEMV calls, {total_bytes / 1e9:.2f} GB of weights")
    if others:
        table = Table("op", "dtype", "M", "shape", "count/token", "MB/call", "layers",
                      title="elementwise ops (shape: N; GROUPSxSIZE for gated_rms_norm; 2N->N for silu_and_mul; "
                            "MB/call: bytes moved, the roofline numerator)")
        for p in others:
            table.add_row(p.op, p.dtype, str(p.m), p.shape_text, str(p.count), f"{moved[p.key] / 1e6:.3f}",
                          ", ".join(p.names))
        console.print(table)
        first = [p for p in others if p.m == others[0].m]
        total = sum(p.count * moved[p.key] for p in first)
        console.print(f"per token at M={others[0].m}: {sum(p.count for p in first)} elementwise calls, "
                      f"{total / 1e6:.2f} MB moved")


def _moved_bytes(problems: list) -> dict[str, int]:
    """Bytes one call must move (tunekit.opspec's roofline numerator), by problem key."""
    if not problems:
        return {}
    from tunekit import opspec  # imports torch: only when elementwise problems are listed

    return {p.key: opspec.get(p.op).bytes_moved(p) for p in problems}


@app.command()
def search(
    model: Annotated[str | None, typer.Option(help="built-in model name")] = None,
    config: Annotated[Path | None, typer.Option(help="path to a Hugging Face config.json")] = None,
    shape: Annotated[list[str], typer.Option(help=_SHAPE_HELP)] = [],  # noqa: B006
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    m: Annotated[str, typer.Option(help=_M_HELP)] = "1",
    ops: Annotated[str, typer.Option(help=_OPS_HELP)] = "gemv",
    backend: Annotated[str | None, typer.Option(
        help="comma list of backends (default: every tuned backend available here)")] = None,
    trials: Annotated[int, typer.Option(help="measured trials per (problem, backend) study")] = 40,
    timeout: Annotated[float | None, typer.Option(help="seconds for the trial phase of the whole run")] = None,
    sampler: Annotated[str, typer.Option(help="tpe, random or grid")] = "tpe",
    numerics: Annotated[str, typer.Option(help="bounded (fp64 reference + BF16 bound) or exact")] = "bounded",
    storage: Annotated[str | None, typer.Option(help="Optuna RDB URL (default: SQLite in --out)")] = None,
    out: Annotated[Path | None, typer.Option(help="run folder (default runs/<model or shapes>)")] = None,
    min_gain: Annotated[float, typer.Option(help="minimum speedup over vendor to enter the table")] = 0.01,
    seed: Annotated[int, typer.Option(help="sampler and input seed")] = 0,
    warm_start: Annotated[int, typer.Option(
        help="first measure the N best configs of every other study of the op in the storage")] = 3,
    seed_from: Annotated[list[Path] | None, typer.Option(
        help="table.json or trials.csv of an earlier run (repeatable): its best configs of the same op and "
             "backend are measured first, nearest shape and M first")] = None,
    trial_timeout: Annotated[float, typer.Option(help="seconds before a stuck candidate is killed")] = 180.0,
    restrict: Annotated[list[str] | None, typer.Option(
        help="NAME=V1,V2 (repeatable): search only these values of a tunable, in every backend that has it, "
             "e.g. MMA=1 or M_MODE=dot,dot_w (an empty value where the domain has one: W_EVICT=,evict_first)")] = None,
    progress: Annotated[bool, typer.Option(help="show progress bars")] = True,
) -> None:
    """Search the best verified kernel per problem; write trials and the dispatch table."""
    from tunekit import backends as registry
    from tunekit.report import print_summary, report_after_search
    from tunekit.search.engine import SearchConfig, read_seed_records, run_search
    from tunekit.verify import NUMERICS

    spec, problems = _problems(model, shape, tp, m, config, ops)
    if numerics not in NUMERICS:
        raise UserError(f"--numerics must be one of {', '.join(NUMERICS)}")
    names = [b.strip() for b in backend.split(",") if b.strip()] if backend else _default_backends()
    if "vendor" in names:
        raise UserError("the vendor baseline is always measured; --backend takes tuned families (triton, hip)")
    if any(name in registry.BASELINES for name in names):
        raise UserError("baselines (vendor, inductor) are measured with every problem they serve; "
                        "--backend takes tuned families (triton, hip)")
    for name in names:
        if name not in registry.BUILTIN and ":" not in name:
            raise UserError(f"unknown backend {name!r} (known: {', '.join(registry.TUNED)})")
    for path in seed_from or ():
        read_seed_records(path)  # a bad file fails now, not after the bandwidth probe
    restricted = _parse_restrict(restrict or [], problems, names)
    run_name = spec.name if spec else "shapes"
    out_dir = out or Path("runs") / run_name
    cfg = SearchConfig(
        problems=problems, backends=names, out_dir=out_dir, trials=trials, timeout_s=timeout,
        sampler=sampler, numerics=numerics, storage=storage, seed=seed, min_gain=min_gain, warm_start=warm_start,
        seed_from=tuple(seed_from or ()), restrict=restricted,
        trial_timeout_s=trial_timeout, command=shlex.join(["tunekit"] + sys.argv[1:]),
        model=spec.name if spec else None,
    )
    outcome = run_search(cfg, progress=progress and sys.stderr.isatty(), log=lambda s: console.print(s))
    print_summary(console, outcome)
    report_after_search(console, outcome.run_dir)


def _parse_restrict(items: list[str], problems: list, backends: list[str]) -> dict[str, tuple[str, ...]]:
    """``--restrict NAME=V1,V2`` options as {tunable: allowed values (text)}, checked against the spaces."""
    from tunekit import backends as registry

    domains: dict[str, set[str]] = {}
    for name in backends:
        backend = registry.get(name)
        for op in sorted({p.op for p in problems}):
            if op in backend.ops:
                for key, values in backend.space(next(p for p in problems if p.op == op)).domains.items():
                    domains.setdefault(key, set()).update(str(v) for v in values)
    out: dict[str, tuple[str, ...]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--restrict {item!r}: expected NAME=VALUE[,VALUE...]")
        # an empty value is a value where the domain has one (W_EVICT="": no hint)
        values = tuple(dict.fromkeys(v.strip() for v in text.split(",")))
        if "" in values and "" not in domains.get(key, ()):
            raise UserError(f"--restrict {item!r}: expected NAME=VALUE[,VALUE...]")
        if key not in domains:
            raise UserError(f"--restrict {key}: no selected backend has this tunable "
                            f"(known: {', '.join(sorted(domains))})")
        unknown = [v for v in values if v not in domains[key]]
        if unknown:
            raise UserError(f"--restrict {key}: {unknown} outside its domain {sorted(domains[key])}")
        out[key] = values
    return out


def _default_backends() -> list[str]:
    """Every tuned family usable on this machine (decided in the worker's device)."""
    from tunekit import backends as registry
    from tunekit.device import detect

    device = detect()
    usable = []
    for name in registry.TUNED:
        try:
            backend = registry.get(name)
        except ImportError:
            continue
        if backend.unavailable_reason(device) is None:
            usable.append(name)
    if not usable:
        raise UserError("no tuned backend can run here (no GPU? set TRITON_INTERPRET=1 for the CPU interpreter)")
    return usable


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="run folder written by `tunekit search`")],
    min_gain: Annotated[float | None, typer.Option(help="minimum speedup over vendor (default: the run's)")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="table (default RUN/table.json)")] = None,
) -> None:
    """(Re)write the dispatch table of a run from its re-measured results."""
    from tunekit import table as table_mod
    from tunekit.search import results

    meta = results.read_run_json(run)
    rows = results.read_final(run)
    gain = meta.get("min_gain", 0.01) if min_gain is None else min_gain
    table = table_mod.build_table(rows, meta["device"], meta["probe"], gain, meta["backends"])
    path = table_mod.save(table, output or run / "table.json")
    console.print(f"wrote {path}: {len(table['entries'])} entries (min gain {gain:.1%})")


@app.command()
def compare(
    run: Annotated[Path, typer.Argument(help="run folder written by `tunekit search`")],
) -> None:
    """Vendor vs Triton vs HIP per problem and per token; writes RUN/report.md and PNG plots."""
    from tunekit.report import compare_run

    compare_run(run, console)


@app.command()
def show(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE", help="dispatch table JSON")],
    check: Annotated[bool, typer.Option(help="fail if the table was tuned for another device/software")] = False,
) -> None:
    """Validate and print a dispatch table."""
    from tunekit import table as table_mod

    table = table_mod.load(table_path)
    env = table["environment"]
    console.print(f"{table_path}: {table['format']}, {len(table['entries'])} entries, tuned on {env['gpu']} "
                  f"({env['arch']}, {env['runtime']}, torch {env['torch']}, triton {env['triton']})")
    if check:
        from tunekit.device import detect

        diffs = table_mod.environment_mismatch(table, detect().as_dict())
        if diffs:
            raise UserError(f"{table_path} does not match this environment: " + "; ".join(diffs))
    rows = Table("op", "M", "N", "K", "backend", "params", "us", "vendor us", "speedup", "GB/s", "% limit")
    for e in table["entries"]:
        pct = e.get("pct_of_limit")
        rows.add_row(e["op"], str(e["m"]), str(e["n"]), str(e["k"]), e["backend"],
                     json.dumps(e["params"], sort_keys=True), f"{e['time_us']:.2f}", f"{e['baseline_us']:.2f}",
                     f"{e['speedup']:.3f}", f"{e['gbps']:.0f}", "-" if pct is None else f"{pct:.1f}")
    console.print(rows)


@app.command()
def chain(
    table: Annotated[list[Path], typer.Option(help="dispatch table to serve (repeatable; the first wins a key)")],
    model: Annotated[str | None, typer.Option(help="built-in model name")] = None,
    config: Annotated[Path | None, typer.Option(help="path to a Hugging Face config.json")] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel size (one rank's shards)")] = 1,
    m: Annotated[str, typer.Option(help="tokens per step, e.g. 1,4 (1..8)")] = "1",
    layers: Annotated[int | None, typer.Option(help="first N decoder layers only (default: all)")] = None,
    iters: Annotated[int, typer.Option(help="graph replays per timing")] = 20,
    repeats: Annotated[int, typer.Option(help="interleaved timings per variant (median)")] = 15,
    out: Annotated[Path | None, typer.Option(help="folder for chain.json")] = None,
) -> None:
    """Time the model's tuned decode-step chain as one CUDA graph: vendor vs tuned GEMVs vs all tuned."""
    from tunekit import chain as chain_mod
    from tunekit import shapes
    from tunekit.models import load_model

    if bool(model) == bool(config):
        raise UserError("give one of --model or --config")
    spec = load_model(str(config) if config else model)
    m_list = shapes.parse_m_list(m, ("gemv",))
    if iters < 1 or repeats < 1:
        raise UserError("--iters and --repeats must be at least 1")
    missing = [str(p) for p in table if not p.exists()]
    if missing:
        raise UserError(f"no such table: {', '.join(missing)}")
    report = chain_mod.run(spec, [str(p) for p in table], m_list, tp=tp, layers=layers, iters=iters,
                           repeats=repeats, log=console.print)
    if not report["timed"]:
        console.print("no GPU: the variants' logits were compared eagerly; nothing was timed")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "chain.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        console.print(f"wrote {out / 'chain.json'}")


@app.command("serve-bench")
def serve_bench(
    table: Annotated[list[Path], typer.Option(
        help="dispatch table the tuned arm serves (repeatable; the first wins a key)")] = [],  # noqa: B006
    model: Annotated[str | None, typer.Option(help="built-in model name")] = None,
    config: Annotated[Path | None, typer.Option(help="path to a Hugging Face config.json")] = None,
    batch: Annotated[str, typer.Option(help="batch sizes (concurrent sequences), e.g. 1,2,4,8")] = "1,2,4,8",
    tokens: Annotated[int, typer.Option(help="new tokens per timed generate (TPOT: vs a 1-token generate)")] = 128,
    prompt_len: Annotated[int, typer.Option(help="prompt tokens per sequence")] = 64,
    repeats: Annotated[int, typer.Option(help="timed (1, --tokens) pairs per batch size and process")] = 5,
    processes: Annotated[int, typer.Option(help="processes (engine starts) per arm, arms alternated")] = 3,
    layers: Annotated[int | None, typer.Option(help="first N decoder layers only (a quick run)")] = None,
    out: Annotated[Path | None, typer.Option(help="folder (default runs/serve-<model>); rerun to resume")] = None,
    endpoint: Annotated[list[str], typer.Option(
        help="ARM=URL of a running OpenAI-compatible server (vanilla=, tuned=, optional passthrough=; "
             "repeatable): A/B against servers instead of offline engines")] = [],  # noqa: B006
    concurrency: Annotated[str, typer.Option(help="--endpoint: concurrent requests, e.g. 1,4,8")] = "1,4,8",
    arms: Annotated[str, typer.Option(help="vanilla plus any of passthrough, tuned")] = "vanilla,passthrough,tuned",
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's share of GPU memory")] = 0.85,
    python: Annotated[Path | None, typer.Option(
        help="Python with vLLM that runs the engines (default: this one)")] = None,
    eager: Annotated[bool, typer.Option(help="vLLM enforce_eager (no CUDA graphs, no compile)")] = False,
    agree_steps: Annotated[int, typer.Option(help="decode steps whose logprobs are compared")] = 8,
    logprob_tol: Annotated[float | None, typer.Option(
        help="agreement tolerance in nats (default 2^-6: four BF16 roundoffs)")] = None,
    runner_timeout: Annotated[float, typer.Option(help="seconds before one engine process is killed")] = 3600.0,
    stop_after: Annotated[float | None, typer.Option(
        help="start no engine process that would end past this many seconds; exit status 3 (rerun resumes)")] = None,
    report_only: Annotated[bool, typer.Option(help="rebuild serve.json/.md/.png from --out's results")] = False,
) -> None:
    """vLLM decode end to end: vanilla vs plugin without table vs tuned, TPOT per batch size, vs the prediction."""
    from tunekit.serve import bench
    from tunekit.serve import endpoint as endpoint_mod
    from tunekit.serve.analysis import DEFAULT_TOL

    def log(text: str) -> None:
        console.print(text, markup=False, highlight=False)

    tol = DEFAULT_TOL if logprob_tol is None else logprob_tol
    if endpoint:
        urls = endpoint_mod.parse_endpoints(endpoint)
        endpoint_mod.run(urls, out or Path("runs") / "serve-endpoints", bench.parse_sizes(concurrency, "--concurrency"),
                         tokens, prompt_len, repeats, model, config, table, log=log)
        return
    if report_only:
        if out is None:
            raise UserError("--report-only needs --out DIR (a serve-bench folder)")
        bench.report_dir(out, tol, log)
        return
    settings = bench.build_settings(
        model, config, table, bench.parse_sizes(batch, "--batch"), tokens=tokens, prompt_len=prompt_len,
        repeats=repeats, processes=processes, layers=layers, arms=[a.strip() for a in arms.split(",") if a.strip()],
        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=eager, agree_steps=agree_steps,
        logprob_tol=tol, python=str(python) if python else sys.executable, runner_timeout_s=runner_timeout)
    serve = bench.run_offline(settings, out or Path("runs") / f"serve-{settings.model}", log, stop_after_s=stop_after)
    if serve is None:
        sys.exit(3)  # stopped early on purpose: not an error, not done


@app.command()
def probe() -> None:
    """Describe the device and measure its read-bandwidth limit."""
    from tunekit.search.worker import Worker

    with Worker() as worker:
        dev = worker.call({"kind": "device"})
        res = worker.call({"kind": "probe"}, timeout=600)
    if res.get("status") != "ok":
        raise UserError(f"probe failed: {res.get('error')}")
    console.print(json.dumps({"device": dev.get("device"), "probe": res["probe"]}, indent=2))


def main() -> None:
    try:
        app(standalone_mode=False)
    except UserError as exc:
        # plain write: rich would wrap a long message over several lines
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: finished trials are stored; rerun the same command to resume\n")
        sys.exit(130)
    except Exception as exc:  # click's usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(1)
        raise
