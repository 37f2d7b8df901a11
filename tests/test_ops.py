"""tunekit.ops on the CPU tier: custom ops, table hits (Triton interpreter) and misses, markers, capture, logs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tunekit
from tunekit import ops
from tunekit import table as table_mod
from tunekit.dispatch import elementwise, elementwise_fallback
from tunekit.dispatch import gemv as serving_gemv
from tunekit.measure.device import detect
from tunekit.problems import opspec, opspec_gemv
from tunekit.problems.shapes import Problem

REPO = Path(__file__).resolve().parents[1]

#: A small Triton config valid for the test shapes (interpreter: 1 warp, short K steps).
PARAMS = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 1, "num_stages": 1}
N, K = 24, 192


def _entry(op: str, m: int, n: int, k: int, backend: str = "triton", params: dict | None = None,
           dtype: str = "bf16") -> dict:
    return {"op": op, "dtype": dtype, "m": m, "n": n, "k": k, "backend": backend,
            "params": json.dumps(PARAMS if params is None else params),
            "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0}


def timed_entry(op: str, n: int, k: int, time_us: float = 1.0, m: int = 1) -> dict:
    """An entry with the Triton backend's default config for its problem, timed at ``time_us`` against a
    2 us baseline (a kernel the serving code can really build and run)."""
    from tunekit.backends import get
    from tunekit.problems.shapes import Problem

    params = get("triton").space(Problem(op, "bf16", m, n, k)).default
    return dict(_entry(op, m, n, k, params=params), time_us=time_us, speedup=2.0 / time_us)


def make_table(path: Path, rows: list[dict], device: dict | None = None) -> Path:
    """A table stamped for this machine (CPU under the interpreter) unless ``device`` says otherwise."""
    # built as Triton rows, then the backend names put back: build_table asks
    # each backend for its kernel name, which test backends need not have.
    backends = {(r["op"], r["m"], r["n"], r["k"]): r["backend"] for r in rows}
    table = table_mod.as_json(table_mod.build_table([{**r, "backend": "triton"} for r in rows],
                                                    device or detect().as_dict(), {}, 0.0, ["triton"]))
    for e in table["entries"]:
        e["backend"] = backends[(e["op"], e["m"], e["n"], e["k"])]
    return table_mod.save(table, path)


pytestmark = pytest.mark.usefixtures("clean_ops")  # conftest.py: no table, markers or vendor GEMM leak


@pytest.fixture
def gemv_table(tmp_path: Path) -> Path:
    # M=1 and M=4 tabulated for N x K: M=2..4 use the M=4 entry, M=5+ has none.
    path = make_table(tmp_path / "table.json", [_entry("gemv", 1, N, K), _entry("gemv", 4, N, K)])
    ops.load_tables(str(path))
    return path


def _rows(**match) -> list[dict]:
    return [r for r in ops.dispatch_stats() if all(r[k] == v for k, v in match.items())]


def _within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    x2 = x.reshape(-1, x.shape[-1])
    problem = Problem("gemv", "bf16", x2.shape[0], w.shape[0], w.shape[1])
    ref = opspec_gemv.GEMV.reference((x2, w))
    bound = opspec_gemv.GEMV.error_bound(problem, (x2, w), ref)
    return bool(((y.reshape(ref.shape).double() - ref).abs() <= bound).all())


def _xw(m: int, n: int = N, k: int = K, seed: int = 0, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, k), generator=gen).to(dtype)
    w = (torch.randn((n, k), generator=gen) * k**-0.5).to(dtype)
    return x, w


# ----------------------------------------------------------------------------- registration


def test_ops_are_registered_with_fake_impls() -> None:
    for op in ("gemv", *ops.ELEMENTWISE_SCHEMAS):
        assert hasattr(torch.ops.tunekit, op), op
    meta = torch.device("meta")
    y = torch.ops.tunekit.gemv(torch.empty(3, 5, K, device=meta), torch.empty(N, K, device=meta), None)
    assert y.shape == (3, 5, N) and y.device.type == "meta"
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.bfloat16)
        assert torch.ops.tunekit.rms_norm(x, w, 1e-6).shape == (2, 64)
        y, r = torch.ops.tunekit.fused_add_rms_norm(x, x, w, 1e-6)
        assert y.shape == r.shape == (2, 64)
        assert torch.ops.tunekit.silu_and_mul(x).shape == (2, 32)
        assert torch.ops.tunekit.gated_rms_norm(x, x, w[:32], 1e-6).shape == (2, 64)
        assert torch.ops.tunekit.bias_gelu(x, w).shape == (2, 64)


def test_import_tunekit_stays_light() -> None:
    code = "import sys, tunekit; print('torch' in sys.modules, 'tunekit.ops' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ----------------------------------------------------------------------------- table hits and misses


def test_table_hit_runs_the_tuned_triton_kernel_with_the_m_rule(gemv_table: Path) -> None:
    for m in (1, 2, 3, 4):
        x, w = _xw(m, seed=m)
        y = torch.ops.tunekit.gemv(x, w, None)
        assert y.shape == (m, N) and y.dtype == torch.bfloat16
        assert _within_bound(y, x, w), m
    x, w = _xw(5)
    assert torch.equal(torch.ops.tunekit.gemv(x, w, None), F.linear(x, w))  # vendor path: same bits
    x, w = _xw(2, n=32)
    torch.ops.tunekit.gemv(x, w, None)
    shape = f"{N}x{K}"
    assert [(r["m"], r["impl"], r["calls"]) for r in _rows(shape=shape)] == [
        (1, "tuned:triton", 1), (2, "tuned:triton", 1), (3, "tuned:triton", 1), (4, "tuned:triton", 1),
        (5, "fallback:m_above_table", 1)]
    assert _rows(shape=f"32x{K}")[0]["impl"] == "fallback:no_entry"
    assert all(r["counted_at"] == "call" for r in ops.dispatch_stats())
    assert tunekit.dispatch_stats() == ops.dispatch_stats()


def test_leading_dims_bias_and_padded_weight_rows(gemv_table: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((1, 3, K), generator=gen).bfloat16()
    w = (torch.randn((N, K), generator=gen) * K**-0.5).bfloat16()
    b = torch.randn(N, generator=gen).bfloat16()
    y = torch.ops.tunekit.gemv(x, w, b)
    assert y.shape == (1, 3, N)
    ref = opspec_gemv.GEMV.reference((x.reshape(3, K), w)) + b.double()
    assert (y.reshape(3, N).double() - ref).abs().max() < 0.05
    # vLLM pads weight rows on ROCm (stride(0) > K, unit stride along K): still tuned
    padded = torch.zeros((N, K + 8), dtype=torch.bfloat16)
    padded[:, :K] = w
    y2 = torch.ops.tunekit.gemv(x, padded[:, :K], None)
    assert _within_bound(y2, x, w)
    assert {r["impl"] for r in _rows(m=3)} == {"tuned:triton"}
    assert {r["bias"] for r in _rows(m=3)} == {True, False}


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda x, w: (x.half(), w.half(), None), "no_entry"),  # fp16 is servable but not tabulated
        (lambda x, w: (x, w.float(), None), "dtype"),
        (lambda x, w: (x.to(torch.int32), w.to(torch.int32), None), "dtype"),
        (lambda x, w: (torch.cat([x, x], 1)[:, ::2], w, None), "strided"),
        (lambda x, w: (x, w.t().contiguous().t(), None), "strided"),
        (lambda x, w: (x, w, torch.zeros(N, dtype=torch.float32)), "bias"),
        (lambda x, w: (x, w, torch.zeros(N + 1, dtype=torch.bfloat16)), "bias"),
        (lambda x, w: (x[:0], w, None), "empty"),
    ],
)
def test_unsupported_inputs_take_the_vendor_path(gemv_table: Path, make, reason: str) -> None:
    x, w = _xw(2)
    xa, wa, ba = make(x, w)
    try:
        expected = F.linear(xa, wa, ba)
    except RuntimeError as vendor_error:  # mixed dtypes: F.linear refuses them, and so does the op
        with pytest.raises(RuntimeError) as err:
            torch.ops.tunekit.gemv(xa, wa, ba)
        assert str(err.value) == str(vendor_error)
    else:
        assert torch.equal(torch.ops.tunekit.gemv(xa, wa, ba), expected)
    rows = ops.dispatch_stats()
    assert [r["impl"] for r in rows] == [f"fallback:{reason}"]


def test_shape_errors_are_the_vendor_paths_own(gemv_table: Path) -> None:
    x, w = _xw(2)
    with pytest.raises(RuntimeError):
        torch.ops.tunekit.gemv(x[:, :-1], w, None)
    assert ops.dispatch_stats()[0]["impl"] == "fallback:bad_input"


def test_no_table_and_unreadable_table(tmp_path: Path, caplog) -> None:
    x, w = _xw(1)
    assert torch.equal(torch.ops.tunekit.gemv(x, w, None), F.linear(x, w))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with caplog.at_level(logging.ERROR, logger="tunekit.ops"):
        rows = ops.load_tables(f"{bad}{os.pathsep}{tmp_path / 'missing.json'}")
        for _ in range(3):
            torch.ops.tunekit.gemv(x, w, None)
    assert all("error" in r for r in rows)
    assert [r["impl"] for r in ops.dispatch_stats()] == ["fallback:no_table", "fallback:table_error"]
    errors = [r for r in caplog.records if r.name == "tunekit.ops" and r.levelno == logging.ERROR]
    assert len(errors) == 2  # once per file, not per call


def test_environment_mismatch_warns_once_and_falls_back(tmp_path: Path, caplog) -> None:
    h200 = {"name": "NVIDIA H200", "arch": "sm_90", "cu_count": 132, "wave_size": 32, "l2_bytes": 1,
            "memory_bytes": 1, "runtime": "cuda 13.0", "vendor": "nvidia", "torch_device": "cuda:0"}
    path = make_table(tmp_path / "h200.json", [_entry("gemv", 1, N, K)], device=h200)
    ops.load_tables(str(path))
    x, w = _xw(1)
    with caplog.at_level(logging.WARNING, logger="tunekit.ops"):
        for _ in range(4):
            assert torch.equal(torch.ops.tunekit.gemv(x, w, None), F.linear(x, w))
    warnings = [r for r in caplog.records if r.name == "tunekit.ops" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "another environment" in warnings[0].getMessage()
    assert "gpu: table 'NVIDIA H200'" in warnings[0].getMessage()
    assert [(r["impl"], r["calls"]) for r in ops.dispatch_stats()] == [("fallback:env_mismatch", 4)]
    # the CLI refuses the same table loudly
    from tunekit import cli

    out = subprocess.run([sys.executable, "-m", "tunekit", "show", "--check", str(path)], cwd=REPO,
                         capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 2 and "does not match this environment" in out.stderr, out.stderr
    assert cli  # imported: the command exists


def test_cpu_tensors_without_the_interpreter_fall_back(gemv_table: Path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ops.load_tables(str(gemv_table))  # forget decisions made under the interpreter
    x, w = _xw(1)
    assert torch.equal(torch.ops.tunekit.gemv(x, w, None), F.linear(x, w))
    assert ops.dispatch_stats()[0]["impl"] == "fallback:interpreter_off"


def test_build_and_launch_failures_become_counted_fallbacks(tmp_path: Path, caplog) -> None:
    rows = [
        _entry("gemv", 1, N, K, params={"BLOCK_N": 3}),  # not a power of two: build refuses
        _entry("gemv", 1, 32, K, backend="test_ops:RAISING"),  # builds, raises at launch
        _entry("gemv", 1, 40, K, backend="no_such_module:X"),
    ]
    ops.load_tables(str(make_table(tmp_path / "t.json", rows)))
    with caplog.at_level(logging.WARNING, logger="tunekit.ops"):
        for n, impl in ((N, "build_error"), (32, "kernel_error"), (40, "build_error")):
            x, w = _xw(1, n=n)
            for _ in range(2):
                assert torch.equal(torch.ops.tunekit.gemv(x, w, None), F.linear(x, w))
            assert _rows(shape=f"{n}x{K}")[0] == {**_rows(shape=f"{n}x{K}")[0], "impl": f"fallback:{impl}",
                                                   "calls": 2}
    assert len([r for r in caplog.records if r.name == "tunekit.ops"]) == 3


class _RaisingBackend:
    """A backend whose kernels build and then fail at launch (test-only: ``test_ops:RAISING``)."""

    name, kind, ops = "raising", "tuned", ("gemv",)

    def unavailable_reason(self, device):
        return None

    def build(self, problem, params, device):
        def kernel(inputs, out):
            raise RuntimeError("injected launch failure")

        return kernel


RAISING = _RaisingBackend()


# ----------------------------------------------------------------------------- capture and markers


def test_capture_counts_at_capture_and_never_builds_there(gemv_table: Path, monkeypatch) -> None:
    capturing = {"on": True}
    monkeypatch.setattr(serving_gemv, "is_capturing", lambda x: capturing["on"])
    x, w = _xw(1)
    assert torch.equal(torch.ops.tunekit.gemv(x, w, None), F.linear(x, w))  # unbuilt under capture
    capturing["on"] = False
    torch.ops.tunekit.gemv(x, w, None)  # eager warm-up builds it
    capturing["on"] = True
    assert _within_bound(torch.ops.tunekit.gemv(x, w, None), x, w)
    rows = {(r["impl"], r["counted_at"]): r for r in ops.dispatch_stats()}
    assert set(rows) == {("fallback:not_built_at_capture", "capture"), ("tuned:triton", "call"),
                         ("tuned:triton", "capture")}
    assert "not counted" in rows[("tuned:triton", "capture")]["note"]
    assert "note" not in rows[("tuned:triton", "call")]
    assert "replays" in ops.dispatch_log()["note"]


def test_prepare_builds_every_served_m_without_counting(gemv_table: Path, monkeypatch) -> None:
    summary = ops.prepare("cpu")
    assert summary["keys"] == 4 and summary["tuned"] == 4 and not summary["errors"], summary
    assert ops.dispatch_stats() == []
    monkeypatch.setattr(serving_gemv, "is_capturing", lambda x: True)
    x, w = _xw(3)
    torch.ops.tunekit.gemv(x, w, None)
    assert [(r["impl"], r["counted_at"]) for r in ops.dispatch_stats()] == [("tuned:triton", "capture")]


def test_dispatch_log_is_written_at_exit(gemv_table: Path, tmp_path: Path) -> None:
    log = tmp_path / "dispatch-{pid}.json"
    code = (
        "import torch, tunekit.ops\n"
        f"x = torch.randn(1, {K}).bfloat16(); w = torch.randn({N}, {K}).bfloat16()\n"
        "for _ in range(3): torch.ops.tunekit.gemv(x, w, None)\n"
        "torch.ops.tunekit.gemv(x.half(), w.half(), None)\n"
        "print(__import__('os').getpid())\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "TUNEKIT_TABLE": str(gemv_table),
           "TUNEKIT_DISPATCH_LOG": str(log), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    written = json.loads((tmp_path / f"dispatch-{out.stdout.strip()}.json").read_text())
    assert written["format"] == ops.STATS_FORMAT and "replays" in written["note"]
    assert written["tables"][0]["path"] == str(gemv_table) and written["tables"][0]["entries"] == 2
    assert {(c["impl"], c["calls"]) for c in written["calls"]} == {("tuned:triton", 3), ("fallback:no_entry", 1)}


@pytest.mark.parametrize("ending", ["returns", "killed"])
def test_a_forked_worker_writes_its_own_dispatch_log(gemv_table: Path, tmp_path: Path, ending: str) -> None:
    # vLLM's engine core is a multiprocessing child forked from the process that loaded the plugin:
    # it inherits the registration and leaves through os._exit, which skips atexit, or is killed by
    # its server's SIGTERM while it tears down. Its calls are the model's, so its own log must be
    # written on the child's exit path ("returns", no rewrites) and while it runs ("killed").
    log = tmp_path / "dispatch-{pid}.json"
    code = (
        "import multiprocessing as mp, os, signal, time, torch, tunekit.ops\n"
        "def work():\n"
        f"    x = torch.randn(1, {K}).bfloat16(); w = torch.randn({N}, {K}).bfloat16()\n"
        "    for _ in range(2): torch.ops.tunekit.gemv(x, w, None)\n"
        "    print(os.getpid(), flush=True)\n"
        f"    if {ending == 'killed'}:\n"
        "        time.sleep(2.0)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "if __name__ == '__main__':\n"
        "    child = mp.get_context('fork').Process(target=work)\n"
        "    child.start(); child.join(120)\n"
        f"    assert child.exitcode == {-9 if ending == 'killed' else 0}, child.exitcode\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "TUNEKIT_TABLE": str(gemv_table),
           "TUNEKIT_DISPATCH_LOG": str(log), "PYTHONPATH": str(REPO),
           "TUNEKIT_DISPATCH_LOG_INTERVAL": "0.3" if ending == "killed" else "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    child = json.loads((tmp_path / f"dispatch-{out.stdout.strip()}.json").read_text())
    assert child["pid"] == int(out.stdout.strip())
    assert [(c["impl"], c["calls"]) for c in child["calls"]] == [("tuned:triton", 2)]


# ----------------------------------------------------------------------------- torch.compile


def compile_capturing(fn):
    """``fn`` compiled whole (fresh Dynamo), and the list its FX graphs are appended to as they are traced."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True), graphs


