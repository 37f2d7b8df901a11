"""Launch-capture + ahead-of-time compile of Triton kernels for GPU targets on a CPU machine.

Why: the CPU test tier runs every Triton kernel on the interpreter
(TRITON_INTERPRET=1), which executes the kernel body as Python and so accepts
code that Triton's real compiler rejects - a kernel reading a plain (not
``tl.constexpr``) module global passed every CPU test and failed on the first
GPU launch. Triton can lower a kernel to PTX (NVIDIA) and AMDGCN (AMD) without
a GPU, so this module compiles the kernels exactly as a launch would and
reports what the compiler rejects, before a GPU ever sees them.

How:
1. *Capture*: the real Python wrappers (``gemv``, ``rms_norm``, ...) are called
   with small CPU tensors while ``JITFunction.run`` is replaced by a recorder,
   so each ``kernel[grid](...)`` is stored (kernel, args, kwargs) instead of
   launched. The wrappers' own logic (constexpr choice, split-K reduce launch,
   derived BLOCK sizes) therefore decides what gets compiled, not a copy of it.
2. *Bind*: Triton's own launch binder (the code ``JITFunction.run`` uses) turns
   the arguments into the signature, constexprs and specialisation attributes:
   defaults of params not passed, None, bools, floats, ``tl`` dtypes, tensors
   of any dtype and ``do_not_specialize`` are handled as a launch would.
3. *Compile*: per target, the stages of ``triton.compiler.compile`` are run up
   to the last text stage (``ptx`` / ``amdgcn``); the binary stages need
   ptxas / ld.lld, which a CPU machine does not have. Identical
   (kernel, signature, constexprs, attributes, options) are compiled once.

It must run in a process where TRITON_INTERPRET is unset *before* triton and
the kernels are imported (``triton.jit`` returns interpreter objects otherwise,
and the kernels pick interpreter-only paths such as ``RNE_BY_BITS`` at import).
The tests set it in conftest.py, so the test starts this as a subprocess:

    python tests/triton_targets.py [--cases SPEC ...] [--json PATH] [--jobs N]
    (or python -m tests.triton_targets from the repository root)

which writes a JSON report: one row per (case, launched kernel, target) with
``ok`` and the compiler's ``error`` text; the exit status is 1 if any row
failed. This relies on Triton internals of the 3.x line (``_pack_args``,
``create_function_from_signature``, ``backend.add_stages``); a Triton upgrade
that moves them breaks this module loudly, not silently.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import itertools
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: Target name -> (GPUTarget arguments, last stage compiled). The stage after it
#: (cubin / hsaco) needs ptxas / ld.lld, absent on a CPU machine.
TARGETS: dict[str, tuple[tuple, str]] = {
    "cuda:sm_90": (("cuda", 90, 32), "ptx"),
    "hip:gfx90a": (("hip", "gfx90a", 64), "amdgcn"),
}

#: A case: a name and a zero-argument callable that calls a kernel wrapper.
Case = tuple[str, Callable[[], Any]]

#: Longest error text kept per row (MLIR diagnostics can run to pages).
MAX_ERROR_CHARS = 6000


@dataclass
class Launch:
    """One captured ``kernel[grid](*args, **kwargs)``; the grid is irrelevant to compilation."""

    kernel: Any  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return f"{self.kernel.fn.__module__}.{self.kernel.fn.__qualname__}"


@contextlib.contextmanager
def capturing() -> Iterator[list[Launch]]:
    """Record JIT launches instead of running them (nothing compiles or runs while active)."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, dict(kwargs)))
        return None

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def capture(call: Callable[[], Any]) -> list[Launch]:
    """The launches ``call`` makes. A wrapper that inspects a kernel's return value would need more."""
    with capturing() as launches:
        call()
    return launches


@dataclass(frozen=True)
class Bound:
    """What ``ASTSource`` needs, plus a hashable key identifying the compiled artefact."""

    signature: dict
    constexprs: dict
    attrs: dict
    options: Any
    key: str


