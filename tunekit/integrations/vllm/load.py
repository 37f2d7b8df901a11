"""The vLLM plugin's load-time steps (hooks ``check_shipped``, ``fold_norms`` and ``merge_siblings``): one
wrapper of vLLM's ``BaseModelLoader.load_model`` runs them after the weights load.

* ``check_shipped`` (where ``TUNEKIT_TABLE`` names the shipped tables,
  ``auto``): first, in the worker whose device is set and before the model's
  first forward, the shipped tables are checked on that device
  (``tunekit.ops.check_shipped``: another GPU's refused, each entry verified
  against the fp64 reference) and the tables served again with what passed;
  its one line is logged here, and what it kept joins the compile-cache key
  (``compile.load_outcome``). ``register`` cannot check them: it runs in
  every vLLM process, where no GPU work may happen;
* ``fold_norms`` (on unless ``TUNEKIT_FOLD_NORMS=0``): decoder norms folded
  into the linears that read them (``tunekit.integrations.vllm.fold``),
  where the tables' ``rms_gemv`` entries pay and the fold passes its check
  on the loaded weights; none where the engine runs LoRA adapters;
* the ``gemv_add`` check: every linear the compile pass could give the
  residual add's epilogue is checked on its weight, a failing shape refused
  (``tunekit.integrations.vllm.verify_fold``);
* ``merge_siblings`` (on unless ``TUNEKIT_MERGE_SIBLINGS=0``): then the
  weights of sibling linears joined into one tensor
  (``tunekit.integrations.vllm.merge``), where the tables' joined GEMV pays;
* what was folded and checked is registered for weights written later
  (``tunekit.integrations.vllm.refold``: fold again, check again).

The steps act only on modules whose forward or GEMM is tunekit's route
(:func:`_module_honours_fold`): those read the marks the steps set
(``tunekit.integrations.vllm.marks``). What the last load did is kept in
:data:`FOLDS`, :data:`FOLD_REPORT` and :data:`MERGES`, logged, and added to
the ``fold_norms`` line of ``plugin.installed()``.

Call protocol::

    done, why = install_fold()    # the plugin's hooks; each (installed, what) or (False, why not)
    done, why = install_merge()   # all three share one load_model wrapper, installed once
    done, why = install_shipped_check()
    FOLD_REPORT                   # {"folded": 4, "kept unfolded": {...}, "not folded": {...}, "check seconds": ...}
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from tunekit.integrations.fold_check import tables_hold
from tunekit.integrations.vllm import fold as vllm_fold
from tunekit.integrations.vllm import merge as vllm_merge
from tunekit.integrations.vllm import refold, verify_fold
from tunekit.integrations.vllm.state import (
    FOLD_ENV,
    MARK,
    MERGE_ENV,
    STATE,
    fold_requested,
    logger,
    merge_requested,
    table_paths,
)

__all__ = ["FOLDS", "FOLD_REPORT", "MERGES", "install_fold", "install_merge", "install_shipped_check",
           "shipped_named"]

#: What the last model load folded: {"gemma_rms_norm folded": 128, "rms_norm (not folded: LoRA)": 2, ...}.
FOLDS: dict[str, int] = {}
#: What the last load's checks found: "folded" (count), "kept unfolded" (norm path -> its worst element),
#: "not folded" (reason -> norm paths), "gemv_add refused" (shape -> layer and worst element), "gemv_add not
#: fused per the table" (shapes), "decisions" (one line per fusion group: fused or not, and why), "checked"
#: ({"norms": n, "linears": n}), "check seconds", "refold" (the writers wrapped for later writes).
FOLD_REPORT: dict[str, Any] = {}
#: What the last model load joined: {"in_proj_qkvz+in_proj_ba joined": 48, ...}.
MERGES: dict[str, int] = {}
_LOAD_MARK = "_tunekit_load_transforms"


def _module_honours_fold(module: torch.nn.Module) -> bool:
    """A norm of the plugin's subclasses (its forward reads the fold mark) or a linear whose GEMM is
    tunekit's route (which reads the fold's eps)."""
    if hasattr(module, "quant_method"):
        return _gemm_honours_fold(module)
    return bool(getattr(type(module), MARK, False))


def _gemm_honours_fold(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s GEMM is tunekit's route (which reads the fold's eps): vLLM 0.33 binds the
    GEMM at construction (``quant_method._gemm_impl``), older vLLM looks it up per call."""
    impl = getattr(getattr(layer, "quant_method", None), "_gemm_impl", None)
    if impl is None:
        linear = importlib.import_module("vllm.model_executor.layers.linear")
        dispatch = getattr(linear, "dispatch_unquantized_gemm", None)
        impl = dispatch() if dispatch is not None and getattr(dispatch, MARK, False) else None
    return bool(getattr(impl, MARK, False))


