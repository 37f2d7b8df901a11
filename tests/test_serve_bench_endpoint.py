"""tunekit serve-bench --endpoint: the A/B against running OpenAI-compatible servers (a local fake streaming
server, benchmarks/endpoint_ab.sh with stand-in `vllm serve` processes), and an endpoint folder's report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from serve_bench_helpers import REPO, RESULTS, TABLE

from tunekit.errors import UserError
from tunekit.evidence.serve_bench import bench, endpoint


def _server(tpot_s: float, seen: list[dict]) -> ThreadingHTTPServer:
    from completions_server import handler_class  # tests/ is on sys.path

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class("served-model", tpot_s, seen))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_endpoint_ab_against_fake_servers(tmp_path: Path) -> None:
    seen: list[dict] = []
    # 60 vs 30 ms per token: large against scheduling noise on a busy 2-core machine (with 20 vs 10 ms, a loaded
    # machine running the tests on two workers measured 14.8 ms for the 10: each sleep overshoots by ~5 ms)
    vanilla, tuned = _server(0.060, seen), _server(0.030, seen)
    try:
        urls = endpoint.parse_endpoints([f"tuned=http://127.0.0.1:{tuned.server_port}/v1",
                                         f"vanilla=http://127.0.0.1:{vanilla.server_port}"])
        assert list(urls) == ["vanilla", "tuned"] and not urls["tuned"].endswith("/v1")
        lines: list[str] = []
        serve = endpoint.run(urls, tmp_path, concurrency=[1, 3], tokens=8, prompt_len=5, repeats=2,
                             model="qwen3.5-27b", tables=[TABLE], log=lines.append)
    finally:
        vanilla.shutdown()
        tuned.shutdown()
    req = seen[0]
    assert req["model"] == "served-model" and req["stream"] and req["ignore_eos"] and req["temperature"] == 0
    assert isinstance(req["prompt"], list) and len(req["prompt"]) == 5 and req["max_tokens"] == 8
    # warm-up at C=3 per arm, then 2 rounds x (1 + 3) requests per arm
    assert len(seen) == 2 * 3 + 2 * 2 * 4
    arms = serve["arms"]
    assert [r["concurrency"] for r in arms["vanilla"]] == [1, 3, 1, 3]
    row1, row3 = serve["batches"]
    assert row1["vanilla_tpot_ms"] == pytest.approx(60.0, rel=0.35)
    assert row1["tuned_tpot_ms"] == pytest.approx(30.0, rel=0.35)
    assert row3["speedup"] > 1.3 and row3["speedup_min"] <= row3["speedup_max"]
    assert row1["ttft_ms"]["vanilla"] > 0 and row3["throughput_tokens_per_s"]["tuned"] > 0
    assert row1["predicted_saving_ms"] > 0  # model and table given: the full model's prediction
    assert row1["agreement"] is None and serve["mode"] == "endpoint"
    assert (tmp_path / "serve.png").is_file() and "| C |" in (tmp_path / "serve.md").read_text()
    assert any(ln.startswith("C=3") and "speedup" in ln for ln in lines)


@pytest.mark.slow  # over 10 s on 2 cores: the slow tier
def test_endpoint_script_starts_both_servers_runs_the_ab_and_stops_them(tmp_path: Path) -> None:
    """benchmarks/endpoint_ab.sh against two stand-in `vllm serve` processes (tests/data/fake_vllm_serve):
    each server gets its arm's environment and the serve options, the A/B runs, both stop cleanly."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    out, record = tmp_path / "ab", tmp_path / "record"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "data" / "fake_vllm_serve"), str(REPO)]),
           "FAKE_SERVE_RECORD": str(record), "PORT": str(port), "START_TIMEOUT": "120",
           "SERVE_BENCH_ARGS": "--concurrency 1,2 --tokens 8 --prompt-len 4 --repeats 2"}
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "endpoint_ab.sh"), sys.executable, str(model_dir),
                          str(TABLE), str(out), "--gdn-prefill-backend", "triton"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    servers = {json.loads(p.read_text())["argv"][3]: json.loads(p.read_text()) for p in record.glob("*.json")}
    vanilla, tuned = servers[str(port)], servers[str(port + 1)]
    assert "tunekit" not in (vanilla["env"]["VLLM_PLUGINS"] or "").split(",")
    assert vanilla["env"]["TUNEKIT_TABLE"] is None
    assert "tunekit" in tuned["env"]["VLLM_PLUGINS"].split(",") and tuned["env"]["TUNEKIT_TABLE"] == str(TABLE)
    for server in (vanilla, tuned):
        argv = server["argv"]
        assert argv[1] == str(model_dir) and argv[-2:] == ["--gdn-prefill-backend", "triton"]
        assert argv[argv.index("--load-format") + 1] == "dummy" and "--skip-tokenizer-init" in argv
        assert argv[argv.index("--shutdown-timeout") + 1] == "30"  # feature-detected: the engine core drains
    # stopped by SIGINT: the tuned server wrote its dispatch log on the way out, and the report merged it
    assert [p.name for p in (out / "dispatch").iterdir()] == [f"tuned-{tuned['pid']}.json"]
    serve = json.loads((out / "serve.json").read_text())
    assert serve["mode"] == "endpoint" and [b["batch"] for b in serve["batches"]] == [1, 2]
    assert all(b["speedup"] > 1.3 for b in serve["batches"])  # the tuned stand-in decodes twice as fast
    assert [b["coverage"]["tuned"]["tuned_calls"] for b in serve["batches"]] == [64, 64]
    assert endpoint.NOTE_NO_COVERAGE not in serve["notes"] and "Dispatch coverage" in (out / "serve.md").read_text()