def _graphs_of(fn, *args):
    compiled, graphs = compile_capturing(fn)
    return compiled(*args), graphs


def test_gemv_stays_one_opaque_node_under_torch_compile(gemv_table: Path) -> None:
    x, w = _xw(2)
    b = torch.randn(N).bfloat16()

    def f(x):
        return torch.ops.tunekit.gemv(x, w, b).relu()

    with torch.no_grad():
        y, graphs = _graphs_of(f, x)
        assert torch.equal(y, f(x))
        targets = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
        assert sum(str(t).startswith("tunekit.gemv") for t in targets) == 1
        assert not any("linear" in str(t) or "mm" in str(t) for t in targets)
        torch._dynamo.reset()
        aot = torch.compile(f, backend="aot_eager", dynamic=True)
        for m in (2, 3, 5):  # one graph, the choice of kernel happens inside the op, per M
            x, _ = _xw(m, seed=m)
            assert torch.equal(aot(x), f(x))
    impls = {(r["m"], r["impl"]) for r in ops.dispatch_stats()}
    assert (3, "tuned:triton") in impls and (5, "fallback:m_above_table") in impls


def test_elementwise_ops_stay_opaque_under_torch_compile() -> None:
    x = torch.randn(3, 64).bfloat16()
    w = torch.randn(64).bfloat16()

    def f(x):
        y, r = torch.ops.tunekit.fused_add_rms_norm(x, x, w, 1e-6)
        return torch.ops.tunekit.silu_and_mul(torch.ops.tunekit.rms_norm(y + r, w, 1e-6))

    y, graphs = _graphs_of(f, x)
    assert torch.equal(y, f(x))
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum(t.startswith("tunekit.") for t in targets) == 3


