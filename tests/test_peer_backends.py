"""The peers as backends without vLLM: registry, one-line unavailability reasons, the skinny GEMM's space and rules.

This environment has no vLLM, CuTe DSL or FlashInfer. Their lookups are monkeypatched (``has_module``,
``vllm_file``), and vLLM's skinny_gemm module is a stand-in with the real interfaces' signatures
(``SkinnyGemmConfig``'s fields and defaults, ``row_stride_ok(a, config)``,
``ShapeDynamicSkinnyGemm._config(m, n, k)``), as is FlashInfer's ``mm_bf16.is_backend_supported(backend,
cc)``. The same code against vLLM 0.33's real classes is in tests/vllm/test_vllm_skinny.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tunekit import backends, ops
from tunekit import table as table_mod
from tunekit.backends import flashinfer as fi
from tunekit.backends import vllm_skinny as vs
from tunekit.backends.base import BuildError
from tunekit.measure.device import DeviceInfo, detect
from tunekit.problems.shapes import Problem

CPU = DeviceInfo("cpu", "cpu", "cpu", 2, 1, 1, 0, "cpu", "cpu")
H200 = DeviceInfo("nvidia", "NVIDIA H200", "sm_90", 132, 32, 60 << 20, 141 << 30, "cuda 13.0", "cuda:0")
B200 = dataclasses.replace(H200, name="NVIDIA B200", arch="sm_100")
T4 = dataclasses.replace(H200, name="Tesla T4", arch="sm_75")
MI250 = DeviceInfo("amd", "AMD Instinct MI250X", "gfx90a", 110, 64, 8 << 20, 64 << 30, "hip 6.3", "cuda:0")
PEER_MODULES = ("vllm", "cutlass", "quack", "cuda.bindings", "tvm_ffi", "flashinfer")


# ----------------------------------------------------------------------------- stand-ins


@dataclasses.dataclass(frozen=True, slots=True)
class SkinnyGemmConfig:  # vLLM 0.33's fields, order and defaults
    num_rows: int
    block_size: int
    outputs_per_block: int
    k_unroll: int = 1
    vector_width: int = 8
    static_k: int | None = None


def row_stride_ok(a: torch.Tensor, config: SkinnyGemmConfig) -> bool:
    vector_bytes = config.vector_width * a.element_size()
    return a.stride(1) == 1 and a.stride(0) % config.vector_width == 0 and a.data_ptr() % vector_bytes == 0


class ShapeDynamicSkinnyGemm:
    @staticmethod
    def _config(m: int, n: int, k: int) -> SkinnyGemmConfig:
        return SkinnyGemmConfig(m, 64, 2, 2)


def _standin(config_cls=SkinnyGemmConfig) -> types.ModuleType:
    module = types.ModuleType(vs.SKINNY_MODULE)
    module.SkinnyGemmConfig = config_cls
    module.row_stride_ok = row_stride_ok
    module.ShapeDynamicSkinnyGemm = ShapeDynamicSkinnyGemm
    module.shape_dynamic_skinny_gemm = ShapeDynamicSkinnyGemm()
    return module


@pytest.fixture
def installed(monkeypatch):
    """Every peer package 'installed' (their lookups answer yes); returns the set to take names out of."""
    present = set(PEER_MODULES)
    monkeypatch.setattr(vs, "has_module", lambda name: name in present)
    monkeypatch.setattr(fi, "has_module", lambda name: name in present)
    monkeypatch.setattr(vs, "vllm_file", lambda relative: Path("/vllm") / relative)
    monkeypatch.setattr(vs, "cute_min_arch", lambda: (8, 0))
    return present


@pytest.fixture
def vllm_standin(monkeypatch, installed):
    module = _standin()
    monkeypatch.setattr(vs, "vllm_skinny_module", lambda: module)
    return module


class _MmBf16:
    """flashinfer.mm_bf16's support query: ``is_backend_supported(backend, cc=None)``."""

    @staticmethod
    def is_backend_supported(backend: str, cc: int | None = None) -> bool:
        return backend == "cute-dsl" and (cc is None or cc in (100, 103, 107))


# ----------------------------------------------------------------------------- registry


