"""The recorded runs under benchmarks/results stay small and readable: gzipped final.csv / trials.csv
read as the plain files are, and the folder within its size budget."""

from __future__ import annotations

import gzip
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

