"""A dispatch table cut to one family per file, for A/Bs that place a served difference (prefill_ablation.toml).

    python benchmarks/plans/cut_table.py TABLE OUT_DIR

Writes OUT_DIR/full.json (the table as searched), gemv.json (its GEMV entries only), ew.json (its elementwise
entries only) and no-lmhead.json (everything but the lm_head's GEMV entries: vLLM computes the logits outside
its graph). Each keeps the table's header (environment stamp, probe), so each loads as the table did.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CUTS = {
    "full": lambda e: True,
    "gemv": lambda e: e["op"] == "gemv",
    "ew": lambda e: e["op"] != "gemv",
    "no-lmhead": lambda e: not (e["op"] == "gemv" and e["n"] >= 100000),
}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    table, out = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, keep in CUTS.items():
        doc = dict(table, entries=[e for e in table["entries"] if keep(e)])
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"cut-table: {name}: {len(doc['entries'])} of {len(table['entries'])} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
