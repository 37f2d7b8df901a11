"""vLLM's CuTe-DSL skinny GEMM as tunekit backends: a searched family and vLLM's own heuristic.

vLLM 0.33 ships a shape-dynamic GEMM for small M written in the CuTe DSL
(``vllm/model_executor/kernels/linear/cute_dsl/skinny_gemm.py``): C = A B^T
(+ residual), one CTA per ``outputs_per_block`` rows of W, M unrolled
(``num_rows``), K read in tiles of ``block_size * vector_width``. Its
configuration is a ``SkinnyGemmConfig``; vLLM picks one per shape with a
hand-written heuristic (``ShapeDynamicSkinnyGemm._config``), and per-model
tables tuned by hand override it (Qwen4Exp, Kimi-K3).

Two backends, one kernel (vLLM's, compiled by vLLM's own ``_compile``):

* ``vllm_skinny`` (kind "tuned", ops ``gemv`` and ``gemv_add``, the latter
  through the kernel's fused residual): the search space is
  ``SkinnyGemmConfig``'s fields, read from vLLM's class at run time
  (``dataclasses.fields``): ``num_rows`` is the problem's M (``fixed``), each
  other field takes the domain in :data:`DOMAINS`; ``static_k`` is 0 (K a
  run-time value, vLLM's ``None``) or the problem's K. A field vLLM adds with
  a default and no domain here keeps vLLM's default. :func:`config_reason`
  mirrors the kernel's own checks (``ShapeDynamicSkinnyGemm.__call__``,
  ``CuteSkinnyGemm.__init__``) and calls vLLM's ``row_stride_ok`` on the
  activation layout the search and the dispatch pass.
* ``vllm_skinny_heuristic`` (kind "baseline": never searched): the
  same kernel at vLLM's heuristic config for the shape, as vLLM runs it.

Call protocol: the Backend protocol (``tunekit.backends.base``). Nothing of
vLLM is imported at module import (vLLM's import takes seconds):
``unavailable_reason`` looks packages up without importing vLLM (one line:
no GPU, architecture, vLLM missing or without the kernel, the CuTe DSL or
what vLLM's compile imports missing); ``space`` / ``invalid_reason`` import
vLLM's module and raise :class:`PeerMissing` (an ``ImportError`` and a
``UserError``) where it cannot be imported: table validation then checks an
entry's structure only, the CLI prints one line; ``build`` compiles the
config (CuTe DSL, seconds) and returns ``kernel(inputs, out)``, which launches
vLLM's compiled kernel on torch's current stream with ``out`` as C (no copy),
graph-capturable.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tunekit.backends.base import BuildError, Kernel, Params, SearchSpace
from tunekit.errors import UserError
from tunekit.measure.device import DeviceInfo
from tunekit.problems.shapes import Problem

#: vLLM's module holding SkinnyGemmConfig, ShapeDynamicSkinnyGemm, row_stride_ok (0.33).
SKINNY_MODULE = "vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm"
#: Its files, relative to the vllm package (the source hash; found without importing vLLM).
SKINNY_FILES = ("model_executor/kernels/linear/cute_dsl/skinny_gemm.py",
                "model_executor/kernels/linear/cute_dsl/_skinny_gemm.py")
OPS = ("gemv", "gemv_add")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_BITS = {"bf16": 16, "fp16": 16}
#: ShapeDynamicSkinnyGemm.__call__: "shape-dynamic skinny GEMM requires 1 <= M <= 16".
MAX_M = 16
#: CuteSkinnyGemm.__init__: block_size a multiple of cute.arch.WARP_SIZE; CUDA's limit on a block.
WARP_SIZE, MAX_BLOCK = 32, 1024
#: The copy atoms move vector_width elements per instruction (CopyG2ROp): at most a 128-bit load.
MAX_COPY_BITS = 128
#: _skinny_gemm._PREFETCH_TILES: a static K holds at least this many whole tiles (the vLLM tier checks it).
PREFETCH_TILES = 2
#: ``static_k`` in params: 0 is vLLM's None (K a run-time value); else the problem's K.
DYNAMIC_K = 0
#: pip extra that installs what the peers need.
EXTRA = "pip install -e .[peers]"

#: tunekit's domain of each SkinnyGemmConfig field it searches (the names are vLLM's). block_size:
#: warp multiples up to 512 (vLLM's own configs use 32-256); vector_width: 2-8 elements (32- to 128-bit
#: loads; vLLM's use 2, 4, 8); outputs_per_block and k_unroll: beyond the values vLLM's tables use.
DOMAINS: dict[str, Callable[[Problem], list[int]]] = {
    "block_size": lambda p: [32, 64, 96, 128, 160, 192, 224, 256, 384, 512],
    "outputs_per_block": lambda p: [1, 2, 3, 4, 6, 8],
    "k_unroll": lambda p: [1, 2, 3, 4, 5, 6, 8, 10],
    "vector_width": lambda p: [2, 4, 8],
    "static_k": lambda p: [DYNAMIC_K, p.k],
}
#: Fields the problem fixes: the kernel unrolls M, so num_rows must be M.
FROM_PROBLEM: dict[str, Callable[[Problem], int]] = {"num_rows": lambda p: p.m}


# ----------------------------------------------------------------------------- what is installed


def has_module(name: str) -> bool:
    """Whether ``name`` is an installed module or regular package, without importing it (only its parents).

    A namespace package does not count: any folder called ``vllm`` on the path (tests/vllm under pytest)
    is one."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