# ----------------------------------------------------------------------------- elementwise


def _hf_rms(x, w, eps, gemma=False):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + w.float())).to(x.dtype) if gemma else w * xf.to(x.dtype)


def test_elementwise_vendor_paths_match_the_reference_math() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=gen).bfloat16()
    r = torch.randn(2, 3, 64, generator=gen).bfloat16()
    w = torch.randn(64, generator=gen).bfloat16()
    eps = 1e-5
    assert torch.equal(torch.ops.tunekit.rms_norm(x, w, eps), _hf_rms(x, w, eps))
    assert torch.equal(torch.ops.tunekit.gemma_rms_norm(x, w, eps), _hf_rms(x, w, eps, gemma=True))
    y, res = torch.ops.tunekit.fused_add_rms_norm(x, r, w, eps)
    s = (x.float() + r.float()).to(x.dtype)
    assert torch.equal(res, s)
    assert (y.float() - _hf_rms(x.float() + r.float(), w.float(), eps)).abs().max() < 0.05
    assert torch.equal(torch.ops.tunekit.silu_and_mul(x), F.silu(x[..., :32]) * x[..., 32:])
    assert torch.equal(torch.ops.tunekit.bias_gelu(x, w), F.gelu(x + w, approximate="tanh"))
    z = torch.randn(2, 3, 64, generator=gen).bfloat16()
    g = torch.ops.tunekit.gated_rms_norm(x, z, w[:32], eps)
    ref = opspec.get("gated_rms_norm").reference((x.reshape(6, 64), z.reshape(6, 64), w[:32]))
    assert (g.reshape(6, 64).double() - ref).abs().max() < 0.05
    y2, _ = torch.ops.tunekit.gemma_fused_add_rms_norm(x, r, w, eps)
    assert (y2.float() - _hf_rms(x.float() + r.float(), w.float(), eps, gemma=True)).abs().max() < 0.05
    impls = {r["op"]: r["impl"] for r in ops.dispatch_stats()}
    assert impls == {op: "fallback:no_table" for op in ops.ELEMENTWISE_SCHEMAS}
    assert {r["shape"] for r in ops.dispatch_stats() if r["op"] == "gated_rms_norm"} == {"192x32"}


