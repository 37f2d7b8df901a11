"""The verbs of tuning: models, shapes, search, export, compare, show, probe."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tunekit.cli.app import app, console
from tunekit.cli.search_options import default_backends, parse_restrict, peers_option, seed_sources
from tunekit.errors import Interrupted, UserError
from tunekit.problems import oprecords
from tunekit.problems.budget import FULL_TRIALS, QUICK_SHARE, QUICK_TRIALS


def _problems(model: str | None, shape: list[str], tp: int, m: str, config: Path | None, ops: str = "gemv"):
    from tunekit.problems import shapes
    from tunekit.problems.models import load_model

    selected = shapes.parse_ops(ops)
    # the M limits depend on the ops that will get problems: GEMV takes 1..16
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
    """List the built-in models.

    Their configs are data (tunekit/problems/models/configs); any other
    Hugging Face config of the families tunekit derives (dense Llama /
    Qwen2 / Qwen3, hybrid Qwen3.5) works through --config.
    """
    from tunekit.problems.models import list_models

    table = Table("model", "family", "hf id", "layers", "hidden")
    for spec in list_models():
        table.add_row(spec.name, spec.family, spec.hf_id or "", str(spec.num_layers), str(spec.hidden_size))
    console.print(table)


_SHAPE_HELP = ("ad-hoc problem (repeatable): NxK is a GEMV; OP:SIZE an elementwise op, e.g. bias_gelu:4096, "
               "gemma_rms_norm:5120, silu_and_mul:17408, gated_rms_norm:48x128 (groups x size)")
_OPS_HELP = ("ops of the model to list / tune: gemv, rms_norm, fused_add_rms_norm, gated_rms_norm, silu_and_mul, "
             "bias_gelu (norm families follow the model's weight convention); fused GEMV families (used by "
             "`tunekit chain`; rms_gemv and gemv_add also served by the vLLM plugin, rms_gemv by "
             "tunekit.patch(fold_norms=True)): rms_norm_gemv (the norm in "
             "the prologue of the GEMV that reads it), silu_mul_gemv (SiLU-and-mul in the down projection's "
             "prologue), gemv_add (the residual add in the epilogue of o_proj / out_proj / down_proj), "
             "rms_gemv (the GEMV of a norm folded into its consumers' weights: every GEMV that reads a "
             "decoder norm), gemv_silu_mul (SiLU-and-mul in gate_up_proj's epilogue, plain and after a folded "
             "norm), fused_gemv (all five)")
_M_HELP = "batch sizes (tokens per step), e.g. 1,2,4,8,16; gemv takes 1..16, elementwise ops up to 65536"
_SEARCH_M_HELP = _M_HELP + " (default: 1,2,4,8,16 with --model/--config, else 1)"
_SEARCH_OPS_HELP = _OPS_HELP + (" (default with --model/--config: every op the model runs and the fused families "
                                "serving uses, rms_gemv and gemv_add; else gemv)")


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
    """List the per-token problems of a model as vLLM executes them.

    One row per (op, dtype, M, N, K) with its count per token: a GEMV with
    the weight bytes it reads per token, an elementwise op with the bytes
    one call moves. Shapes come from the config the way vLLM builds its
    layers (merged qkv_proj, gate_up_proj, in_proj_qkvz, in_proj_ba ...),
    sharded for --tp. --shape adds ad-hoc problems: a GEMV takes M 1..16,
    an elementwise op any M (1, 256, 4096 ...).
    """
    _, problems = _problems(model, shape, tp, m, config, ops)
    gemvs = [p for p in problems if oprecords.get(p.op).kind == "gemv"]  # weight reads; the rest: bytes moved
    others = [p for p in problems if p not in gemvs]
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
    """Bytes one call must move (tunekit.problems.opspec's roofline numerator), by problem key."""
    if not problems:
        return {}
    from tunekit.problems import opspec  # imports torch: only when elementwise problems are listed

    return {p.key: opspec.get(p.op).bytes_moved(p) for p in problems}


@app.command()
def search(
    model: Annotated[str | None, typer.Option(help="built-in model name")] = None,
    config: Annotated[Path | None, typer.Option(help="path to a Hugging Face config.json")] = None,
    shape: Annotated[list[str], typer.Option(help=_SHAPE_HELP)] = [],  # noqa: B006
    tp: Annotated[int, typer.Option(help="tensor-parallel size")] = 1,
    m: Annotated[str | None, typer.Option(help=_SEARCH_M_HELP, show_default=False)] = None,
    ops: Annotated[str | None, typer.Option(help=_SEARCH_OPS_HELP, show_default=False)] = None,
    backend: Annotated[str | None, typer.Option(
        help="comma list of tuned backends: triton, hip, vllm_skinny (vLLM's CuTe-DSL skinny GEMM, its "
             "SkinnyGemmConfig searched per shape; needs vLLM >= 0.33 and the CuTe DSL, "
             "the peers extra: docs/search.md) (default: every tuned backend available here)")] = None,
    trials: Annotated[int | None, typer.Option(
        help=f"measured trials per (problem, backend) study (default: {FULL_TRIALS}; {QUICK_TRIALS} with "
             "--budget quick)", show_default=False)] = None,
    budget: Annotated[str, typer.Option(
        help="full, or quick for a user in a hurry (the CPU interpreter, a first look): M=1 only unless --m "
             f"is given, per M only the largest problems ({QUICK_SHARE:.0%} of the estimated time per step: "
             f"bytes moved plus a launch's cost, times calls per step), {QUICK_TRIALS} trials per study "
             "unless --trials is given; decided from the problem list alone, and one line says what it "
             "left out")] = "full",
    min_trials: Annotated[int, typer.Option(
        help="measured trials a study runs before it may stop early (near the limit, or a plateau)")] = 12,
    stop_near_limit: Annotated[float, typer.Option(
        help="stop a study once its best moves its bytes within this share of the measured read (GEMV) or copy "
             "(elementwise) limit: 0.02 is 98% of it; 0: off")] = 0.02,
    stop_patience: Annotated[int, typer.Option(
        help="stop a study once its last N measured trials gained no more than --stop-gain over its best; "
             "0: off (every study runs --trials)")] = 10,
    stop_gain: Annotated[float, typer.Option(
        help="the gain over the best so far that counts as progress for --stop-patience (0.01: 1%)")] = 0.01,
    timeout: Annotated[float | None, typer.Option(help="seconds for the trial phase of the whole run")] = None,
    sampler: Annotated[str, typer.Option(help="tpe, random or grid")] = "tpe",
    numerics: Annotated[str, typer.Option(help="bounded (fp64 reference + BF16 bound) or exact")] = "bounded",
    storage: Annotated[str | None, typer.Option(
        help="Optuna RDB URL (default: SQLite in --out); postgresql://... to share the work between hosts")] = None,
    gpus: Annotated[str | None, typer.Option(
        help="'all' or indices like 0,1: one worker per GPU, sharing the studies through the storage "
             "(default: one worker on the current device)")] = None,
    out: Annotated[Path | None, typer.Option(help="run folder (default runs/<model or shapes>)")] = None,
    add: Annotated[bool, typer.Option(
        "--add", help="add this command's problems to an --out made for others (run.json then records the "
                      "union, and the table covers it); without it another problem set is refused")] = False,
    min_gain: Annotated[float, typer.Option(
        help="minimum gain over the stock path (the faster of vendor and Inductor; peers are reported, not a "
             "bar) to enter the table (0.01: 1%; >= 0)")] = 0.01,
    seed: Annotated[int, typer.Option(help="sampler and input seed")] = 0,
    warm_start: Annotated[int, typer.Option(
        help="first measure the N best configs of every other study of the op in the storage, the same "
             "shape at the nearest M first")] = 3,
    seed_from: Annotated[list[Path] | None, typer.Option(
        help="table.json or trials.csv of an earlier run (repeatable): its best configs of the same op and "
             "backend are measured first, nearest shape and M first; auto (the default): the shipped tables "
             "measured on this GPU (tunekit tables); none: no seeds, a fresh search")] = None,
    trial_timeout: Annotated[float, typer.Option(help="seconds before a stuck candidate is killed")] = 180.0,
    restrict: Annotated[list[str] | None, typer.Option(
        help="NAME=V1,V2 (repeatable): search only these values of a tunable, in every backend that has it, "
             "e.g. MMA=1 or M_MODE=dot,dot_w (an empty value where the domain has one)")] = None,
    peers: Annotated[str, typer.Option(
        help="what a user could pick instead (vLLM's skinny GEMM, FlashInfer, torch.compile max-autotune, a "
             "plain @triton.autotune GEMV), timed in each problem's final re-measure beside the winners: all, "
             "none, or a comma list of their names (docs/search.md); each is built and autotuned per problem, "
             "most of a search's time, and some need the peers extra")] = "none",
    progress: Annotated[bool, typer.Option(
        help="progress bars on a terminal; elsewhere (a pipe, a file) a progress line per finished study and at "
             "most one per 10 s between, with an ETA")] = True,
) -> None:
    """Search the best verified kernel per problem; write trials and the dispatch table.

    With --model/--config: every op the model runs (its GEMVs and fused
    elementwise ops) and the fused GEMV families the vLLM plugin serves
    (rms_gemv: a norm folded into its consumers' GEMV; gemv_add: the
    residual add in the GEMV's epilogue) at M = 1,2,4,8,16, unless --ops / --m
    narrow it; with only --shape: gemv at M=1. One Optuna study per (problem, backend). Every
    candidate is checked against an fp64 reference before it is timed; the
    vendor path is timed in the same process, and each problem's top
    candidates are re-measured interleaved with it at the end.

    Writes RUN/optuna.db and RUN/trials.csv (every trial, failures
    included), RUN/final.csv (the re-measure), RUN/table.json (the winners
    that beat the stock path by --min-gain) and RUN/report.md.

    Rerunning the same command resumes, also after Ctrl-C (exit status
    130), SIGTERM (143), SIGHUP (129) or a lost storage (a database server
    stopped, a full disk: one error line, exit status 2). A run folder
    keeps the problems it was made for (run.json): another problem set on
    it is refused unless --add. A search holds its run folder's lock: a
    second one on a folder in use is refused. Searches with their own --out may share one --storage;
    --gpus runs one worker per GPU, and a PostgreSQL storage shares the
    work between hosts (docs/search.md).
    """
    from tunekit import backends as registry
    from tunekit.evidence.search_summary import print_summary, report_after_search
    from tunekit.measure.verify import NUMERICS
    from tunekit.problems import shapes as shapes_mod
    from tunekit.problems.budget import apply_budget
    from tunekit.search.early_stop import StopRule
    from tunekit.search.engine import SearchConfig, read_seed_records, run_search
    from tunekit.table_fusions import model_groups

    m_given = m is not None
    # the model's spec keeps, of the default op families, those it runs
    m, ops = shapes_mod.search_selection(bool(model or config), m, ops)
    if not min_gain >= 0:  # also NaN
        raise UserError(f"--min-gain must be a number >= 0 (got {min_gain}); 0.01 asks a 1% gain")
    spec, problems = _problems(model, shape, tp, m, config, ops)
    planned = apply_budget(budget, problems, trials, m_given)
    problems, trials = planned.problems, planned.trials
    if numerics not in NUMERICS:
        raise UserError(f"--numerics must be one of {', '.join(NUMERICS)}")
    names = [b.strip() for b in backend.split(",") if b.strip()] if backend else default_backends()
    if "vendor" in names:
        raise UserError("the vendor baseline is always measured; --backend takes tuned families (triton, hip)")
    if any(name in registry.BASELINES for name in names):
        raise UserError("baselines (vendor, inductor) are measured with every problem they serve; "
                        "--backend takes tuned families (triton, hip)")
    for name in names:
        if name not in registry.BUILTIN and ":" not in name:
            raise UserError(f"unknown backend {name!r} (known: {', '.join(registry.TUNED)})")
    seeds = seed_sources(seed_from)
    for path in seeds:
        if str(path) != "auto":  # the shipped tables of the device's GPU, named once the device is known
            read_seed_records(path)  # a bad file fails now, not after the bandwidth probe
    restricted = parse_restrict(restrict or [], problems, names)
    run_name = spec.name if spec else "shapes"
    out_dir = out or Path("runs") / run_name
    if planned.note:
        console.print(planned.note, soft_wrap=True, markup=False, highlight=False)
    cfg = SearchConfig(
        problems=problems, backends=names, out_dir=out_dir, trials=trials, timeout_s=timeout,
        stop=StopRule(min_trials=min_trials, near_limit=stop_near_limit, patience=stop_patience, min_gain=stop_gain),
        sampler=sampler, numerics=numerics, storage=storage, seed=seed, min_gain=min_gain, warm_start=warm_start,
        seed_from=seeds, restrict=restricted,
        trial_timeout_s=trial_timeout, command=shlex.join(["tunekit"] + sys.argv[1:]),
        model=spec.name if spec else None, gpus=gpus, add=add, tp=tp if spec else None,
        fusion_groups=model_groups(spec, tp) if spec else [], peers=peers_option(peers),
    )
    try:
        with _stop_signals():
            # markup off: a log line is plain text ("pip install -e .[peers]" would lose its brackets)
            outcome = run_search(cfg, progress=_progress_mode(progress),
                                 log=lambda s: console.print(s, markup=False, highlight=False))
            print_summary(console, outcome)
            report_after_search(console, outcome.run_dir)
    except Interrupted:
        from tunekit.search.stops import STOPS

        signum = STOPS.received
        if signum in (None, signal.SIGINT):
            raise  # Ctrl-C: the CLI's own line and status 130
        name = signal.Signals(signum).name
        sys.stderr.write(f"interrupted: {name}; finished trials are stored (trials.csv lists them); "
                         "rerun the same command to resume\n")
        sys.exit(128 + signum)  # as the shell reports a process ended by the signal


@contextlib.contextmanager
def _stop_signals():
    """Ctrl-C, SIGTERM and SIGHUP (``kill``, batch schedulers, systemd, a closed terminal) stop the search:
    the trials in flight are recorded, trials.csv is written, the workers are closed. Their handlers only
    record the signal (``tunekit.search.stops.STOPS``, whose ``received`` names it); the search raises
    Interrupted where it checks, and at the end of this block a signal that came after its last check. The
    search command exits 128 + the signal's number (130 for Ctrl-C, with the CLI's own line)."""
    from tunekit.search.stops import SIGNALS, STOPS

    def stop(signum: int, frame: object) -> None:
        raise Interrupted()

    with STOPS.recorded({signum: stop for signum in SIGNALS}):
        yield


def _progress_mode(progress: bool) -> str | bool:
    """Bars where stdout (rich's console) is a terminal, lines elsewhere, nothing under --no-progress."""
    if not progress:
        return False
    return "bars" if sys.stdout.isatty() else "lines"


@app.command()
def export(
    run: Annotated[Path | None, typer.Argument(
        help="run folder written by `tunekit search` (optional with --storage)", show_default=False)] = None,
    storage: Annotated[str | None, typer.Option(
        help="build from every final re-measure in this Optuna storage (all workers and hosts) instead of "
             "RUN/final.csv")] = None,
    stamp: Annotated[str | None, typer.Option(
        help="with --storage holding several device models: the device stamp to export")] = None,
    min_gain: Annotated[float | None, typer.Option(
        help="minimum gain over the stock path (vendor, Inductor), >= 0 (default: the run's, else 0.01)")] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="table (default RUN/table.json)")] = None,
) -> None:
    """(Re)write the dispatch table of a run, or of a shared storage, from its re-measured results."""
    from tunekit import table as table_mod
    from tunekit.search import results

    if min_gain is not None and not min_gain >= 0:  # also NaN
        raise UserError(f"--min-gain must be a number >= 0 (got {min_gain}); 0.01 asks a 1% gain")
    if run is None and storage is None:
        raise UserError("give a run folder, or --storage URL (with --output) to export a shared storage")
    if stamp is not None and storage is None:
        raise UserError("--stamp selects a device model of a --storage; a run folder holds one")
    meta = results.read_run_json(run) if run is not None else {}
    target = output or (run / "table.json" if run is not None else None)
    if target is None:
        raise UserError("--storage without a run folder: give --output FILE")
    if target.is_dir():
        raise UserError(f"{target} is a folder: give --output a file name")
    results.check_writable_dir(target.parent, "export writes the table there")
    if storage is not None:
        rows, device, probe, backends = _storage_finals(storage, stamp)
    else:
        rows = results.read_final(run)
        if not rows:
            raise UserError(f"{run}/final.csv has no rows: the final re-measure produced nothing to export")
        device, probe, backends = meta["device"], meta["probe"], meta["backends"]
    gain = meta.get("min_gain", 0.01) if min_gain is None else min_gain
    table = table_mod.build_table(rows, device, probe, gain, backends, tp=meta.get("tp"))
    if run is not None:  # the fusions the run measured, decided again for this table's entries
        from tunekit.problems.shapes import Problem
        from tunekit.search.fusion_phase import redecide

        problems = [Problem(p["op"], p["dtype"], p["m"], p["n"], p["k"]) for p in meta.get("problems", [])]
        fusions = redecide(run, table, rows, device, problems)
        if fusions is not None:
            table["fusions"] = fusions
    path = table_mod.save(table, target)
    problems = len({(r["op"], r["m"], r["n"], r["k"]) for r in rows})
    console.print(f"wrote {path}: {len(table_mod.entries(table))} entries from {problems} problems "
                  f"(min gain {gain:.1%})")


