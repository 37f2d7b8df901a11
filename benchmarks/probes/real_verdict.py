"""The agreement verdict on a real checkpoint served by a GPU table through ``tunekit.patch``: correct and defective.

    python -m benchmarks.probes.real_verdict --model-dir DIR --table TABLE [--steps 16] [--out verdict.json]

On the device that made the table: the Hugging Face model in BF16 decodes its own greedy tokens (the reference),
the same positions through one forward over the whole sequence (vanilla's spread, other GEMM shapes), then the
patched model teacher-forced on the reference's tokens with the table unfolded, folded (the default), and folded
with one injected defect (``tests/fault_backend.drop_residual``: a gemv_add that drops the residual, on the middle
layer). Each is judged by ``tunekit.evidence.verdict`` (``check_serving.forced_hf.agreement``) against the BF16 caps:
the correct arms must pass, the defect must fail. Writes every figure and the dispatch counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Water boils at a temperature of",
           "The three primary colours are")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--table", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--topk", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("verdict.json"))
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import fault_backend  # the defect hooks the CPU tests inject
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tunekit
    from tunekit import ops
    from tunekit.evidence.check_serving import forced_hf

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16).to(device).eval()
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    dtype = forced_hf.model_dtype(model)

    t0 = time.perf_counter()
    ref = forced_hf.decode_record(model, prompts, args.steps, args.topk)
    forced = forced_hf.forced_of(ref)
    spread = forced_hf.prefill_record(model, prompts, forced, args.topk)
    doc: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                 "model_dir": str(args.model_dir),
                 "table": str(args.table), "steps": args.steps, "topk": args.topk, "prompts": list(PROMPTS),
                 "reference_text": [tok.decode(ids) for ids in forced], "arms": {}}
    layers = model.model.layers
    middle = layers[len(layers) // 2]

    arms = (("unfolded", False, None), ("folded", True, None),
            ("folded+drop_residual", True, lambda: fault_backend.drop_residual(middle)))
    for name, fold, defect in arms:
        ops.dispatch_stats(reset=True)
        counts = tunekit.patch(model, table=str(args.table), fold_norms=fold)
        handles = defect() if defect else []
        try:
            record = forced_hf.decode_record(model, prompts, args.steps, args.topk, forced=forced)
        finally:
            for h in handles:
                h.remove()
            tunekit.unpatch(model)
        verdict = forced_hf.agreement(ref, record, [spread], dtype=dtype)
        served = [r for r in ops.dispatch_stats() if str(r.get("impl", "")).startswith("tuned:")]
        doc["arms"][name] = {"patched": counts, "served_tuned_calls": sum(int(r.get("calls", 0)) for r in served),
                             "served": served, "agreement": verdict}
        print(f"{name}: verdict {verdict.get('verdict')}; patched {counts}; tuned calls "
              f"{doc['arms'][name]['served_tuned_calls']}", flush=True)
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    ok = (doc["arms"]["unfolded"]["agreement"].get("verdict") == "pass"
          and doc["arms"]["folded"]["agreement"].get("verdict") == "pass"
          and doc["arms"]["folded+drop_residual"]["agreement"].get("verdict") == "fail")
    print("expected outcome (correct arms pass, the defect fails):", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
