"""The vLLM plugin's load-time steps (hooks ``fold_norms`` and ``merge_siblings``): one wrapper of
vLLM's ``BaseModelLoader.load_model`` runs them after the weights load.

* ``fold_norms`` (``TUNEKIT_FOLD_NORMS=1``): decoder norms folded into the
  linears that read them (``tunekit.integrations.vllm.fold``), where the
  tables' ``rms_gemv`` entries pay;
* ``merge_siblings`` (on unless ``TUNEKIT_MERGE_SIBLINGS=0``): then the
  weights of sibling linears joined into one tensor
  (``tunekit.integrations.vllm.merge``), where the tables' joined GEMV pays.

Both steps act only on modules whose forward or GEMM is tunekit's route
(:func:`_module_honours_fold`): those read the marks the steps set
(``tunekit.integrations.vllm.marks``). What the last load did is kept in
:data:`FOLDS` and :data:`MERGES`.

Call protocol::

    done, why = install_fold()    # the plugin's hooks; each (installed, what) or (False, why not)
    done, why = install_merge()   # both share one load_model wrapper, installed once
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from tunekit.integrations.vllm import fold as vllm_fold
from tunekit.integrations.vllm import merge as vllm_merge
from tunekit.integrations.vllm.state import FOLD_ENV, MARK, MERGE_ENV, fold_requested, logger, merge_requested

__all__ = ["FOLDS", "MERGES", "install_fold", "install_merge"]

#: What the last model load folded: {"gemma_rms_norm folded": 128, ...} (the dispatch log's evidence).
FOLDS: dict[str, int] = {}
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


def _transform_loaded(model: torch.nn.Module) -> None:
    """The load-time steps, in order: fold the decoder norms (priced joined where the merge will join
    their consumers), then join sibling linears' weights."""
    FOLDS.clear()
    MERGES.clear()
    if fold_requested():
        counts = vllm_fold.fold_model(model, _module_honours_fold, join_siblings=merge_requested())
        FOLDS.update(counts)
        logger.info("tunekit vLLM plugin: folded norms: %s", counts or "none (no foldable decoder layer)")
    if merge_requested():
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


install_fold = _load_step_installer(
    fold_requested, f"{FOLD_ENV} is not 1: decoder norms run as separate layers", "nothing folded",
    "after loading, decoder norms the tables' rms_gemv entries pay for are folded into their consumers' weights; "
    "the residual add goes into the previous GEMV where gemv_add is tabulated")
install_merge = _load_step_installer(
    merge_requested, f"{MERGE_ENV} is 0: sibling linears run as separate GEMVs", "nothing joined",
    "after loading, sibling linears (in_proj_qkvz + in_proj_ba) whose joined GEMV the tables pay for get one "
    "weight tensor; the compile pass makes their GEMVs one launch")