def bind(launch: Launch, backend) -> Bound:
    """Bind a launch's arguments as ``JITFunction.run`` does, for ``backend``'s target."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    kwargs = dict(launch.kwargs)
    # as JITFunction.run: these two options come from the kernel / environment, not the caller
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    key = repr((launch.name, kernel.cache_key, sorted(signature.items()), sorted(constexprs.items(), key=str),
                sorted(attrs.items()), sorted(options.__dict__.items())))
    return Bound(signature, constexprs, attrs, options, key)


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Redirect file descriptor 2: MLIR/LLVM write their diagnostics there, not into the exception."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def compile_bound(launch: Launch, bound: Bound, target_name: str, diag_path: str | None = None) -> str | None:
    """Compile to ``target_name``'s last text stage; None on success, else the error text.

    The compiler's stderr goes to ``diag_path`` (a temporary file if None, then
    removed): a caller that gives the path can still read it if LLVM aborts.
    """
    own_path = diag_path is None
    if own_path:
        with tempfile.NamedTemporaryFile(suffix=".stderr", delete=False) as tmp:
            diag_path = tmp.name
    try:
        with _stderr_to(diag_path):
            try:
                lower(launch, bound, target_name)
                return None
            except Exception as exc:  # every compiler error is a finding, reported as text
                error = f"{type(exc).__name__}: {exc}"
        diagnostics = Path(diag_path).read_text(errors="replace").strip()
        if diagnostics:
            error += "\n--- compiler diagnostics ---\n" + diagnostics
        return error[:MAX_ERROR_CHARS]
    finally:
        if own_path:
            os.unlink(diag_path)


def lower(launch: Launch, bound: Bound, target_name: str) -> str:
    """The text of ``target_name``'s last text stage (PTX / AMDGCN) for a bound launch; raises what the
    compiler raises."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    target_args, last_stage = TARGETS[target_name]
    target = GPUTarget(*target_args)
    backend = make_backend(target)
    src = ASTSource(launch.kernel, bound.signature, bound.constexprs, bound.attrs)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, bound.options, backend.get_codegen_implementation(bound.options),
                         backend.get_module_map(), context)
    stages: dict = {}
    backend.add_stages(stages, bound.options, src.language)
    if last_stage not in stages:
        raise RuntimeError(f"target {target_name} has no stage {last_stage!r} (stages: {list(stages)})")
    # Seeded as triton.compiler.compile does: stages read the options from it
    # (Triton 3.9's AMD backend reads metadata["num_ctas"]).
    metadata: dict = {"hash": "0" * 64, "target": target, **bound.options.__dict__}
    for stage, lower_stage in stages.items():
        module = lower_stage(module, metadata)
        if stage == last_stage:
            break
    if not module:
        raise RuntimeError(f"stage {last_stage} produced no output")
    return module if isinstance(module, str) else str(module)


# ---------------------------------------------------------------------------------------------
# The repository's cases: real wrappers, small CPU tensors.


def _bf16(*shape: int):
    import torch

    return torch.randn(*shape, dtype=torch.float32).to(torch.bfloat16)


def _params(config) -> str:
    return ",".join(f"{k}={v}" for k, v in dataclasses.asdict(config).items())