class _TorchNormBackend:
    """Test backend (``test_ops:TORCH_NORM``): rms_norm kernels in torch, taking eps like the real ones."""

    name, kind, ops = "torchnorm", "tuned", ("rms_norm", "fused_add_rms_norm")

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def unavailable_reason(self, device):
        return None

    def build(self, problem, params, device):
        def kernel(inputs, out, eps=1e-6):
            self.calls.append((problem.op, problem.m, eps))
            if problem.op == "rms_norm":
                out.copy_(_hf_rms(inputs[0], inputs[1], eps))
            else:
                x, r, w = inputs
                out[1].copy_(x + r)
                out[0].copy_(_hf_rms(out[1], w, eps))

        return kernel


TORCH_NORM = _TorchNormBackend()


def test_elementwise_tuned_path_passes_eps_and_the_rows(tmp_path: Path) -> None:
    rows = [_entry("rms_norm", 8, 64, 64, backend="test_ops:TORCH_NORM", params={}),
            _entry("fused_add_rms_norm", 8, 64, 64, backend="test_ops:TORCH_NORM", params={})]
    ops.load_tables(str(make_table(tmp_path / "ew.json", rows)))
    TORCH_NORM.calls.clear()
    x = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    assert torch.equal(torch.ops.tunekit.rms_norm(x, w, 1e-5), _hf_rms(x, w, 1e-5))
    y, s = torch.ops.tunekit.fused_add_rms_norm(x, x, w, 1e-5)
    assert y.shape == s.shape == x.shape and torch.equal(s, x + x)
    assert TORCH_NORM.calls == [("rms_norm", 6, 1e-5), ("fused_add_rms_norm", 6, 1e-5)]
    assert {r["impl"] for r in ops.dispatch_stats()} == {"tuned:test_ops:TORCH_NORM"}
    torch.ops.tunekit.rms_norm(x[:, :, :32].contiguous(), w[:32], 1e-5)  # a width the table does not hold
    assert _rows(op="rms_norm", shape="32x32")[0]["impl"] == "fallback:no_entry"


def test_fallbacks_run_the_installed_vendor_kernel_and_the_markers_name_it(tmp_path: Path, caplog) -> None:
    ops.load_tables(str(make_table(tmp_path / "ew.json", [
        _entry("rms_norm", 4, 64, 64, backend="test_ops:TORCH_NORM", params={})])))
    x = torch.randn(9, 64).bfloat16()  # M above the table's M=4
    w = torch.randn(64).bfloat16()
    seen: list[tuple[int, ...]] = []

    def vendor_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return _hf_rms(x, w, eps)

    def broken(*args):
        raise RuntimeError("no kernel image")

    try:
        torch.ops.tunekit.rms_norm(x, w, 1e-6)  # nothing installed: tunekit's default-config kernel
        ops.set_vendor_elementwise("rms_norm", vendor_rms_norm, "test.rms_norm", ("cpu",))
        assert torch.equal(torch.ops.tunekit.rms_norm(x, w, 1e-6), _hf_rms(x, w, 1e-6))
        torch.ops.tunekit.rms_norm(x[:2], w, 1e-6)  # a table hit never reaches the vendor kernel
        torch.ops.tunekit.rms_norm(torch.randn(9, 128).bfloat16()[:, ::2], w, 1e-6)  # nor inputs failing a check
        assert seen == [(9, 64)]
        ops.set_vendor_elementwise("rms_norm", vendor_rms_norm, "test.rms_norm", ("cuda",))  # not for CPU tensors
        torch.ops.tunekit.rms_norm(x, w, 1e-6)  # no vendor kernel for the CPU: the default-config kernel
        ops.set_vendor_elementwise("rms_norm", broken, "test.broken", ("cpu",))
        with caplog.at_level(logging.WARNING, logger="tunekit.ops"):
            for _ in range(2):  # never raises; logged once
                assert torch.equal(torch.ops.tunekit.rms_norm(x, w, 1e-6),
                                   elementwise._vendor_rms_norm(x, w, 1e-6, False))
        assert len([r for r in caplog.records if "test.broken" in r.getMessage()]) == 1
        ops.set_vendor_elementwise("rms_norm", None, "looked, found none")
        torch.ops.tunekit.rms_norm(x, w, 1e-6)  # the default-config kernel again
        assert ops.vendor_kernels()["rms_norm"] == {"name": "eager:no_vendor_kernel", "device_types": [],
                                                    "why": "looked, found none"}
        assert ops.dispatch_log()["vendors"]["rms_norm"]["why"] == "looked, found none"
        with pytest.raises(ValueError):
            ops.set_vendor_elementwise("gemv", vendor_rms_norm, "test", ("cpu",))
    finally:
        ops.clear_vendor_elementwise()
    got = {(r["m"], r["impl"], r["vendor"]): r["calls"] for r in ops.dispatch_stats()}
    assert got == {
        (9, "fallback:m_above_table", ops.DEFAULT_VENDOR): 3,
        (9, "fallback:m_above_table", "test.rms_norm"): 1,
        (2, "tuned:test_ops:TORCH_NORM", None): 1,
        (9, "fallback:strided", "eager"): 1,
        (9, "fallback:m_above_table", "eager:vendor_error"): 2,
    }
    # gemv's fallbacks name theirs too (CPU tensors: always F.linear)
    torch.ops.tunekit.gemv(torch.randn(2, K).bfloat16(), torch.randn(N, K).bfloat16())
    assert _rows(op="gemv")[0]["vendor"] == "F.linear"


