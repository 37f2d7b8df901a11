"""Weights written while the engine runs: what was folded is folded again, and checked again.

A folded model holds W diag(g) in its consumers' weights and a norm that
passes x on, and its compiled graph (vLLM drops the guards) keeps that
shape for good. vLLM can write weights after loading:

* ``reload_weights`` (the model runner's, reached by the worker's and by
  ``LLM.collective_rpc("reload_weights")``): in checkpoint format through
  ``model.load_weights`` and a layerwise reload, or in kernel format by
  ``param.copy_`` per name;
* RL refits: the worker's ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` (the weight-transfer engines call
  ``model.load_weights`` per chunk, or write in place);
* ``model.load_weights`` called directly (older RL frameworks, per parameter);
* ``sleep`` / ``wake_up``: level 1 offloads the weights and puts the same
  bytes back; level 2 discards them, and a reload follows the wake-up.

Each lands raw weights (the checkpoint's W, its g) over folded state. What
a load folded is kept per model (:func:`register`): the norm, its
consumers, the gain they were folded with and per-row fingerprints of their
folded weights (:func:`row_prints`: each row's bits as integers times fixed
per-column integers, summed exactly in int64, so a change of any one element
changes it). At the end of a write (:func:`resync`: the outermost
``load_weights`` call, ``reload_weights``, a weight-update session, a
wake-up from level 1; never inside a session, nor while a layerwise reload
holds layers on the meta device) what changed is found:

* rows of a consumer whose fingerprint changed hold raw weights: they are
  folded with the norm's gain as it is now (exactly as at load);
* rows that did not change, where the norm's gain did: rescaled from their
  folded values by g_new / g_old (the raw weights are gone: one more BF16
  rounding), the columns of channels whose old gain was (near) 0 from the
  copies the fold keeps of them (``fold.zero_columns``: a norm has at most
  a handful of dead channels). A reload, a session, or one ``load_weights``
  call writing a norm with its consumers leaves no such row: the fold is
  exact. Only rows whose norm is written after them, or without them
  (per-parameter calls, the consumers first), keep the rescale;

then checked as at load (``fold.check_fold``) and written in place. A
compiled graph cannot unfold a layer, so where the check fails now, the
failing kernel's key is refused (``fold_check.refuse_kernels``: the op
serves its fallback, the norm then the GEMV on the folded weight, which is
checked in turn) and the layer logged. The linears checked for ``gemv_add``
at load are checked again when their weights change (a failure refuses the
key likewise and joins ``marks.REFUSED``).

Call protocol::

    register(model, fold_report.folded, adds.passed)  # after the load-time fold; wraps model.load_weights
    install()                  # once, in the process that loads: wraps vLLM's writers it has imported
    resync(model, "reload")    # {"rms_norm folded again": 4, ...}: what a write changed, folded and checked
    REFOLDS                    # what the resyncs of this process did, counted

No vLLM import at module level; :func:`install` patches only modules vLLM
already imported.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn

from tunekit.integrations.fold_check import fold_scale, refuse_kernels
from tunekit.integrations.vllm.fold import FoldPlan, check_fold, zero_columns
from tunekit.integrations.vllm.marks import JOINED_N, REFUSED
from tunekit.integrations.vllm.state import MARK, logger

__all__ = ["MODELS", "REFOLDS", "install", "register", "resync", "row_prints"]

#: elements per chunk of a fingerprint's int64 products
_CHUNK = 1 << 22


@dataclass
class Folded:
    """A fold a load made: its plan, the gain its consumers hold, their folded rows' fingerprints."""

    plan: FoldPlan
    gain: torch.Tensor
    prints: list[torch.Tensor]
    names: frozenset[str]


@dataclass
class Checked:
    """A linear whose ``gemv_add`` passed at load: its path, module, key and weight's fingerprints."""

    name: str
    linear: nn.Module
    key: tuple[str, str, int, int, str]
    prints: torch.Tensor
    names: frozenset[str]


#: model -> (its folds, its gemv_add-checked linears)
MODELS: WeakKeyDictionary[nn.Module, tuple[list[Folded], list[Checked]]] = WeakKeyDictionary()
#: What the resyncs of this process did: {"rms_norm folded again": 4, "rms_norm refused at reload": 1, ...}
REFOLDS: dict[str, int] = {}
#: nesting of write calls, an open weight-update session, the last sleep level
_WRITES: dict[str, Any] = {"depth": 0, "session": False, "sleep_level": 0}
_COEFFS: dict[tuple[int, int, str], torch.Tensor] = {}


