"""CLI: user errors are one line and a non-zero exit; shapes lists the real problems."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tunekit.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=cwd or REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_shapes_json_for_qwen35_27b() -> None:
    res = _run("shapes", "--model", "qwen3.5-27b", "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    got = sorted((r["n"], r["k"], r["count"]) for r in rows)
    assert got == sorted([(14336, 5120, 16), (16384, 5120, 48), (96, 5120, 48), (34816, 5120, 64),
                          (5120, 17408, 64), (5120, 6144, 64), (248320, 5120, 1)])
    assert all(r["op"] == "gemv" and r["m"] == 1 for r in rows)
    assert sum(r["count"] for r in rows) == 305
    assert sum(r["bytes_per_token"] for r in rows) == 51_243_909_120


def test_shapes_table_tp_and_m_list() -> None:
    res = _run("shapes", "--model", "qwen3.5-27b", "--tp", "4", "--m", "1,2")
    assert res.returncode == 0, res.stderr
    assert "4096" in res.stdout and "3584" in res.stdout  # in_proj_qkvz and qkv_proj at TP=4
    res = _run("shapes", "--shape", "96x5120", "--json")
    assert json.loads(res.stdout)[0]["n"] == 96


def test_models_lists_the_builtins() -> None:
    res = _run("models")
    assert res.returncode == 0 and "qwen3.5-27b" in res.stdout and "llama-3.1-8b-instruct" in res.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["shapes", "--model", "no-such-model"], "no-such-model"),
        (["shapes", "--model", "qwen2-7b-instruct", "--tp", "8"], "not divisible"),
        (["shapes", "--shape", "96by5120"], "NxK"),
        (["shapes", "--model", "qwen3-8b", "--m", "1,17"], "1..16"),
        (["shapes"], "no problems"),
        (["search", "--shape", "96x256", "--backend", "cudnn"], "unknown backend"),
        (["search", "--shape", "96x256", "--numerics", "loose"], "numerics"),
        (["search", "--shape", "96x256", "--backend", "triton", "--restrict", "MMA=1"], "no selected backend"),
        (["search", "--shape", "96x256", "--backend", "triton", "--restrict", "M_MODE=wide"], "outside its domain"),
        (["search", "--shape", "96x256", "--backend", "triton", "--restrict", "M_MODE"], "NAME=VALUE"),
        (["search", "--shape", "96x256", "--backend", "triton", "--restrict", "M_MODE=,dot"], "NAME=VALUE"),
        (["search", "--shape", "96x256", "--peers", "cublaslt"], "unknown peer cublaslt (known: all, none, "),
        (["show", "/nonexistent/table.json"], "no such table"),
        (["export", "/nonexistent/run"], "not a tunekit run folder"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(args, fragment) -> None:
    res = _run(*args)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], res.stderr
    assert "Traceback" not in res.stderr


def test_malformed_config_and_corrupt_table(tmp_path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    res = _run("shapes", "--config", str(cfg))
    assert res.returncode == 2 and res.stderr.startswith("error:") and len(res.stderr.strip().splitlines()) == 1
    bad = tmp_path / "table.json"
    bad.write_text("{not json")
    res = _run("show", str(bad))
    assert res.returncode == 2 and "corrupt" in res.stderr


def test_restrict_values_are_parsed_against_the_selected_spaces() -> None:
    from tunekit.cli.search_options import parse_restrict
    from tunekit.problems.shapes import Problem

    problems = [Problem("gemv", "bf16", 1, 96, 256)]
    parsed = parse_restrict(["M_MODE=dot, dot_w", "MMA=1"], problems, ["triton", "hip"])
    assert parsed == {"M_MODE": ("dot", "dot_w"), "MMA": ("1",)}
    # W_EVICT is fixed (not searched: it cost served time), so it cannot be restricted either
    with pytest.raises(UserError, match="W_EVICT: no selected backend has this tunable"):
        parse_restrict(["W_EVICT=evict_first"], problems, ["triton"])