def test_the_peers_are_registered_with_their_kinds() -> None:
    assert "vllm_skinny" in backends.TUNED
    assert backends.PEERS == ("vllm_skinny_heuristic", "flashinfer", "inductor_max_autotune", "triton_autotune")
    assert set(backends.PEERS) <= set(backends.BASELINES) and backends.BASELINES[:2] == ("vendor", "inductor")
    kinds = {name: (backends.get(name).kind, backends.get(name).ops) for name in ("vllm_skinny", *backends.PEERS)}
    assert kinds == {"vllm_skinny": ("tuned", ("gemv", "gemv_add")),
                     "vllm_skinny_heuristic": ("baseline", ("gemv", "gemv_add")),
                     "flashinfer": ("baseline", ("gemv",)),
                     "inductor_max_autotune": ("baseline", ("gemv",)),
                     "triton_autotune": ("baseline", ("gemv",))}


def test_without_the_peers_the_default_backends_skip_vllm_skinny(monkeypatch) -> None:
    from tunekit.cli.search_options import default_backends

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    names = default_backends()
    assert "triton" in names and "vllm_skinny" not in names  # skipped for its reason, not an error
    assert backends.get("vllm_skinny").unavailable_reason(detect()) is not None


# ----------------------------------------------------------------------------- unavailability, one line each


@pytest.mark.parametrize("name", ["vllm_skinny", "vllm_skinny_heuristic"])
def test_skinny_unavailable_reasons(name: str, installed, monkeypatch) -> None:
    backend = backends.get(name)
    assert backend.unavailable_reason(H200) is None
    assert backend.unavailable_reason(CPU) == "no GPU (vLLM's CuTe-DSL skinny GEMM runs on NVIDIA GPUs)"
    assert backend.unavailable_reason(MI250) == (
        "architecture gfx90a unsupported (vLLM's CuTe-DSL skinny GEMM runs on NVIDIA GPUs only)")
    assert backend.unavailable_reason(T4) == "architecture sm_75 unsupported (the CuTe DSL targets sm_80 and newer)"
    reasons = {}
    for module in ("tvm_ffi", "cuda.bindings", "quack", "cutlass", "vllm"):  # the last one missing is named
        installed.discard(module)
        reasons[module] = backend.unavailable_reason(H200)
    assert reasons == {
        "tvm_ffi": "apache-tvm-ffi is not installed (vLLM's skinny GEMM compiles through tvm_ffi; "
                   "pip install -e .[peers])",
        "cuda.bindings": "cuda-bindings is not installed (vLLM's skinny GEMM compiles through cuda.bindings; "
                         "pip install -e .[peers])",
        "quack": "quack-kernels is not installed (vLLM's skinny GEMM compiles through quack; "
                 "pip install -e .[peers])",
        "cutlass": "the CuTe DSL is not installed (nvidia-cutlass-dsl; pip install -e .[peers])",
        "vllm": "vLLM is not installed (the skinny GEMM is vLLM's kernel, vLLM >= 0.33; "
                "pip install -e .[peers] does not add vLLM)",
    }
    installed.add("vllm")
    monkeypatch.setattr(vs, "vllm_file", lambda relative: None)  # an older vLLM
    monkeypatch.setattr(vs, "version_of", lambda dist: "0.26.0")
    assert backend.unavailable_reason(H200) == ("vLLM 0.26.0 has no CuTe-DSL skinny GEMM "
                                                "(vllm/model_executor/kernels/linear/cute_dsl/skinny_gemm.py, "
                                                "vLLM 0.33)")


def test_here_every_reason_is_one_line_and_nothing_raises() -> None:
    for name in ("vllm_skinny", "vllm_skinny_heuristic", "flashinfer"):  # the peers that need packages
        for device in (detect(), CPU, H200, B200, T4, MI250):
            why = backends.get(name).unavailable_reason(device)
            assert why and "\n" not in why, (name, device.arch, why)
    assert backends.get("vllm_skinny").unavailable_reason(H200).startswith("vLLM is not installed")
    assert backends.get("flashinfer").unavailable_reason(B200).startswith("flashinfer-python is not installed")
    assert backends.get("inductor_max_autotune").unavailable_reason(CPU) == (
        "torch.compile max-autotune is measured on GPUs only (its autotuning times on the device)")
    assert backends.get("triton_autotune").unavailable_reason(CPU) == (
        "the plain @triton.autotune GEMV is measured on GPUs only (its autotuner times on the device)")
    for name in ("inductor_max_autotune", "triton_autotune"):  # no package beyond torch and Triton
        assert backends.get(name).unavailable_reason(H200) is None