def row_prints(weight: torch.Tensor) -> torch.Tensor:
    """Per row of a 2-D weight, an int64 fingerprint of its bits: sum_j bits[i, j] * c_j, c_j fixed seeded
    integers (below 2^20 for 2-byte dtypes, 2^8 for 4-byte, so the sums stay exact)."""
    w = weight.detach()
    n, k = w.shape
    size = w.element_size()
    key = (k, size, str(w.device))
    coeffs = _COEFFS.get(key)
    if coeffs is None:
        gen = torch.Generator(device="cpu").manual_seed(k)
        high = 1 << (20 if size <= 2 else 8)
        coeffs = _COEFFS.setdefault(key, torch.randint(1, high, (k,), generator=gen, dtype=torch.int64).to(w.device))
    bits = w.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    out = torch.empty(n, dtype=torch.int64, device=w.device)
    step = max(1, _CHUNK // max(k, 1))
    for start in range(0, n, step):
        out[start:start + step] = (bits[start:start + step].to(torch.int64) * coeffs).sum(dim=1)
    return out


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}


def register(model: nn.Module, folded: list[FoldPlan], checked: list[tuple[str, nn.Module, tuple]]) -> None:
    """Keep what a load folded and checked, fingerprinted as it is now, and route the model's ``load_weights``
    through a write boundary (:func:`resync` after its outermost call)."""
    if not folded and not checked:
        MODELS.pop(model, None)
        return
    names = _param_names(model)
    folds = [Folded(p, p.norm.weight.detach().clone(), [row_prints(c.weight) for c in p.consumers],
                    frozenset(names.get(id(t), "") for t in (p.norm.weight, *(c.weight for c in p.consumers))))
             for p in folded]
    adds = [Checked(name, linear, key, row_prints(linear.weight), frozenset({names.get(id(linear.weight), "")}))
            for name, linear, key in checked]
    MODELS[model] = (folds, adds)
    load_weights = getattr(model, "load_weights", None)
    if callable(load_weights) and not getattr(load_weights, MARK, False):
        model.load_weights = _boundary(load_weights, "load_weights", model)


def _on_meta(model: nn.Module) -> bool:
    folds, adds = MODELS.get(model, ([], []))
    tensors = [t for f in folds for t in (f.plan.norm.weight, *(c.weight for c in f.plan.consumers))]
    return any(t.is_meta for t in tensors + [a.linear.weight for a in adds])


def resync(model: nn.Module, why: str, written: set[str] | None = None) -> dict[str, int] | None:
    """Fold again what a write changed in ``model`` (``written``: the parameter names it wrote, when known),
    check it and write it in place; None where a layerwise reload still holds layers on the meta device."""
    if model not in MODELS:
        return {}
    if _on_meta(model):
        logger.debug("tunekit vLLM plugin: %s: layers still on the meta device; the fold waits for the end", why)
        return None
    folds, adds = MODELS[model]
    if written is not None and not written <= set(_param_names(model).values()):
        written = None  # names this model does not know: look at everything
    counts: dict[str, int] = {}
    with torch.no_grad():
        for rec in folds:
            if written is None or rec.names & written:
                _refold(rec, why, counts)
        for add in adds:
            if written is None or add.names & written:
                _recheck(add, why, counts)
    for key, value in counts.items():
        REFOLDS[key] = REFOLDS.get(key, 0) + value
    if counts:
        logger.info("tunekit vLLM plugin: weights written (%s): %s", why, counts)
    return counts