def test_covers_follows_the_loaded_tables(tmp_path: Path) -> None:
    assert not ops.covers("gemv", "bf16", N, K, "cpu")
    ops.load_tables(str(make_table(tmp_path / "t.json", [_entry("gemv", 1, N, K)])))
    for _ in range(2):  # the second answer is the cached one
        assert ops.covers("gemv", "bf16", N, K, "cpu")
        assert not ops.covers("gemv", "bf16", N, 2 * K, "cpu") and not ops.covers("gemv", "fp16", N, K, "cpu")
    ops.load_tables([])
    assert not ops.covers("gemv", "bf16", N, K, "cpu")


def _triton_has(op: str) -> bool:
    from tunekit import backends

    return op in backends.get("triton").ops


def _triton_has_kernels() -> bool:
    return _triton_has("rms_norm")


def test_strided_elementwise_inputs_fall_back_to_dense_results() -> None:
    # rows that no [m, width] view holds (a transpose) or strided inside a row
    t = torch.randn(4, 3, 64).bfloat16().transpose(0, 1)
    assert torch.ops.tunekit.silu_and_mul(t).is_contiguous()
    x = torch.randn(3, 128).bfloat16()[:, ::2]
    w = torch.randn(64).bfloat16()
    y = torch.ops.tunekit.rms_norm(x, w, 1e-6)
    assert y.is_contiguous() and torch.equal(y, _hf_rms(x.contiguous(), w, 1e-6))
    assert [r["impl"] for r in ops.dispatch_stats()] == ["fallback:strided", "fallback:strided"]


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
def test_row_strided_inputs_are_served_through_the_kernels_row_stride(tmp_path: Path) -> None:
    # HF Qwen3.5's q_norm: q and its gate interleaved per head, q = every other head_dim slice
    entries = [_entry("gemma_rms_norm", 8, 64, 64, params={}), _entry("gated_rms_norm", 2, 128, 32, params={}),
               _entry("silu_and_mul", 4, 48, 96, params={})]
    ops.load_tables(str(make_table(tmp_path / "ew.json", entries)))
    gen = torch.Generator().manual_seed(3)
    qg = torch.randn(2, 4, 2 * 64, generator=gen).bfloat16()
    q = qg[..., :64]  # [tokens, heads, head_dim], rows 128 apart
    w = torch.randn(64, generator=gen).bfloat16()
    y = torch.ops.tunekit.gemma_rms_norm(q, w, 1e-6)
    want = elementwise._vendor_rms_norm(q.contiguous(), w, 1e-6, True)
    assert y.is_contiguous() and y.shape == q.shape
    assert ((y.float() - want.float()).abs() <= 2**-6 * want.float().abs() + 1e-3).all()
    h = torch.randn(2, 6, 32, generator=gen).bfloat16()[:, :4]  # tokens 6*32 apart, heads contiguous
    z = torch.randn(2, 4, 32, generator=gen).bfloat16()
    g = torch.ops.tunekit.gated_rms_norm(h, z, w[:32], 1e-6)
    want = elementwise._vendor_gated(h.contiguous(), z, w[:32], 1e-6)
    assert ((g.float() - want.float()).abs() <= 2**-6 * want.float().abs() + 1e-3).all()
    a = torch.randn(4, 100, generator=gen).bfloat16()[:, :96]
    s = torch.ops.tunekit.silu_and_mul(a)
    want = elementwise._vendor_silu_and_mul(a.contiguous())
    assert ((s.float() - want.float()).abs() <= 2**-6 * want.float().abs() + 1e-3).all()
    assert [r["impl"] for r in ops.dispatch_stats()] == ["tuned:triton"] * 3




@pytest.mark.skipif(not _triton_has("rms_norm"), reason="kernels_triton has no elementwise kernels yet")
def test_elementwise_ops_launch_the_real_triton_kernels(tmp_path: Path) -> None:
    shapes = (("rms_norm", 64, 64), ("fused_add_rms_norm", 64, 64), ("gemma_rms_norm", 64, 64),
              ("gated_rms_norm", 128, 32), ("silu_and_mul", 48, 96), ("bias_gelu", 64, 64))
    ops.load_tables(str(make_table(tmp_path / "ew.json", [_entry(op, 4, n, k, params={}) for op, n, k in shapes])))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    w = torch.randn(64, generator=gen).bfloat16()
    h = torch.randn(3, 4, 32, generator=gen).bfloat16()  # [tokens, heads, head_dim]
    a = torch.randn(3, 96, generator=gen).bfloat16()

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:  # BF16 results, a rounding or two apart
        return bool(((got.float() - want.float()).abs() <= 2**-6 * want.float().abs() + 1e-3).all())

    assert close(torch.ops.tunekit.rms_norm(x, w, 1e-6), elementwise._vendor_rms_norm(x, w, 1e-6, False))
    assert close(torch.ops.tunekit.gemma_rms_norm(x, w, 1e-6), elementwise._vendor_rms_norm(x, w, 1e-6, True))
    y, s = torch.ops.tunekit.fused_add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(s, x + x) and close(y, elementwise._vendor_fused_add(x, x, w, 1e-6, False)[0])
    assert close(torch.ops.tunekit.gated_rms_norm(h, h, w[:32], 1e-6), elementwise._vendor_gated(h, h, w[:32], 1e-6))
    assert close(torch.ops.tunekit.silu_and_mul(a), elementwise._vendor_silu_and_mul(a))
    assert close(torch.ops.tunekit.bias_gelu(x, w), elementwise._vendor_bias_gelu(x, w))
    # eps is the kernels' run-time argument: a model's own epsilon (Llama-3.1: 1e-5) is served tuned.
    # Rows of small values (mean square ~1e-6) make the two epsilons' results far apart.
    small = x * 2**-10
    for eps in (1e-5, 1e-6, 1e-5):
        assert close(torch.ops.tunekit.rms_norm(small, w, eps), elementwise._vendor_rms_norm(small, w, eps, False))
        y, s = torch.ops.tunekit.fused_add_rms_norm(small, small, w, eps)
        assert close(y, elementwise._vendor_fused_add(small, small, w, eps, False)[0])
    assert not close(torch.ops.tunekit.rms_norm(small, w, 1e-5), elementwise._vendor_rms_norm(small, w, 1e-6, False))
    impls = {(r["op"], r["impl"]) for r in ops.dispatch_stats()}
    assert {impl for _, impl in impls} == {"tuned:triton"}
    assert {op for op, _ in impls} == {op for op, _, _ in shapes}


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
def test_gated_norm_in_another_row_layout_is_served_by_the_tabulated_one(tmp_path: Path) -> None:
    # the table holds vLLM's layout [tokens, heads * head_dim]; HF calls [tokens * heads, head_dim]
    ops.load_tables(str(make_table(tmp_path / "g.json", [_entry("gated_rms_norm", 1, 4 * 32, 32, params={})])))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 32, generator=gen).bfloat16()
    z = torch.randn(4, 32, generator=gen).bfloat16()
    w = torch.randn(32, generator=gen).bfloat16()
    y = torch.ops.tunekit.gated_rms_norm(x, z, w, 1e-6)
    want = elementwise._vendor_gated(x, z, w, 1e-6)
    assert y.shape == x.shape and ((y.float() - want.float()).abs() <= 2**-6 * want.float().abs() + 1e-3).all()
    torch.ops.tunekit.gated_rms_norm(x[:3], z[:3], w, 1e-6)  # 96 elements: no tabulated grouping of them
    assert [(r["shape"], r["m"], r["impl"]) for r in ops.dispatch_stats()] == [
        ("128x32", 1, "tuned:triton"), ("32x32", 3, "fallback:no_entry")]


