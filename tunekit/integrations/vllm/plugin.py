"""vLLM general plugin: serve tunekit's dispatch tables inside vLLM.

Installed as the entry point ``tunekit`` of the group ``vllm.general_plugins``
(pyproject.toml), so ``vllm.plugins.load_general_plugins()`` calls
:func:`register` in every vLLM process (API server, engine core, workers).

Call protocol::

    TUNEKIT_TABLE=runs/x/table.json TUNEKIT_DISPATCH_LOG=/tmp/dispatch-{pid}.json vllm serve ...
    # or, in a script: import vllm.plugins; vllm.plugins.load_general_plugins()
    tunekit.integrations.vllm.plugin.installed()   # {"linear": "...", "RMSNorm": "...", ...} hook -> what it does

The rule: the plugin never makes vLLM slower. A layer reaches a tunekit op
only where the loaded tables can serve it; everything else is vLLM's own
code, untouched, so its traced graph is the one plain vLLM traces.

* No table named (``TUNEKIT_TABLE`` unset or empty): nothing is installed
  (logged once); vLLM runs exactly as without the plugin.
* Per layer, from static facts only (op, dtype, N, K of the layer, device)
  and the tables' keys (``tunekit.ops.covers``: an entry at some M),
  decided once per trace and baked into the graph: a covered layer calls
  the tunekit op, any other runs vLLM's own forward / GEMM.
* An eager call (M known: vLLM's logits, computed outside the compiled
  graph at every step; ``enforce_eager``) above the largest M the tables
  hold for the layer runs vLLM's own path and never enters the op
  (:func:`_eager_above_tables`; the gated norm, whose flattened rows do not
  tell the token count, by the most rows an entry serves). Traced graphs
  get the same from the compile ranges (``compile_ranges`` below).
* Inside a covered layer's op, per call (M is dynamic under vLLM's
  compile): a tuned kernel where the table has one for this M, else the
  fallback, which runs what vLLM itself would have run: ``F.linear`` (vLLM's
  ``rocm_unquantized_gemm`` on ROCm) for GEMMs, vLLM's own kernels for the
  elementwise ops (``torch.ops._C.rms_norm``, ``torch.ops._C.silu_and_mul``,
  the FLA gated-norm Triton kernel; feature-detected, see
  :func:`_install_vendor_kernels`) where vLLM enables that custom op. Where
  it does not (the default under Inductor: vLLM compiles the native math
  to one kernel) tunekit's default-config kernel, below, comes first and
  vLLM's kernel only after it (:func:`_tell_engine_path`). Where vLLM has none (GemmaRMSNorm runs
  its native math, which vLLM's Inductor compiles to one kernel; CPU wheels
  lack ``_C``) tunekit's own Triton kernel at the op's default config
  serves, one launch as well (``vendor: "tunekit:triton-default"``, see
  ``tunekit.dispatch.elementwise._ew_default``), and the op's PyTorch composition only where
  that cannot (``vendor: "eager:..."`` says why). vLLM's fused add + RMSNorm
  works in place, so served functionally it is two launches (an add, then
  ``_C.rms_norm``): there the default-config kernel comes first and this
  path only where it cannot serve (:data:`_MULTI_LAUNCH_VENDORS`).
  Every call is counted with its impl and the vendor that served it.
* The tables' digest joins vLLM's compile-cache key
  (``TUNEKIT_TABLE_DIGEST``), so a graph traced under one table (or under
  plain vLLM) is never loaded under another.

Guarantees (an exception escaping a general plugin stops vLLM's start-up):

* idempotent per process: a second :func:`register` is a no-op;
* catches its own exceptions: a hook that cannot be installed is skipped
  and logged, the others still go in;
* touches no GPU at load: ROCm is told by ``torch.version.hip`` and the
  tables are parsed at the first op call, not here (only their bytes are
  hashed, for the compile-cache key);
* logs once, at INFO, which hooks it installed and which it skipped and why.

Hooks:

* ``linear``: the function ``dispatch_unquantized_gemm`` is wrapped and the
  wrapper is bound where vLLM imported it (``layers.utils``, ``layers.linear``,
  ``layers.vocab_parallel_embedding``), so both the per-call use (older vLLM,
  the vocab embedding's ``dispatch_unquantized_gemm()(layer, x, w, b)``) and
  the bind-at-construction use of vLLM 0.33 (``UnquantizedLinearMethod.
  _gemm_impl``) go through tunekit. When vLLM picked its plain path
  (``default_unquantized_gemm`` = ``F.linear`` on CUDA,
  ``rocm_unquantized_gemm`` on ROCm), the wrapped GEMM calls
  ``torch.ops.tunekit.gemv(x, weight, bias)`` for a weight whose (gemv,
  dtype, N, K) the tables cover and vLLM's ``impl(layer, x, weight, bias)``
  for any other. On ROCm the op's vendor path is vLLM's own
  ``torch.ops.vllm.rocm_unquantized_gemm`` (LLMM1 / wvSplitK kept). Other
  paths vLLM may pick (FlashInfer mm_bf16 by ``--linear-backend``, the CPU
  platform's prepacked oneDNN / SGL GEMMs, which drop the weight) are left
  as they are. Off when vLLM's AITER linear path is enabled on ROCm.
* norms and activation: ``CustomOp.register_oot`` subclasses of ``RMSNorm``,
  ``GemmaRMSNorm``, ``RMSNormGated`` and ``SiluAndMul``. Each keeps the
  forward vLLM's own class would use (``dispatch_forward`` with vLLM's
  ``enabled()`` for the in-tree name: ``forward_cuda`` when the custom op
  is on, ``forward_native`` - compiled where vLLM compiles it - when off, as
  under inductor) and puts the coverage check in front of it: a covered
  layer (an entry for its op, dtype and width; a plain layout) calls the
  tunekit op, on the platforms whose enabled forward is ``forward_cuda`` /
  ``forward_hip``; every other layer runs that stock forward. Installed only
  for ops ``tunekit.ops`` defines.
* ``compile_cache_key``: the tables' digest as a vLLM compile factor.
* ``compile_ranges``: vLLM compiles each graph piece once per token-count
  range (``CompilationConfig.compile_ranges_endpoints``) and runs its
  post-grad passes per range. The hook adds endpoints, the tables'
  largest M and each fused GEMV op's largest M below it (2 at least: vLLM
  takes endpoints above 1; :func:`_range_endpoints` says why the fused
  ops), and one post-grad
  pass (``PostGradPassManager.configure`` gains it): in a range that starts
  above the largest M a table holds for a node's (op, dtype, N, K), the
  node is replaced by the stock math (``tunekit.integrations.vllm.graph_routes``),
  so prefills and captured sizes above the tables run the graph vLLM
  compiles without tunekit, with none of the op's per-call Python. Off
  where vLLM's compile mode is not its Inductor one (no post-grad passes):
  there the op decides per call, as before. In the ranges the tables serve,
  the same pass makes sibling GEMVs on joined weights one ``sibling_gemv``
  and moves residual adds into ``gemv_add`` where tabulated.
* ``fold_norms`` (``TUNEKIT_FOLD_NORMS=1``) and ``merge_siblings`` (on unless
  ``TUNEKIT_MERGE_SIBLINGS=0``): one wrapper of ``BaseModelLoader.load_model``
  runs, after the weights load, the fold (``tunekit.integrations.vllm.fold``)
  and then the join of sibling linears' weights
  (``tunekit.integrations.vllm.merge``), each only where the tables pay.

No route branches on M: vLLM traces with dynamic token counts and drops
shape guards, so inside a compile range every choice that depends on M is
made inside the op. The static checks here (dtype, hidden size, flags,
coverage) are fixed per layer; the ranges split the token counts once, at
compile time.

Every vLLM name is feature-detected; an older vLLM (the forks DCU users run)
missing one gets that hook skipped with a log line naming what is missing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from tunekit.integrations.vllm.fold import folded_norm_forward
from tunekit.integrations.vllm.marks import FOLD_EPS, FOLDED, JOINED_N

__all__ = ["installed", "register", "skipped"]

# A child of vLLM's logger: vLLM configures "vllm" (its handler, VLLM_LOGGING_LEVEL) in every
# process, so the plugin's lines land in vLLM's own log, where a user reads what was installed.
logger = logging.getLogger("vllm.tunekit")

#: Modules that bound ``dispatch_unquantized_gemm`` at import (``from ... import``).
GEMM_DISPATCH_MODULES: tuple[str, ...] = (
    "vllm.model_executor.layers.utils",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
)
_UTILS = GEMM_DISPATCH_MODULES[0]
TABLE_ENV = "TUNEKIT_TABLE"

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"registered": False, "installed": {}, "skipped": {}}
_MARK = "_tunekit_wrapped"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: install the hooks once per process; never raises."""
    with _LOCK:
        if _STATE["registered"]:
            return
        _STATE["registered"] = True
    try:
        if not _table_paths():
            _install_nothing()
            return
        installed, skipped = _install()
    except Exception as exc:  # nothing may escape a general plugin
        logger.exception("tunekit vLLM plugin: not installed (%s); vLLM runs without tunekit", exc)
        return
    _STATE["installed"], _STATE["skipped"] = installed, skipped
    logger.info(
        "tunekit vLLM plugin: installed %s; skipped %s; tables from %s=%r (read at the first call)",
        ", ".join(f"{k} ({v})" for k, v in installed.items()) or "nothing",
        ", ".join(f"{k} ({v})" for k, v in skipped.items()) or "nothing",
        "TUNEKIT_TABLE", os.environ.get("TUNEKIT_TABLE", ""),
    )