def _storage_finals(url: str, stamp: str | None) -> tuple[list[dict], dict, dict, list[str]]:
    """The final re-measures in a storage for one device stamp: (rows, device, probe, backends)."""
    from tunekit.search import fleet
    from tunekit.search.engine import open_storage

    by_stamp = fleet.finals_in_storage(open_storage(url))
    if not by_stamp:
        raise UserError(f"storage {fleet.redact(url)} holds no completed final re-measure (run a search first)")
    described = "; ".join(f"{s} = {results_[0].get('stamp_text')} ({len(results_)} problems)"
                          for s, results_ in by_stamp.items())
    if stamp is None:
        if len(by_stamp) > 1:
            raise UserError(f"storage {fleet.redact(url)} holds measurements of {len(by_stamp)} device models; "
                            f"they are never merged into one table: pick one with --stamp ({described})")
        stamp = next(iter(by_stamp))
    if stamp not in by_stamp:
        raise UserError(f"--stamp {stamp}: not in this storage ({described})")
    chosen = by_stamp[stamp]
    rows = [row for result in chosen for row in result["rows"]]
    first = chosen[0]
    backends = sorted({b for result in chosen for b in result.get("backends", [])})
    return rows, first["device"], first["probe"], backends


@app.command()
def compare(
    run: Annotated[Path, typer.Argument(help="run folder written by `tunekit search`")],
) -> None:
    """Vendor, the peers and the tuned backends per problem and per token; writes RUN/report.md, CSVs, plots.

    Per problem: the vendor, each peer's (Inductor, vLLM's skinny GEMM,
    FlashInfer ...) and each tuned backend's best time (us), GB/s, % of the
    measured read limit, speedup, tuned over vendor and over the best peer,
    winner; per token (one served path per layer): the sums, per peer too,
    and the Amdahl prediction of the step. A peer not measured is one line
    saying why.
    """
    from tunekit.evidence.compare import compare_run

    compare_run(run, console)