def gemv_cases() -> list[Case]:
    """GEMV over M, M_MODE, split-K and its reduction, even and odd K, each with both eviction hints (valid only).

    BLOCK_K=64 lets SPLIT_K=3 cut both K=384 (EVEN_K: 3 splits of 128) and K=300
    (masked loads) into non-empty splits; the "dot" modes need BLOCK_N >= 16.
    """
    import torch

    from kernels_triton import gemv as g

    n = 40  # not a multiple of BLOCK_N: the clamped-row path is the one compiled anyway
    splits = ((1, "kernel"), (3, "kernel"), (3, "fused"))
    cases: list[Case] = []
    for m, (k_index, k) in itertools.product((1, 3, 8), enumerate((384, 300))):
        configs = [g.DEFAULT]
        modes = ("tile", "rows", "dot", "dot_w")
        for mode, (split_index, (split, reduce)) in itertools.product(modes, enumerate(splits)):
            # W_EVICT only changes the W load's cache hint, so it is paired, not crossed: every
            # (M, M_MODE, K) and every (M, M_MODE, split) sees both hints, at half the compiles.
            evict = "evict_first" if (split_index + k_index) % 2 else ""
            block_n = {"dot": 16, "dot_w": 64}.get(mode, 4)  # dot_w at 64: Hopper's wgmma lowering
            configs.append(g.GemvConfig(BLOCK_N=block_n, BLOCK_K=64, SPLIT_K=split, SPLIT_REDUCE=reduce,
                                        W_EVICT=evict, M_MODE=mode))
        for config in configs:
            if g.invalid_reason(config, m, n, k) is not None:
                continue
            x, w = _bf16(m, k), _bf16(n, k)
            out = torch.empty(m, n, dtype=torch.bfloat16)
            cases.append((f"gemv[M={m},N={n},K={k}] {_params(config)}",
                          lambda x=x, w=w, config=config, out=out: g.gemv(x, w, config, out=out)))
    return cases


def gemv_add_cases() -> list[Case]:
    """The GEMV with its residual epilogue (``gemv_add``): every store site that adds it (one split, the
    fused split-K reduction, the reduce kernel), in the 2D, per-row and swapped-MMA layouts."""
    import torch

    from kernels_triton import gemv as g

    n, k = 40, 384
    configs = [g.DEFAULT, g.GemvConfig(BLOCK_K=64, SPLIT_K=3),
               g.GemvConfig(BLOCK_K=64, SPLIT_K=3, SPLIT_REDUCE="fused"),
               g.GemvConfig(BLOCK_N=64, BLOCK_K=64, M_MODE="dot_w"), g.GemvConfig(BLOCK_K=64, M_MODE="rows")]
    cases: list[Case] = []
    for m, config in itertools.product((1, 3), configs):
        if g.invalid_reason(config, m, n, k) is not None:
            continue
        x, w, r = _bf16(m, k), _bf16(n, k), _bf16(m, n)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        cases.append((f"gemv_add[M={m},N={n},K={k}] {_params(config)}",
                      lambda x=x, w=w, r=r, config=config, out=out: g.gemv(x, w, config, out=out, residual=r)))
    return cases


def rms_gemv_cases() -> list[Case]:
    """The GEMV with the 1/rms scale of a folded norm (``rms_gemv``): the 2D tile, the per-row and
    swapped-MMA layouts (split-K refuses the scale)."""
    import torch

    from kernels_triton import gemv as g

    n, k = 40, 384
    configs = [g.DEFAULT, g.GemvConfig(BLOCK_N=1, BLOCK_K=256, num_warps=1, num_stages=4, W_EVICT="evict_first"),
               g.GemvConfig(BLOCK_N=64, BLOCK_K=64, M_MODE="dot_w"), g.GemvConfig(BLOCK_K=64, M_MODE="rows")]
    cases: list[Case] = []
    for m, config in itertools.product((1, 3), configs):
        if g.invalid_reason(config, m, n, k) is not None:
            continue
        x, w = _bf16(m, k), _bf16(n, k)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        cases.append((f"rms_gemv[M={m},N={n},K={k}] {_params(config)}",
                      lambda x=x, w=w, config=config, out=out: g.gemv(x, w, config, out=out, rms_eps=1e-6)))
    return cases