def test_an_entry_whose_config_cannot_run_a_smaller_m_is_a_reasoned_fallback(tmp_path: Path) -> None:
    # M=4's winner uses per-row accumulators, which M=1 cannot run: M=1 takes the vendor path, M=2 the kernel.
    rows_params = dict(PARAMS, M_MODE="rows")
    path = make_table(tmp_path / "table.json", [_entry("gemv", 4, N, K, params=rows_params)])
    ops.load_tables(str(path))
    for m in (1, 2):
        x, w = _xw(m, seed=m)
        y = torch.ops.tunekit.gemv(x, w, None)
        assert _within_bound(y, x, w)
    impls = {r["m"]: r["impl"] for r in _rows(shape=f"{N}x{K}")}
    assert impls == {1: "fallback:config_invalid_at_m", 2: "tuned:triton"}
    assert "config_invalid_at_m" in ops.FALLBACK_REASONS


# ----------------------------------------------------------------------------- default-config kernel


def _gemma_table(tmp_path: Path, n: int = 64, backend: str = "triton", params: dict | None = None) -> None:
    """Gemma norms of width ``n`` tabulated at M=4 (Triton unless ``backend``): M=9 is above the table."""
    entries = [_entry("gemma_rms_norm", 4, n, n, backend, params=params or {}),
               _entry("gemma_fused_add_rms_norm", 4, n, n, backend, params=params or {})]
    ops.load_tables(str(make_table(tmp_path / "gemma.json", entries)))