@app.command()
def show(
    table_path: Annotated[Path, typer.Argument(metavar="TABLE", help="dispatch table JSON")],
    check: Annotated[bool, typer.Option(help="fail if the table was tuned for another device/software")] = False,
) -> None:
    """Validate every entry of a dispatch table and print it.

    Each entry must name a known backend, op and dtype, have M, N, K > 0,
    params named and typed as the backend's search space has them and
    accepted by the kernel's own predicate, and finite positive times.
    Served on another device or software, a table is one warning and the
    vendor path; --check makes that an error here.
    """
    from tunekit import table as table_mod

    table = table_mod.load(table_path, strict=True)
    entries = table_mod.entries(table)
    env = table["environment"]
    console.print(f"{table_path}: {table['format']}, {len(entries)} entries, tuned on {env['gpu']} "
                  f"({env['arch']}, {env['runtime']}, torch {env['torch']}, triton {env['triton']})")
    if check:
        from tunekit.measure.device import detect

        diffs = table_mod.environment_mismatch(table, detect().as_dict())
        if diffs:
            raise UserError(f"{table_path} does not match this environment: " + "; ".join(diffs))
    if "fusions" in table:
        from tunekit.table_fusions import describe

        console.print(f"fusions ({len(table['fusions'])} group(s), each measured against its unfused sequence at "
                      "every M, the fused kernel served at the Ms where it won):" if table["fusions"]
                      else "fusions: none decided (no layer group searched)",
                      soft_wrap=True, markup=False, highlight=False)
        for key, rec in table["fusions"].items():
            console.print(f"  {describe(key, rec)}", soft_wrap=True, markup=False, highlight=False)
    else:
        console.print("fusions: no section (a table written before tunekit measured fusions): serving decides "
                      "folds from the M=1 entries as before", soft_wrap=True, markup=False, highlight=False)
    if not entries:
        gain = table.get("min_gain")
        console.print("no entries: every shape served with this table takes the stock path (no tuned "
                      "candidate beat it" + ("" if gain is None else f" by the min gain {gain:.1%}") + ")")
        return
    rows = Table("op", "M", "N", "K", "backend", "params", "us", "vendor us", "speedup", "GB/s", "% limit")
    for e in entries:
        pct = e.pct_of_limit
        rows.add_row(e.op, str(e.m), str(e.n), str(e.k), e.backend, json.dumps(dict(e.params), sort_keys=True),
                     f"{e.time_us:.2f}", f"{e.baseline_us:.2f}", f"{e.speedup:.3f}", f"{e.gbps:.0f}",
                     "-" if pct is None else f"{pct:.1f}")
    console.print(rows)



