"""HIP backend: the ``kernels_hip`` sources, compiled at run time per config.

Ops: every op whose record names a kernels_hip source, each a ``Family``
(source, kernel, tunable defines, predicate, derived defines, launcher):
``GEMV_FAMILY`` below and the elementwise families of
``tunekit.backends.hip_elementwise``, together in ``FAMILIES`` (op -> family).

One source serves both vendors: NVRTC builds it for NVIDIA (WAVE=32), hipRTC
for AMD/DCU (WAVE=64 on gfx9). Search-space keys are the kernel's compile-time
defines (``ROWS_PER_BLOCK``, ``ROWS_PER_THREAD``, ``THREADS_PER_ROW``, ``VEC``, ``UNROLL``,
``SPLIT_K``, ``FUSED_REDUCE``, ``NONTEMPORAL``, ``X_IN_SHARED``, ``REDUCE_DPP``, ``MMA``); the backend
adds ``WAVE`` (from the device) and ``MAX_M`` (= problem.m, so the M loops are
fully unrolled for the M being tuned).

Call protocol (see ``tunekit.backends.base``)::

    backend = tunekit.backends.get("hip")
    backend.unavailable_reason(device)            # None on nvidia/amd with cuda.core/hip-python
    space = backend.space(problem)                # [hip] table of search_spaces/gemv.toml
    backend.invalid_reason(problem, params)       # pure predicate, no compile
    kernel = backend.build(problem, params, device)   # compile (disk-cached) + load
    kernel((x, w), y)                             # y[M,N] = x[M,K] @ w[N,K]^T, async, graph-capturable

``kernel.compile_s`` and ``kernel.cache_hit`` tell how the build went.

Notes: ``REDUCE_DPP`` only changes AMD code (the NVIDIA build is the shuffle
path, the same kernel as REDUCE_DPP=0). ``MMA=1`` is the tensor-core path
(mma.sync, NVIDIA sm_80+ only: pinned to 0 elsewhere); there a row group is
``16*ROWS_PER_THREAD`` rows and ``THREADS_PER_ROW`` whole warps. Every config
is bit-identical to the reference config when it shares MMA, THREADS_PER_ROW,
VEC and SPLIT_K with it (the K-reduction order); the others differ in the last
bits only.
"""

from __future__ import annotations

import torch

import search_spaces
from tunekit import rtc
from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.backends.hip_elementwise import FAMILIES as ELEMENTWISE_FAMILIES
from tunekit.backends.hip_elementwise import Family, int_params
from tunekit.measure.device import DeviceInfo
from tunekit.problems import oprecords
from tunekit.problems.shapes import Problem

#: Tunable defines of kernels_hip/gemv.hip and their allowed values (any config
#: outside these is refused before compiling).
GEMV_PARAMS: tuple[str, ...] = (
    "ROWS_PER_BLOCK",
    "ROWS_PER_THREAD",
    "THREADS_PER_ROW",
    "VEC",
    "UNROLL",
    "SPLIT_K",
    "NONTEMPORAL",
    "X_IN_SHARED",
    "REDUCE_DPP",
    "FUSED_REDUCE",
    "MMA",
)
#: Defines added after tables and trials were first written: a params dict
#: without one means the kernel as it was before (MMA absent = CUDA-core path).
_ADDED_LATER: dict[str, int] = {"MMA": 0}
#: Largest MAX_M the kernel accepts (static_assert in gemv.hip).
MAX_M_LIMIT = 16
#: Threads of a block: whole 32-lane groups (full-mask shuffles need whole
#: NVIDIA warps). On wave64 a 32-thread block is half a wave, which gemv.hip
#: allows (its shuffles stay inside 32-lane groups there); one warp per row
#: per block is the shape that balances the tail best on NVIDIA.
_BLOCK_MULTIPLE = 32
#: Staged-x budget: NVIDIA allows 48 KiB of static shared memory without
#: opt-in; 16 KiB stay for the two-stage reduction buffer (<= 8 KiB).
_SMEM_LIMIT = 32 * 1024
#: Must match X_SMEM_BYTES / TK_REDUCE_THREADS defaults in gemv.hip.
_X_SMEM_BYTES = 16384
_REDUCE_THREADS = 256
#: Accumulators plus W words in flight a thread may hold; past this the
#: compilers spill (AMD: 128 VGPRs keep 4 waves/SIMD; NVIDIA: 255 max).
_MAX_LIVE_REGS = 96
#: More splits than this only multiply the partials traffic (M*N*4 bytes each).
_MAX_SPLIT_K = 64
#: MMA=1: rows of one mma tile (the m16n8k16 M side), its x columns (tokens),
#: the NVIDIA warp, and the oldest architecture with bf16 mma.sync.
_MMA_TILE_ROWS = 16
_MMA_MAX_M = 8
_NV_WARP = 32
_MMA_MIN_SM = 80


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def rows_per_group(params: Params) -> int:
    """W rows of one row group: ROWS_PER_THREAD, or that many 16-row mma tiles when MMA=1."""
    rpt = int(params["ROWS_PER_THREAD"])
    return rpt * _MMA_TILE_ROWS if int(params.get("MMA", 0)) else rpt


