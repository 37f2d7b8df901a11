"""The recorded runs under benchmarks/results stay small and readable: gzipped final.csv / trials.csv
read as the plain files are, the folder within its size budget, every folder with its README and its row
in the index, and no serve.json carrying a second copy of the runner results kept beside it."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd

from tunekit.search import results

REPO = Path(__file__).resolve().parents[1]


def _gzip(path: Path) -> Path:
    packed = path.with_name(path.name + ".gz")
    packed.write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    return packed


def _final_rows() -> pd.DataFrame:
    return pd.DataFrame([
        {"op": "gemv", "dtype": "bf16", "m": 1, "n": 96, "k": 256, "backend": "vendor", "time_us": 7.0},
        {"op": "gemv", "dtype": "bf16", "m": 1, "n": 96, "k": 256, "backend": "triton", "time_us": 2.5},
    ])


def test_read_final_takes_the_gzipped_copy_where_final_csv_is_absent(tmp_path: Path) -> None:
    _final_rows().to_csv(tmp_path / "final.csv", index=False)
    plain = results.read_final(tmp_path)
    assert results.final_path(tmp_path) == tmp_path / "final.csv"
    packed = _gzip(tmp_path / "final.csv")
    assert results.final_path(tmp_path) == packed
    assert results.read_final(tmp_path) == plain
    # a plain final.csv written beside it (a search resumed in the folder) is the one read
    _final_rows().iloc[:1].to_csv(tmp_path / "final.csv", index=False)
    assert len(results.read_final(tmp_path)) == 1


def test_a_recorded_run_with_gzipped_finals_compares_as_before(tmp_path: Path) -> None:
    from tunekit.evidence.compare import load_comparison

    src = REPO / "benchmarks" / "results" / "h200-m1-triton-9251ae9"  # its final.csv is plain (tests read it)
    run = tmp_path / "run"
    shutil.copytree(src, run)
    before = load_comparison(run).tokens[0]
    _gzip(run / "final.csv")
    after = load_comparison(run).tokens[0]
    assert (after.vendor_us, after.tuned_us) == (before.vendor_us, before.tuned_us)



def test_seed_from_reads_a_gzipped_trials_csv(tmp_path: Path) -> None:
    from tunekit.search.engine import read_seed_records

    src = REPO / "benchmarks" / "results" / "h200-m1248-gemv-ew-fab7a9c" / "gemv" / "trials.csv.gz"
    records = read_seed_records(src)
    assert records and {r["m"] for r in records} == {1, 2, 4, 8}
    plain = tmp_path / "trials.csv"
    plain.write_bytes(gzip.decompress(src.read_bytes()))
    assert read_seed_records(plain) == records


# ---- the folder as recorded ------------------------------------------------------------------------

RESULTS = REPO / "benchmarks" / "results"
#: benchmarks/results stays small enough to carry with the tree (the whole tree is copied to the GPU machine)
BUDGET_BYTES = 10 * 2**20


def test_the_recorded_runs_fit_their_budget() -> None:
    size = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert size <= BUDGET_BYTES, f"benchmarks/results holds {size / 2**20:.2f} MiB, budget {BUDGET_BYTES / 2**20:.0f}"


def test_every_folder_has_a_readme_and_an_index_row() -> None:
    index = (RESULTS / "README.md").read_text().split("## Folders", 1)[1].split("\n## ", 1)[0]
    for folder in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        assert (folder / "README.md").is_file(), folder.name
        assert f"| `{folder.name}` |" in index, folder.name


def test_no_serve_json_embeds_the_runs_kept_beside_it() -> None:
    for path in RESULTS.rglob("serve.json"):
        if (path.parent / "runs").is_dir():
            assert "arms" not in json.loads(path.read_text()), path