def _candidates(rec: Folded, changed: list[torch.Tensor], gain_changed: bool
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(raw weights, folded weights) of each consumer: changed rows raw as written, the others the raw weights
    their folded values came from (W' / g_old, within one rounding; the columns a 0 gain multiplied away
    from the copies the fold kept, ``FoldPlan.zero_columns``)."""
    plan = rec.plan
    s_new, s_old = fold_scale(plan.norm.weight, plan.op), fold_scale(rec.gain, plan.op)
    safe_old = torch.where(s_old == 0, torch.ones_like(s_old), s_old)
    zeros = plan.zero_channels
    raws, weights = [], []
    for i, (c, rows) in enumerate(zip(plan.consumers, changed, strict=True)):
        w = c.weight.detach()
        raw = w.to(torch.float32, copy=True)
        kept = ~rows
        if bool(kept.any()):
            raw[kept] = w[kept].float() / safe_old
            if zeros is not None and zeros.numel():
                raw[kept.nonzero().flatten()[:, None], zeros[None, :]] = plan.zero_columns[i][kept].float()
        folded = (raw * s_new).to(w.dtype)
        if not gain_changed:
            folded[kept] = w[kept]  # exactly what they hold
        raws.append(raw.to(w.dtype))
        weights.append(folded)
    return raws, weights


def _shapes(rec: Folded) -> list[tuple[int, int]]:
    shapes = [tuple(c.weight.shape) for c in rec.plan.consumers]
    joined = {getattr(c, JOINED_N, None) for c in rec.plan.consumers}
    if joined != {None}:
        shapes += [(n, shapes[0][1]) for n in joined if n is not None]
    return shapes


def _refold(rec: Folded, why: str, counts: dict[str, int]) -> None:
    from tunekit.ops import dtype_name

    plan = rec.plan
    gain = plan.norm.weight.detach()
    gain_changed = not torch.equal(gain, rec.gain)
    changed = [row_prints(c.weight) != p for c, p in zip(plan.consumers, rec.prints, strict=True)]
    if not gain_changed and not any(bool(r.any()) for r in changed):
        return
    raws, weights = _candidates(rec, changed, gain_changed)
    joined = any(getattr(c, JOINED_N, None) for c in plan.consumers)
    result = check_fold(plan, weights, joined, raws)
    if not result.ok:
        weight = plan.consumers[0].weight
        dtype, device = dtype_name(weight.dtype), str(weight.device)
        for n, k in _shapes(rec):
            refuse_kernels("rms_gemv", dtype, n, k, device)
        again = check_fold(plan, weights, joined, raws)
        logger.error("tunekit vLLM plugin: %s (%s) failed the check on the weights written by %s: %s. A compiled graph "
                     "cannot unfold it: rms_gemv at its shapes now serves its fallback (the norm, then the GEMV on "
                     "the folded weight), which %s", plan.name, plan.op, why, result.describe(),
                     "passes" if again.ok else f"fails too: {again.describe()}")
        counts[f"{plan.op} refused at reload"] = counts.get(f"{plan.op} refused at reload", 0) + 1
    plan.zero_channels, plan.zero_columns = zero_columns(plan.op, gain, raws)
    for c, w in zip(plan.consumers, weights, strict=True):
        c.weight.data.copy_(w)
    rec.gain = gain.clone()
    rec.prints = [row_prints(c.weight) for c in plan.consumers]
    rescaled = gain_changed and not all(bool(r.all()) for r in changed)
    key = f"{plan.op} folded again" + (" (partly rescaled)" if rescaled else "")
    counts[key] = counts.get(key, 0) + 1


def _recheck(rec: Checked, why: str, counts: dict[str, int]) -> None:
    from tunekit.integrations.fold_check import check_residual_add

    prints = row_prints(rec.linear.weight)
    if torch.equal(prints, rec.prints):
        return
    rec.prints = prints
    if rec.key in REFUSED:
        return
    result = check_residual_add(rec.linear.weight.detach())
    if result.ok:
        return
    op, dtype, n, k, device = rec.key
    REFUSED.add(rec.key)
    refuse_kernels(op, dtype, n, k, device)
    logger.error("tunekit vLLM plugin: gemv_add %s %dx%d failed the check on %s's weights written by %s: %s; it "
                 "serves its fallback (the GEMV, then the add) from now on", dtype, n, k, rec.name, why,
                 result.describe())
    counts["gemv_add refused at reload"] = counts.get("gemv_add refused at reload", 0) + 1


def resync_all(why: str, written: set[str] | None = None) -> None:
    """:func:`resync` every registered model, unless a write is still in progress (nested call, open session).
    Never raises: a failure is logged."""
    if _WRITES["depth"] or _WRITES["session"]:
        return
    for model in list(MODELS):
        try:
            resync(model, why, written)
        except Exception:  # never break vLLM's own write path
            logger.exception("tunekit vLLM plugin: could not fold the weights written by %s again", why)


def _boundary(fn: Callable[..., Any], why: str, model: nn.Module | None = None) -> Callable[..., Any]:
    """``fn`` as a write: nested writes wait for the outermost, which resyncs (only the parameters it reports
    loaded, for ``model.load_weights``, which returns their names)."""
    @functools.wraps(fn)
    def write(*args: Any, **kwargs: Any) -> Any:
        _WRITES["depth"] += 1
        loaded = None
        try:
            loaded = fn(*args, **kwargs)
            return loaded
        finally:
            _WRITES["depth"] -= 1
            names = set(loaded) if model is not None and isinstance(loaded, (set, list, tuple)) else None
            resync_all(why, names)

    setattr(write, MARK, True)
    return write


def _session(start: Callable[..., Any], finish: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    @functools.wraps(start)
    def start_weight_update(*args: Any, **kwargs: Any) -> Any:
        _WRITES["session"] = True
        try:
            return start(*args, **kwargs)
        except BaseException:
            _WRITES["session"] = False
            raise

    @functools.wraps(finish)
    def finish_weight_update(*args: Any, **kwargs: Any) -> Any:
        try:
            return finish(*args, **kwargs)
        finally:
            _WRITES["session"] = False
            resync_all("a weight update")

    for fn in (start_weight_update, finish_weight_update):
        setattr(fn, MARK, True)
    return start_weight_update, finish_weight_update


def _sleep_wake(sleep: Callable[..., Any], wake_up: Callable[..., Any]) -> tuple[Callable[..., Any], ...]:
    @functools.wraps(sleep)
    def sleep_and_remember(self: Any, level: int = 1, *args: Any, **kwargs: Any) -> Any:
        _WRITES["sleep_level"] = level
        return sleep(self, level, *args, **kwargs)

    @functools.wraps(wake_up)
    def wake_up_and_refold(self: Any, tags: list[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        out = wake_up(self, tags, *args, **kwargs)
        if tags is None or "weights" in tags:
            if _WRITES["sleep_level"] == 2:  # the weights were discarded: the reload that follows folds them
                logger.info("tunekit vLLM plugin: woken from sleep level 2: the weights fold again when reloaded")
            else:
                resync_all("wake_up")
        return out

    for fn in (sleep_and_remember, wake_up_and_refold):
        setattr(fn, MARK, True)
    return sleep_and_remember, wake_up_and_refold


#: modules that bound ``reload_weights`` at import (``from ... import reload_weights``)
_RELOAD_MODULES = ("vllm.model_executor.model_loader.reload.inplace", "vllm.model_executor.model_loader.reload",
                   "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


def install() -> list[str]:
    """Wrap the writers of vLLM's modules already imported (idempotent: MARK): ``reload_weights`` wherever it
    was bound, the worker's weight-update session and sleep / wake-up. Returns what it wrapped."""
    wrapped = []
    inplace = sys.modules.get(_RELOAD_MODULES[0])
    original = getattr(inplace, "reload_weights", None)
    if original is not None:
        boundary = original if getattr(original, MARK, False) else _boundary(original, "reload_weights")
        for name in _RELOAD_MODULES:
            module = sys.modules.get(name)
            if module is not None and getattr(module, "reload_weights", None) in (original, boundary):
                module.reload_weights = boundary
                wrapped.append(f"{name.rsplit('.', 1)[-1]}.reload_weights")
    worker = getattr(sys.modules.get("vllm.v1.worker.gpu_worker"), "Worker", None)
    if worker is not None:
        start, finish = getattr(worker, "_start_weight_update", None), getattr(worker, "finish_weight_update", None)
        if callable(start) and callable(finish):
            if not getattr(finish, MARK, False):
                worker._start_weight_update, worker.finish_weight_update = _session(start, finish)
            wrapped.append("Worker weight updates")
        sleep, wake_up = getattr(worker, "sleep", None), getattr(worker, "wake_up", None)
        if callable(sleep) and callable(wake_up):
            if not getattr(wake_up, MARK, False):
                worker.sleep, worker.wake_up = _sleep_wake(sleep, wake_up)
            wrapped.append("Worker sleep/wake_up")
    return wrapped
