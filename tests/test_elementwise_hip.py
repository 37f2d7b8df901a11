"""CPU-only checks of the HIP elementwise families (kernels_hip/{rms_norm, fused_add_rms_norm,
gated_rms_norm, silu_and_mul, bias_gelu}.hip), as tests/test_hip_compile.py does for gemv.hip:

* hipcc (HIP_PLATFORM=amd) builds every family for gfx90a with its defaults and a
  spread of defines covering each code path (wave64, rows wider than a wave, row
  cached in registers or re-read, VEC 1..8, Gemma weight, both numerics), warning-free;
* NVRTC builds the same spread for sm_90 through tunekit.rtc (no GPU, no driver);
* the backend's predicates, defines and search spaces;
* the algorithms run on the CPU: each kernel compiled by g++ against a small
  emulation of the CUDA built-ins (one std::thread per GPU thread, barriers for
  __syncthreads and the warp shuffles), checked against the op's fp64 bound and
  bit by bit against the Triton module's rounded_reference (the same rounding
  locations).
Skips: no hipcc, no NVRTC library, no g++ (as test_hip_compile.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels_hip import SOURCE_DIR
from kernels_triton import bias_gelu, fused_add_rms_norm, gated_rms_norm, rms_norm, silu_and_mul
from tunekit import rtc
from tunekit.backends import get as get_backend
from tunekit.backends.base import BuildError
from tunekit.backends.hip import BACKEND
from tunekit.backends.hip_elementwise import FAMILIES, eps_bits
from tunekit.measure.device import DeviceInfo
from tunekit.problems import opspec
from tunekit.problems.shapes import Problem

# The slow tier (`python -m pytest -q -m slow`, run by .ci/run):
# every elementwise HIP variant compiled and run.
pytestmark = pytest.mark.slow

#: Define sets per family (the backend sets WAVE, N_COLS and GEMMA; here given by hand).
COMBOS: dict[str, list[dict[str, int]]] = {
    "rms_norm": [
        {},
        {"WAVE": 64, "N_COLS": 5120, "THREADS_PER_ROW": 1024, "VEC": 8, "GEMMA": 1},
        {"WAVE": 64, "N_COLS": 13, "THREADS_PER_ROW": 16, "ROWS_PER_BLOCK": 4, "VEC": 1, "VLLM_ROUNDING": 0},
        {"WAVE": 64, "N_COLS": 20000, "THREADS_PER_ROW": 256, "VEC": 4},  # row re-read, not cached
    ],
    "fused_add_rms_norm": [
        {},
        {"WAVE": 64, "N_COLS": 5120, "THREADS_PER_ROW": 128, "ROWS_PER_BLOCK": 2, "GEMMA": 1},
        {"WAVE": 64, "N_COLS": 40000, "THREADS_PER_ROW": 512, "VEC": 2, "VLLM_ROUNDING": 0},  # recomputes x + r
        {"WAVE": 64, "N_COLS": 20001, "THREADS_PER_ROW": 256, "VEC": 8},  # re-reads r_out
    ],
    "gated_rms_norm": [
        {},
        {"WAVE": 64, "N_COLS": 128, "THREADS_PER_ROW": 16, "ROWS_PER_BLOCK": 4, "VEC": 8},
        {"WAVE": 64, "N_COLS": 100, "THREADS_PER_ROW": 128, "ROWS_PER_BLOCK": 2, "VEC": 2},
    ],
    "silu_and_mul": [
        {},
        {"WAVE": 64, "THREADS": 1024, "VEC": 4, "UNROLL": 4, "ROWS_PER_BLOCK": 8, "VLLM_ROUNDING": 0},
        {"WAVE": 64, "THREADS": 64, "VEC": 1, "UNROLL": 1},
    ],
    "bias_gelu": [
        {},
        {"WAVE": 64, "THREADS": 512, "VEC": 8, "UNROLL": 2, "ROWS_PER_BLOCK": 4, "VLLM_ROUNDING": 0},
        {"WAVE": 64, "THREADS": 64, "VEC": 2, "UNROLL": 8},
    ],
}
KERNELS = {"rms_norm": "tunekit_rms_norm", "fused_add_rms_norm": "tunekit_fused_add_rms_norm",
           "gated_rms_norm": "tunekit_gated_rms_norm", "silu_and_mul": "tunekit_silu_and_mul",
           "bias_gelu": "tunekit_bias_gelu"}
CASES = [(family, combo) for family, combos in COMBOS.items() for combo in combos]


def _ids(case) -> str:
    family, combo = case
    return family + ":" + (",".join(f"{k}={v}" for k, v in combo.items()) or "defaults")


# --------------------------------------------------------------------- hipcc
def _hipcc() -> str:
    return shutil.which("hipcc") or "hipcc"  # the tests that call it are marked needs("hipcc")


def _hipcc_compile(family: str, defines: dict[str, int], out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [_hipcc(), "--offload-arch=gfx90a", "--genco", "-O3", "-I", str(SOURCE_DIR)]
    cmd += [f"-D{k}={v}" for k, v in defines.items()] + [str(SOURCE_DIR / f"{family}.hip"), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HIP_PLATFORM="amd"),
                          timeout=300)


@pytest.mark.needs("hipcc")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_hipcc_compiles_for_gfx90a(case, tmp_path: Path) -> None:
    family, combo = case
    result = _hipcc_compile(family, combo, tmp_path / "k.co")
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr, result.stderr
    blob = (tmp_path / "k.co").read_bytes()
    assert b"gfx90a" in blob and KERNELS[family].encode() in blob


@pytest.mark.needs("hipcc")
def test_hipcc_rejects_bad_defines(tmp_path: Path) -> None:
    result = _hipcc_compile("silu_and_mul", {"VEC": 3}, tmp_path / "bad.co")
    assert result.returncode != 0 and "VEC must be 1, 2, 4 or 8" in result.stderr
    result = _hipcc_compile("rms_norm", {"THREADS_PER_ROW": 32, "ROWS_PER_BLOCK": 1, "WAVE": 64}, tmp_path / "b.co")
    assert result.returncode != 0 and "whole waves" in result.stderr


# --------------------------------------------------------------------- NVRTC
SM90 = DeviceInfo(
    vendor="nvidia", name="H200 (compile only)", arch="sm_90", cu_count=132, wave_size=32,
    l2_bytes=60 * 2**20, memory_bytes=0, runtime="cuda", torch_device="cuda:0",
)  # fmt: skip
GFX90A = DeviceInfo("amd", "MI250X (compile only)", "gfx90a", 110, 64, 8 << 20, 0, "hip", "cuda:0")


@pytest.mark.needs("nvrtc")
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_nvrtc_compiles_for_sm90(case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path))
    family, combo = case
    defines = combo | {"WAVE": 32} if "WAVE" in combo else dict(combo)  # NVIDIA's 32-lane warps
    module = rtc.compile_kernel(family, defines, SM90)
    assert module.binary[:4] == b"\x7fELF" and KERNELS[family].encode() in module.binary
    assert not module.cache_hit


@pytest.mark.needs("nvrtc")
def test_nvrtc_refuses_wave64() -> None:
    with pytest.raises(BuildError) as info:
        rtc.compile_kernel("gated_rms_norm", {"WAVE": 64}, SM90, use_cache=False)
    assert "NVIDIA warps have 32 lanes" in info.value.log


# ------------------------------------------------------- backend: predicates
def _problem(op: str, m: int = 1, n: int = 5120, k: int | None = None) -> Problem:
    if k is None:
        k = 2 * n if op == "silu_and_mul" else n
    return Problem(op, "bf16", m, n, k)


def _default(op: str) -> dict[str, int]:
    space = BACKEND.space(_problem(op, k=128 if op == "gated_rms_norm" else None))
    return dict(space.fixed) | space.default


def test_space_keys_are_the_defines() -> None:
    for op, family in FAMILIES.items():
        space = BACKEND.space(_problem(op))
        assert set(space.domains) | set(space.fixed) == set(family.params) == set(space.default) | set(space.fixed)
        source = (SOURCE_DIR / f"{family.source}.hip").read_text()
        for name in (*family.params, *family.derived(_problem(op, k=128 if op == "gated_rms_norm" else None))):
            assert f"#ifndef {name}\n#define {name} " in source, f"{name} has no #ifndef default in {family.source}"
    assert "gemv" in BACKEND.ops and set(FAMILIES) <= set(BACKEND.ops)


def test_defaults_valid_for_every_model_problem_and_odd_sizes() -> None:
    from tunekit.problems.models import list_models
    from tunekit.problems.shapes import ELEMENTWISE_OPS

    problems = []
    for spec in list_models():
        for tp in (1, 2, 4, 8):
            if spec.tp_error(tp) is None:
                problems += spec.problems(tp=tp, m_list=(1, 2, 8, 256, 4096), ops=ELEMENTWISE_OPS)
    problems += [_problem(op, 3, 13) for op in ("rms_norm", "gemma_fused_add_rms_norm", "silu_and_mul", "bias_gelu")]
    problems += [_problem("gated_rms_norm", 5, 3 * 100, 100), _problem("gated_rms_norm", 2, 2 * 2048, 2048),
                 _problem("rms_norm", 1, 100003)]
    assert len(problems) > 300
    triton = get_backend("triton")
    for problem in problems:
        assert BACKEND.invalid_reason(problem, _default(problem.op)) is None, problem
        space = triton.space(problem)
        assert triton.invalid_reason(problem, dict(space.fixed) | space.default) is None, problem


@pytest.mark.parametrize(
    ("op", "change", "expect"),
    [
        ("rms_norm", {"VEC": 3}, "VEC=3"),
        ("rms_norm", {"THREADS_PER_ROW": 48}, "power of two"),
        ("fused_add_rms_norm", {"THREADS_PER_ROW": 1024, "ROWS_PER_BLOCK": 2}, "exceeds 1024"),
        ("gated_rms_norm", {"THREADS_PER_ROW": 4, "ROWS_PER_BLOCK": 4}, "multiple of 64"),
        ("silu_and_mul", {"THREADS": 96}, "multiple of 64"),
        ("bias_gelu", {"UNROLL": 8, "VEC": 8}, "in flight"),
        ("silu_and_mul", {"BLOCK_N": 4}, "unknown parameter"),
        ("rms_norm", {"VLLM_ROUNDING": 2}, "0 or 1"),
    ],
)
def test_invalid_reason_rejects(op: str, change: dict[str, int], expect: str) -> None:
    problem = _problem(op, k=128 if op == "gated_rms_norm" else None)
    reason = BACKEND.invalid_reason(problem, _default(op) | change)
    assert reason is not None and expect in reason, reason


def test_defines_and_kernel_names() -> None:
    gemma = BACKEND.defines(_problem("gemma_fused_add_rms_norm", 4), _default("gemma_fused_add_rms_norm"), GFX90A)
    assert gemma["WAVE"] == 64 and gemma["N_COLS"] == 5120 and gemma["GEMMA"] == 1 and gemma["VLLM_ROUNDING"] == 1
    gated = BACKEND.defines(_problem("gated_rms_norm", 1, 6144, 128), _default("gated_rms_norm"), SM90)
    assert gated["WAVE"] == 32 and gated["N_COLS"] == 128 and "GEMMA" not in gated
    with pytest.raises(BuildError, match="set by the backend"):
        BACKEND.defines(_problem("rms_norm"), _default("rms_norm") | {"N_COLS": 7}, SM90)
    assert BACKEND.kernel_name(_problem("silu_and_mul")) == "kernels_hip/silu_and_mul.hip:tunekit_silu_and_mul"
    assert BACKEND.invalid_reason(Problem("rms_norm", "fp16", 1, 64, 64), _default("rms_norm")) is not None
    cpu = DeviceInfo("cpu", "x86", "cpu", 2, 1, 0, 0, "cpu", "cpu")
    with pytest.raises(BuildError):
        BACKEND.build(_problem("rms_norm"), _default("rms_norm"), cpu)


# ------------------------------------------------------- CPU emulation (numerics)
_PRELUDE = r"""
#include "cuda_on_cpu.h"
#include "SOURCE"