def _lora_enabled(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the engine that loads (``load_model(vllm_config, model_config)``) runs LoRA adapters: vLLM wraps
    the linears for them after loading, and an adapter reads the normed input a fold would take away."""
    config = kwargs.get("vllm_config", args[0] if args else None)
    return getattr(config, "lora_config", None) is not None


def shipped_named() -> bool:
    """Whether ``TUNEKIT_TABLE`` names shipped tables (``auto``), which are checked after the weights load."""
    from tunekit import shipped

    return any(shipped.is_shipped(p) for p in table_paths())


def _check_shipped() -> None:
    """The shipped tables checked on this worker's device (set before vLLM loads the model) and served with
    what passed, before the fold reads them and before the first forward traces which layers they cover."""
    from tunekit import ops

    STATE["shipped_outcome"] = ""
    result = ops.check_shipped()
    if result is None:
        return
    level, line, digest = result
    STATE["shipped_outcome"] = digest
    logger.log(level, "tunekit vLLM plugin: %s", line.removeprefix("tunekit: "))


def _transform_loaded(model: torch.nn.Module, lora: bool = False) -> None:
    """The load-time steps, in order: fold the decoder norms (priced and checked joined where the merge will
    join their consumers), check the linears gemv_add could serve, join sibling linears' weights, and keep
    what was folded and checked for later writes."""
    FOLDS.clear()
    MERGES.clear()
    FOLD_REPORT.clear()
    report = vllm_fold.FoldReport()
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)
    if fold_requested() and weight is not None and not tables_hold("rms_gemv", str(weight.device)):
        logger.info("tunekit vLLM plugin: folded norms: none (no table holds an rms_gemv entry)")
    elif fold_requested():
        counts = vllm_fold.fold_model(model, _module_honours_fold, join_siblings=merge_requested(), lora=lora,
                                      report=report)
        FOLDS.update(counts)
        logger.info("tunekit vLLM plugin: folded norms: %s", counts or "none (no foldable decoder layer)")
    adds = verify_fold.check_residual_adds(model, _module_honours_fold)
    verify_fold.log_outcome(report, adds)
    if merge_requested():
        counts = vllm_merge.merge_model(model, _module_honours_fold)
        MERGES.update(counts)
        if counts:
            logger.info("tunekit vLLM plugin: sibling linears: %s", counts)
    refold.register(model, report.folded, adds.passed)
    wrapped = refold.install() if report.folded or adds.passed else []
    FOLD_REPORT.update({
        "folded": len(report.folded),
        "kept unfolded": {name: result.describe() for name, _, result in report.failed},
        "not folded": {why: [n for n, _, w in report.not_folded if w == why] for _, _, why in report.not_folded},
        "gemv_add refused": {f"{k[1]} {k[2]}x{k[3]}": f"{name}: {result.describe()}"
                             for name, k, result in adds.failed},
        "gemv_add not fused per the table": [f"{k[1]} {k[2]}x{k[3]}" for k in adds.declined],
        "decisions": report.decisions + adds.decisions,
        "checked": {"norms": report.checked, "linears": adds.checked},
        "check seconds": round(report.seconds + adds.seconds, 3),
        "refold": wrapped,
    })
    STATE["fold_outcome"] = sorted(p.name for p in report.folded)
    if "fold_norms" in STATE["installed"]:
        base = STATE["installed"]["fold_norms"].split("; last load: ")[0]
        STATE["installed"]["fold_norms"] = f"{base}; last load: {verify_fold.outcome_text(report, adds)}"


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
            if shipped_named():
                _check_shipped()
            _transform_loaded(model, _lora_enabled(args, kwargs))
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


install_fold = _load_step_installer(
    fold_requested, f"{FOLD_ENV}=0: decoder norms run as separate layers", "nothing folded",
    "after loading, decoder norms whose fold the tables decide for (their measured fusions section; older tables: "
    "their rms_gemv entries) are folded into their consumers' weights where the fold passes its check on those "
    "weights; the residual add goes into the previous GEMV where gemv_add is tabulated, decided for and passes its "
    "check; weights written later are folded and checked again")
install_merge = _load_step_installer(
    merge_requested, f"{MERGE_ENV} is 0: sibling linears run as separate GEMVs", "nothing joined",
    "after loading, sibling linears (in_proj_qkvz + in_proj_ba) whose joined GEMV the tables pay for get one "
    "weight tensor; the compile pass makes their GEMVs one launch")
install_shipped_check = _load_step_installer(
    shipped_named, "TUNEKIT_TABLE names no shipped table", "the shipped tables are not checked, so none is served",
    "after loading, on the worker's device and before the first forward, the shipped tables (auto) are checked "
    "(another GPU's refused, each entry verified against the fp64 reference) and served with what passed")
