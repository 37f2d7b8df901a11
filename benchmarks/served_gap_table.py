"""Per GEMV problem of a Qwen3.5-27B decode step, one launch's time read four ways, from the files of
``benchmarks/served_gap_h200.sh`` (``by_launch`` of the served profile and of the chain's graphs, and the
engine process's own standalone timings), as the Markdown tables of the result's README.

Usage: python benchmarks/served_gap_table.py benchmarks/results/h200-served-gap-ad3a8ee
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: problem -> (tunekit kernel launch: grid, predecessor prefix or None; the in-process key; the table's
#: count per step; cuBLAS's launch in vanilla / the chain's vendor variant: name prefix, grid)
PROBLEMS = {
    "gate_up (rms_gemv 34816x5120)": ((34816, None), "rms_gemv 1x34816x5120", 64,
                                      ("nvjet_sm90_tst_384x8", (4, 23, 1))),
    "down_proj (gemv_add 5120x17408)": ((1280, "_silu_and_mul"), "gemv_add 1x5120x17408", 63,
                                        ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK", (2, 66, 1))),
    "in_proj_qkvz+ba (rms_gemv 16480x5120)": ((16480, None), "rms_gemv 1x16480x5120", 48,
                                              ("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", (2, 64, 1))),
    "out_proj (gemv_add 5120x6144)": ((1280, "_gated_rms_norm"), "gemv_add 1x5120x6144", 48,
                                      ("nvjet_sm90_tst_64x8_64x16_4x1", (4, 20, 1))),
    "qkv_proj (rms_gemv 14336x5120)": ((14336, None), "rms_gemv 1x14336x5120", 16,
                                       ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", (2, 66, 1))),
    "lm_head (gemv 248320x5120)": ((248320, None), "gemv 1x248320x5120", 1,
                                   ("nvjet_sm90_tst_512x8", (2, 66, 1))),
}


def _parse(key: str) -> tuple[str, tuple[int, ...] | None, str]:
    name = key.split(": ", 1)[1]
    grid = None
    if " grid=(" in name:
        grid = tuple(int(v) for v in name.split(" grid=(", 1)[1].split(")", 1)[0].split(","))
    after = name.rsplit(" after=", 1)[1] if " after=" in name else ""
    return name.split(" grid=", 1)[0].split(" after=", 1)[0], grid, after


def per_launch(by_launch: dict, match) -> float | None:
    """Time of one launch (us) over the by_launch rows ``match(name, grid, after)`` accepts."""
    us = kernels = 0.0
    for key, row in by_launch.items():
        if match(*_parse(key)):
            us, kernels = us + row["us"], kernels + row["kernels"]
    return us / kernels if kernels >= 0.5 else None


def tunekit_match(grid_n: int, after: str | None):
    return lambda name, grid, prev: (name == "_gemv_kernel" and grid is not None and grid[0] == grid_n
                                     and (after is None or prev.startswith(after)))


def vendor_match(prefix: str, want: tuple[int, ...]):
    return lambda name, grid, prev: name.startswith(prefix) and grid == want


def chain_launches(folder: Path) -> dict[str, dict]:
    """{variant: {"wall_us", "busy_us", "gap_us", "kernels", "by_launch"}} of a chain's M=1 profile:
    ``tunekit chain --profile-replays`` (chain.json rows with ``by_launch``), or the probe script this
    result's first two calls ran (0802a99, ad3a8ee: chain_launches.json)."""
    old = folder / "chain_launches.json"
    if old.exists():
        return json.loads(old.read_text())[0]["variants"]
    rows = [r for r in json.loads((folder / "chain.json").read_text())["results"] if r["m"] == 1 and r.get("by_launch")]
    return {r["variant"]: {"wall_us": r["step_us"], "by_launch": r["by_launch"],
                           "busy_us": sum(v["us"] for v in r["by_launch"].values()),
                           "gap_us": sum(v["gap_us"] for v in r["by_launch"].values()),
                           "kernels": sum(v["kernels"] for v in r["by_launch"].values())} for r in rows}


def _fmt(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}"


def main() -> None:
    root = Path(sys.argv[1])
    calls = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("call"))
    for call in calls:
        served = json.loads((call / "serve/runs/folded-0.json").read_text())["batches"][0]["profile"]
        vanilla = json.loads((call / "serve/runs/vanilla-0.json").read_text())["batches"][0]["profile"]
        chain = chain_launches(next(d for d in (call / "chain", call / "chain-after") if d.exists()))
        in_process = served.get("in_process", {})
        print(f"\n### {call.name}\n")
        print("| problem | table | chain | in-process standalone | served | served - chain, x count | "
              "cuBLAS chain | cuBLAS served |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        total = 0.0
        for problem, ((grid_n, after), ip_key, count, (prefix, vgrid)) in PROBLEMS.items():
            t_chain = per_launch(chain["tuned_fused"]["by_launch"], tunekit_match(grid_n, after))
            t_served = per_launch(served["by_launch"], tunekit_match(grid_n, after))
            ip = in_process.get(ip_key, {})
            v_chain = per_launch(chain["vendor"]["by_launch"], vendor_match(prefix, vgrid))
            v_served = per_launch(vanilla["by_launch"], vendor_match(prefix, vgrid))
            excess = (t_served - t_chain) * count if t_served and t_chain else None
            total += excess or 0.0
            print(f"| {problem} | {_fmt(ip.get('table_us'))} | {_fmt(t_chain)} | {_fmt(ip.get('us'))} | "
                  f"{_fmt(t_served)} | {_fmt(excess)} | {_fmt(v_chain)} | {_fmt(v_served)} |")
        print(f"\nserved - chain over these problems: {total:.1f} us per step")
        for arm, prof in (("vanilla", vanilla), ("folded", served)):
            gaps = sum(r.get("gap_us", 0.0) for r in prof["by_launch"].values())
            print(f"- {arm}: busy {prof['busy_us']:.1f} us, {prof['kernels']:.0f} kernels, launch gaps {gaps:.1f} us")
        for variant in ("vendor", "tuned_fused"):
            v = chain[variant]
            print(f"- chain {variant}: wall {v['wall_us']:.1f} us, kernels {v['busy_us']:.1f} us "
                  f"({v['kernels']:.0f}), launch gaps {v['gap_us']:.1f} us")


if __name__ == "__main__":
    main()