def glu_gemv_cases() -> list[Case]:
    """gate_up with SiLU-and-mul in its epilogue (``glu=``), with and without the 1/rms scale: one pair
    and several per program, the 2D and 3D tiles and the swapped MMA, K a multiple of BLOCK_K or not."""
    import torch

    from kernels_triton import gemv as g

    n = 40
    configs = [g.DEFAULT, g.GemvConfig(BLOCK_N=2, BLOCK_K=256, num_warps=1, num_stages=4, W_EVICT="evict_first"),
               g.GemvConfig(BLOCK_N=64, BLOCK_K=64, M_MODE="dot_w"), g.GemvConfig(BLOCK_K=64, M_MODE="rows")]
    cases: list[Case] = []
    for m, k, config, rms_eps in itertools.product((1, 3), (384, 200), configs, (None, 1e-6)):
        if g.invalid_reason(config, m, n, k) is not None:
            continue
        x, w = _bf16(m, k), _bf16(n, k)
        out = torch.empty(m, n // 2, dtype=torch.bfloat16)
        op = "rms_gemv_silu_mul" if rms_eps else "gemv_silu_mul"
        cases.append((f"{op}[M={m},N={n},K={k}] {_params(config)}",
                      lambda x=x, w=w, config=config, out=out, rms_eps=rms_eps: g.gemv(x, w, config, out=out,
                                                                                        rms_eps=rms_eps, glu=True)))
    return cases


def _search_configs(module, op: str, m: int, n: int, k: int) -> list:
    """DEFAULT and the first and last valid configs (domain order) of ``op``'s search space.

    First and last are far apart (smallest tiles and warps vs largest), so they
    cover chunked and one-pass paths; the pick follows the TOML if it changes.
    """
    import search_spaces

    space = search_spaces.load(op, "triton")
    names = list(space.domains)
    valid = []
    for values in itertools.product(*(space.domains[name] for name in names)):
        config = module.Config.from_params({**space.default, **space.fixed, **dict(zip(names, values, strict=True))})
        if config != module.DEFAULT and module.invalid_reason(config, m, n, k) is None:
            valid.append(config)
    if len(valid) < 2:
        raise ValueError(f"{op}: fewer than 2 valid non-default configs at M={m}, N={n}, K={k}")
    return [module.DEFAULT, valid[0], valid[-1]]


def _with_roundings(config) -> list:
    """Both VLLM_ROUNDING values where the config has it (they select different kernel code)."""
    if not hasattr(config, "VLLM_ROUNDING"):
        return [config]
    return [dataclasses.replace(config, VLLM_ROUNDING=r) for r in (1, 0)]


def elementwise_cases() -> list[Case]:
    """Each elementwise module: DEFAULT + 2 search-space configs, every op it serves, both roundings."""
    import torch

    from kernels_triton import bias_gelu, fused_add_rms_norm, gated_rms_norm, rms_norm, silu_and_mul

    m, n, group = 3, 1024, 128

    def rms(op, c):
        x, w = _bf16(m, n), _bf16(n)
        return lambda: rms_norm.rms_norm(x, w, c, out=torch.empty_like(x), gemma=op == "gemma_rms_norm")

    def fused(op, c):
        x, r, w = _bf16(m, n), _bf16(m, n), _bf16(n)
        out = (torch.empty_like(x), torch.empty_like(x))
        return lambda: fused_add_rms_norm.fused_add_rms_norm(x, r, w, c, out=out,
                                                              gemma=op == "gemma_fused_add_rms_norm")

    def gated(op, c):
        x, z, w = _bf16(m, 4 * group), _bf16(m, 4 * group), _bf16(group)
        return lambda: gated_rms_norm.gated_rms_norm(x, z, w, c, out=torch.empty_like(x))

    def silu(op, c):
        x = _bf16(m, 2 * n)
        return lambda: silu_and_mul.silu_and_mul(x, c, out=torch.empty(m, n, dtype=torch.bfloat16))

    def gelu(op, c):
        x, b = _bf16(m, n), _bf16(n)
        return lambda: bias_gelu.bias_gelu(x, b, c, out=torch.empty_like(x))

    table = [  # module, (n, k) of invalid_reason, case builder
        (rms_norm, (n, n), rms),
        (fused_add_rms_norm, (n, n), fused),
        (gated_rms_norm, (4 * group, group), gated),
        (silu_and_mul, (n, 2 * n), silu),
        (bias_gelu, (n, n), gelu),
    ]
    cases: list[Case] = []
    for module, (pn, pk), build in table:
        for op in module.OPS:
            for base in _search_configs(module, op, m, pn, pk):
                for config in _with_roundings(base):
                    cases.append((f"{op}[M={m},N={pn},K={pk}] {_params(config)}", build(op, config)))
    return cases


def norm_gemv_cases() -> list[Case]:
    """RMSNorm -> GEMV: every op (residual x weight convention) at M = 1, 3, 8 with DEFAULT (one pass),
    the two-pass kernel at M = 1, 3, and a wide multi-stage tile at M = 1, 3; K=300 is not a multiple of
    BLOCK_K (masked steps)."""
    import torch

    from kernels_triton import rms_norm_gemv as f

    n, k = 40, 300
    wide = f.RmsNormGemvConfig(BLOCK_N=16, BLOCK_K=128, num_warps=2, num_stages=3, W_EVICT="evict_first")
    two_pass = f.RmsNormGemvConfig(ONE_PASS=0)
    cases: list[Case] = []
    for op in f.OPS:
        for m, config in [(1, f.DEFAULT), (3, f.DEFAULT), (8, f.DEFAULT), (1, two_pass), (3, two_pass), (1, wide),
                          (3, wide)]:
            if f.invalid_reason(config, m, n, k) is not None:
                continue
            x, g, w = _bf16(m, k), _bf16(k), _bf16(n, k)
            res = (_bf16(m, k), torch.empty(m, k, dtype=torch.bfloat16)) if op in f.FUSED_ADD_OPS else (None, None)
            out = torch.empty(m, n, dtype=torch.bfloat16)
            cases.append((f"{op}[M={m},N={n},K={k}] {_params(config)}",
                          lambda x=x, g=g, w=w, res=res, config=config, out=out, op=op: f.rms_norm_gemv(
                              x, g, w, config, out=out, residual=res[0], residual_out=res[1],
                              gemma=op.startswith("gemma_"))))
    return cases


def act_gemv_cases() -> list[Case]:
    """SiLU-and-mul -> GEMV at M = 1, 3, 8 with DEFAULT, a wide multi-stage tile at M = 1, 3 and both
    tensor-core modes at M = 2, 8, split-K (each with the GEMV's reduce kernel); K=300 is not a multiple of
    BLOCK_K (masked steps), K=256 is (EVEN_K)."""
    import torch

    from kernels_triton import silu_mul_gemv as f

    n = 40
    wide = f.SiluMulGemvConfig(BLOCK_N=16, BLOCK_K=128, num_warps=2, num_stages=3, W_EVICT="evict_first")
    dot = f.SiluMulGemvConfig(BLOCK_N=16, BLOCK_K=128, num_warps=4, M_MODE="dot")
    dot_w = f.SiluMulGemvConfig(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, M_MODE="dot_w")
    split = f.SiluMulGemvConfig(BLOCK_N=4, BLOCK_K=64, num_warps=2, SPLIT_K=2)
    split_w = dataclasses.replace(dot_w, SPLIT_K=2)
    cases: list[Case] = []
    for k in (300, 256):
        for m, config in [(1, f.DEFAULT), (3, f.DEFAULT), (8, f.DEFAULT), (1, wide), (3, wide),
                          (2, dot), (8, dot), (2, dot_w), (8, dot_w), (1, split), (4, split_w)]:
            if f.invalid_reason(config, m, n, k) is not None:
                continue
            x, w, out = _bf16(m, 2 * k), _bf16(n, k), torch.empty(m, n, dtype=torch.bfloat16)
            cases.append((f"silu_mul_gemv[M={m},N={n},K={k}] {_params(config)}",
                          lambda x=x, w=w, config=config, out=out: f.silu_mul_gemv(x, w, config, out=out)))
    return cases


def stream_cases() -> list[Case]:
    """The bandwidth probe's kernels (``stream_copy`` only where the module has it), first and last probe config."""
    import torch

    from kernels_triton import stream_read as s

    src = _bf16(1 << 16)
    cases: list[Case] = []
    for cfg in (s.PROBE_CONFIGS[0], s.PROBE_CONFIGS[-1]):
        partials = s.make_partials(src.numel(), cfg, torch.device("cpu"))
        cases.append((f"stream_read {cfg}", lambda cfg=cfg, p=partials: s.stream_read(src, p, cfg)))
        if hasattr(s, "stream_copy"):
            dst = torch.empty_like(src)
            cases.append((f"stream_copy {cfg}", lambda cfg=cfg, dst=dst: s.stream_copy(src, dst, cfg)))
    return cases


def autotune_gemv_cases() -> list[Case]:
    """The plain @triton.autotune peer, its first and last config at M = 1 and 16 (the autotuner times on the
    device, so each config's kernel is launched directly, as the autotuner launches it)."""
    import torch

    from kernels_triton import autotune_gemv as ag

    n, k = 40, 300  # masked tails in N and K
    cases: list[Case] = []
    for m, config in itertools.product((1, 16), (ag.CONFIGS[0], ag.CONFIGS[-1])):
        x, w = _bf16(m, k), _bf16(n, k)
        out = torch.empty(m, n, dtype=torch.bfloat16)
        cases.append((f"autotune_gemv[M={m},N={n},K={k}] {config.kwargs} w{config.num_warps}",
                      lambda x=x, w=w, out=out, config=config: ag.launch_config(x, w, out, config)))
    return cases


def repo_cases() -> list[Case]:
    """Every Triton kernel of kernels_triton, through its wrapper."""
    return (gemv_cases() + gemv_add_cases() + rms_gemv_cases() + glu_gemv_cases() + elementwise_cases()
            + norm_gemv_cases() + act_gemv_cases() + stream_cases() + autotune_gemv_cases())


# ---------------------------------------------------------------------------------------------
# Driver


def _load_cases(spec: str) -> list[Case]:
    """``repo`` (``repo_cases``), ``path/to/file.py:FUNC`` or ``package.module:FUNC``."""
    if spec == "repo":
        return repo_cases()
    where, _, func = spec.rpartition(":")
    if where.endswith(".py"):
        # by path: a test module need not be importable as a package (tests/ has no __init__.py)
        module_spec = importlib.util.spec_from_file_location(f"_cases_{Path(where).stem}", where)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, func)()