@app.command()
def probe() -> None:
    """Describe the device and measure its read-bandwidth limit.

    On a CPU (the interpreter) it says its figures are not bandwidth
    evidence.
    """
    from tunekit.measure.device import no_driver_reason
    from tunekit.search.worker import Worker

    reason = no_driver_reason()
    if reason is not None:  # Triton's own words are "0 active drivers ([]). There should only be one."
        raise UserError(f"probe: {reason}")
    with Worker() as worker:
        dev = worker.call({"kind": "device"})
        res = worker.call({"kind": "probe"}, timeout=600)
    if res.get("status") != "ok":
        raise UserError(f"probe failed: {res.get('error')}")
    report = {"device": dev.get("device"), "probe": res["probe"]}
    if res["probe"].get("kind") == "cpu":
        report["note"] = ("CPU (interpreter) timing: these GB/s show that the probe runs; they are not "
                          "bandwidth evidence (measure the read-bandwidth limit on a GPU)")
    console.print(json.dumps(report, indent=2))




@app.command()
def tables(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False) -> None:
    """List the tables tunekit ships, one per GPU and model it was measured on.

    Per table: the GPU, the model, its Ms, when it was measured, the per-token speedup its search recorded
    per M (a prediction from the interleaved microbenchmarks) and the results folder it came from. Serve
    them with TUNEKIT_TABLE=auto or tunekit.patch(model, table="auto"): each is checked on the device at load
    (another GPU's is refused; each entry is verified against the reference). `tunekit search --seed-from
    auto` starts from the ones measured on this GPU.
    """
    from tunekit import shipped

    rows = [shipped.describe(s) for s in shipped.load_all()]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        console.print(f"no shipped tables in {shipped.TABLES_DIR}")
        return
    table = Table("GPU", "model", "M", "entries", "measured", "per-token speedup (recorded)", "source")
    for r in rows:
        speedups = ", ".join(f"M={m}: {s:.3f}x" for m, s in r["speedup_per_token"].items()) or "-"
        table.add_row(r["gpu"], r["model"] or "-", ",".join(map(str, r["ms"])), str(r["entries"]),
                      (r["created"] or "-")[:10], speedups, r["source"] or "-")
    console.print(table)