def _table_paths() -> list[str]:
    return [p for p in os.environ.get(TABLE_ENV, "").split(os.pathsep) if p.strip()]


def _hook_names() -> list[str]:
    return ["linear", *_OOT_SPECS, "compile_cache_key", "compile_ranges", "fold_norms", "merge_siblings"]


def _install_nothing() -> None:
    """No table named: vLLM must run exactly as without tunekit, so no hook goes in at all."""
    # The ops are still defined (no GPU work, no table read): a compiled graph
    # that names them, loaded from a cache, resolves instead of failing.
    import tunekit.ops  # noqa: F401

    why = f"{TABLE_ENV} is not set: no table, so nothing is routed and vLLM's own layers run unchanged"
    _STATE["installed"], _STATE["skipped"] = {}, {name: why for name in _hook_names()}
    logger.info("tunekit vLLM plugin: nothing installed (%s)", why)


def installed() -> dict[str, str]:
    """Hook name -> what it does, for the hooks :func:`register` installed in this process."""
    return dict(_STATE["installed"])


def skipped() -> dict[str, str]:
    """Hook name -> why it was not installed."""
    return dict(_STATE["skipped"])


def _install() -> tuple[dict[str, str], dict[str, str]]:
    import tunekit.ops  # noqa: F401 - defines torch.ops.tunekit.* (no GPU work, no table read)

    installed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    hooks = (("linear", _install_linear), *[(n, _oot_installer(n)) for n in _OOT_SPECS],
             ("compile_cache_key", _install_compile_factor), ("compile_ranges", _install_compile_ranges),
             ("fold_norms", _install_fold), ("merge_siblings", _install_merge))
    for name, hook in hooks:
        try:
            done, why = hook()
        except Exception as exc:  # one failing hook must not cost the others
            logger.debug("tunekit vLLM plugin: hook %s failed", name, exc_info=True)
            done, why = False, f"error: {type(exc).__name__}: {exc}"
        (installed if done else skipped)[name] = why
    return installed, skipped


# ---------------------------------------------------------------------------
# vLLM's compile cache key
# ---------------------------------------------------------------------------

#: The name under which the tables' digest joins vLLM's compile-cache factors.
COMPILE_FACTOR = "TUNEKIT_TABLE_DIGEST"


def _tables_digest() -> str:
    """sha256 over the named tables' paths and bytes (an unreadable one: its path and the error) and
    the fold and merge switches (a folded or joined model traces another graph)."""
    h = hashlib.sha256(f"fold={_fold_requested()} merge={_merge_requested()}".encode())
    for path in _table_paths():
        h.update(os.path.abspath(path).encode() + b"\0")
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError as exc:
            h.update(f"unreadable: {exc}".encode())
        h.update(b"\0")
    return h.hexdigest()


def _install_compile_factor() -> tuple[bool, str]:
    # Which layers reach a tunekit op is decided while vLLM traces the model
    # and baked into the graph; vLLM's compile cache (AOT artifacts included)
    # is keyed on its config and its own env vars only, so a graph traced
    # under one table (or under plain vLLM) would be loaded under another.
    # The tables' digest joins those factors: another table, another graph.
    try:
        import vllm.envs as envs
    except ImportError:
        return False, "vllm.envs not importable"
    factors = getattr(envs, "environment_variables", None)
    if not isinstance(factors, dict) or not hasattr(envs, "compile_factors"):
        return False, "this vLLM has no envs.environment_variables / compile_factors: compile cache not keyed"
    digest = _tables_digest()  # hashed here (bytes only): the tables are parsed at the first op call
    factors[COMPILE_FACTOR] = lambda: digest
    return True, f"{COMPILE_FACTOR}={digest[:12]} joins vLLM's compile-cache factors"