def k_lanes(params: Params) -> int:
    """Threads side by side along K on one row (MMA=1: 4 per warp of the row group)."""
    tpr = int(params["THREADS_PER_ROW"])
    return tpr // 8 if int(params.get("MMA", 0)) else tpr


def block_threads(params: Params) -> int:
    """Threads of one block: row groups per block x THREADS_PER_ROW."""
    return int(params["ROWS_PER_BLOCK"]) // rows_per_group(params) * int(params["THREADS_PER_ROW"])


def split_k_chunk(k: int, split_k: int, vec: int, klanes: int) -> int:
    """K elements per split: ceil(K / SPLIT_K) rounded up to whole row-group vector rows.

    ``klanes`` is the number of threads side by side along K (``k_lanes``).
    The rounding keeps every split's start VEC-aligned (vector loads) and makes
    all but the last split run whole lane rows.
    """
    if split_k <= 1:
        return k
    quantum = vec * klanes
    per_split = -(-k // split_k)
    return -(-per_split // quantum) * quantum


def gemv_invalid_reason(params: Params, m: int, n: int, k: int) -> str | None:
    """None if ``params`` build a correct gemv.hip kernel for (m, n, k), else why not.

    Pure: mirrors the kernel's #error / static_assert checks and refuses
    configs that are legal but pointless (a step several times longer than K,
    splits that would get no full step).
    """
    p = int_params(_ADDED_LATER | dict(params), GEMV_PARAMS)
    if isinstance(p, str):
        return p
    rpb, rpt, tpr = p["ROWS_PER_BLOCK"], p["ROWS_PER_THREAD"], p["THREADS_PER_ROW"]
    vec, unroll = p["VEC"], p["UNROLL"]
    split = p["SPLIT_K"]
    mma = p["MMA"]
    if not 1 <= m <= MAX_M_LIMIT:
        return f"M={m} outside 1..{MAX_M_LIMIT}"
    if n < 1 or k < 1:
        return f"empty problem (N={n}, K={k})"
    for flag in ("NONTEMPORAL", "X_IN_SHARED", "REDUCE_DPP", "FUSED_REDUCE", "MMA"):
        if p[flag] not in (0, 1):
            return f"{flag}={p[flag]}: must be 0 or 1"
    if vec not in (2, 4, 8):
        return f"VEC={vec}: must be 2, 4 or 8 (4-, 8- or 16-byte loads)"
    if not _pow2(tpr) or tpr > 1024:
        return f"THREADS_PER_ROW={tpr}: must be a power of two <= 1024"
    if mma:
        if m > _MMA_MAX_M:
            return f"MMA=1 serves M <= {_MMA_MAX_M} (the mma's 8 columns), not M={m}"
        if vec not in (4, 8):
            return f"MMA=1 needs VEC=4 or 8 (one or two k16 mma steps per load), not {vec}"
        if tpr % _NV_WARP:
            return f"MMA=1 needs THREADS_PER_ROW a multiple of the {_NV_WARP}-lane warp, not {tpr}"
        if p["REDUCE_DPP"]:
            return "MMA=1 has no DPP reduction (REDUCE_DPP=0)"
    group_rows = rows_per_group(p)
    if rpt < 1 or rpb < 1 or rpb % group_rows:
        what = f"16*ROWS_PER_THREAD={group_rows}" if mma else f"ROWS_PER_THREAD={rpt}"
        return f"ROWS_PER_BLOCK={rpb} must be a positive multiple of {what}"
    threads = block_threads(p)
    if threads > 1024:
        return f"block of {threads} threads (row groups x THREADS_PER_ROW) exceeds 1024"
    if threads % _BLOCK_MULTIPLE:
        return f"block of {threads} threads is not a multiple of {_BLOCK_MULTIPLE} (whole 32-lane groups)"
    if not 1 <= unroll <= 16:
        return f"UNROLL={unroll}: must be 1..16"
    # Live registers per thread (32-bit words): accumulators + W and x vectors in
    # flight (MMA=1: 4 fragment accumulators per tile, two W rows per tile and x).
    if mma:
        regs = 4 * rpt + unroll * (2 * rpt + 1) * vec // 2
    else:
        regs = rpt * m + unroll * rpt * vec // 2
    if regs > _MAX_LIVE_REGS:
        return f"{regs} live accumulator/load registers per thread > {_MAX_LIVE_REGS}"
    if split < 1:
        return f"SPLIT_K={split}: must be >= 1"
    if split == 1 and p["FUSED_REDUCE"]:
        return "FUSED_REDUCE only applies to SPLIT_K > 1"
    klanes = k_lanes(p)
    step = vec * klanes * unroll
    lanes = "THREADS_PER_ROW/8" if mma else "THREADS_PER_ROW"
    if split == 1:
        if vec * klanes > k:
            return f"VEC*{lanes}={vec * klanes} > K={k}: lanes without a single load"
        if step > 2 * k:
            return f"VEC*{lanes}*UNROLL={step} > 2*K={2 * k}: most unrolled loads would be masked off"
    else:
        if split > _MAX_SPLIT_K:
            return f"SPLIT_K={split} > {_MAX_SPLIT_K}"
        per_split = -(-k // split)
        if per_split < step:
            return f"SPLIT_K={split}: K/SPLIT_K={per_split} is shorter than one step (VEC*{lanes}*UNROLL={step})"
        chunk = split_k_chunk(k, split, vec, klanes)
        if chunk * (split - 1) >= k:
            return f"SPLIT_K={split}: with {chunk}-element chunks the last split would be empty"
    smem = 0
    if p["X_IN_SHARED"]:
        # gemv.hip stages at least one step of x per row: MAX_M * step bf16.
        chunk_steps = max(1, _X_SMEM_BYTES // (2 * m * step))
        smem = 2 * m * step * chunk_steps
        if smem > _SMEM_LIMIT:
            return f"X_IN_SHARED: staging {smem} bytes of x exceeds {_SMEM_LIMIT} (lower the step)"
    if mma and tpr > _NV_WARP:
        # red_mma: every warp of a row group but the first parks 4 fp32 per tile and lane
        groups, parked_warps = threads // tpr, tpr // _NV_WARP - 1
        smem += groups * parked_warps * rpt * 4 * _NV_WARP * 4
        if smem > _SMEM_LIMIT:
            return f"MMA=1: {smem} bytes of shared memory (K-warp partials + staged x) > {_SMEM_LIMIT}"
    return None


class HipBackend:
    name = "hip"
    kind = "tuned"
    #: the ops whose record names a kernels_hip source: gemv and the elementwise families
    ops: tuple[str, ...] = oprecords.names(backend="hip")

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        if not device.is_gpu:
            return f"no GPU ({device.vendor}): HIP kernels run on NVIDIA (NVRTC) or AMD/DCU (hipRTC) GPUs"
        return rtc.unavailable_reason(device.vendor)

    def pinned_params(self, device: DeviceInfo) -> Params:
        """Tunables that do not change the kernel on ``device`` (the search pins them).

        REDUCE_DPP selects AMD cross-lane instructions; the NVIDIA build always
        takes the shuffle path, so both values compile to the same kernel there.
        MMA=1 exists only on NVIDIA sm_80+ (elsewhere it would not compile).
        """
        if device.vendor != "nvidia":
            return {"MMA": 0}  # mma.sync is NVIDIA's; no AMD MFMA path is written
        pinned = {"REDUCE_DPP": 0}
        arch = device.arch.removeprefix("sm_")
        if not arch.isdigit() or int(arch) < _MMA_MIN_SM:
            pinned["MMA"] = 0  # bf16 mma.sync needs sm_80+
        return pinned

    def space(self, problem: Problem) -> SearchSpace:
        self._check_op(problem.op)
        return search_spaces.load(problem.op, self.name)

    def serving_space(self, problem: Problem) -> SearchSpace:
        """The names serving checks an entry's params against, each an integer define (the kernel's own list,
        Python next to its predicate, not the search-time TOML); no default config (HIP serves no fallback)."""
        self._check_op(problem.op)
        names = FAMILIES[problem.op].params
        return SearchSpace(op=problem.op, backend=self.name, domains={name: [0] for name in names}, default={},
                           reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        if problem.op not in self.ops:
            return f"hip backend has no kernel for op {problem.op!r}"
        family = FAMILIES[problem.op]
        if problem.dtype != "bf16":
            return f"{family.source}.hip is BF16 only (got {problem.dtype})"
        return family.invalid_reason(params, problem)

    def defines(self, problem: Problem, params: Params, device: DeviceInfo) -> dict[str, int]:
        """The full define set a build of ``params`` compiles with (tunables + WAVE + MAX_M,
        or for an elementwise op + the shape-derived defines of its family)."""
        wave = device.wave_size if device.wave_size in (32, 64) else (64 if device.vendor == "amd" else 32)
        return FAMILIES[problem.op].defines(params, problem, wave)

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        self._check_op(problem.op)
        why = self.unavailable_reason(device)
        if why:
            raise BuildError(why)
        reason = self.invalid_reason(problem, params)
        if reason:
            raise BuildError(f"invalid config: {reason}")
        defines = self.defines(problem, params, device)
        index = torch.device(device.torch_device).index or 0
        family = FAMILIES[problem.op]
        return family.build(rtc.compile_kernel(family.source, defines, device), defines, index, problem)

    def source_hash(self) -> str:
        return rtc.sources_hash()[:16]

    def builds_up_to_m(self, op: str) -> bool:
        """The GEMV compiles MAX_M in (one build serves every M up to it); the elementwise families take M at
        launch time."""
        return FAMILIES[op].built_up_to_m if op in FAMILIES else False

    def kernel_name(self, problem: Problem) -> str:
        family = FAMILIES[problem.op]
        return f"kernels_hip/{family.source}.hip:{family.kernel}"

    def _check_op(self, op: str) -> None:
        if op not in self.ops:
            raise BuildError(f"hip backend has no kernel for op {op!r}")


class _GemvLauncher:
    """The built kernel: ``launcher((x, w), y)`` writes y = x @ w^T on torch's current stream.

    No host-device copies, no syncs: the split-K workspace comes from torch's
    caching allocator (a graph's private pool under capture); the fused
    reduction's ticket counters are allocated zeroed at the first call and
    left zero by every call.
    """

    def __init__(self, family: Family, module: rtc.CompiledModule, defines: dict[str, int], device_index: int,
                 problem: Problem) -> None:
        self.module = module
        self.defines = defines
        self.compile_s = module.compile_s
        self.cache_hit = module.cache_hit
        self._rows = defines["ROWS_PER_BLOCK"]
        self._threads = block_threads(defines)
        self._split = defines["SPLIT_K"]
        self._vec = defines["VEC"]
        self._klanes = k_lanes(defines)
        self._max_m = defines["MAX_M"]
        self._main = module.kernel("tunekit_gemv", device_index)
        self._fused = self._split > 1 and bool(defines["FUSED_REDUCE"])
        self._reduce = module.kernel("tunekit_gemv_reduce", device_index)
        self._ticket_cache: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        x, w = inputs[0], inputs[1]
        m, k = x.shape
        n = w.shape[0]
        self._check(x, w, out, m, n, k)
        if m == 0 or n == 0:
            return
        stream = torch.cuda.current_stream(x.device).cuda_stream
        # With one row the row stride is never used; 0 keeps the alignment test happy for any view.
        stride_xm = x.stride(0) if m > 1 else 0
        blocks_n = -(-n // self._rows)
        grid = (blocks_n, self._split, 1)
        block = (self._threads, 1, 1)
        strides = [stride_xm, w.stride(0), out.stride(0)]
        if self._split == 1:
            args = [x.data_ptr(), w.data_ptr(), out.data_ptr(), 0, 0, m, n, k, *strides, k]
            self._main(grid, block, args, stream)
            return
        ws = torch.empty((self._split, m, n), dtype=torch.float32, device=x.device)
        chunk = split_k_chunk(k, self._split, self._vec, self._klanes)
        tickets = self._tickets(x.device, blocks_n).data_ptr() if self._fused else 0
        args = [x.data_ptr(), w.data_ptr(), out.data_ptr(), ws.data_ptr(), tickets, m, n, k, *strides, chunk]
        self._main(grid, block, args, stream)
        if self._fused:
            return
        total = m * n
        self._reduce(
            (-(-total // _REDUCE_THREADS), 1, 1),
            (_REDUCE_THREADS, 1, 1),
            [ws.data_ptr(), out.data_ptr(), m, n, out.stride(0)],
            stream,
        )

    def _tickets(self, device: torch.device, blocks: int) -> torch.Tensor:
        # Zeroed once per (device, row tiles); every fused call leaves them zero,
        # so one allocation serves all calls and graph replays. The first call
        # (warm-up, before capture) makes it.
        key = (str(device), blocks)
        tickets = self._ticket_cache.get(key)
        if tickets is None:
            tickets = torch.zeros(blocks, dtype=torch.int32, device=device)
            self._ticket_cache[key] = tickets
        return tickets

    def _check(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, m: int, n: int, k: int) -> None:
        if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
            raise ValueError(f"gemv.hip takes bf16 tensors (x {x.dtype}, w {w.dtype}, out {out.dtype})")
        if w.shape[1] != k or tuple(out.shape) != (m, n):
            raise ValueError(f"shape mismatch: x {tuple(x.shape)}, w {tuple(w.shape)}, y {tuple(out.shape)}")
        if m > self._max_m:
            raise ValueError(f"M={m} exceeds MAX_M={self._max_m} this kernel was built for")
        if (k > 1 and (x.stride(1) != 1 or w.stride(1) != 1)) or (n > 1 and out.stride(1) != 1):
            raise ValueError("gemv.hip needs unit stride along K (x, w) and N (out)")
        if not (x.is_cuda and w.is_cuda and out.is_cuda):
            raise ValueError("gemv.hip runs on GPU tensors")

    def __repr__(self) -> str:
        return f"hip gemv {self.defines}"


BACKEND = HipBackend()


#: kernels_hip/gemv.hip as a family like the elementwise ones: MAX_M = the problem's M (every smaller M runs
#: on the same build), WAVE from the device, MMA absent in older tables = the CUDA-core path.
GEMV_FAMILY = Family("gemv", "tunekit_gemv", GEMV_PARAMS,
                     lambda params, p: gemv_invalid_reason(params, p.m, p.n, p.k), lambda p: {"MAX_M": p.m},
                     None, defaults=_ADDED_LATER, launcher=_GemvLauncher, built_up_to_m=True)
#: op -> the kernels_hip family that serves it (the record's ``kernels["hip"]``)
FAMILIES: dict[str, Family] = {"gemv": GEMV_FAMILY, **ELEMENTWISE_FAMILIES}
