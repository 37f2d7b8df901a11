"""CPU-only checks of kernels_hip and tunekit.rtc: every variant family compiles.

* hipcc (Debian: ``apt-get install hipcc libamdhip64-dev rocm-device-libs``)
  builds each .hip file for gfx906, gfx90a and gfx940 with its defaults and a
  spread of define combinations, warning-free. ``HIP_PLATFORM=amd`` is forced:
  hipcc otherwise picks the NVIDIA platform when an ``nvcc`` is on PATH.
* NVRTC (PyPI: ``cuda-core``, ``cuda-bindings``, ``nvidia-cuda-nvrtc``) builds
  the same spread for sm_90 through ``tunekit.rtc`` (no GPU, no driver), and
  the disk cache is checked: hit, miss, BuildError carrying the compiler log.
* The HIP backend's pure predicate ``invalid_reason`` and its search space.
* The algorithm itself, run on the CPU: gemv.hip compiled by g++ against a
  small emulation of the CUDA built-ins it uses (one std::thread per GPU
  thread, barriers for __syncthreads and the warp shuffles), compared with an
  fp64 reference and between configs that must give identical bits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels_hip import HEADER, SOURCE_DIR
from tunekit import rtc
from tunekit.backends.base import BuildError
from tunekit.backends.hip import BACKEND, GEMV_PARAMS, gemv_invalid_reason, k_lanes, split_k_chunk
from tunekit.measure.device import DeviceInfo
from tunekit.problems.shapes import Problem

# The slow tier (`python -m pytest -q -m slow`, run by .ci/run):
# every HIP variant compiled by hipcc and NVRTC.
pytestmark = pytest.mark.slow

# The GEMV define combinations below apply to gemv.hip; the elementwise families
# (kernels_hip/*.hip besides gemv) have theirs in test_elementwise_hip.py.
HIP_SOURCES = [SOURCE_DIR / "gemv.hip"]
AMD_ARCHS = ("gfx906", "gfx90a", "gfx940")

#: Define combinations covering every code path: defaults, wave64 with row
#: groups wider than a wave (two-stage reduction), split-K with both reductions,
#: nontemporal loads, staged x, DPP reduction, small vectors, several rows per
#: thread, M = 1, M up to 16 (speculative decoding's verify steps).
COMBOS: list[dict[str, int]] = [
    {},
    {"WAVE": 64, "MAX_M": 1, "THREADS_PER_ROW": 64, "ROWS_PER_BLOCK": 4, "VEC": 8, "UNROLL": 4},
    {"WAVE": 64, "THREADS_PER_ROW": 256, "ROWS_PER_BLOCK": 2, "SPLIT_K": 4, "NONTEMPORAL": 1},
    {"WAVE": 64, "MAX_M": 4, "SPLIT_K": 8, "FUSED_REDUCE": 1, "THREADS_PER_ROW": 128, "ROWS_PER_BLOCK": 2},
    {"WAVE": 64, "MAX_M": 2, "X_IN_SHARED": 1, "VEC": 4, "UNROLL": 2, "REDUCE_DPP": 1},
    {"WAVE": 64, "THREADS_PER_ROW": 8, "ROWS_PER_BLOCK": 32, "VEC": 2, "REDUCE_DPP": 1},
    {"WAVE": 64, "THREADS_PER_ROW": 16, "ROWS_PER_BLOCK": 64, "ROWS_PER_THREAD": 4, "REDUCE_DPP": 1},
    {"WAVE": 32, "MAX_M": 4, "THREADS_PER_ROW": 512, "ROWS_PER_BLOCK": 2, "X_IN_SHARED": 1, "UNROLL": 1},
    # one 32-thread row group per block: half a wave on wave64
    {"WAVE": 64, "MAX_M": 1, "THREADS_PER_ROW": 32, "ROWS_PER_BLOCK": 1, "REDUCE_DPP": 1},
    {"WAVE": 64, "MAX_M": 16, "THREADS_PER_ROW": 64, "ROWS_PER_BLOCK": 4, "ROWS_PER_THREAD": 2, "X_IN_SHARED": 1},
    {"WAVE": 32, "MAX_M": 16, "SPLIT_K": 4, "FUSED_REDUCE": 1, "UNROLL": 4},
]


#: The tensor-core path (MMA=1) is NVIDIA's mma.sync: NVRTC only, M <= 8.
NV_MMA_COMBOS: list[dict[str, int]] = [
    {"MMA": 1, "ROWS_PER_BLOCK": 32},
    {"MMA": 1, "MAX_M": 1, "ROWS_PER_BLOCK": 64, "ROWS_PER_THREAD": 2, "THREADS_PER_ROW": 64, "UNROLL": 4},
    {"MMA": 1, "MAX_M": 4, "ROWS_PER_BLOCK": 16, "THREADS_PER_ROW": 128, "SPLIT_K": 4, "FUSED_REDUCE": 1,
     "X_IN_SHARED": 1, "NONTEMPORAL": 1, "VEC": 4},
    {"MMA": 1, "MAX_M": 2, "ROWS_PER_BLOCK": 64, "ROWS_PER_THREAD": 4, "SPLIT_K": 2},
]


def _ids(combo: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in combo.items()) or "defaults"


# --------------------------------------------------------------------- hipcc
def _hipcc() -> str:
    return shutil.which("hipcc") or "hipcc"  # the tests that call it are marked needs("hipcc")


def _hipcc_compile(src: Path, defines: dict[str, int], out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [_hipcc(), *(f"--offload-arch={a}" for a in AMD_ARCHS), "--genco", "-O3", "-I", str(SOURCE_DIR)]
    cmd += [f"-D{k}={v}" for k, v in defines.items()]
    cmd += [str(src), "-o", str(out)]
    env = dict(os.environ, HIP_PLATFORM="amd")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.needs("hipcc")
@pytest.mark.parametrize("src", HIP_SOURCES, ids=lambda p: p.name)
@pytest.mark.parametrize("combo", COMBOS, ids=_ids)
def test_hipcc_compiles(src: Path, combo: dict[str, int], tmp_path: Path) -> None:
    out = tmp_path / "kernel.co"
    result = _hipcc_compile(src, combo, out)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr, result.stderr
    blob = out.read_bytes()
    for arch in AMD_ARCHS:
        assert arch.encode() in blob, f"no {arch} code object in the bundle"
    assert b"tunekit_gemv_reduce" in blob and b"tunekit_gemv" in blob


@pytest.mark.needs("hipcc")
def test_hipcc_rejects_bad_vec(tmp_path: Path) -> None:
    result = _hipcc_compile(SOURCE_DIR / "gemv.hip", {"VEC": 3}, tmp_path / "bad.co")
    assert result.returncode != 0
    assert "VEC must be 2, 4 or 8" in result.stderr


@pytest.mark.needs("hipcc")
def test_hipcc_rejects_mma(tmp_path: Path) -> None:
    # MMA=1 is mma.sync (NVIDIA): an AMD build must say so, not compile something else.
    result = _hipcc_compile(SOURCE_DIR / "gemv.hip", {"MMA": 1, "ROWS_PER_BLOCK": 32}, tmp_path / "mma.co")
    assert result.returncode != 0
    assert "MMA=1 is the NVIDIA mma.sync path" in result.stderr


@pytest.mark.needs("hipcc")
def test_hipcc_rejects_wave64_on_wave32_target(tmp_path: Path) -> None:
    # RDNA (gfx1030) runs wave32 by default: a WAVE=64 build must refuse, not miscompute.
    cmd = [_hipcc(), "--offload-arch=gfx1030", "--genco", "-I", str(SOURCE_DIR), "-DWAVE=64"]
    cmd += [str(SOURCE_DIR / "gemv.hip"), "-o", str(tmp_path / "w.co")]
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HIP_PLATFORM="amd"))
    if "cannot find ROCm device library" in result.stderr:
        pytest.skip("no gfx1030 device library in this ROCm")
    assert result.returncode != 0
    assert "WAVE is larger than the target's wavefront" in result.stderr


# --------------------------------------------------------------------- NVRTC
SM90 = DeviceInfo(
    vendor="nvidia", name="H200 (compile only)", arch="sm_90", cu_count=132, wave_size=32,
    l2_bytes=60 * 2**20, memory_bytes=0, runtime="cuda", torch_device="cuda:0",
)  # fmt: skip


def _nvidia(combo: dict[str, int]) -> dict[str, int]:
    # Same spread, with NVIDIA's 32-lane warps (REDUCE_DPP compiles to the shuffle path).
    return combo | {"WAVE": 32} if "WAVE" in combo else dict(combo)


@pytest.mark.needs("nvrtc")
@pytest.mark.parametrize("combo", COMBOS + NV_MMA_COMBOS, ids=_ids)
def test_nvrtc_compiles(combo: dict[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path))
    module = rtc.compile_kernel("gemv", _nvidia(combo), SM90)
    assert not module.cache_hit
    assert module.binary[:4] == b"\x7fELF"
    assert b"tunekit_gemv_reduce" in module.binary
    assert module.compiler.startswith("nvrtc ")


@pytest.mark.needs("nvrtc")
def test_nvrtc_refuses_wave64() -> None:
    with pytest.raises(BuildError) as info:
        rtc.compile_kernel("gemv", {"WAVE": 64}, SM90, use_cache=False)
    assert "NVIDIA warps have 32 lanes" in info.value.log


@pytest.mark.needs("nvrtc")
def test_disk_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path / "cache"))
    defines = {"WAVE": 32, "MAX_M": 1, "VEC": 8, "UNROLL": 2}
    cold = rtc.compile_kernel("gemv", defines, SM90)
    warm = rtc.compile_kernel("gemv", dict(reversed(list(defines.items()))), SM90)  # order-free key
    assert not cold.cache_hit and warm.cache_hit
    assert warm.key == cold.key and warm.binary == cold.binary
    assert warm.compile_s < 0.05 < cold.compile_s, (cold.compile_s, warm.compile_s)
    other = rtc.compile_kernel("gemv", defines | {"UNROLL": 4}, SM90)
    assert not other.cache_hit and other.key != cold.key
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and ".locks" not in p.parts]
    assert len(files) == 2 and not any(p.name.endswith(".tmp") for p in files)


@pytest.mark.needs("nvrtc")
def test_compile_error_raises_build_error_with_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEKIT_CACHE", str(tmp_path))
    with pytest.raises(BuildError) as info:
        rtc.compile_kernel("gemv", {"WAVE": 32, "VEC": 3}, SM90)
    assert "VEC must be 2, 4 or 8" in info.value.log
    assert "gemv.hip" in info.value.log  # #line keeps diagnostics on the real file
    entries = [p for p in tmp_path.rglob("*") if p.is_file() and ".locks" not in p.parts]
    assert not entries, "failed builds must not be cached"


# ------------------------------------------------------------- rtc plumbing
def test_source_text_inlines_header_with_line_markers() -> None:
    text = rtc.source_text("gemv")
    assert f'#include "{HEADER}"' not in text
    assert "#define TUNEKIT_HIP_H" in text
    original = (SOURCE_DIR / "gemv.hip").read_text().splitlines()
    marker = next(line for line in text.splitlines() if line.startswith('#line ') and "gemv.hip" in line)
    resume = int(marker.split()[1])
    after = text.split(marker + "\n", 1)[1].splitlines()[0]
    assert original[resume - 1] == after


def test_cache_key_covers_everything() -> None:
    from tunekit.rtc import cache

    base = dict(arch="sm_90", compiler="nvrtc 13.0", target="cubin", options=("-std=c++17",))
    key = cache.cache_key("src", {"A": 1, "B": 2}, **base)
    assert key == cache.cache_key("src", {"B": 2, "A": 1}, **base)
    assert key != cache.cache_key("src2", {"A": 1, "B": 2}, **base)
    assert key != cache.cache_key("src", {"A": 1, "B": 3}, **base)
    for field, value in (("arch", "sm_80"), ("compiler", "nvrtc 13.1"), ("target", "ptx"), ("options", ())):
        assert key != cache.cache_key("src", {"A": 1, "B": 2}, **(base | {field: value}))


def test_unavailable_on_cpu() -> None:
    cpu = DeviceInfo("cpu", "x86", "cpu", 2, 1, 0, 0, "cpu", "cpu")
    reason = BACKEND.unavailable_reason(cpu)
    assert reason and "GPU" in reason
    problem = Problem("gemv", "bf16", 1, 96, 5120)
    with pytest.raises(BuildError):
        BACKEND.build(problem, BACKEND.space(problem).default, cpu)


# ------------------------------------------------------- backend: predicate
def _problem(m: int = 1, n: int = 5120, k: int = 5120) -> Problem:
    return Problem("gemv", "bf16", m, n, k)


def _default() -> dict[str, int]:
    return dict(BACKEND.space(_problem()).default)


def test_space_keys_are_the_defines() -> None:
    space = BACKEND.space(_problem())
    assert set(space.domains) == set(GEMV_PARAMS) == set(space.default) == set(space.reference)
    source = (SOURCE_DIR / "gemv.hip").read_text()
    for name in GEMV_PARAMS:
        assert f"#ifndef {name}\n#define {name} " in source, f"{name} has no #ifndef default in gemv.hip"


def test_default_valid_for_every_builtin_model_shape() -> None:
    from tunekit.problems.models import list_models

    checked = 0
    for spec in list_models():
        for tp in (1, 2, 4, 8):
            try:
                problems = spec.problems(tp=tp, m_list=(1, 2, 4, 8))
            except Exception:  # noqa: BLE001 - tp not supported by this model
                continue
            for problem in problems:
                assert BACKEND.invalid_reason(problem, BACKEND.space(problem).default) is None, problem
                checked += 1
    assert checked > 100


@pytest.mark.parametrize(
    ("change", "shape", "expect"),
    [
        ({"VEC": 3}, (1, 96, 5120), "VEC=3"),
        ({"THREADS_PER_ROW": 48}, (1, 96, 5120), "power of two"),
        ({"THREADS_PER_ROW": 512, "ROWS_PER_BLOCK": 4}, (1, 96, 5120), "exceeds 1024"),
        ({"THREADS_PER_ROW": 8, "ROWS_PER_BLOCK": 2}, (1, 96, 5120), "multiple of 32"),
        ({"ROWS_PER_THREAD": 4, "ROWS_PER_BLOCK": 2}, (1, 96, 5120), "multiple of ROWS_PER_THREAD"),
        ({"FUSED_REDUCE": 1}, (1, 96, 5120), "only applies to SPLIT_K > 1"),
        ({"SPLIT_K": 16, "UNROLL": 4}, (1, 96, 5120), "shorter than one step"),
        ({"THREADS_PER_ROW": 256, "ROWS_PER_BLOCK": 1}, (1, 96, 1024), "lanes without a single load"),
        ({"UNROLL": 8}, (1, 96, 768), "masked off"),
        ({"X_IN_SHARED": 1, "THREADS_PER_ROW": 512, "ROWS_PER_BLOCK": 2}, (8, 96, 8192), "X_IN_SHARED"),
        ({"UNROLL": 16, "ROWS_PER_THREAD": 4, "ROWS_PER_BLOCK": 32}, (8, 96, 65536), "registers"),
        ({"NONTEMPORAL": 2}, (1, 96, 5120), "0 or 1"),
        ({"BLOCK_N": 4}, (1, 96, 5120), "unknown parameter"),
        ({"MMA": 1, "ROWS_PER_BLOCK": 8}, (1, 96, 5120), "multiple of 16*ROWS_PER_THREAD=16"),
        ({"MMA": 1, "ROWS_PER_BLOCK": 32, "VEC": 2}, (1, 96, 5120), "VEC=4 or 8"),
        ({"MMA": 1, "ROWS_PER_BLOCK": 64, "THREADS_PER_ROW": 16}, (1, 96, 5120), "multiple of the 32-lane warp"),
        ({"MMA": 1, "ROWS_PER_BLOCK": 32}, (16, 96, 5120), "M <= 8"),
        ({"MMA": 1, "ROWS_PER_BLOCK": 32, "REDUCE_DPP": 1}, (1, 96, 5120), "no DPP"),
        ({"MMA": 1, "ROWS_PER_BLOCK": 16, "THREADS_PER_ROW": 1024, "UNROLL": 1}, (1, 96, 768), "lanes without"),
        ({"MMA": 1, "ROWS_PER_BLOCK": 64, "ROWS_PER_THREAD": 4, "UNROLL": 8}, (1, 96, 5120), "registers"),
        ({"MMA": 1, "ROWS_PER_BLOCK": 32, "THREADS_PER_ROW": 1024, "ROWS_PER_THREAD": 2, "UNROLL": 1,
          "X_IN_SHARED": 1}, (8, 96, 65536), "shared memory"),
    ],
)
def test_invalid_reason_rejects(change: dict[str, int], shape: tuple[int, int, int], expect: str) -> None:
    m, n, k = shape
    reason = BACKEND.invalid_reason(_problem(m, n, k), _default() | change)
    assert reason is not None and expect in reason, reason


@pytest.mark.parametrize(
    "change",
    [
        {"SPLIT_K": 4, "FUSED_REDUCE": 1},
        {"THREADS_PER_ROW": 256, "ROWS_PER_BLOCK": 4, "UNROLL": 2},
        {"ROWS_PER_THREAD": 4, "ROWS_PER_BLOCK": 16, "THREADS_PER_ROW": 16},
        {"X_IN_SHARED": 1, "VEC": 4, "REDUCE_DPP": 1, "NONTEMPORAL": 1},
        {"MMA": 1, "ROWS_PER_BLOCK": 32},
        {"MMA": 1, "ROWS_PER_BLOCK": 64, "ROWS_PER_THREAD": 2, "THREADS_PER_ROW": 64, "SPLIT_K": 2},
        {"ROWS_PER_BLOCK": 1, "THREADS_PER_ROW": 32},
        {"ROWS_PER_BLOCK": 2, "THREADS_PER_ROW": 16},
    ],
)
def test_invalid_reason_accepts(change: dict[str, int]) -> None:
    assert BACKEND.invalid_reason(_problem(4, 96, 5120), _default() | change) is None


def test_invalid_reason_is_pure_and_reports_missing_keys() -> None:
    params = _default()
    del params["VEC"]
    assert "missing" in (gemv_invalid_reason(params, 1, 96, 5120) or "")
    assert BACKEND.invalid_reason(Problem("gemv", "fp16", 1, 96, 5120), _default()) is not None
    assert BACKEND.invalid_reason(Problem("gemv", "bf16", 17, 96, 5120), _default()) is not None


def test_params_without_mma_are_the_cuda_core_kernel() -> None:
    # Tables and trials written before MMA existed still validate and build the same kernel.
    old = {k: v for k, v in _default().items() if k != "MMA"}
    assert BACKEND.invalid_reason(_problem(4), old) is None
    assert BACKEND.defines(_problem(4), old, SM90) == BACKEND.defines(_problem(4), _default(), SM90)
    assert BACKEND.defines(_problem(4), old, SM90)["MMA"] == 0


def test_mma_block_and_split_geometry() -> None:
    from tunekit.backends.hip import block_threads, rows_per_group

    mma = _default() | {"MMA": 1, "ROWS_PER_BLOCK": 64, "ROWS_PER_THREAD": 2, "THREADS_PER_ROW": 64}
    assert rows_per_group(mma) == 32 and block_threads(mma) == 128 and k_lanes(mma) == 8
    assert block_threads(_default()) == 256 and k_lanes(_default()) == 32
    # a split starts on whole steps of the row group's K lanes
    assert split_k_chunk(5120, 3, 8, k_lanes(mma)) % (8 * 8) == 0


def test_backend_defines_add_wave_and_max_m() -> None:
    defines = BACKEND.defines(_problem(4), _default(), SM90)
    assert defines["WAVE"] == 32 and defines["MAX_M"] == 4
    with pytest.raises(BuildError):
        BACKEND.defines(_problem(4), _default() | {"WAVE": 64}, SM90)
    assert len(BACKEND.source_hash()) == 16 and BACKEND.source_hash() == BACKEND.source_hash()
    assert BACKEND.name == "hip" and BACKEND.kind == "tuned" and BACKEND.ops[0] == "gemv"


def test_split_k_chunks_cover_k() -> None:
    for k in (256, 1000, 5120, 17408, 27648):
        for split in (2, 3, 4, 8):
            chunk = split_k_chunk(k, split, 8, 32)
            assert chunk % 8 == 0 and chunk * split >= k


# ------------------------------------------------- CPU emulation (numerics)
_EMU = r"""
#include "cuda_on_cpu.h"
#include "gemv.hip"