int main(int argc, char** argv) {
    const char* d = argv[1];
    long a[16] = {0};
    for (int i = 2; i < argc && i < 18; ++i) a[i - 2] = std::atol(argv[i]);
    BODY
    return 0;
}
"""

# argv scalars a[0..]; outputs poisoned with NaN bits (0xffff) before the launch.
_BODIES = {
    "rms_norm": """
    auto x = read_u16(d, "x.bin"), w = read_u16(d, "w.bin");
    const long M = a[0], sx = a[1], sy = a[2], xo = a[3];
    std::vector<unsigned short> y(M * sy, 0xffff);
    run_grid((M + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, 1, TK_THREADS,
             [&] { tunekit_rms_norm(x.data() + xo, w.data(), y.data(), M, sx, sy, a[4]); });
    write_u16(d, "y.bin", y);""",
    "fused_add_rms_norm": """
    auto x = read_u16(d, "x.bin"), r = read_u16(d, "r.bin"), w = read_u16(d, "w.bin");
    const long M = a[0], sx = a[1], sr = a[2], sy = a[3], so = a[4], xo = a[5];
    std::vector<unsigned short> y(M * sy, 0xffff), o(M * so, 0xffff);
    run_grid((M + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, 1, TK_THREADS, [&] {
        tunekit_fused_add_rms_norm(x.data() + xo, r.data(), w.data(), y.data(), o.data(), M, sx, sr, sy, so, a[6]); });
    write_u16(d, "y.bin", y);
    write_u16(d, "o.bin", o);""",
    "gated_rms_norm": """
    auto x = read_u16(d, "x.bin"), z = read_u16(d, "z.bin"), w = read_u16(d, "w.bin");
    const long M = a[0], G = a[1], sx = a[2], sz = a[3], sy = a[4];
    std::vector<unsigned short> y(M * sy, 0xffff);
    run_grid((M * G + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, 1, TK_THREADS, [&] {
        tunekit_gated_rms_norm(x.data(), z.data(), w.data(), y.data(), M * G, G, sx, sz, sy, a[5]); });
    write_u16(d, "y.bin", y);""",
    "silu_and_mul": """
    auto x = read_u16(d, "x.bin");
    const long M = a[0], D = a[1], sx = a[2], sy = a[3];
    std::vector<unsigned short> y(M * sy, 0xffff);
    run_grid((D + TK_COLS_PER_BLOCK - 1) / TK_COLS_PER_BLOCK, (M + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, THREADS,
             [&] { tunekit_silu_and_mul(x.data(), y.data(), M, D, sx, sy); });
    write_u16(d, "y.bin", y);""",
    "bias_gelu": """
    auto x = read_u16(d, "x.bin"), b = read_u16(d, "b.bin");
    const long M = a[0], N = a[1], sx = a[2], sy = a[3];
    std::vector<unsigned short> y(M * sy, 0xffff);
    run_grid((N + TK_COLS_PER_BLOCK - 1) / TK_COLS_PER_BLOCK, (M + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, THREADS,
             [&] { tunekit_bias_gelu(x.data(), b.data(), y.data(), M, N, sx, sy); });
    write_u16(d, "y.bin", y);""",
}


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    return tmp_path_factory.mktemp("emu_elementwise")


def _build(emu_dir: Path, family: str, defines: dict[str, int]) -> Path:
    defines = {"WAVE": 32} | defines
    exe = emu_dir / (family + "_" + "_".join(f"{a}{b}" for a, b in sorted(defines.items())))
    if not exe.exists():
        src = emu_dir / f"{exe.name}.cpp"
        src.write_text(_PRELUDE.replace("SOURCE", f"{family}.hip").replace("BODY", _BODIES[family]))
        cmd = ["g++", "-std=c++20", "-O1", "-pthread", "-I", str(SOURCE_DIR), "-I", str(Path(__file__).parent)]
        cmd += [f"-D{a}={b}" for a, b in defines.items()] + [str(src), "-o", str(exe)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return exe


def _padded(t: torch.Tensor, stride: int, offset: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """``t`` [M, N] laid out with row ``stride`` after ``offset`` elements (a strided view and the raw buffer)."""
    m, n = t.shape
    flat = torch.zeros(offset + m * stride, dtype=t.dtype)
    view = torch.as_strided(flat, (m, n), (stride, 1), offset)
    view.copy_(t)
    return view, flat.view(torch.int16).numpy()


def _out(emu_dir: Path, name: str, m: int, n: int, stride: int) -> torch.Tensor:
    raw = np.fromfile(emu_dir / f"{name}.bin", dtype=np.int16)
    return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(m, stride)[:, :n]


def _check(op: str, inputs: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...],
           emulated: tuple[torch.Tensor, ...]) -> None:
    problem_n = outs[0].shape[1]
    k = 2 * problem_n if op == "silu_and_mul" else inputs[2].shape[0] if op == "gated_rms_norm" else problem_n
    problem = Problem(op, "bf16", outs[0].shape[0], problem_n, k)
    spec = opspec.get(op)
    refs = spec.reference(inputs)
    refs = refs if isinstance(refs, tuple) else (refs,)
    bounds = spec.error_bound(problem, inputs, refs if len(refs) > 1 else refs[0])
    bounds = bounds if isinstance(bounds, tuple) else (bounds,)
    for out, ref, bound, emu in zip(outs, refs, bounds, emulated, strict=True):
        assert not torch.isnan(out).any(), "unwritten (poisoned) outputs"
        assert float(((out.double() - ref).abs() / bound).max()) <= 1.0
        g, w = out.contiguous().view(torch.int16).int(), emu.view(torch.int16).int()
        assert int((g - w).abs().max()) <= 1 and float((g == w).float().mean()) >= 0.99


def _inputs(op: str, m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return opspec.get(op).make_inputs(Problem(op, "bf16", m, n, k), torch.device("cpu"),
                                      torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("defines", "layout"),
    [
        # two-stage reduction (64 lanes > the 32-lane warp), cached row, vectors with a tail
        ({"THREADS_PER_ROW": 64, "VEC": 8}, {"stride": 1008, "offset": 0}),
        # four rows per block (one past M), re-read row (MAX_CACHED), misaligned: scalar path, Gemma
        ({"THREADS_PER_ROW": 16, "ROWS_PER_BLOCK": 4, "VEC": 2, "MAX_CACHED": 4, "GEMMA": 1},
         {"stride": 1003, "offset": 1}),
    ],
)
def test_emulated_rms_norm(emu_dir: Path, defines: dict[str, int], layout: dict[str, int]) -> None:
    m, n = 3, 1001
    gemma = bool(defines.get("GEMMA"))
    op = "gemma_rms_norm" if gemma else "rms_norm"
    x, w = _inputs(op, m, n, n, seed=1)
    exe = _build(emu_dir, "rms_norm", defines | {"N_COLS": n})
    _, raw = _padded(x, layout["stride"], layout["offset"])
    raw.tofile(emu_dir / "x.bin")
    w.view(torch.int16).numpy().tofile(emu_dir / "w.bin")
    ys = n + 5
    args = [m, layout["stride"], ys, layout["offset"], eps_bits(opspec.EPS)]
    subprocess.run([str(exe), str(emu_dir), *map(str, args)], check=True, timeout=300)
    y = _out(emu_dir, "y", m, n, ys)
    _check(op, (x, w), (y,), (rms_norm.rounded_reference(x, w, opspec.EPS, gemma=gemma),))


@pytest.mark.parametrize(
    "defines",
    [
        {"THREADS_PER_ROW": 64, "VEC": 8, "GEMMA": 1},  # cached, Gemma, sum rounded
        {"THREADS_PER_ROW": 32, "ROWS_PER_BLOCK": 2, "VEC": 4, "MAX_CACHED": 8},  # re-reads r_out
        {"THREADS_PER_ROW": 32, "ROWS_PER_BLOCK": 2, "VEC": 4, "MAX_CACHED": 8, "VLLM_ROUNDING": 0},  # x + r again
    ],
)
def test_emulated_fused_add_rms_norm(emu_dir: Path, defines: dict[str, int]) -> None:
    m, n = 3, 520
    gemma = bool(defines.get("GEMMA"))
    flag = defines.get("VLLM_ROUNDING", 1)
    op = "gemma_fused_add_rms_norm" if gemma else "fused_add_rms_norm"
    x, r, w = _inputs(op, m, n, n, seed=2)
    exe = _build(emu_dir, "fused_add_rms_norm", defines | {"N_COLS": n})
    for name, t in (("x", x), ("r", r), ("w", w)):
        t.view(torch.int16).numpy().tofile(emu_dir / f"{name}.bin")
    subprocess.run([str(exe), str(emu_dir), *map(str, [m, n, n, n, n, 0, eps_bits(opspec.EPS)])], check=True,
                   timeout=300)
    y, s = _out(emu_dir, "y", m, n, n), _out(emu_dir, "o", m, n, n)
    emulated = fused_add_rms_norm.rounded_reference(x, r, w, opspec.EPS, gemma=gemma, vllm_rounding=flag)
    _check(op, (x, r, w), (y, s), emulated)
    other, _ = fused_add_rms_norm.rounded_reference(x, r, w, opspec.EPS, gemma=gemma, vllm_rounding=1 - flag)
    assert float((y.contiguous().view(torch.int16) == other.view(torch.int16)).float().mean()) < 0.9


def test_emulated_gated_rms_norm(emu_dir: Path) -> None:
    m, groups, k = 3, 3, 128
    n = groups * k
    x, z, w = _inputs("gated_rms_norm", m, n, k, seed=3)
    exe = _build(emu_dir, "gated_rms_norm", {"THREADS_PER_ROW": 16, "ROWS_PER_BLOCK": 4, "VEC": 8, "N_COLS": k})
    for name, t in (("x", x), ("z", z), ("w", w)):
        t.view(torch.int16).numpy().tofile(emu_dir / f"{name}.bin")
    subprocess.run([str(exe), str(emu_dir), *map(str, [m, groups, n, n, n, eps_bits(opspec.EPS)])], check=True,
                   timeout=300)
    y = _out(emu_dir, "y", m, n, n)
    _check("gated_rms_norm", (x, z, w), (y,), (gated_rms_norm.rounded_reference(x, z, w, opspec.EPS),))


@pytest.mark.parametrize("family", ["silu_and_mul", "bias_gelu"])
@pytest.mark.parametrize("n", [1000, 999])  # vector path with a partial block; odd width: scalar path
def test_emulated_pointwise(emu_dir: Path, family: str, n: int) -> None:
    m = 3
    k = 2 * n if family == "silu_and_mul" else n
    inputs = _inputs(family, m, n, k, seed=4)
    exe = _build(emu_dir, family, {"THREADS": 64, "VEC": 4, "UNROLL": 2, "ROWS_PER_BLOCK": 2})
    inputs[0].view(torch.int16).numpy().tofile(emu_dir / "x.bin")
    if family == "bias_gelu":
        inputs[1].view(torch.int16).numpy().tofile(emu_dir / "b.bin")
    subprocess.run([str(exe), str(emu_dir), *map(str, [m, n, k, n])], check=True, timeout=300)
    y = _out(emu_dir, "y", m, n, n)
    module = silu_and_mul if family == "silu_and_mul" else bias_gelu
    _check(family, inputs, (y,), (module.rounded_reference(*inputs),))


def test_the_norms_epsilon_is_a_launch_argument() -> None:
    """One HIP build serves any model's epsilon: the launcher passes the call's eps (as fp32 bits) and
    opspec.EPS when none is given; the pointwise ops have no epsilon."""
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    cases = {"rms_norm": ((x, w), (x.clone(),)), "fused_add_rms_norm": ((x, x.clone(), w), (x.clone(), x.clone())),
             "gated_rms_norm": ((x, x.clone(), w[:32]), (x.clone(),))}
    defines = {"ROWS_PER_BLOCK": 1, "THREADS_PER_ROW": 64}
    for op, (inputs, outs) in cases.items():
        family = FAMILIES[op]
        assert family.launch_args(defines, inputs, outs, 1e-5)[2][-1] == eps_bits(1e-5) != eps_bits(opspec.EPS)
        assert family.launch_args(defines, inputs, outs)[2][-1] == eps_bits(opspec.EPS)
    a = torch.zeros(2, 128, dtype=torch.bfloat16)
    pointwise = FAMILIES["silu_and_mul"].launch_args({"THREADS": 64, "VEC": 1, "UNROLL": 1, "ROWS_PER_BLOCK": 1},
                                                     (a,), (a[:, :64].contiguous(),), 1e-5)[2]
    assert eps_bits(1e-5) not in pointwise