def test_flashinfer_unavailable_reasons(installed, monkeypatch) -> None:
    backend = backends.get("flashinfer")
    monkeypatch.setattr(fi, "_mm_bf16", lambda: _MmBf16)
    monkeypatch.setattr(fi.shutil, "which", lambda name: "/usr/local/cuda/bin/nvcc")
    assert backend.unavailable_reason(B200) is None
    assert backend.unavailable_reason(dataclasses.replace(B200, arch="sm_103")) is None
    # SM90 runs tinygemm_bf16: no CuTe DSL needed, nvcc is (FlashInfer JIT-compiles it)
    installed.discard("cutlass")
    assert backend.unavailable_reason(H200) is None
    monkeypatch.setattr(fi.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    assert backend.unavailable_reason(H200) == (
        "nvcc not found: FlashInfer JIT-compiles tinygemm_bf16 on sm_90 (set CUDA_HOME)")
    installed.add("cutlass")
    assert backend.unavailable_reason(dataclasses.replace(H200, arch="sm_89")) == (
        "architecture sm_89 unsupported (FlashInfer's BF16 small-M GEMM: tinygemm_bf16 on sm_90, mm_bf16 backend "
        "'cute-dsl' (vLLM's --linear-backend flashinfer_cutedsl) on sm_100, sm_103, sm_107)")
    assert backend.unavailable_reason(dataclasses.replace(B200, runtime="cuda 12.6")) == (
        "cuda 12.6: FlashInfer's BF16 small-M GEMM ('cute-dsl') needs CUDA 12.8 or newer")
    assert backend.unavailable_reason(CPU) == "no GPU (FlashInfer's BF16 small-M GEMM runs on NVIDIA GPUs)"
    assert backend.unavailable_reason(MI250).startswith("architecture gfx90a unsupported")

    def broken():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(fi, "_mm_bf16", broken)
    assert backend.unavailable_reason(B200) == (
        "flashinfer cannot be imported (OSError: libcuda.so.1: cannot open shared object file)")
    installed.discard("cutlass")
    assert backend.unavailable_reason(B200) == (
        "the CuTe DSL is not installed (nvidia-cutlass-dsl, which FlashInfer's 'cute-dsl' mm needs; "
        "pip install -e .[peers])")
    installed.discard("flashinfer")
    assert backend.unavailable_reason(B200) == "flashinfer-python is not installed (pip install -e .[peers])"
    assert backend.unavailable_reason(H200) == "flashinfer-python is not installed (pip install -e .[peers])"


def test_flashinfer_shapes() -> None:
    backend = backends.get("flashinfer")
    assert backend.invalid_reason(Problem("gemv", "bf16", 1, 5120, 17408), {}) is None
    assert backend.invalid_reason(Problem("gemv", "fp16", 1, 96, 5120), {}) == (
        "shape unsupported: FlashInfer's BF16 GEMMs take BF16 only (got fp16)")
    assert backend.invalid_reason(Problem("gemv_add", "bf16", 1, 96, 5120), {}) == (
        "no FlashInfer baseline for op 'gemv_add'")
    # the kernel that runs is known with the device: tinygemm on SM90, mm_bf16 (cute-dsl) on SM100+
    odd_k = Problem("gemv", "bf16", 1, 96, 5120 + 64)
    assert backend.shape_reason(odd_k, "sm_90") is None
    assert backend.shape_reason(odd_k, "sm_100") == (
        "shape unsupported: K=5184 is not a multiple of 128 (vLLM runs F.linear there under --linear-backend "
        "flashinfer_cutedsl)")
    assert backend.shape_reason(Problem("gemv", "bf16", 1, 100, 5120), "sm_90") == (
        "shape unsupported: tinygemm_bf16 needs K % 64 == 0 and N % 16 == 0 (N=100, K=5120)")
    assert backend.shape_reason(Problem("gemv", "bf16", 16, 248320, 5120), "sm_90") is None
    with pytest.raises(BuildError, match="no GPU"):
        backend.build(Problem("gemv", "bf16", 1, 96, 5120), {}, CPU)


# ----------------------------------------------------------------------------- vLLM missing: no traceback


def test_without_vllm_the_space_says_why_and_a_table_entry_keeps_its_structure(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(vs, "has_module", lambda name: False)
    problem = Problem("gemv", "bf16", 1, 96, 5120)
    for call in (lambda: vs.BACKEND.space(problem), lambda: vs.BACKEND.invalid_reason(problem, {}),
                 lambda: vs.HEURISTIC.invalid_reason(problem, {})):
        with pytest.raises(ImportError, match="vLLM is not installed"):
            call()
    with pytest.raises(BuildError, match="vLLM is not installed"):
        vs.BACKEND.build(problem, {"block_size": 64}, H200)
    # a table searched where vLLM runs loads where it does not (its entries checked for structure only)
    path = _table(tmp_path, {"block_size": 64, "outputs_per_block": 2, "k_unroll": 2, "vector_width": 8,
                             "static_k": 0, "num_rows": 1})
    assert table_mod.entries(table_mod.load(path, strict=True))[0].backend == "vllm_skinny"


# ----------------------------------------------------------------------------- the space and its rules (stand-in)


def test_the_space_is_read_from_the_config_class(vllm_standin, monkeypatch) -> None:
    problem = Problem("gemv", "bf16", 4, 96, 5120)
    space = vs.BACKEND.space(problem)
    assert list(space.domains) == ["block_size", "outputs_per_block", "k_unroll", "vector_width", "static_k"]
    assert space.fixed == {"num_rows": 4}
    assert space.domains["static_k"] == [0, 5120]
    # the default (enqueued first) is vLLM's heuristic config for the shape
    assert space.default == space.reference == {"block_size": 64, "outputs_per_block": 2, "k_unroll": 2,
                                                "vector_width": 8, "static_k": 0}
    assert vs.BACKEND.invalid_reason(problem, space.fixed | space.default) is None

    # a field vLLM adds with a default is left at it; one it drops leaves the space
    @dataclasses.dataclass(frozen=True)
    class Newer:
        num_rows: int
        block_size: int
        outputs_per_block: int
        vector_width: int = 8
        swizzle: int = 0

    newer = _standin(Newer)
    newer.ShapeDynamicSkinnyGemm = type("S", (), {"_config": staticmethod(lambda m, n, k: Newer(m, 128, 1))})
    monkeypatch.setattr(vs, "vllm_skinny_module", lambda: newer)
    space = vs.BACKEND.space(problem)
    assert list(space.domains) == ["block_size", "outputs_per_block", "vector_width"]
    assert space.default == {"block_size": 128, "outputs_per_block": 1, "vector_width": 8}
    assert vs.make_config(problem, space.fixed | space.default) == Newer(4, 128, 1, 8, 0)


def test_every_legal_point_builds_a_config_and_round_trips(vllm_standin) -> None:
    import itertools

    for problem in (Problem("gemv", "bf16", 1, 5120, 17408), Problem("gemv_add", "bf16", 8, 96, 5120)):
        space = vs.BACKEND.space(problem)
        names, legal = list(space.domains), 0
        for values in itertools.product(*space.domains.values()):
            params = space.fixed | dict(zip(names, values, strict=True))
            if vs.BACKEND.invalid_reason(problem, params) is None:
                legal += 1
                config = vs.make_config(problem, params)
                assert vs.config_params(config) == params
                assert config.static_k in (None, problem.k)
        assert legal > 100


@pytest.mark.parametrize("change, reason", [
    ({"num_rows": 2}, "config num_rows must match M (num_rows=2, M=4)"),
    ({"block_size": 48}, "block_size=48 must be a multiple of the warp size (32), at most 1024"),
    ({"block_size": 2048}, "block_size=2048 must be a multiple of the warp size (32), at most 1024"),
    ({"vector_width": 16}, "vector_width=16: the kernel's loads are a power of two of at most 128 bits"),
    ({"vector_width": 6}, "vector_width=6: the kernel's loads are a power of two of at most 128 bits"),
    ({"outputs_per_block": 5}, "N must be divisible by outputs_per_block (N=96, outputs_per_block=5)"),
    ({"block_size": 512}, "K must be divisible by block_size * vector_width for this config (K=5120, 512 * 8 = 4096)"),
    ({"static_k": 4096}, "input K must match config static_k (K=5120, static_k=4096)"),
    ({"static_k": 5120, "block_size": 640}, "static K must contain at least 2 complete tiles (K=5120, tile 5120)"),
    ({"static_k": 5120, "k_unroll": 2}, "k_unroll has no effect with a static K (the loop is unrolled whole): "
                                        "k_unroll=1"),
    ({"k_unroll": 0}, "k_unroll=0 must be >= 1"),
    ({"swizzle": 1}, "bad params: SkinnyGemmConfig has no field swizzle"),
])
def test_the_kernels_rules(vllm_standin, change: dict, reason: str) -> None:
    problem = Problem("gemv", "bf16", 4, 96, 5120)
    base = {"num_rows": 4, "block_size": 64, "outputs_per_block": 2, "k_unroll": 1, "vector_width": 8, "static_k": 0}
    assert vs.BACKEND.invalid_reason(problem, base) is None
    assert vs.BACKEND.invalid_reason(problem, base | change) == reason


def test_problems_the_kernel_does_not_serve(vllm_standin) -> None:
    params = {"block_size": 64, "outputs_per_block": 2, "k_unroll": 1, "vector_width": 8, "static_k": 0}
    assert vs.BACKEND.invalid_reason(Problem("gemv", "bf16", 17, 96, 5120), params | {"num_rows": 17}) == (
        "vLLM's skinny GEMM requires 1 <= M <= 16 (M=17)")
    assert vs.BACKEND.invalid_reason(Problem("gemv", "fp32", 1, 96, 5120), params) == (
        "vLLM's skinny GEMM takes BF16 or FP16 (got fp32)")
    assert vs.BACKEND.invalid_reason(Problem("rms_norm", "bf16", 1, 96, 5120), {}) == (
        "vllm_skinny has no kernel for op 'rms_norm' (it serves gemv, gemv_add)")
    assert vs.BACKEND.space(Problem("rms_norm", "bf16", 1, 96, 5120)).is_empty()
    # the heuristic baseline: a shape its config does not fit is "shape unsupported"
    assert vs.HEURISTIC.invalid_reason(Problem("gemv", "bf16", 2, 96, 5120), {}) is None
    assert vs.HEURISTIC.invalid_reason(Problem("gemv", "bf16", 1, 96, 64 * 8 + 64), {}) == (
        "shape unsupported: vLLM's heuristic SkinnyGemmConfig(num_rows=1, block_size=64, outputs_per_block=2, "
        "k_unroll=2, vector_width=8, static_k=None): K must be divisible by block_size * vector_width for this "
        "config (K=576, 64 * 8 = 512)")
    assert vs.HEURISTIC.invalid_reason(Problem("gemv", "bf16", 32, 96, 5120), {}) == (
        "shape unsupported: vLLM's skinny GEMM requires 1 <= M <= 16 (M=32)")
    assert vs.HEURISTIC.space(Problem("gemv", "bf16", 2, 96, 5120)).is_empty()


def test_table_validation_checks_an_entry_against_the_kernels_rules(tmp_path: Path, vllm_standin) -> None:
    good = {"num_rows": 1, "block_size": 64, "outputs_per_block": 2, "k_unroll": 1, "vector_width": 8, "static_k": 0}
    assert table_mod.entries(table_mod.load(_table(tmp_path, good), strict=True))[0].params == good
    with pytest.raises(table_mod.TableError, match="N must be divisible by outputs_per_block"):
        table_mod.load(_table(tmp_path, good | {"outputs_per_block": 5}), strict=True)


# ----------------------------------------------------------------------------- serving without a GPU


def _table(tmp_path: Path, params: dict, m: int = 1, n: int = 96, k: int = 5120) -> Path:
    entry = {"op": "gemv", "dtype": "bf16", "m": m, "n": n, "k": k, "backend": "vllm_skinny", "params": params,
             "kernel": "test", "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0}
    table = {"format": table_mod.FORMAT, "created": "test", "read_limit_gbps": None, "entries": [entry],
             "environment": table_mod.environment_stamp(detect().as_dict(), [])}
    return table_mod.save(table, tmp_path / "table.json")


@pytest.mark.usefixtures("clean_ops")
def test_an_entry_that_cannot_build_here_serves_the_vendor_path_with_its_reason(tmp_path: Path, caplog) -> None:
    params = {"num_rows": 1, "block_size": 64, "outputs_per_block": 2, "k_unroll": 1, "vector_width": 8,
              "static_k": 0}
    ops.load_tables(str(_table(tmp_path, params)))
    from tunekit.dispatch.state import STATE

    with STATE.lock:  # the warning is logged once per process: an earlier test may have had it already
        STATE.logged = {key for key in STATE.logged if not key.startswith("unavailable:vllm_skinny:")}
    x, w = torch.randn(1, 5120).bfloat16(), torch.randn(96, 5120).bfloat16()
    with caplog.at_level(logging.WARNING, logger="tunekit.ops"):
        y = ops.gemv(x, w)
    assert torch.equal(y, F.linear(x, w))
    rows = [(r["op"], r["m"], r["impl"]) for r in ops.dispatch_stats()]
    assert rows == [("gemv", 1, "fallback:backend_unavailable")]
    why = backends.get("vllm_skinny").unavailable_reason(detect())
    assert any(f"backend vllm_skinny unavailable here ({why})" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
    json.dumps(ops.dispatch_log())


def test_search_backend_vllm_skinny_without_vllm_is_one_error_line(tmp_path: Path, monkeypatch, capsys) -> None:
    import sys

    from tunekit.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(sys, "argv", ["tunekit", "search", "--shape", "96x256", "--backend", "vllm_skinny",
                                      "--trials", "1", "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == ("error: vLLM's skinny GEMM cannot be used here: vLLM is not installed (the skinny GEMM is "
                   "vLLM's kernel, vLLM >= 0.33; pip install -e .[peers] does not add vLLM)\n")
    assert not (tmp_path / "run").exists()


class _StandInGemm:
    """vLLM's ShapeDynamicSkinnyGemm as build_kernel uses it: ``_compile(dtype, config, has_residual)`` fills
    ``_compiled[(dtype, config, has_residual)]`` with ``fn(a, b, residual, c, stream)`` (the compiled kernel's
    argument order in vLLM's ``__call__``); this one computes C = A B^T (+ residual) on the CPU and records."""

    def __init__(self) -> None:
        self._compiled: dict = {}
        self.calls: list[tuple] = []

    def _compile(self, dtype: torch.dtype, config: SkinnyGemmConfig, has_residual: bool) -> None:
        def fn(a, b, residual, c, stream) -> None:
            self.calls.append((a, residual is c, int(stream)))
            acc = a.float() @ b.float().T
            c.copy_(acc + residual.float() if has_residual else acc)

        self._compiled[(dtype, config, has_residual)] = fn


@pytest.mark.needs("nvrtc")  # cuda-bindings' CUstream, the real one (the nvrtc extra's; also the peers')
def test_the_built_kernel_calls_vllms_compiled_kernel_into_the_ops_output(vllm_standin, monkeypatch) -> None:
    gemm = _StandInGemm()
    vllm_standin.shape_dynamic_skinny_gemm = gemm
    monkeypatch.setattr(vs, "current_raw_stream", lambda index: 7)
    params = {"num_rows": 2, "block_size": 32, "outputs_per_block": 2, "k_unroll": 1, "vector_width": 8,
              "static_k": 0}
    kernel = vs.BACKEND.build(Problem("gemv", "bf16", 2, 6, 256), params, H200)
    assert list(gemm._compiled) == [(torch.bfloat16, SkinnyGemmConfig(2, 32, 2, 1, 8, None), False)]
    x, w = torch.randn(2, 256).bfloat16(), torch.randn(6, 256).bfloat16()
    out = torch.empty(2, 6, dtype=torch.bfloat16)
    kernel((x, w), out)
    assert torch.equal(out, (x.float() @ w.float().T).bfloat16())
    assert gemm.calls[-1][0] is x and gemm.calls[-1][1:] == (True, 7)  # no residual: C stands in (vLLM's call)
    # x rows vLLM's row_stride_ok refuses (a view one element in) are copied, not refused
    wide = torch.randn(2, 257).bfloat16()
    kernel((wide[:, 1:], w), out)
    assert gemm.calls[-1][0].is_contiguous() and torch.equal(out, (wide[:, 1:].float() @ w.float().T).bfloat16())
    with pytest.raises(ValueError, match="contiguous weight"):
        kernel((x, torch.randn(256, 6).bfloat16().T), out)
    # gemv_add: the kernel's fused residual, which may be the output itself
    kernel = vs.BACKEND.build(Problem("gemv_add", "bf16", 2, 6, 256), params, H200)
    residual = torch.randn(2, 6).bfloat16()
    expected = (x.float() @ w.float().T + residual.float()).bfloat16()
    kernel((x, w, residual), residual)
    assert torch.equal(residual, expected)
    # the heuristic baseline compiles vLLM's pick for the shape
    vs.HEURISTIC.build(Problem("gemv", "bf16", 2, 6, 512), {}, H200)
    assert (torch.bfloat16, SkinnyGemmConfig(2, 64, 2, 2), False) in gemm._compiled
    with pytest.raises(BuildError, match="shape unsupported"):
        vs.HEURISTIC.build(Problem("gemv", "bf16", 2, 6, 576), {}, H200)
    with pytest.raises(BuildError, match="invalid config: N must be divisible by outputs_per_block"):
        vs.BACKEND.build(Problem("gemv", "bf16", 2, 5, 256), params, H200)


def test_without_cuda_bindings_the_build_is_unavailable_in_one_line(vllm_standin, monkeypatch) -> None:
    """The lookup found cuda-bindings but it cannot be imported (or the lookups were wrong): the build's verdict
    is an ``unavailable:`` BuildError saying what to install, before vLLM compiles anything."""
    import sys

    gemm = _StandInGemm()
    vllm_standin.shape_dynamic_skinny_gemm = gemm
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # its import fails, installed or not
    params = {"num_rows": 2, "block_size": 32, "outputs_per_block": 2, "k_unroll": 1, "vector_width": 8,
              "static_k": 0}
    for backend, problem_params in ((vs.BACKEND, params), (vs.HEURISTIC, {})):  # 64 * 8 divides K=512
        with pytest.raises(BuildError) as info:
            backend.build(Problem("gemv", "bf16", 2, 6, 512), problem_params, H200)
        why = str(info.value)
        assert why.startswith("unavailable: cuda-bindings cannot be imported (ModuleNotFoundError") and "\n" not in why
        assert why.endswith("pip install -e .[peers])"), why
    assert gemm._compiled == {}


# ----------------------------------------------------------------------------- the plain Triton peer


@pytest.mark.parametrize("m", [1, 3, 16])
def test_the_afternoon_triton_gemv_is_correct_at_each_config_shape(m: int, monkeypatch) -> None:
    """The @triton.autotune peer's kernel (its autotuner times on the device, so here one config of its list
    runs directly, under the interpreter): masked tails in N and K, every M it serves. In FP16: the
    interpreter's tl.dot of BF16 tiles returns garbage (Triton 3.9; FP16 and FP32 are exact), and the kernel
    is the same for both types."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels_triton import autotune_gemv as ag

    gen = torch.Generator().manual_seed(m)
    n, k = 40, 200  # neither a multiple of BLOCK_N nor of BLOCK_K
    x = torch.randn(m, k, generator=gen).to(torch.float16)
    w = torch.randn(n, k, generator=gen).to(torch.float16)
    out = torch.full((m, n), float("nan"), dtype=torch.float16)
    ag.launch_config(x, w, out, ag.CONFIGS[0])
    exact = x.double() @ w.double().t()
    assert torch.isfinite(out).all()
    assert (out.double() - exact).abs().max() <= 0.01 * exact.abs().max()
    assert ag.invalid_reason(17, n, k) == "the afternoon GEMV holds M in one tile of 16 rows (M=17)"
    assert backends.get("triton_autotune").invalid_reason(Problem("gemv", "bf16", 17, n, k), {}).startswith(
        "shape unsupported: the afternoon GEMV")