// argv: M N K stride_xm stride_wn stride_ym x_offset w_offset k_chunk dir
int main(int argc, char** argv) {
    if (argc != 11) return 1;
    long a[9]; for (int i = 0; i < 9; ++i) a[i] = std::atol(argv[i + 1]);
    const long M = a[0], N = a[1], K = a[2], sxm = a[3], swn = a[4], sym = a[5];
    std::vector<unsigned short> x = read_u16(argv[10], "x.bin"), w = read_u16(argv[10], "w.bin");
    std::vector<unsigned short> y(M * sym, 0xffff);  // poisoned: NaN bits
    std::vector<float> ws((size_t)SPLIT_K * M * N, NAN);
    const unsigned gx = (N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
    std::vector<unsigned> tickets(gx, 0);
    for (int call = 0; call < 2; ++call) {  // twice: fused-reduce tickets must re-arm
        run_grid(gx, SPLIT_K, TK_THREADS, [&] {
            tunekit_gemv(x.data() + a[6], w.data() + a[7], y.data(), ws.data(), tickets.data(), M, N, K, sxm,
                         swn, sym, a[8]);
        });
#if SPLIT_K > 1 && !FUSED_REDUCE
        run_grid((M * N + TK_REDUCE_THREADS - 1) / TK_REDUCE_THREADS, 1, TK_REDUCE_THREADS,
                 [&] { tunekit_gemv_reduce(ws.data(), y.data(), M, N, sym); });
#endif
    }
    for (unsigned t : tickets) if (t) return 3;
    write_u16(argv[10], "y.bin", y);
    return 0;
}
"""

#: Emulated configs (WAVE=32, the NVIDIA shape of the code): one per code path.
EMU_CONFIGS: list[dict[str, int]] = [
    {},
    {"ROWS_PER_THREAD": 4, "ROWS_PER_BLOCK": 8, "THREADS_PER_ROW": 64, "UNROLL": 4},
    {"THREADS_PER_ROW": 128, "ROWS_PER_BLOCK": 2, "ROWS_PER_THREAD": 2, "X_IN_SHARED": 1, "NONTEMPORAL": 1},
    {"THREADS_PER_ROW": 64, "ROWS_PER_BLOCK": 4, "SPLIT_K": 3, "UNROLL": 1},
    {"THREADS_PER_ROW": 64, "ROWS_PER_BLOCK": 4, "SPLIT_K": 3, "UNROLL": 1, "FUSED_REDUCE": 1},
    {"THREADS_PER_ROW": 8, "ROWS_PER_BLOCK": 16, "VEC": 2},
    {"THREADS_PER_ROW": 32, "ROWS_PER_BLOCK": 1, "UNROLL": 4},  # one warp, one row per block
    # tensor-core path (warp-level mma emulated): one warp per tile, 2 tiles and
    # 2 K-warps with staged x, split-K with the fused reduction, VEC=4
    {"MMA": 1, "ROWS_PER_BLOCK": 32, "UNROLL": 2},
    {"MMA": 1, "ROWS_PER_BLOCK": 32, "ROWS_PER_THREAD": 2, "THREADS_PER_ROW": 64, "X_IN_SHARED": 1, "NONTEMPORAL": 1},
    {"MMA": 1, "ROWS_PER_BLOCK": 64, "SPLIT_K": 3, "FUSED_REDUCE": 1, "VEC": 4, "UNROLL": 4},
]


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ not on PATH")
    path = tmp_path_factory.mktemp("emu")
    (path / "emu.cpp").write_text(_EMU)
    return path


def _emulate(
    emu_dir: Path, config: dict[str, int], m: int, n: int, k: int, *,
    w_pad: int = 0, x_offset: int = 0, y_pad: int = 0, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    defines = {"WAVE": 32, "MAX_M": 4, "THREADS_PER_ROW": 32} | config
    exe = emu_dir / ("emu_" + "_".join(f"{a}{b}" for a, b in sorted(defines.items())))
    if not exe.exists():
        cmd = ["g++", "-std=c++20", "-O1", "-pthread", "-I", str(SOURCE_DIR), "-I", str(Path(__file__).parent)]
        cmd += [f"-D{a}={b}" for a, b in defines.items()] + [str(emu_dir / "emu.cpp"), "-o", str(exe)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    gen = torch.Generator().manual_seed(seed)
    sxm, swn, sym = k, k + w_pad, n + y_pad
    x_all = torch.randn(x_offset + m * sxm, generator=gen).to(torch.bfloat16)
    w_all = torch.randn(n * swn, generator=gen).to(torch.bfloat16)
    x_all.view(torch.int16).numpy().tofile(emu_dir / "x.bin")
    w_all.view(torch.int16).numpy().tofile(emu_dir / "w.bin")
    x = torch.as_strided(x_all, (m, k), (sxm, 1), x_offset)
    w = torch.as_strided(w_all, (n, k), (swn, 1), 0)
    chunk = split_k_chunk(k, defines.get("SPLIT_K", 1), defines.get("VEC", 8), k_lanes(defines))
    args = [m, n, k, sxm, swn, sym, x_offset, 0, chunk, emu_dir]
    subprocess.run([str(exe), *map(str, args)], check=True, timeout=300)
    raw = np.fromfile(emu_dir / "y.bin", dtype=np.int16)
    y = torch.from_numpy(raw).view(torch.bfloat16).reshape(m, sym)[:, :n]
    return y, x.double() @ w.double().T


def _check_close(y: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    assert torch.isfinite(y.double()).all(), "unwritten (poisoned) or non-finite outputs"
    # bf16 output rounding (half an ulp, 2^-8 relative) + fp32 accumulation over K.
    tol = ref.abs() * 2.0**-8 + k * 2.0**-23 * ref.abs().max() + 1e-6
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"max err {err.max().item():.4g}, worst tolerance {tol.min().item():.4g}"


@pytest.mark.parametrize("config", EMU_CONFIGS, ids=_ids)
def test_emulated_numerics(emu_dir: Path, config: dict[str, int]) -> None:
    # Odd N (row tails) throughout. K a multiple of 8 but of no step: the
    # vector paths and their tails. Then K odd, W rows padded and x offset by
    # one (misaligned: the scalar / guarded paths), y rows padded.
    m, n = 3, 13
    for k, layout in ((2 * 1536 + 8 * 5, {}), (2 * 1536 + 8 * 5 + 3, {"w_pad": 3, "x_offset": 1, "y_pad": 5})):
        y, ref = _emulate(emu_dir, config, m, n, k, **layout)
        _check_close(y, ref, k)


@pytest.mark.parametrize("config", [{"ROWS_PER_THREAD": 2, "ROWS_PER_BLOCK": 4},
                                    {"THREADS_PER_ROW": 64, "ROWS_PER_BLOCK": 2, "X_IN_SHARED": 1, "SPLIT_K": 2}],
                         ids=_ids)
def test_emulated_every_m_to_16(emu_dir: Path, config: dict[str, int]) -> None:
    # One build for M <= 16 (MAX_M = the tabulated M) serves every smaller M, odd ones included: the
    # in-between Ms a table's M = 16 entry serves (docs/serving.md)
    for m in range(1, 17):
        y, ref = _emulate(emu_dir, {"MAX_M": 16} | config, m, 13, 2 * 256 + 40, seed=m)
        _check_close(y, ref, 2 * 256 + 40)


def test_emulated_bits_depend_only_on_reduction_order(emu_dir: Path) -> None:
    # The reference config's bits are kept by every change that leaves
    # THREADS_PER_ROW, VEC and SPLIT_K alone (the `exact` numerics policy).
    base = {"THREADS_PER_ROW": 64, "ROWS_PER_BLOCK": 4, "SPLIT_K": 3, "UNROLL": 1}
    same = {"ROWS_PER_BLOCK": 8, "ROWS_PER_THREAD": 2, "UNROLL": 2, "X_IN_SHARED": 1, "FUSED_REDUCE": 1}
    m, n, k = 2, 9, 4096 + 40
    started = time.perf_counter()
    y0, _ = _emulate(emu_dir, base, m, n, k, seed=7)
    y1, _ = _emulate(emu_dir, base | same, m, n, k, seed=7)
    assert torch.equal(y0.view(torch.int16), y1.view(torch.int16))
    assert time.perf_counter() - started < 120


def test_vendor_specific_tunables_are_pinned() -> None:
    from dataclasses import replace

    from tunekit.backends.hip import BACKEND as HIP
    from tunekit.measure.device import DeviceInfo

    nvidia = DeviceInfo("nvidia", "NVIDIA H200", "sm_90", 132, 32, 60 << 20, 1, "cuda 13.0", "cuda:0")
    # DPP is AMD's; mma.sync is NVIDIA's from sm_80 on
    assert HIP.pinned_params(nvidia) == {"REDUCE_DPP": 0}
    assert HIP.pinned_params(replace(nvidia, arch="sm_75")) == {"REDUCE_DPP": 0, "MMA": 0}
    assert HIP.pinned_params(replace(nvidia, vendor="amd", arch="gfx90a", wave_size=64)) == {"MMA": 0}