def vllm_file(relative: str) -> Path | None:
    """A file of the installed vllm package (found without importing vLLM), or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root) / relative
        if path.is_file():
            return path
    return None


def version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def capability(arch: str) -> tuple[int, int] | None:
    """(major, minor) of an NVIDIA ``sm_XY`` / ``sm_XXY`` arch (tunekit.measure.device's form), else None."""
    digits = arch[3:] if arch.startswith("sm_") else ""
    digits = digits.rstrip("afAF")  # sm_90a, sm_100f: the family suffixes
    if len(digits) < 2 or not digits.isdigit():
        return None
    return int(digits[:-1]), int(digits[-1])


@functools.cache
def cute_min_arch() -> tuple[int, int]:
    """The oldest architecture the CuTe DSL targets: the lowest of ``cutlass.base_dsl.enums.Arch``."""
    try:
        from cutlass.base_dsl.enums import Arch

        return min((a.major, a.minor) for a in Arch)
    except Exception:  # noqa: BLE001 - an older or newer DSL without that enum: its documented floor
        return (8, 0)


def packages_reason() -> str | None:
    """Why vLLM's skinny GEMM cannot be compiled here for lack of a package, else None."""
    if not has_module("vllm"):
        return f"vLLM is not installed (the skinny GEMM is vLLM's kernel, vLLM >= 0.33; {EXTRA} does not add vLLM)"
    if vllm_file(SKINNY_FILES[0]) is None:
        return f"vLLM {version_of('vllm')} has no CuTe-DSL skinny GEMM (vllm/{SKINNY_FILES[0]}, vLLM 0.33)"
    if not has_module("cutlass"):
        return f"the CuTe DSL is not installed (nvidia-cutlass-dsl; {EXTRA})"
    # what vLLM's ShapeDynamicSkinnyGemm._compile imports and passes (make_fake_tensor, CUstream, tvm-ffi)
    for module, dist in (("quack", "quack-kernels"), ("cuda.bindings", "cuda-bindings"),
                         ("tvm_ffi", "apache-tvm-ffi")):
        if not has_module(module):
            return f"{dist} is not installed (vLLM's skinny GEMM compiles through {module}; {EXTRA})"
    return None


def device_reason(device: DeviceInfo, what: str) -> str | None:
    """No GPU, or not NVIDIA: the one-line reason, else None."""
    if not device.is_gpu:
        return f"no GPU ({what} runs on NVIDIA GPUs)"
    if device.vendor != "nvidia":
        return f"architecture {device.arch} unsupported ({what} runs on NVIDIA GPUs only)"
    return None


# ----------------------------------------------------------------------------- vLLM's interfaces


class PeerMissing(ImportError, UserError):
    """vLLM's skinny GEMM module cannot be imported here: an ImportError to table validation (an entry's
    structure is all it can check), one ``error:`` line to the CLI (``--backend vllm_skinny`` without vLLM)."""


def vllm_skinny_module():
    """vLLM's skinny_gemm module (imported on first use); ImportError, with the reason, where it cannot be."""
    if not has_module("vllm") or vllm_file(SKINNY_FILES[0]) is None:
        raise PeerMissing(f"vLLM's skinny GEMM cannot be used here: {packages_reason()}")
    try:
        return importlib.import_module(SKINNY_MODULE)
    except Exception as exc:  # noqa: BLE001 - vLLM's import can fail many ways; the verdict is one line
        raise PeerMissing(f"vLLM's skinny GEMM cannot be used here: {SKINNY_MODULE} cannot be imported "
                          f"({type(exc).__name__}: {exc})") from exc


def config_fields() -> tuple[dataclasses.Field, ...]:
    """The fields of vLLM's SkinnyGemmConfig, in its order."""
    return dataclasses.fields(vllm_skinny_module().SkinnyGemmConfig)


def heuristic_config(problem: Problem):
    """vLLM's heuristic SkinnyGemmConfig for the problem's (M, N, K) (``ShapeDynamicSkinnyGemm._config``)."""
    cls = vllm_skinny_module().ShapeDynamicSkinnyGemm
    pick = getattr(cls, "_config", None)
    if not callable(pick):
        raise PeerMissing(f"vLLM {version_of('vllm')}'s ShapeDynamicSkinnyGemm has no _config heuristic")
    return pick(problem.m, problem.n, problem.k)


def config_params(config) -> Params:
    """A SkinnyGemmConfig as tunekit params (static_k None -> 0): every field, num_rows included."""
    params = dataclasses.asdict(config)
    if params.get("static_k") is None and "static_k" in params:
        params["static_k"] = DYNAMIC_K
    return params


def make_config(problem: Problem, params: Params):
    """The SkinnyGemmConfig of ``params`` for ``problem`` (num_rows from M where params lack it).

    Raises TypeError / ValueError for params that name no field or lack a required one."""
    cls = vllm_skinny_module().SkinnyGemmConfig
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise TypeError(f"SkinnyGemmConfig has no field {', '.join(unknown)}")
    kwargs = {name: FROM_PROBLEM[name](problem) for name in names if name in FROM_PROBLEM}
    kwargs.update(params)
    if kwargs.get("static_k") == DYNAMIC_K:
        kwargs["static_k"] = None
    return cls(**kwargs)


def config_reason(problem: Problem, config) -> str | None:
    """Why vLLM's kernel refuses ``config`` for ``problem`` (its checks, mirrored), else None."""
    m, n, k = problem.m, problem.n, problem.k
    if problem.op not in OPS:
        return f"vLLM's skinny GEMM has no kernel for op {problem.op!r} (it serves {', '.join(OPS)})"
    if problem.dtype not in DTYPES:
        return f"vLLM's skinny GEMM takes BF16 or FP16 (got {problem.dtype})"
    if not 1 <= m <= MAX_M:
        return f"vLLM's skinny GEMM requires 1 <= M <= {MAX_M} (M={m})"
    if config.num_rows != m:
        return f"config num_rows must match M (num_rows={config.num_rows}, M={m})"
    bs, vw, opb = config.block_size, config.vector_width, config.outputs_per_block
    if bs <= 0 or bs % WARP_SIZE or bs > MAX_BLOCK:
        return f"block_size={bs} must be a multiple of the warp size ({WARP_SIZE}), at most {MAX_BLOCK}"
    if vw <= 0 or vw & (vw - 1) or vw * DTYPE_BITS[problem.dtype] > MAX_COPY_BITS:
        return f"vector_width={vw}: the kernel's loads are a power of two of at most {MAX_COPY_BITS} bits"
    if config.k_unroll < 1:
        return f"k_unroll={config.k_unroll} must be >= 1"
    if opb < 1 or n % opb:
        return f"N must be divisible by outputs_per_block (N={n}, outputs_per_block={opb})"
    tile = bs * vw
    if k % tile:
        return f"K must be divisible by block_size * vector_width for this config (K={k}, {bs} * {vw} = {tile})"
    if config.static_k is not None:
        if config.static_k != k:
            return f"input K must match config static_k (K={k}, static_k={config.static_k})"
        if config.static_k < PREFETCH_TILES * tile:
            return f"static K must contain at least {PREFETCH_TILES} complete tiles (K={k}, tile {tile})"
    # vector width against alignment: vLLM's own check on the x the search and the dispatch pass
    # (contiguous [M, K] rows; the kernel copes with other layouts per call, see build)
    x = torch.empty((m, k), dtype=DTYPES[problem.dtype], device="meta")
    if not vllm_skinny_module().row_stride_ok(x, config):
        return f"x rows of K={k} are not vector_width-aligned (vector_width={vw}; vLLM's row_stride_ok)"
    return None


# ----------------------------------------------------------------------------- building


def _seed_vllm_stream() -> None:
    """Point vLLM's stream tracking at torch's current stream before vLLM's compile asks for it.

    vLLM's ``current_stream()``, called by ``ShapeDynamicSkinnyGemm._stream`` at compile time, makes
    and switches to a new stream on its first call in a process vLLM did not set up (a search worker,
    an HF model under ``tunekit.patch``); seeded, it returns the stream torch has now.
    """
    try:
        from vllm.utils import torch_utils
    except ImportError:
        return
    tls = getattr(torch_utils, "_current_stream_tls", None)
    if tls is not None and getattr(tls, "value", None) is None:
        tls.value = torch.cuda.current_stream()


def current_raw_stream(index: int) -> int:
    """torch's current stream on device ``index`` (a capture's, under capture) as a raw handle."""
    return torch.cuda.current_stream(index).cuda_stream


# torch's own accessor where the build has it: no Stream object built per call
current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or current_raw_stream  # noqa: F811


def cu_stream() -> type:
    """cuda.bindings' CUstream, the stream type vLLM's compiled kernel takes; a BuildError with the one-line
    ``unavailable:`` reason where cuda-bindings cannot be imported (packages_reason finds it without importing it)."""
    try:
        from cuda.bindings.driver import CUstream
    except ImportError as exc:
        raise BuildError(f"unavailable: cuda-bindings cannot be imported ({type(exc).__name__}: {exc}; vLLM's "
                         f"skinny GEMM launches on its CUstream; {EXTRA})") from None
    return CUstream


def build_kernel(problem: Problem, config) -> Kernel:
    """vLLM's kernel compiled for ``config`` (through vLLM's ``_compile`` and its cache), as ``kernel(inputs, out)``.

    Per call: x rows that fail vLLM's ``row_stride_ok`` (a view at an odd offset or row stride) are
    copied into a fresh contiguous tensor first, and a non-contiguous residual made contiguous
    (vLLM's checks); a non-contiguous W raises (the dispatch then serves the vendor path)."""
    module = vllm_skinny_module()
    gemm = module.shape_dynamic_skinny_gemm
    compile_, compiled = getattr(gemm, "_compile", None), getattr(gemm, "_compiled", None)
    if not callable(compile_) or not isinstance(compiled, dict):
        raise BuildError(f"vLLM {version_of('vllm')}'s ShapeDynamicSkinnyGemm has no _compile / _compiled "
                         "(tunekit launches vLLM's compiled kernel into its own output; written for vLLM 0.33)")
    stream_type = cu_stream()
    dtype = DTYPES[problem.dtype]
    has_residual = problem.op == "gemv_add"
    key = (dtype, config, has_residual)
    if key not in compiled:
        _seed_vllm_stream()
        try:
            compile_(dtype, config, has_residual)
        except Exception as exc:  # noqa: BLE001 - the DSL's and ptxas's errors: a failed candidate
            raise BuildError(f"CuTe DSL compile of {config} failed: {type(exc).__name__}: {exc}",
                             log=traceback.format_exc()) from None
    fn = compiled[key]
    row_stride_ok = module.row_stride_ok

    def kernel(inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        x, w = inputs[0], inputs[1]
        if not row_stride_ok(x, config):
            x = x.clone(memory_format=torch.contiguous_format)
        if not w.is_contiguous():
            raise ValueError("vLLM's skinny GEMM reads a contiguous weight")
        residual = out
        if has_residual:
            residual = inputs[2] if inputs[2].is_contiguous() else inputs[2].contiguous()
        fn(x, w, residual, out, stream_type(current_raw_stream(x.get_device())))

    kernel.config = config  # type: ignore[attr-defined]
    return kernel


@functools.cache
def _source_hash(vllm_version: str, cute_version: str) -> str:
    digest = hashlib.sha256(f"vllm-{vllm_version}|cutlass-dsl-{cute_version}".encode())
    for relative in SKINNY_FILES:
        path = vllm_file(relative)
        digest.update(path.read_bytes() if path else b"missing")
    return digest.hexdigest()[:16]


class _SkinnyBase:
    ops = OPS

    def unavailable_reason(self, device: DeviceInfo) -> str | None:
        why = device_reason(device, "vLLM's CuTe-DSL skinny GEMM") or packages_reason()
        if why:
            return why
        cc, floor = capability(device.arch), cute_min_arch()
        if cc is None or cc < floor:
            return (f"architecture {device.arch} unsupported (the CuTe DSL targets sm_{floor[0]}{floor[1]} "
                    "and newer)")
        return None

    def source_hash(self) -> str:
        return _source_hash(version_of("vllm"), version_of("nvidia-cutlass-dsl"))

    def _build(self, problem: Problem, config, device: DeviceInfo) -> Kernel:
        why = self.unavailable_reason(device)
        if why:
            raise BuildError(why)
        reason = config_reason(problem, config)
        if reason:
            raise BuildError(f"invalid config: {reason}")
        return build_kernel(problem, config)


class VllmSkinnyBackend(_SkinnyBase):
    """``vllm_skinny``: vLLM's skinny GEMM searched over SkinnyGemmConfig."""

    name = "vllm_skinny"
    kind = "tuned"

    def space(self, problem: Problem) -> SearchSpace:
        if problem.op not in self.ops:
            # an op it lacks (the engine pairs a problem only with the backends of its op): nothing to tune
            return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})
        domains: dict[str, list[Any]] = {}
        fixed: Params = {}
        for f in config_fields():
            if f.name in FROM_PROBLEM:
                fixed[f.name] = FROM_PROBLEM[f.name](problem)
            elif f.name in DOMAINS:
                domains[f.name] = DOMAINS[f.name](problem)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BuildError(f"vLLM's SkinnyGemmConfig has a required field {f.name!r} with no tunekit domain")
        heuristic = config_params(heuristic_config(problem))
        default = {name: heuristic[name] for name in domains}
        return SearchSpace(op=problem.op, backend=self.name, domains=domains, default=default,
                           reference=dict(default), fixed=fixed)

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        if problem.op not in self.ops:
            return f"vllm_skinny has no kernel for op {problem.op!r} (it serves {', '.join(self.ops)})"
        try:
            config = make_config(problem, params)
        except (TypeError, ValueError) as exc:
            return f"bad params: {exc}"
        reason = config_reason(problem, config)
        if reason is None and config.static_k is not None and config.k_unroll != 1:
            # tunekit's rule, not the kernel's: with K static the K loop is unrolled whole at compile
            # time and k_unroll is never read, so one kernel would be measured under several names
            return "k_unroll has no effect with a static K (the loop is unrolled whole): k_unroll=1"
        return reason

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        why = self.unavailable_reason(device)
        if why:
            raise BuildError(why)
        try:
            config = make_config(problem, params)
        except (TypeError, ValueError) as exc:
            raise BuildError(f"bad params: {exc}") from None
        return self._build(problem, config, device)

    def kernel_name(self, problem: Problem) -> str:
        return f"{SKINNY_MODULE}:ShapeDynamicSkinnyGemm (CuTe DSL)"