# ---------------------------------------------------------------------------
# compile ranges: token counts above the tables run vLLM's own graph
# ---------------------------------------------------------------------------

#: Per compile range (vLLM's ``Range``, as text): tunekit op -> graph nodes handed back to vLLM's path.
RANGE_ROUTES: dict[str, dict[str, int]] = {}
#: Per compile range: GEMV -> residual add pairs rewritten to ``gemv_add`` (``graph_routes.fuse_residual_adds``).
RANGE_FUSIONS: dict[str, int] = {}
#: Per compile range: groups of sibling GEMVs rewritten to one ``sibling_gemv`` (``graph_routes.merge_siblings``).
RANGE_MERGES: dict[str, int] = {}


def _tables_tops() -> dict[str, int]:
    """Per op, the largest M of its entries in the named tables (read from the files: no GPU here)."""
    from tunekit import table as table_mod

    tops: dict[str, int] = {}
    for path in _table_paths():
        try:
            entries = table_mod.load(path)["entries"]
        except Exception:  # the ops log a broken table once, at their first call
            continue
        for entry in entries:
            tops[entry["op"]] = max(tops.get(entry["op"], 0), int(entry["m"]))
    return tops


def _range_endpoints(tops: dict[str, int]) -> list[int]:
    """The compile-range endpoints for tables whose ops end at ``tops`` (vLLM takes endpoints above 1
    only, so an M=1 table ends the range [1, 2]): the largest M, and the largest M of each fused GEMV
    op below it. Why the fused ops: above their entries a plain op's fallback is the vendor kernel
    vLLM's graph would run anyway, but a fused op's is its unfused sequence run inside the op, where
    Inductor cannot fuse it (a folded norm's fallback is a norm launch before the GEMM, a residual
    add one after it). A range that starts above a fused op's entries hands it back to the stock
    math, which Inductor compiles as vLLM would; only the Ms up to that endpoint keep its fallback."""
    from tunekit.problems.shapes import FUSED_GEMV_OPS

    if not tops:
        return []
    top = max(tops.values())
    return sorted({max(2, top)} | {max(2, m) for op, m in tops.items() if op in FUSED_GEMV_OPS})


def _install_compile_ranges() -> tuple[bool, str]:
    # A covered layer calls the tunekit op at every token count, since the route is decided once
    # per trace. An eager prefill above the tables then pays the op's Python per call (~190 calls
    # per Llama-8B forward) for a fallback, where vLLM's compiled code runs a fused kernel from
    # Inductor's wrapper. vLLM compiles each graph piece per token-count range and runs its
    # post-grad passes per range: one range ends at the tables' largest M, and in the ranges above
    # it a pass hands every tunekit node back to the stock math (graph_routes.unroute).
    tops = _tables_tops()
    if not tops:
        return False, "the named tables hold no entry"
    top, endpoints = max(tops.values()), _range_endpoints(tops)
    try:
        from vllm.compilation.passes import pass_manager
        from vllm.compilation.passes.inductor_pass import InductorPass, get_pass_context
        from vllm.config import CompilationConfig, VllmConfig
    except ImportError as exc:
        return False, f"this vLLM has no compile ranges or post-grad pass manager ({exc}): every range keeps the ops"
    manager = getattr(pass_manager, "PostGradPassManager", None)
    set_ranges = VllmConfig.__dict__.get("_set_compile_ranges")
    configure = getattr(manager, "configure", None)
    if (manager is None or not callable(set_ranges) or not callable(configure) or not hasattr(manager, "add")
            or "compile_ranges_endpoints" not in getattr(CompilationConfig, "__dataclass_fields__", {})):
        return False, ("this vLLM lacks VllmConfig._set_compile_ranges, CompilationConfig.compile_ranges_endpoints "
                       "or PostGradPassManager.configure/add: every range keeps the ops")
    route_pass = _range_pass(InductorPass, get_pass_context)

    if not getattr(set_ranges, _MARK, False):
        @functools.wraps(set_ranges)
        def _set_compile_ranges(self: Any) -> Any:
            cc = self.compilation_config
            cc.compile_ranges_endpoints = sorted(set(cc.compile_ranges_endpoints or ()) | set(endpoints))
            return set_ranges(self)

        setattr(_set_compile_ranges, _MARK, True)
        VllmConfig._set_compile_ranges = _set_compile_ranges
    if not getattr(configure, _MARK, False):
        @functools.wraps(configure)
        def configure_with_tunekit(self: Any, config: Any) -> Any:
            result = configure(self, config)
            self.add(route_pass)
            return result

        setattr(configure_with_tunekit, _MARK, True)
        manager.configure = configure_with_tunekit
    return True, (f"compile range endpoints {', '.join(map(str, endpoints))} (the tables' largest M is {top}); in "
                  "a range above an op's entries the tunekit op is handed back to vLLM's own math")


def _range_pass(base: type, get_pass_context: Callable[[], Any]) -> Any:
    """vLLM's post-grad pass that keeps the tunekit ops only in compile ranges the tables serve."""
    from tunekit.integrations.vllm import graph_routes
    from tunekit.integrations.vllm import merge as vllm_merge

    class TunekitRangeRoutes(base):  # type: ignore[misc, valid-type]
        def __call__(self, graph: Any) -> None:
            compile_range = get_pass_context().compile_range
            start = compile_range.start

            def keep(*key: Any) -> bool:  # a tunekit op stays where the tables serve this range
                return graph_routes.within_table(*key, start=start)

            merged = graph_routes.merge_siblings(graph, keep, vllm_merge.JOINED)
            if merged:
                RANGE_MERGES[str(compile_range)] = RANGE_MERGES.get(str(compile_range), 0) + merged
            fused = graph_routes.fuse_residual_adds(graph, keep)
            if fused:
                RANGE_FUSIONS[str(compile_range)] = RANGE_FUSIONS.get(str(compile_range), 0) + fused
            replaced = graph_routes.unroute(graph, keep)
            if replaced:
                seen = RANGE_ROUTES.setdefault(str(compile_range), {})
                first = not seen
                for op, count in replaced.items():
                    seen[op] = seen.get(op, 0) + count
                if first:
                    logger.info("tunekit vLLM plugin: compile range %s is above these ops' table entries: handed "
                                "back to vLLM's math (first graph piece: %s)", compile_range, replaced)

        _uuid: str | None = None

        def uuid(self) -> str:
            # the rewrite, its compositions, this pass and the tables it reads (vLLM's pass manager adds
            # the range); made at the first compile, so no vLLM process pays it at start-up, and kept:
            # vLLM asks per compiled piece
            if self._uuid is None:
                import inspect

                from tunekit.dispatch import elementwise

                sources = (inspect.getsource(obj) for obj in (graph_routes, elementwise, _range_pass))
                self._uuid = base.hash_dict({"source": base.hash_source(*sources), "tables": _tables_digest()})
            return self._uuid

    return TunekitRangeRoutes()