def _within_op_bound(op: str, got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...],
                     inputs: tuple[torch.Tensor, ...]) -> bool:
    """Every output of ``got`` within the op's BF16 bound (OpSpec.error_bound, verify's) of ``want``."""
    m, n = inputs[0].shape
    spec = opspec.get(op)
    ref = spec.reference(inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    bound = spec.error_bound(Problem(op, "bf16", m, n, n), inputs, ref)
    bounds = bound if isinstance(bound, tuple) else (bound,)
    return all(bool(((g.double() - w.double()).abs() <= b).all())
               for g, w, b in zip(got, want or refs, bounds, strict=True))


def _count_builds(monkeypatch) -> list[tuple]:
    from tunekit import backends

    backend = backends.get("triton")
    original = backend.build
    built: list[tuple] = []

    def build(problem, params, device):
        built.append((problem.op, problem.m, tuple(sorted(params.items()))))
        return original(problem, params, device)

    monkeypatch.setattr(backend, "build", build)
    return built


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
@pytest.mark.parametrize("width", [64, 1536])  # one pass, and the default BLOCK_N=1024's chunked two passes
def test_gemma_norm_above_the_table_without_a_vendor_kernel_runs_the_default_config_kernel(
        tmp_path: Path, monkeypatch, width: int) -> None:
    # the table's entries are HIP's: no Triton config of the shape to borrow, so the family's default serves
    _gemma_table(tmp_path, width, backend="hip", params={"THREADS_PER_ROW": 64, "ROWS_PER_BLOCK": 1, "VEC": 1})
    built = _count_builds(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, width, generator=gen).bfloat16()
    r = torch.randn(9, width, generator=gen).bfloat16()
    w = (torch.randn(width, generator=gen) * 0.3).bfloat16()
    eps = ops.DEFAULT_EPS
    for _ in range(2):  # built once per key, then the cached kernel
        y = torch.ops.tunekit.gemma_rms_norm(x, w, eps)
        assert _within_op_bound("gemma_rms_norm", (y,), (), (x, w))  # the fp64 reference
        assert _within_op_bound("gemma_rms_norm", (y,), (elementwise._vendor_rms_norm(x, w, eps, True),), (x, w))
        y2, s = torch.ops.tunekit.gemma_fused_add_rms_norm(x, r, w, eps)
        comp = elementwise._vendor_fused_add(x, r, w, eps, True)
        assert torch.equal(s, comp[1])  # the residual sum: one rounding either way
        assert _within_op_bound("gemma_fused_add_rms_norm", (y2, s), (), (x, r, w))
        assert _within_op_bound("gemma_fused_add_rms_norm", (y2, s), comp, (x, r, w))
    default = {"BLOCK_N": 1024, "ROWS": 1, "num_warps": 4, "VLLM_ROUNDING": 1}  # search_spaces' default + fixed
    assert built == [("gemma_rms_norm", 9, tuple(sorted(default.items()))),
                     ("gemma_fused_add_rms_norm", 9, tuple(sorted(default.items())))]
    # an integration that looked and found no kernel (vLLM's GemmaRMSNorm) is served the same way
    try:
        ops.set_vendor_elementwise("gemma_rms_norm", None, "no kernel in this engine")
        torch.ops.tunekit.gemma_rms_norm(x, w, eps)
    finally:
        ops.clear_vendor_elementwise()
    got = {(r["op"], r["m"], r["impl"], r["vendor"]): r["calls"] for r in ops.dispatch_stats()}
    assert got == {("gemma_rms_norm", 9, "fallback:m_above_table", ops.DEFAULT_VENDOR): 3,
                   ("gemma_fused_add_rms_norm", 9, "fallback:m_above_table", ops.DEFAULT_VENDOR): 2}
    assert ops.DEFAULT_VENDOR in ops.dispatch_log()["default_vendor"]


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
def test_above_the_table_the_fallback_kernel_borrows_the_nearest_tuned_config(tmp_path: Path, monkeypatch) -> None:
    """A row op computes each row alone, so the Triton config tuned at M=4 for this shape serves M=9 (the
    search measured the generic default slower than Inductor; the tuned one-pass configs faster). A
    config that cannot run the call's M leaves the generic default."""
    from tunekit import backends

    tuned = {"BLOCK_N": 2048, "ROWS": 2, "num_warps": 2}
    _gemma_table(tmp_path, 1536, params=tuned)
    built = _count_builds(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, 1536, generator=gen).bfloat16()
    w = (torch.randn(1536, generator=gen) * 0.3).bfloat16()
    y = torch.ops.tunekit.gemma_rms_norm(x, w, ops.DEFAULT_EPS)
    assert _within_op_bound("gemma_rms_norm", (y,), (), (x, w))
    assert built == [("gemma_rms_norm", 9, tuple(sorted((tuned | {"VLLM_ROUNDING": 1}).items())))]
    assert {(r["m"], r["impl"], r["vendor"]) for r in ops.dispatch_stats()} == {
        (9, "fallback:m_above_table", ops.DEFAULT_VENDOR)}
    backend = backends.get("triton")
    check = backend.invalid_reason
    monkeypatch.setattr(backend, "invalid_reason",
                        lambda problem, params: "no" if params.get("BLOCK_N") == 2048 else check(problem, params))
    y = torch.ops.tunekit.gemma_rms_norm(x[:7], w, ops.DEFAULT_EPS)
    assert _within_op_bound("gemma_rms_norm", (y,), (), (x[:7], w))
    default = {"BLOCK_N": 1024, "ROWS": 1, "num_warps": 4, "VLLM_ROUNDING": 1}  # search_spaces' default + fixed
    assert built[1:] == [("gemma_rms_norm", 7, tuple(sorted(default.items())))]
    # the nearest M below the call's is preferred, then the nearest above
    entries = [table_mod.Entry("rms_norm", "bf16", m, 8, 8, "triton", "k", {"M": m}, 1.0, 2.0, 2.0, 1.0)
               for m in (1, 4, 16)]
    nearest = elementwise_fallback._nearest_config
    assert [nearest(entries, "rms_norm", "bf16", m, 8, 8, "triton") for m in (2, 9, 32)] == [
        {"M": 1}, {"M": 4}, {"M": 16}]
    assert nearest(entries, "rms_norm", "bf16", 2, 8, 8, "hip") is None


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
def test_an_installed_vendor_kernel_is_preferred_to_the_default_config_kernel(tmp_path: Path, monkeypatch) -> None:
    _gemma_table(tmp_path)
    built = _count_builds(monkeypatch)
    x = torch.randn(9, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    seen: list[tuple[int, ...]] = []

    def vendor(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return _hf_rms(x, w, eps, gemma=True)

    try:
        ops.set_vendor_elementwise("gemma_rms_norm", vendor, "test.gemma", ("cpu",))
        assert torch.equal(torch.ops.tunekit.gemma_rms_norm(x, w, 1e-6), _hf_rms(x, w, 1e-6, gemma=True))
    finally:
        ops.clear_vendor_elementwise()
    assert seen == [(9, 64)] and built == []
    assert [(r["impl"], r["vendor"]) for r in ops.dispatch_stats()] == [("fallback:m_above_table", "test.gemma")]
    # prepare() builds the tabulated Ms and leaves those above the table to an installed vendor kernel
    try:
        ops.set_vendor_elementwise("gemma_rms_norm", vendor, "test.gemma", ("cpu",))
        ops.set_vendor_elementwise("gemma_fused_add_rms_norm", vendor, "test.gemma", ("cpu",))
        summary = ops.prepare("cpu", ms=[4, 16])
    finally:
        ops.clear_vendor_elementwise()
    assert summary["keys"] == summary["tuned"] == 2 and summary["default"] == 0, summary
    assert [b[:2] for b in built] == [("gemma_fused_add_rms_norm", 4), ("gemma_rms_norm", 4)]


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
def test_a_vendor_path_of_several_launches_comes_after_the_default_kernel(tmp_path: Path, monkeypatch) -> None:
    """vLLM's fused add served functionally is an add and a norm: two launches. The default-config kernel
    (one launch) serves first; the vendor path only where that cannot, ahead of the composition."""
    from tunekit import backends

    ops.load_tables(str(make_table(tmp_path / "add.json", [_entry("fused_add_rms_norm", 4, 64, 64, params={})])))
    x, r, w = torch.randn(9, 64).bfloat16(), torch.randn(9, 64).bfloat16(), torch.randn(64).bfloat16()
    want = elementwise._vendor_fused_add(x, r, w, 1e-6, False)
    seen: list[int] = []

    def add_then_norm(x, residual, weight, eps):
        seen.append(x.shape[0])
        return elementwise._vendor_fused_add(x, residual, weight, eps, False)

    def close(got, ref) -> bool:
        return all(((g.float() - f.float()).abs() <= 2**-6 * f.float().abs() + 1e-3).all()
                   for g, f in zip(got, ref, strict=True))

    try:
        ops.set_vendor_elementwise("fused_add_rms_norm", add_then_norm, "test.add_then_norm", ("cpu",),
                                   single_launch=False)
        assert close(torch.ops.tunekit.fused_add_rms_norm(x, r, w, 1e-6), want)  # M=9: above the table
        assert seen == []
        with monkeypatch.context() as mp:  # no default kernel here: the vendor path, not the composition
            mp.setattr(backends.get("triton"), "unavailable_reason", lambda device: "triton is not installed")
            assert close(torch.ops.tunekit.fused_add_rms_norm(x[:7], r[:7], w, 1e-6), tuple(t[:7] for t in want))
        assert seen == [7]
        ops.set_vendor_elementwise("fused_add_rms_norm", add_then_norm, "test.one_launch", ("cpu",))
        torch.ops.tunekit.fused_add_rms_norm(x[:8], r[:8], w, 1e-6)  # a single-launch vendor comes first
        assert seen == [7, 8]
    finally:
        ops.clear_vendor_elementwise()
    got = {(r["m"], r["vendor"]) for r in ops.dispatch_stats()}
    assert got == {(9, "tunekit:triton-default"), (7, "test.add_then_norm"), (8, "test.one_launch")}
    # the warm-up builds the default kernel above the table for a several-launch vendor (a capture then
    # holds it), and leaves those sizes to a single-launch one
    try:
        ops.set_vendor_elementwise("fused_add_rms_norm", add_then_norm, "test.add_then_norm", ("cpu",),
                                   single_launch=False)
        assert ops.prepare("cpu", ms=[4, 16])["default"] == 1
        ops.set_vendor_elementwise("fused_add_rms_norm", add_then_norm, "test.one_launch", ("cpu",))
        assert ops.prepare("cpu", ms=[4, 32])["keys"] == 1  # M=4 only
    finally:
        ops.clear_vendor_elementwise()


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
def test_a_vendor_kernel_the_engine_would_not_run_comes_after_the_default_kernel(tmp_path: Path) -> None:
    """vLLM under Inductor compiles SiLU-and-mul's native math; its _C kernel is then not what it would
    have run (and was 3x slower at M=2..8 on the H200). Told so, the op serves fallbacks with the
    default-config kernel first, and the warm-up builds that kernel above the table; told the engine
    runs the vendor kernel again, the vendor kernel serves first."""
    ops.load_tables(str(make_table(tmp_path / "silu.json", [_entry("silu_and_mul", 4, 48, 96, params={})])))
    x = torch.randn(9, 96).bfloat16()
    want = F.silu(x[:, :48]) * x[:, 48:]
    seen: list[int] = []

    def vendor(t):
        seen.append(t.shape[0])
        return F.silu(t[..., :48]) * t[..., 48:]

    try:
        ops.set_vendor_elementwise("silu_and_mul", vendor, "test.c_silu", ("cpu",))
        ops.set_engine_runs_vendor("silu_and_mul", False)
        assert ops.vendor_kernels()["silu_and_mul"]["serves_first"] is False
        got = torch.ops.tunekit.silu_and_mul(x)  # M=9: above the table
        assert ((got.float() - want.float()).abs() <= 2**-6 * want.float().abs() + 1e-3).all()
        assert seen == []
        assert ops.prepare("cpu", ms=[4, 16])["default"] == 1  # built above the table before any capture
        ops.set_engine_runs_vendor("silu_and_mul", True)
        torch.ops.tunekit.silu_and_mul(x[:8])
        assert seen == [8]
        ops.set_engine_runs_vendor("silu_and_mul", False)
        ops.clear_vendor_elementwise()  # forgets the engine's choice with the kernels
        ops.set_vendor_elementwise("silu_and_mul", vendor, "test.c_silu", ("cpu",))
        assert ops.vendor_kernels()["silu_and_mul"]["serves_first"] is True
    finally:
        ops.clear_vendor_elementwise()
    got = {(r["m"], r["vendor"]) for r in ops.dispatch_stats() if r["impl"].startswith("fallback")}
    assert got == {(9, "tunekit:triton-default"), (8, "test.c_silu")}
    with pytest.raises(ValueError, match="unknown elementwise op"):
        ops.set_engine_runs_vendor("gemv", False)


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
def test_default_config_kernel_failures_fall_back_to_the_composition_with_a_counted_reason(
        tmp_path: Path, monkeypatch, caplog) -> None:
    from tunekit import backends

    _gemma_table(tmp_path)
    backend = backends.get("triton")
    x = torch.randn(9, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    comp = elementwise._vendor_rms_norm(x, w, 1e-6, True)

    def no_build(problem, params, device):
        raise RuntimeError("ptxas died")

    with monkeypatch.context() as mp, caplog.at_level(logging.WARNING, logger="tunekit.ops"):
        mp.setattr(backend, "build", no_build)
        for _ in range(2):  # never raises; logged once; the key keeps the composition
            assert torch.equal(torch.ops.tunekit.gemma_rms_norm(x, w, 1e-6), comp)
    assert len([r for r in caplog.records if "ptxas died" in r.getMessage()]) == 1
    with monkeypatch.context() as mp:
        mp.setattr(backend, "unavailable_reason", lambda device: "triton is not installed")
        assert torch.equal(torch.ops.tunekit.gemma_rms_norm(x[:7], w, 1e-6), comp[:7])
    build = backend.build

    def fixed_eps_build(problem, params, device):  # a kernel built for one epsilon, as HIP's are
        kernel = build(problem, params, device)
        return lambda inputs, out: kernel(inputs, out)

    with monkeypatch.context() as mp:
        mp.setattr(backend, "build", fixed_eps_build)
        torch.ops.tunekit.gemma_rms_norm(x[:6], w, 1e-5)
    assert torch.equal(torch.ops.tunekit.gemma_rms_norm(x[:6].half(), w.half(), 1e-6),
                       elementwise._vendor_rms_norm(x[:6].half(), w.half(), 1e-6, True))  # BF16 kernels only

    def broken_launch(problem, params, device):
        def kernel(inputs, out):
            raise RuntimeError("illegal memory access")

        return kernel

    with monkeypatch.context() as mp:
        mp.setattr(backend, "build", broken_launch)
        for _ in range(2):
            assert torch.equal(torch.ops.tunekit.gemma_rms_norm(x[:5], w, 1e-6), comp[:5])
    got = {(r["m"], r["impl"], r["vendor"]): r["calls"] for r in ops.dispatch_stats()}
    assert got == {(9, "fallback:m_above_table", "eager:default_build_error"): 2,
                   (7, "fallback:m_above_table", "eager:default_unavailable"): 1,
                   (6, "fallback:m_above_table", "eager:default_eps"): 1,
                   (6, "fallback:no_entry", "eager:default_dtype"): 1,
                   (5, "fallback:m_above_table", "eager:default_kernel_error"): 2}
    assert all(v in ops.EAGER_VENDORS for _, _, v in got)


@pytest.mark.skipif(not _triton_has_kernels(), reason="kernels_triton has no elementwise kernels yet")
def test_capture_before_build_keeps_the_composition_and_prepare_builds_the_default(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    _gemma_table(tmp_path)
    capturing = {"on": True}
    monkeypatch.setattr(elementwise, "is_capturing", lambda x: capturing["on"])
    x = torch.randn(9, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    comp = elementwise._vendor_rms_norm(x, w, 1e-6, True)
    assert torch.equal(torch.ops.tunekit.gemma_rms_norm(x, w, 1e-6), comp)  # unbuilt under capture
    capturing["on"] = False
    torch.ops.tunekit.gemma_rms_norm(x, w, 1e-6)  # eager warm-up builds it
    capturing["on"] = True
    y = torch.ops.tunekit.gemma_rms_norm(x, w, 1e-6)
    assert _within_op_bound("gemma_rms_norm", (y,), (comp,), (x, w))
    assert {(r["vendor"], r["counted_at"]) for r in ops.dispatch_stats()} == {
        ("eager:default_not_built_at_capture", "capture"), (ops.DEFAULT_VENDOR, "call"),
        (ops.DEFAULT_VENDOR, "capture")}
    # prepare(ms=...) builds the default kernels of the capture sizes above the table
    ops.reset_stats()
    capturing["on"] = False
    summary = ops.prepare("cpu", ms=[2, 4, 12])
    assert summary["keys"] == 6 and summary["tuned"] == 4 and summary["default"] == 2, summary
    assert not summary["errors"] and ops.dispatch_stats() == []
    capturing["on"] = True
    torch.ops.tunekit.gemma_fused_add_rms_norm(x[:3].repeat(4, 1), x[:3].repeat(4, 1), w, 1e-6)
    assert [(r["m"], r["vendor"], r["counted_at"]) for r in ops.dispatch_stats()] == [
        (12, ops.DEFAULT_VENDOR, "capture")]