def test_endpoint_report_says_when_the_dispatch_logs_hold_no_call(tmp_path: Path) -> None:
    """A server stopped without draining leaves its API process's log only (no call): the report says so;
    no log at all keeps the note that says how to add it."""
    # the H200's `vllm serve` A/B (vLLM 0.26.0, stopped without draining): its API server's log, 0 calls
    recorded = RESULTS / "h200-serve-fallbacks-34a4b7f" / "endpoint-llama-a4366bc"
    (tmp_path / "serve.json").write_text((recorded / "serve.json").read_text())
    got = bench.report_dir(tmp_path, log=lambda s: None)  # --report-only on an endpoint folder
    assert endpoint.NOTE_NO_COVERAGE in got["notes"] and all(b["coverage"] is None for b in got["batches"])
    assert [round(b["speedup"], 4) for b in got["batches"]] == [1.1255, 0.9696, 0.9686]  # the figures are kept
    (tmp_path / "dispatch").mkdir()
    for log in (recorded / "dispatch").iterdir():
        (tmp_path / "dispatch" / log.name).write_text(log.read_text())
    got = bench.report_dir(tmp_path, log=lambda s: None)
    assert "no call counted" in got["notes"][-1] and endpoint.NOTE_NO_COVERAGE not in got["notes"]
    count = len(got["notes"])
    got = bench.report_dir(tmp_path, log=lambda s: None)
    assert len(got["notes"]) == count  # rebuilt again: the note is replaced, not repeated


def test_endpoint_errors() -> None:
    with pytest.raises(UserError, match="vanilla=URL and tuned=URL"):
        endpoint.parse_endpoints(["vanilla=http://h:1"])
    with pytest.raises(UserError, match="ARM=http"):
        endpoint.parse_endpoints(["fast=http://h:1", "vanilla=http://h:2"])
    with pytest.raises(UserError, match="one of vanilla, passthrough, tuned"):  # a folded server is given as tuned
        endpoint.parse_endpoints(["folded=http://h:1", "vanilla=http://h:2"])
    with pytest.raises(UserError, match="no model listed"):
        endpoint.served_model("http://127.0.0.1:1", timeout=2)