# ---------------------------------------------------------------------------
# fold_norms: decoder norms folded into their consumers at load time
# ---------------------------------------------------------------------------

#: Set to 1 to fold decoder norms into the linears that read them (``tunekit.integrations.vllm.fold``).
FOLD_ENV = "TUNEKIT_FOLD_NORMS"
#: What the last model load folded: {"gemma_rms_norm folded": 128, ...} (the dispatch log's evidence).
FOLDS: dict[str, int] = {}


def _fold_requested() -> bool:
    return os.environ.get(FOLD_ENV, "").strip().lower() in ("1", "true")


def _module_honours_fold(module: torch.nn.Module) -> bool:
    """A norm of the plugin's subclasses (its forward reads the fold mark) or a linear whose GEMM is
    tunekit's route (which reads the fold's eps)."""
    if hasattr(module, "quant_method"):
        return _gemm_honours_fold(module)
    return bool(getattr(type(module), _MARK, False))


#: Set to 0 to keep sibling linears' weights apart (``tunekit.integrations.vllm.merge``; on by default:
#: it joins only where the tables' entries for the joined shape pay, and moves no value).
MERGE_ENV = "TUNEKIT_MERGE_SIBLINGS"
#: What the last model load joined: {"in_proj_qkvz+in_proj_ba joined": 48, ...}.
MERGES: dict[str, int] = {}
_LOAD_MARK = "_tunekit_load_transforms"


def _merge_requested() -> bool:
    return os.environ.get(MERGE_ENV, "1").strip().lower() not in ("0", "false")


def _transform_loaded(model: torch.nn.Module) -> None:
    """The load-time steps, in order: fold the decoder norms (priced joined where the merge will join
    their consumers), then join sibling linears' weights."""
    from tunekit.integrations.vllm import fold as vllm_fold
    from tunekit.integrations.vllm import merge as vllm_merge

    FOLDS.clear()
    MERGES.clear()
    if _fold_requested():
        counts = vllm_fold.fold_model(model, _module_honours_fold, join_siblings=_merge_requested())
        FOLDS.update(counts)
        logger.info("tunekit vLLM plugin: folded norms: %s", counts or "none (no foldable decoder layer)")
    if _merge_requested():
        counts = vllm_merge.merge_model(model, _module_honours_fold)
        MERGES.update(counts)
        if counts:
            logger.info("tunekit vLLM plugin: sibling linears: %s", counts)


def _wrap_load_model() -> str | None:
    """Run :func:`_transform_loaded` after vLLM's loader has loaded and post-processed the weights
    (BaseModelLoader.load_model: the default and dummy loaders both end there). None, or why not."""
    try:
        base_loader = importlib.import_module("vllm.model_executor.model_loader.base_loader")
        load_model = base_loader.BaseModelLoader.load_model
    except (ImportError, AttributeError) as exc:
        return f"this vLLM has no BaseModelLoader.load_model ({exc})"
    if not getattr(load_model, _LOAD_MARK, False):
        @functools.wraps(load_model)
        def load_model_and_transform(self: Any, *args: Any, **kwargs: Any) -> Any:
            model = load_model(self, *args, **kwargs)
            _transform_loaded(model)
            return model

        setattr(load_model_and_transform, _LOAD_MARK, True)
        base_loader.BaseModelLoader.load_model = load_model_and_transform
    return None


def _load_step_installer(requested: Callable[[], bool], off: str, nothing: str, done: str
                         ) -> Callable[[], tuple[bool, str]]:
    """A hook of one load-time step (:func:`_transform_loaded` runs the requested ones): installs the
    shared ``load_model`` wrapper when the step is requested."""
    def install() -> tuple[bool, str]:
        if not requested():
            return False, off
        why_not = _wrap_load_model()
        return (False, f"{why_not}: {nothing}") if why_not is not None else (True, done)
    return install


_install_fold = _load_step_installer(
    _fold_requested, f"{FOLD_ENV} is not 1: decoder norms run as separate layers", "nothing folded",
    "after loading, decoder norms the tables' rms_gemv entries pay for are folded into their consumers' weights; "
    "the residual add goes into the previous GEMV where gemv_add is tabulated")
_install_merge = _load_step_installer(
    _merge_requested, f"{MERGE_ENV} is 0: sibling linears run as separate GEMVs", "nothing joined",
    "after loading, sibling linears (in_proj_qkvz + in_proj_ba) whose joined GEMV the tables pay for get one "
    "weight tensor; the compile pass makes their GEMVs one launch")


# ---------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------


def _env_flag(name: str, default: bool) -> bool:
    """vLLM's parse of a boolean env var ("1"/"true"), read from vllm.envs when it knows the name."""
    try:
        import vllm.envs as envs

        return bool(getattr(envs, name))
    except Exception:
        value = os.environ.get(name)
        return default if value is None else value.strip().lower() in ("1", "true")


def _aiter_linear_enabled() -> bool:
    return _env_flag("VLLM_ROCM_USE_AITER", False) and _env_flag("VLLM_ROCM_USE_AITER_LINEAR", True)


def _install_linear() -> tuple[bool, str]:
    is_rocm = torch.version.hip is not None
    if is_rocm and _aiter_linear_enabled():
        return False, "VLLM_ROCM_USE_AITER with AITER linear is on: vLLM's AITER GEMMs stay in charge"
    utils = importlib.import_module(_UTILS)
    original = getattr(utils, "dispatch_unquantized_gemm", None)
    if original is None:
        return False, f"this vLLM has no {_UTILS}.dispatch_unquantized_gemm (older fork?): linears stay vLLM's"
    plain = tuple(fn for fn in (getattr(utils, "default_unquantized_gemm", None),
                                getattr(utils, "rocm_unquantized_gemm", None)) if fn is not None)
    if not plain:
        return False, f"this vLLM has neither default_ nor rocm_unquantized_gemm in {_UTILS}"
    from tunekit import ops

    vendor = "F.linear"
    if is_rocm:
        # torch.ops.vllm.rocm_unquantized_gemm is defined when layers.utils is
        # imported (direct_register_custom_op); keep vLLM's skinny GEMMs.
        try:
            rocm_gemm = torch.ops.vllm.rocm_unquantized_gemm
        except (AttributeError, RuntimeError):
            rocm_gemm = None
        if rocm_gemm is not None:
            vendor = "torch.ops.vllm.rocm_unquantized_gemm"
            ops.set_vendor_gemm(lambda x, w, b: rocm_gemm(x, w, b), vendor)
    wrapped = _wrap_dispatch(getattr(original, "__wrapped__", original) if getattr(original, _MARK, False)
                             else original, plain)
    places = []
    for module_name in GEMM_DISPATCH_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            logger.debug("tunekit vLLM plugin: %s not importable: %s", module_name, exc)
            continue
        if hasattr(module, "dispatch_unquantized_gemm"):
            module.dispatch_unquantized_gemm = wrapped
            places.append(module_name.rsplit(".", 1)[-1])
    return True, f"dispatch_unquantized_gemm wrapped in {', '.join(places)}; fallback {vendor}"