#: Work of the forked compile workers (inherited, not pickled: JITFunctions do not pickle).
_WORK: list[tuple[Launch, Bound, str]] = []


def _compile_job(index: int, diag_path: str | None = None) -> tuple[str | None, float]:
    launch, bound, target_name = _WORK[index]
    start = time.perf_counter()
    error = compile_bound(launch, bound, target_name, diag_path)
    return error, time.perf_counter() - start


def _isolated_child(index: int, diag_path: str, result_path: str) -> None:
    Path(result_path).write_text(json.dumps(_compile_job(index, diag_path)))


def _compile_isolated(index: int) -> tuple[str | None, float]:
    """One job in its own forked process: a compiler that aborts or segfaults is named, not fatal."""
    import multiprocessing

    with tempfile.TemporaryDirectory() as tmp:
        diag_path, result_path = f"{tmp}/stderr", f"{tmp}/result.json"
        start = time.perf_counter()
        child = multiprocessing.get_context("fork").Process(target=_isolated_child,
                                                            args=(index, diag_path, result_path))
        child.start()
        child.join()
        if child.exitcode == 0 and Path(result_path).exists():
            error, seconds = json.loads(Path(result_path).read_text())
            return error, seconds
        diagnostics = Path(diag_path).read_text(errors="replace").strip() if Path(diag_path).exists() else ""
        error = f"the compiler process died (exit code {child.exitcode})\n--- compiler diagnostics ---\n{diagnostics}"
        return error[:MAX_ERROR_CHARS], time.perf_counter() - start