class VllmSkinnyHeuristicBackend(_SkinnyBase):
    """``vllm_skinny_heuristic``: the baseline, vLLM's skinny GEMM at vLLM's heuristic config per shape."""

    name = "vllm_skinny_heuristic"
    kind = "baseline"

    def space(self, problem: Problem) -> SearchSpace:
        return SearchSpace(op=problem.op, backend=self.name, domains={}, default={}, reference={})

    def invalid_reason(self, problem: Problem, params: Params) -> str | None:
        if problem.op not in self.ops:
            return f"vLLM's skinny GEMM has no kernel for op {problem.op!r} (it serves {', '.join(self.ops)})"
        if not 1 <= problem.m <= MAX_M:  # vLLM's heuristic is not meant for them (its M check comes first)
            return f"shape unsupported: vLLM's skinny GEMM requires 1 <= M <= {MAX_M} (M={problem.m})"
        config = heuristic_config(problem)
        reason = config_reason(problem, config)
        return None if reason is None else f"shape unsupported: vLLM's heuristic {config}: {reason}"

    def build(self, problem: Problem, params: Params, device: DeviceInfo) -> Kernel:
        why = self.unavailable_reason(device) or self.invalid_reason(problem, params)
        if why:
            raise BuildError(why)
        return self._build(problem, heuristic_config(problem), device)

    def kernel_name(self, problem: Problem) -> str:
        return f"{SKINNY_MODULE}:ShapeDynamicSkinnyGemm at its heuristic config (_config)"


BACKEND = VllmSkinnyBackend()
HEURISTIC = VllmSkinnyHeuristicBackend()