def _wrap_dispatch(original: Callable[..., Any], plain: tuple[Callable[..., Any], ...]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch_unquantized_gemm(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        impl = original(*args, **kwargs)
        try:
            return _wrap_gemm(impl, plain)
        except Exception:  # never stand between vLLM and its own GEMM
            logger.debug("tunekit vLLM plugin: could not wrap %r", impl, exc_info=True)
            return impl

    setattr(dispatch_unquantized_gemm, _MARK, True)
    return dispatch_unquantized_gemm


def _wrap_gemm(impl: Callable[..., Any], plain: tuple[Callable[..., Any], ...]) -> Callable[..., Any]:
    """The GEMM vLLM picked, routed through ``torch.ops.tunekit.gemv`` when it is vLLM's plain path."""
    if getattr(impl, _MARK, False):
        return impl
    if impl not in plain:
        # FlashInfer mm_bf16, the CPU platform's prepacked GEMMs (weight
        # removed after loading): the op's vendor path could not reproduce
        # them, so they stay vLLM's.
        return impl

    def tunekit_unquantized_gemm(
        layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Static per layer (dtype, N, K, device; traced once): no M here, the
        # op decides per call. A linear no loaded table covers runs vLLM's own
        # GEMM, untouched: an opaque op there would only cost (no tuned kernel
        # to gain, and vLLM's compiler passes lose sight of the matmul).
        fold_eps = getattr(layer, FOLD_EPS, None)
        if fold_eps is not None:  # its weight holds a folded norm's: the norm must be applied here
            return _folded_gemm(impl, layer, x, weight, bias, fold_eps)
        n = getattr(layer, JOINED_N, weight.shape[0])  # a joined sibling: the compile pass merges its GEMV
        if weight.dim() == 2 and weight.dtype == x.dtype and _covered("gemv", x, n, weight.shape[1]) \
                and not _eager_above_tables("gemv", x, n, weight.shape[1]):
            return torch.ops.tunekit.gemv(x, weight, bias)
        return impl(layer, x, weight, bias)

    setattr(tunekit_unquantized_gemm, _MARK, True)
    tunekit_unquantized_gemm.__wrapped__ = impl  # type: ignore[attr-defined]
    return tunekit_unquantized_gemm


def _folded_gemm(impl: Callable[..., Any], layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A consumer of a folded norm (``tunekit.integrations.vllm.fold``): ``rms_gemv`` where the tables
    cover it, else the unweighted norm then vLLM's own GEMM; the same math either way."""
    k = weight.shape[1]
    n = getattr(layer, JOINED_N, weight.shape[0])  # a joined sibling: the compile pass merges its GEMV
    if _covered("rms_gemv", x, n, k) and not _eager_above_tables("rms_gemv", x, n, k):
        y = torch.ops.tunekit.rms_gemv(x, weight, eps)
        return y if bias is None else y + bias
    from tunekit.dispatch.fused_gemv import unweighted_rms_norm

    return impl(layer, unweighted_rms_norm(x, eps), weight, bias)


def _gemm_honours_fold(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s GEMM is tunekit's route (which reads the fold's eps): vLLM 0.33 binds the
    GEMM at construction (``quant_method._gemm_impl``), older vLLM looks it up per call."""
    impl = getattr(getattr(layer, "quant_method", None), "_gemm_impl", None)
    if impl is None:
        linear = importlib.import_module("vllm.model_executor.layers.linear")
        dispatch = getattr(linear, "dispatch_unquantized_gemm", None)
        impl = dispatch() if dispatch is not None and getattr(dispatch, _MARK, False) else None
    return bool(getattr(impl, _MARK, False))


# ---------------------------------------------------------------------------
# norms and activation (CustomOp.register_oot)
# ---------------------------------------------------------------------------


def _x_ok(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Static checks shared by the elementwise routes (dtype fixed per layer)."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return weight is None or weight.dtype == x.dtype


def _rows_even(x: torch.Tensor, row_dims: int = 1) -> bool:
    """x views as evenly strided rows of its last ``row_dims`` dims, contiguous inside a row.

    That is the layout the tunekit ops serve with the kernels' row stride.
    vLLM's q/k norms get per-head views of the qkv split ([T, H, D], T stride
    = the qkv width): there the op would run its PyTorch fallback, so those
    layers keep vLLM's own kernel. Only the token dim's size (outermost) may
    vary between calls and it is never compared, so under compilation the
    answer is fixed per layer.
    """
    if x.dim() < row_dims or x.stride(-1) != 1:
        return False
    # inside a row, and the leading dims folded into one row index (all but the innermost leading dim)
    folded = [*range(x.dim() - row_dims, x.dim() - 1), *range(x.dim() - row_dims - 1)]
    return all(x.stride(d) == x.shape[d + 1] * x.stride(d + 1) for d in folded)


def _ops() -> Any:
    # Eager vLLM asks on every call of every layer: no import statement here.
    return sys.modules.get("tunekit.ops") or importlib.import_module("tunekit.ops")


def _covers_impl(op: str, dtype: str, n: int | None, k: int, device: str) -> bool:
    return _ops().covers(op, dtype, n, k, device)


#: torch dtype -> the tables' dtype name (tunekit.ops' names; other dtypes are never tabulated)
_TABLE_DTYPES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


# Evaluated once per trace and baked in as a constant: whether the tables hold
# (op, dtype, N, K) is fixed per layer (N, K are not the token dimension), and
# the table lookup itself (locks, file reads) must not be traced. Layers the
# tables do not cover keep vLLM's own path (its CUDA kernel, or the native
# code inductor fuses), which the op's vendor path would not match.
try:
    _covers = torch.compiler.assume_constant_result(_covers_impl)
except AttributeError:  # torch without torch.compiler: eager only anyway
    _covers = _covers_impl


def _covered(op: str, x: torch.Tensor, n: int | None, k: int) -> bool:
    # vLLM marks only the token dim dynamic, so widths are plain ints here; a
    # width that is symbolic (a caller compiling with every dim dynamic) can
    # not be decided per layer, and undecided means vLLM's own path.
    dtype = _TABLE_DTYPES.get(x.dtype)
    if dtype is None or not isinstance(n, (int, type(None))) or not isinstance(k, int):
        return False
    return bool(_covers(op, dtype, n, k, str(x.device)))


_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


def _eager_above_tables(op: str, x: torch.Tensor, n: int | None, k: int, by_rows: bool = False) -> bool:
    """True for a call made outside tracing whose token count is above every M the tables hold for
    the layer's (op, dtype, N, K): vLLM's own path serves it then, with none of the op's Python.

    Eager calls know M: vLLM's logits (computed outside the compiled graph, at every step), an
    ``enforce_eager`` engine, a capture without compilation. Under tracing M is symbolic and never
    read here: the op decides per call, and the compile ranges keep the ops out of the graphs for
    token counts above the tables (:func:`_install_compile_ranges`). ``by_rows``: for an op called in
    either row layout (the gated norm: vLLM 0.26's Qwen3.5 flattens [T, H, D] to [T * H, D], so T
    cannot be read), the call's K-wide rows against the most any entry serves in one call
    (``tunekit.ops.largest_rows``).
    """
    if _is_compiling():  # before any size is read: nothing of this enters a traced graph
        return False
    dtype = _TABLE_DTYPES.get(x.dtype)
    if dtype is None:
        return False
    device = str(x.device)
    top = _ops().largest_rows(op, dtype, k, device) if by_rows else _ops().largest_m(op, dtype, n, k, device)
    return top is not None and x.numel() // k > top  # rows of K elements (every routed op's input): its M


def _same_rows(a: torch.Tensor, x: torch.Tensor) -> bool:
    """a matches x in dtype and in every dim but the token dim. That one is dynamic and never compared
    here, so no shape check enters the traced graph; the op itself rejects a token-count mismatch."""
    return a.dtype == x.dtype and a.dim() == x.dim() and a.shape[1:] == x.shape[1:]


def _norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                plain_op: str, fused_op: str) -> Any:
    """The tunekit op for a norm (``plain_op``) or fused add + norm (``fused_op``), or None (stock method).

    ``weight`` is the layer's parameter: only its static shape and dtype are
    read until the layer is known to be covered, so an uncovered layer adds
    nothing to the traced graph (not even a ``.data`` access).
    """
    n = weight.shape[0]
    op = plain_op if residual is None else fused_op
    # coverage first: an uncovered layer (the common case) leaves after the fewest checks in eager mode
    if x.shape[-1] != n or not _covered(op, x, n, n) or not _x_ok(x, weight) or not _rows_even(x) \
            or _eager_above_tables(op, x, n, n):
        return None
    eps = float(self.variance_epsilon)
    if residual is None:
        return getattr(torch.ops.tunekit, plain_op)(x, weight.data, eps)
    if not _same_rows(residual, x):
        return None
    out, res = getattr(torch.ops.tunekit, fused_op)(x, residual, weight.data, eps)
    return out, res


def _rms_norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    """tunekit op for RMSNorm's plain cases, or None (the stock method runs)."""
    if (getattr(self, "variance_size_override", None) is not None or not getattr(self, "has_weight", True)
            or not isinstance(self.weight, torch.Tensor) or self._tunekit_batch_invariant):
        return None
    return _norm_route(self, x, residual, self.weight, "rms_norm", "fused_add_rms_norm")


def _gemma_rms_norm_route(self: Any, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
    return _norm_route(self, x, residual, self.weight, "gemma_rms_norm", "gemma_fused_add_rms_norm")


def _rms_norm_gated_route(self: Any, x: torch.Tensor, z: torch.Tensor | None = None) -> Any:
    # tunekit's gated_rms_norm: y = rms_norm(x) * w * silu(z), one group (norm before gate).
    hidden = self.weight.shape[0]
    if (z is None or not self.norm_before_gate or self.activation not in ("swish", "silu")
            or self.group_size not in (None, hidden) or x.shape[-1] != hidden):
        return None
    # Matched by row width (head_dim) alone, as the torch patch does: vLLM 0.26's Qwen3.5 passes
    # [T * H, D] (flattened before the norm; no head count left to form the table's N = H * D), the
    # 0.33 Qwen3-Next path [T, H, D]. The op serves either row layout from the table's entries per M;
    # the eager check above the tables counts rows of D, since that layout does not tell T.
    if (not _covered("gated_rms_norm", x, None, hidden) or not _x_ok(x, self.weight) or not _same_rows(z, x)
            or not _rows_even(x, 2 if x.dim() >= 3 else 1) or not _rows_even(z, 2 if z.dim() >= 3 else 1)
            or _eager_above_tables("gated_rms_norm", x, None, hidden, by_rows=True)):
        return None
    return torch.ops.tunekit.gated_rms_norm(x, z, self.weight, float(self.eps))


def _silu_and_mul_route(self: Any, x: torch.Tensor) -> Any:
    k = x.shape[-1]
    if k % 2 or not _covered("silu_and_mul", x, k // 2, k) \
            or _eager_above_tables("silu_and_mul", x, k // 2, k):  # _covered: tabulated dtypes only
        return None
    return torch.ops.tunekit.silu_and_mul(x)


#: vLLM class -> (module, tunekit ops it needs, route). Extension point: a new
#: vLLM CustomOp is one line here plus a route returning None where the
#: tunekit op does not apply.
_OOT_SPECS: dict[str, tuple[str, tuple[str, ...], Callable[..., Any]]] = {
    "RMSNorm": ("vllm.model_executor.layers.layernorm", ("rms_norm", "fused_add_rms_norm"), _rms_norm_route),
    "GemmaRMSNorm": ("vllm.model_executor.layers.layernorm", ("gemma_rms_norm", "gemma_fused_add_rms_norm"),
                     _gemma_rms_norm_route),
    "RMSNormGated": ("vllm.model_executor.layers.layernorm", ("gated_rms_norm",), _rms_norm_gated_route),
    "SiluAndMul": ("vllm.model_executor.layers.activation", ("silu_and_mul",), _silu_and_mul_route),
}


def _tunekit_op_defined(op: str) -> bool:
    try:
        getattr(torch.ops.tunekit, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def _oot_installer(class_name: str) -> Callable[[], tuple[bool, str]]:
    def install() -> tuple[bool, str]:
        module_name, needed, route = _OOT_SPECS[class_name]
        missing_ops = [op for op in needed if not _tunekit_op_defined(op)]
        if missing_ops:
            return False, f"tunekit.ops has no {', '.join(missing_ops)} yet"
        try:
            custom_op = importlib.import_module("vllm.model_executor.custom_op")
            registry = custom_op.op_registry_oot
        except (ImportError, AttributeError):
            return False, "this vLLM has no CustomOp.register_oot / op_registry_oot (older fork?)"
        try:
            base = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            return False, f"this vLLM has no {module_name}.{class_name}"
        for method in ("forward_cuda", "forward_native", "enabled", "dispatch_forward"):
            if not hasattr(base, method):
                return False, f"{class_name} has no {method} in this vLLM"
        current = registry.get(class_name)
        if current is not None:
            if getattr(current, _MARK, False):
                return True, "already registered in this process"
            return False, f"another plugin registered {class_name} ({current.__module__}.{current.__qualname__})"
        subclass = _make_oot_subclass(base, route, needed)
        base.register_oot(subclass, name=class_name)
        try:
            fallbacks = _install_vendor_kernels(needed)
        except Exception as exc:  # the subclass is in: report it, with tunekit's own fallbacks
            fallbacks = (f"tunekit's default-config Triton kernel, else the PyTorch composition (looking for "
                         f"vLLM's kernels failed: {type(exc).__name__}: {exc})")
        return True, (f"{subclass.__name__}: covered layers -> torch.ops.tunekit.{'/'.join(needed)}, the others "
                      f"vLLM's own forward; fallback {fallbacks}")

    return install


def _make_oot_subclass(base: type, route: Callable[..., Any], ops_served: tuple[str, ...] = ()) -> type:
    """A subclass of vLLM's ``base`` that serves covered layers by ``route`` and is ``base`` for the others.

    vLLM picks a CustomOp's forward once, at construction
    (``dispatch_forward``: the platform's ``forward_cuda`` when the op is
    enabled, else ``forward_native``, compiled where vLLM compiles it). The
    subclass keeps that choice, made by vLLM's own rule for the in-tree class,
    as the stock forward and puts in front of it a check of static facts
    (width, dtype, layout, tables: fixed per layer, so decided once per
    trace): a layer the tables cover reaches the tunekit op; any other runs
    the stock forward, exactly what ``base`` would have run, so its traced
    graph is the stock one (vLLM's kernel, or the native math inductor fuses).

    The same choice tells the ops in ``ops_served`` whether vLLM itself
    would run their vendor kernel (``tunekit.ops.set_engine_runs_vendor``):
    with the custom op off, a covered layer's fallbacks are served by
    tunekit's default-config kernel first, as fast as the kernel Inductor
    makes of the native math, not by vLLM's ``_C`` kernel, which vLLM would
    not have run there.
    """
    # vLLM's decision for the in-tree class: its registered name ("rms_norm")
    # is what custom_ops spells ("+rms_norm"); the subclass is registered
    # under the class name ("RMSNorm"), which CustomOp.enabled would look up.
    stock_enabled = base.enabled

    def enabled(cls: type) -> bool:
        return stock_enabled()

    def dispatch_forward(self: Any, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        self._tunekit_stock_forward = super(subclass, self).dispatch_forward(*args, **kwargs)
        _tell_engine_path(ops_served, bool(getattr(self, "_enforce_enable", False) or type(self).enabled()))
        self._tunekit_routes = _routes_on_platform()
        # Read once per layer, not per call (vLLM's env lookup costs microseconds; it is fixed per process).
        self._tunekit_batch_invariant = _env_flag("VLLM_BATCH_INVARIANT", False)
        return self._tunekit_forward

    def _tunekit_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, FOLDED, False):  # its weight lives in its consumers' now: never the stock forward
            return folded_norm_forward(*args, **kwargs)
        if self._tunekit_routes:
            out = route(self, *args, **kwargs)
            if out is not None:
                return out
        return self._tunekit_stock_forward(*args, **kwargs)

    subclass = type(
        f"Tunekit{base.__name__}",
        (base,),
        {
            "dispatch_forward": dispatch_forward,
            "_tunekit_forward": _tunekit_forward,
            "enabled": classmethod(enabled),
            "__module__": __name__,
            "__doc__": f"vLLM {base.__name__} served by tunekit's ops where the tables cover the layer "
                       f"(tunekit vLLM plugin); vLLM's own {base.__name__} elsewhere.",
            _MARK: True,
        },
    )
    return subclass


def _routes_on_platform() -> bool:
    """True where vLLM runs an enabled CustomOp's forward_cuda / forward_hip: the platforms tunekit's ops serve."""
    try:
        from vllm.platforms import current_platform
    except Exception:
        return False
    for probe in ("is_cpu", "is_tpu", "is_xpu", "is_out_of_tree"):
        check = getattr(current_platform, probe, None)
        try:
            if check is not None and check():
                return False
        except Exception:
            return False
    return True


# ---------------------------------------------------------------------------
# vLLM's kernels as the elementwise ops' vendor path
# ---------------------------------------------------------------------------
def _tell_engine_path(ops_served: tuple[str, ...], custom_op_enabled: bool) -> None:
    """Tell tunekit's ops whether vLLM runs their vendor kernel in this process (its CustomOp's
    ``enabled()``, as ``dispatch_forward`` reads it). Never raises: a layer's construction must not fail."""
    try:
        from tunekit import ops

        for op in ops_served:
            ops.set_engine_runs_vendor(op, custom_op_enabled)
    except Exception as exc:  # the vendor kernel keeps serving first, as before this was known
        logger.warning("tunekit: could not record vLLM's custom-op choice for %s: %s: %s",
                       "/".join(ops_served), type(exc).__name__, exc)


#
# Inside a covered layer's op, a call the table does not serve (M above the
# table under vLLM's dynamic-M graph, a capture before build, ...) takes the
# op's vendor path. Its PyTorch composition is several launches inside an
# opaque op, where vLLM would have run one kernel, so the plugin installs
# vLLM's own kernels there (tunekit.ops.set_vendor_elementwise). Each is
# feature-detected: names differ between vLLM releases, and a vLLM without
# its _C extension (CPU wheels) has none; then tunekit's default-config Triton
# kernel serves (vendor "tunekit:triton-default"), else the composition.

#: torch device type -> the dispatch key whose kernel serves its tensors
_DISPATCH_KEYS: dict[str, str] = {"cuda": "CUDA", "cpu": "CPU"}

#: (function with the tunekit op's signature, the markers' name, device types it serves)
VendorKernel = tuple[Callable[..., Any], str, frozenset[str]]


def _torch_op(namespace: str, name: str) -> tuple[Any, frozenset[str]] | None:
    """``torch.ops.<namespace>.<name>`` and the device types it has a kernel for, or None."""
    try:
        op = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None
    qualname = f"{namespace}::{name}"
    devices = set()
    for device_type, key in _DISPATCH_KEYS.items():
        for dispatch_key in (key, "CompositeExplicitAutograd", "CompositeImplicitAutograd"):
            try:
                if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, dispatch_key):
                    devices.add(device_type)
                    break
            except Exception:  # a torch without this query: the op is not trusted on any device
                break
    return (op, frozenset(devices)) if devices else None


def _load_vllm_kernels() -> None:
    # Loads vLLM's compiled extensions (torch.ops._C.*): library loading only,
    # no CUDA context. Importing vllm.model_executor.layers.layernorm already
    # does it in the vLLM releases seen so far; this covers the others.
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()
    except Exception:
        logger.debug("tunekit vLLM plugin: vLLM's kernels not loaded", exc_info=True)


def _vllm_has_triton() -> bool:
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return importlib.util.find_spec("triton") is not None
    return bool(HAS_TRITON)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous [rows, width] (a view unless x has odd strides): vLLM's kernels index rows densely."""
    return (x if x.is_contiguous() else x.contiguous()).view(-1, x.shape[-1])


def _vllm_rms_norm() -> VendorKernel | str:
    found = _torch_op("_C", "rms_norm")
    if found is None:
        return "no torch.ops._C.rms_norm (vLLM's _C extension is not loaded here)"
    kernel, devices = found

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = _rows(x)
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        kernel(out, rows, weight, eps)
        return out.view(x.shape)

    return rms_norm, "torch.ops._C.rms_norm", devices


def _vllm_fused_add_rms_norm() -> VendorKernel | str:
    found = _torch_op("_C", "rms_norm")
    if found is None:
        return "no torch.ops._C.rms_norm (vLLM's _C extension is not loaded here)"
    kernel, devices = found

    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # vLLM's _C.fused_add_rms_norm works in place on x and residual, and
        # the tunekit op is functional: copying both first would cost more
        # than this add. That kernel rounds the sum to x's dtype before
        # normalising, as this add does, so the results agree.
        total = _rows(x + residual)
        out = torch.empty(total.shape, dtype=x.dtype, device=x.device)
        kernel(out, total, weight, eps)
        return out.view(x.shape), total.view(x.shape)

    return fused_add_rms_norm, "torch.ops._C.rms_norm(x + residual)", devices


def _vllm_silu_and_mul() -> VendorKernel | str:
    found = _torch_op("_C", "silu_and_mul")
    if found is None:
        return "no torch.ops._C.silu_and_mul (vLLM's _C extension is not loaded here)"
    kernel, devices = found

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        x = x if x.is_contiguous() else x.contiguous()
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
        kernel(out, x)
        return out

    return silu_and_mul, "torch.ops._C.silu_and_mul", devices


def _vllm_gated_rms_norm() -> VendorKernel | str:
    # What vLLM's RMSNormGated.forward_cuda runs: the FLA Triton kernel,
    # wrapped as torch.ops.vllm.fla_rms_norm_gated in newer releases and
    # called as layernorm_guard.rmsnorm_fn in older ones.
    if not _vllm_has_triton():
        return "vLLM has no Triton here (its gated norm is the FLA Triton kernel)"
    found = _torch_op("vllm", "fla_rms_norm_gated")
    if found is not None:
        kernel, devices = found

        def gated_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            k = weight.shape[0]  # one group of len(weight) per row, norm before the gate, as the tunekit op
            return kernel(x.reshape(-1, k), z.reshape(-1, k), weight, eps, None, True, "silu").view(x.shape)

        return gated_op, "torch.ops.vllm.fla_rms_norm_gated", devices
    try:
        from vllm.third_party.flash_linear_attention.ops.layernorm_guard import rmsnorm_fn
    except Exception:
        return "neither torch.ops.vllm.fla_rms_norm_gated nor layernorm_guard.rmsnorm_fn in this vLLM"

    def gated_fn(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        k = weight.shape[0]
        return rmsnorm_fn(x.reshape(-1, k), weight, None, z=z.reshape(-1, k), eps=eps, group_size=None,
                          norm_before_gate=True, activation="silu").view(x.shape)

    return gated_fn, "vllm layernorm_guard.rmsnorm_fn", frozenset({"cuda"})


def _no_gemma_kernel() -> str:
    return "vLLM's GemmaRMSNorm has no kernel of its own: its forward_cuda runs the native math"


#: tunekit elementwise op -> how to find vLLM's kernel for its fallbacks (or why there is none)
_VENDOR_RESOLVERS: dict[str, Callable[[], VendorKernel | str]] = {
    "rms_norm": _vllm_rms_norm,
    "fused_add_rms_norm": _vllm_fused_add_rms_norm,
    "gemma_rms_norm": _no_gemma_kernel,
    "gemma_fused_add_rms_norm": _no_gemma_kernel,
    "gated_rms_norm": _vllm_gated_rms_norm,
    "silu_and_mul": _vllm_silu_and_mul,
}


#: Ops whose vLLM path above is several launches: the op serves its fallbacks with tunekit's
#: default-config kernel (one launch) first, and this path only where that cannot serve.
_MULTI_LAUNCH_VENDORS = frozenset({"fused_add_rms_norm"})


def _install_vendor_kernels(ops_needed: tuple[str, ...]) -> str:
    """Install vLLM's kernel as the vendor path of each op in ``ops_needed``; returns what was found."""
    from tunekit import ops

    _load_vllm_kernels()
    found_parts = []
    for op in ops_needed:
        resolver = _VENDOR_RESOLVERS.get(op)
        try:
            found = resolver() if resolver is not None else "no vLLM kernel known for this op"
        except Exception as exc:  # a detection that fails is "no vLLM kernel", never a lost hook
            found = f"detection failed: {type(exc).__name__}: {exc}"
        if isinstance(found, str):
            ops.set_vendor_elementwise(op, None, found)
            found_parts.append(f"{op}: no vLLM kernel ({found}): tunekit's default-config Triton kernel, "
                               "else the PyTorch composition")
        else:
            fn, name, devices = found
            single = op not in _MULTI_LAUNCH_VENDORS
            ops.set_vendor_elementwise(op, fn, name, devices, single_launch=single)
            found_parts.append(f"{op}: {name} on {'/'.join(sorted(devices))}"
                               + ("" if single else " (after tunekit's default-config Triton kernel, one launch)"))
    return "; ".join(found_parts)