def _compile_all(jobs: int) -> list[tuple[str | None, float]]:
    """Every job of ``_WORK`` in ``jobs`` forked workers (fork: they inherit ``_WORK``).

    A worker killed by the compiler (LLVM fatal error, segfault) breaks the
    pool; the jobs left without a result are then rerun one process each, so
    the crash becomes the error of the kernel that caused it.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    results: list[tuple[str | None, float] | None] = [None] * len(_WORK)
    with ProcessPoolExecutor(max(1, jobs), mp_context=multiprocessing.get_context("fork")) as pool:
        futures = {pool.submit(_compile_job, index): index for index in range(len(_WORK))}
        for future in as_completed(futures):
            try:
                results[futures[future]] = future.result()
            except BrokenProcessPool:
                pass
    return [result if result is not None else _compile_isolated(index) for index, result in enumerate(results)]


def run_cases(cases: list[Case], jobs: int = 1) -> dict:
    """Capture, bind, dedupe and compile ``cases`` for every target; the JSON-able report."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import JITFunction

    start = time.perf_counter()
    backends = {name: make_backend(GPUTarget(*args)) for name, (args, _) in TARGETS.items()}
    rows: list[dict] = []
    pending: list[tuple[dict, int]] = []  # (row, index into _WORK) awaiting a compile result
    index_of: dict[tuple[str, str], int] = {}
    _WORK.clear()
    for case, call in cases:
        try:
            launches = capture(call)
            if not launches:
                raise RuntimeError("the wrapper launched no kernel")
        except Exception:  # a wrapper that fails to launch is a failed case
            for target_name in TARGETS:
                rows.append({"case": case, "kernel": None, "target": target_name, "ok": False,
                             "error": "capture failed:\n" + traceback.format_exc()[-MAX_ERROR_CHARS:]})
            continue
        for launch in launches:
            for target_name in TARGETS:
                row = {"case": case, "kernel": launch.name, "target": target_name, "ok": None, "error": None}
                rows.append(row)
                if not isinstance(launch.kernel, JITFunction):
                    row.update(ok=False, error=f"not a JITFunction ({type(launch.kernel).__name__}): "
                                               "is TRITON_INTERPRET set in this process?")
                    continue
                try:
                    bound = bind(launch, backends[target_name])
                except Exception:  # arguments a real launch would reject
                    row.update(ok=False, error="bind failed:\n" + traceback.format_exc()[-MAX_ERROR_CHARS:])
                    continue
                key = (target_name, bound.key)
                if key not in index_of:
                    index_of[key] = len(_WORK)
                    _WORK.append((launch, bound, target_name))
                pending.append((row, index_of[key]))
    captured = time.perf_counter() - start
    results = _compile_all(jobs)
    for row, index in pending:
        error, seconds = results[index]
        # rows with the same compile_index share one compile (identical kernel, arguments and options)
        row.update(ok=error is None, error=error, compile_index=index, compile_seconds=round(seconds, 3))
    return {
        "targets": {name: {"target": list(args), "last_stage": stage} for name, (args, stage) in TARGETS.items()},
        "cases": len(cases),
        "compiles": len(_WORK),
        "capture_seconds": round(captured, 2),
        "seconds": round(time.perf_counter() - start, 2),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", action="append", metavar="SPEC",
                        help="'repo' (the default), FILE.py:FUNC or MODULE:FUNC, a function returning "
                             "[(name, call)]; repeatable")
    parser.add_argument("--json", metavar="PATH", help="write the report here (default: stdout)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    args = parser.parse_args(argv)
    # Either variable would make the check vacuous: interpreter objects instead of kernels, or
    # plain module globals accepted by the compiler (the very bug this check exists for).
    for var in ("TRITON_INTERPRET", "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS"):
        if os.environ.get(var, "0") not in ("", "0"):
            parser.error(f"{var} is set; unset it for this process")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    cases: list[Case] = []
    for spec in args.cases or ["repo"]:
        cases += _load_cases(spec)
    report = run_cases(cases, jobs=args.jobs)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    failed = [r for r in report["rows"] if not r["ok"]]
    print(f"{report['cases']} cases, {report['compiles']} compiles, {len(failed)} failed rows, "
          f"{report['seconds']} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
