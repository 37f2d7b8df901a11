"""GPU evidence for serving: the tunekit ops from a dispatch table, and a patched Hugging Face model.

A thin wrapper: the checks are ``tunekit.evidence`` (``tunekit check-serving`` runs the same); this script
adds the two helpers that print what to tune for the Hugging Face model of the check.

    python benchmarks/probes/serving_check.py --print-shapes [--model qwen3.5-27b] [--layers 4] [--tiny] \
        [--only gemv|norms|rms_gemv|merged]
    python benchmarks/probes/serving_check.py --print-m [--model qwen3.5-27b] [--layers 4] [--tiny]
    python benchmarks/probes/serving_check.py --table RUN/table.json [--table ...] [--model ...] [--layers 4] \\
        [--out DIR]

``--print-shapes`` prints the ``--shape`` arguments of ``tunekit search`` that cover the Hugging Face model:
one ``--shape NxK`` per distinct nn.Linear (``torch_patch.linear_shapes`` of the model built on the meta
device) and one ``--shape OP:SIZE`` per distinct routed norm, in the layout HF calls it: for Qwen3.5
``gemma_rms_norm:HIDDEN`` and ``gemma_rms_norm:HEAD_DIM`` (q_norm / k_norm), and ``gated_rms_norm:1xHEAD_V_DIM``,
because HF reshapes the gated norm's input to [tokens * heads, head_dim], so ``tunekit.ops`` looks it up as
(m = tokens * heads, n = k = head_dim) first. Those norms run at decode with M > 1 (k_norm: M = kv heads,
gated norm: M = value heads), and a GEMV search takes M 1..8 only, so they need their own search at the M
that ``--print-m`` prints. ``--only rms_gemv`` prints ``--shape rms_gemv:NxK`` for every linear a folded
decoder norm feeds (``--fold-norms``: ``tunekit.patch(fold_norms=True)``); ``--only merged`` the GEMV of
every group of sibling linears (``tunekit.patch(merge_siblings=True)``, the default; ``--no-merge-siblings``
patches without it), which are vLLM's merged shapes, so the table of ``tunekit search --model`` covers
them. Typical GPU use:

    python -m tunekit search $(python benchmarks/probes/serving_check.py --print-shapes --only gemv) --m 1 \\
        --out runs/serving-gemv
    python -m tunekit search $(python benchmarks/probes/serving_check.py --print-shapes --only norms) \\
        --m $(python benchmarks/probes/serving_check.py --print-m) --out runs/serving-norms
    python -m tunekit check-serving --table runs/serving-gemv/table.json \\
        --table runs/serving-norms/table.json --out runs/serving-check

What is checked, judged and timed: ``tunekit/evidence/check_serving/model_check.py``. Exit status 1 if a
check fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tunekit.errors import UserError  # noqa: E402
from tunekit.evidence.check_serving import hf_decode  # noqa: E402
from tunekit.evidence.check_serving import model_check as serving  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = serving.Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print-shapes", action="store_true",
                        help="print the --shape arguments of tunekit search covering the HF model, and exit")
    parser.add_argument("--print-m", action="store_true",
                        help="print the comma list of M at which the HF model calls its tunable norms, and exit")
    parser.add_argument("--only", choices=("all", "gemv", "norms", "rms_gemv", "merged"), default="all",
                        help="with --print-shapes: the linears, the norms, both, the folded norms' consumers, or "
                             "the merged siblings' GEMVs")
    parser.add_argument("--model", default=defaults.model, help=f"one of {', '.join(hf_decode.MODELS)}")
    parser.add_argument("--table", action="append", default=[],
                        help="dispatch table (repeatable; first wins a duplicate key); default: TUNEKIT_TABLE")
    parser.add_argument("--layers", type=int, default=defaults.layers, help="decoder layers of the model")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (hidden 128, vocab 256 ...): CPU test")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="greedy tokens to decode")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--iters", type=int, default=defaults.iters, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="interleaved timing rounds")
    parser.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps per variant first")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--tol-factor", type=float, default=defaults.tol_factor,
                        help="a variant may be this many times as far from fp32 as the unpatched model")
    parser.add_argument("--rel-tol", type=float, default=defaults.rel_tol,
                        help="allowed max|variant - unpatched| / logit std when the fp32 reference fails")
    parser.add_argument("--compile-backend", default=defaults.compile_backend,
                        help="torch.compile backend of the ops check")
    parser.add_argument("--device", default=None, help="default: cuda if available (and not interpreting), else cpu")
    parser.add_argument("--skip-ops", action="store_true")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--skip-graphed", action="store_true")
    parser.add_argument("--fold-norms", action="store_true",
                        help="the patched model folds its decoder norms into their consumers where it pays")
    parser.add_argument("--merge-siblings", action=argparse.BooleanOptionalAction, default=defaults.merge_siblings,
                        help="the patched model runs q/k/v, gate/up (...) as one GEMV of vLLM's merged shape "
                             "where a table covers it (tunekit.patch's default)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "serving-check")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.print_shapes or args.print_m:
            hf_decode.check_model_name(args.model)
            config = hf_decode.build_config(args.model, args.layers, args.tiny)
            if args.print_shapes:
                print(" ".join(f"--shape {s}" for s in hf_decode.shape_args(args.model, config, args.only)))
            if args.print_m:
                ms = sorted({c["m"] for c in hf_decode.decode_norm_calls(args.model, config)})
                print(",".join(str(m) for m in ms))
            return 0
        settings = serving.Settings(
            model=args.model, tables=list(args.table), layers=args.layers, steps=args.steps,
            prompt_len=args.prompt_len, iters=args.iters, rounds=args.rounds, warmup=args.warmup, seed=args.seed,
            tol_factor=args.tol_factor, rel_tol=args.rel_tol, tiny=args.tiny, device=args.device,
            compile_backend=args.compile_backend, skip_ops=args.skip_ops, skip_model=args.skip_model,
            skip_graphed=args.skip_graphed, fold_norms=args.fold_norms, merge_siblings=args.merge_siblings,
            out=str(args.out))
        serving.validate(settings)
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    results = serving.run_check(settings)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
