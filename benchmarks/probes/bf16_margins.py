"""The BF16 verdict's margins per real checkpoint, over eight prompts of four kinds: how far a correct table sits
below the caps, vanilla's own spread, and how far the gross defects sit above them (CPU; numerics, not timings).

    python benchmarks/probes/bf16_margins.py --out DIR        # DIR/margins.json

For each checkpoint of ``tests/real_checkpoints.NAMES`` in BF16 and fp32: the unpatched model decodes its greedy
tokens (6 positions per prompt, teacher-forced thereafter, as ``tests/test_real_verdict.py``), vanilla's spread is
the same positions by one forward over the whole sequence, then the correct table (``fault_backend:REORDERED``:
another summation order, rounded once as a tuned kernel is) unfolded and folded, and two gross defects (one layer's
down_proj leaving its first K block out; one layer's residual dropped) are judged by ``forced_hf.agreement`` with
the dtype's caps. Per arm: the verdict, max |dlogprob| over the top-K, the largest KL, and its share of the cap.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# the tables are stamped for this CPU under Triton's interpreter, as the tests' are (tests/conftest.py)
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
#: two prompts of each kind: prose, code, numbers, a list
PROMPTS = ("The capital of France is", "Water boils at a temperature of", "def fibonacci(n):",
           "for i in range(10):", "2, 3, 5, 7, 11, 13,", "The year 1969 was when", "Ingredients: two eggs,",
           "The three primary colours are")
STEPS, TOPK = 6, 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    import fault_backend
    import real_checkpoints as rc

    import tunekit
    from tunekit import ops
    from tunekit.evidence.check_serving import forced_hf
    from tunekit.evidence.verdict import caps_for

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict = {"prompts": PROMPTS, "steps": STEPS, "topk": TOPK, "torch": torch.__version__, "models": {}}
    for name in rc.NAMES:
        for dtype in (torch.bfloat16, torch.float32):
            start = time.perf_counter()
            model = rc.load(name, dtype)
            label = forced_hf.model_dtype(model)
            caps = caps_for(label)
            prompts = rc.prompts(name, PROMPTS)
            ref = forced_hf.decode_record(model, prompts, STEPS, TOPK)
            forced = forced_hf.forced_of(ref)
            spread = forced_hf.prefill_record(model, prompts, forced, TOPK)
            table = rc.table_for(model, args.out / f"table-{name}-{label}.json")
            layer = model.model.layers[len(model.model.layers) // 2]
            arms: dict = {"vanilla spread (one forward)": forced_hf.figures(ref, spread, caps)}
            for arm, fold, defect in (("correct, unfolded", False, None), ("correct, folded", True, None),
                                      ("one down_proj drops a K block", False, "drop_k_block"),
                                      ("one residual dropped", False, "drop_residual")):
                ops.load_tables([])
                rc.clear_faults()
                with rc.torch_norm_vendors():
                    tunekit.patch(model, table=str(table), fold_norms=fold)
                    handles = []
                    try:
                        if defect == "drop_k_block":
                            rc.arm_fault("drop_k_block", layer.mlp.down_proj.weight)
                        elif defect == "drop_residual":
                            handles = fault_backend.drop_residual(layer) or []
                        ops.reset_stats()
                        record = forced_hf.decode_record(model, prompts, STEPS, TOPK, forced=forced)
                        if not any(r["impl"].startswith("tuned:") for r in ops.dispatch_stats()):
                            raise SystemExit(f"{name} {label} {arm}: the table served nothing")
                    finally:
                        for h in handles:
                            h.remove()
                        tunekit.unpatch(model)
                        rc.clear_faults()
                arms[arm] = forced_hf.agreement(ref, record, [spread], dtype=label)
            for figures in arms.values():
                figures["share_of_logprob_cap"] = figures["max_abs_logprob_diff"] / caps.logprob
            doc["models"][f"{name} {label}"] = {"caps": caps.as_dict(), "arms": arms,
                                                "seconds": round(time.perf_counter() - start, 1)}
            print(name, label, {a: (f.get("verdict"), round(f["max_abs_logprob_diff"], 4), round(f["kl_max"], 5))
                                for a, f in arms.items()}, flush=True)
    (args.out / "margins.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
