"""The load check of the residual-add epilogue, and what the load-time checks report.

The fold checks each norm it folds itself (``fold.check_fold``). The
residual add a fold leaves goes into the previous GEMV's epilogue
(``gemv_add``) by the compile pass, which sees shapes, not layers: so every
linear that pass could give ``gemv_add`` (tunekit routes its GEMM, it is
unquantized, and a table covers its (gemv_add, dtype, N, K)) is checked
here on its own weight against the GEMV then the add
(``fold_check.check_residual_add``), before anything is compiled. A shape
that fails on any layer's weight goes into ``marks.REFUSED``: the pass then
leaves every add after a GEMV of that shape an add. So does a shape whose
``gemv_add`` group the tables decided against (their ``fusions`` section:
the search timed ``gemv_add`` against the GEMV then the add at every M;
``tunekit.ops.add_decision``), unchecked.

Call protocol::

    adds = check_residual_adds(model, honours)   # AddReport; fills marks.REFUSED
    log_outcome(fold_report, adds)                # the log lines (once per layer kept unfolded / per reason)
    text = outcome_text(fold_report, adds)        # one line for plugin.installed()

No vLLM import (module classes and attributes only).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from tunekit.integrations.fold_check import CheckResult, check_residual_add
from tunekit.integrations.vllm.fold import FoldReport
from tunekit.integrations.vllm.marks import REFUSED
from tunekit.integrations.vllm.state import logger

__all__ = ["AddReport", "check_residual_adds", "log_outcome", "outcome_text", "residual_add_linears"]


@dataclass
class AddReport:
    """What the ``gemv_add`` check did: the linears it passed (name, module, key), the shapes it refused (with
    the layer and worst element that failed), how many linears it checked and the seconds it took."""

    passed: list[tuple[str, nn.Module, tuple[str, str, int, int, str]]] = field(default_factory=list)
    failed: list[tuple[str, tuple[str, str, int, int, str], CheckResult]] = field(default_factory=list)
    checked: int = 0
    seconds: float = 0.0
    #: the shapes the tables decided against (not checked) and each decided group's line
    declined: list[tuple[str, str, int, int, str]] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)


def add_key(weight: torch.Tensor) -> tuple[str, str, int, int, str]:
    """The ``gemv_add`` key of a linear's weight: (op, dtype, N, K, device)."""
    from tunekit.ops import dtype_name

    n, k = weight.shape
    return ("gemv_add", dtype_name(weight.dtype), int(n), int(k), str(weight.device))


def residual_add_linears(model: nn.Module, honours: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """(path, linear) of every linear the compile pass could route to ``gemv_add``: unquantized, a 2-D weight,
    GEMM through tunekit's route (``honours``), its (gemv_add, dtype, N, K) covered by a table."""
    from tunekit.ops import covers

    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or type(getattr(module, "quant_method", None))
                .__name__ != "UnquantizedLinearMethod" or not honours(module)):
            continue
        op, dtype, n, k, device = add_key(weight)
        if covers(op, dtype, n, k, device):
            found.append((name, module))
    return found


def check_residual_adds(model: nn.Module, honours: Callable[[nn.Module], bool]) -> AddReport:
    """Check ``gemv_add`` on the weight of every :func:`residual_add_linears` linear; a failing shape joins
    ``marks.REFUSED`` (and is not checked again on the next layer of that shape), as does, unchecked, a shape
    whose ``gemv_add`` group the tables decided against."""
    from tunekit.ops import add_decision

    report = AddReport()
    start = time.perf_counter()
    for name, linear in residual_add_linears(model, honours):
        key = add_key(linear.weight)
        if key in REFUSED:
            continue
        decision = add_decision(*key[1:])
        if decision is not None and decision.first:
            report.decisions.append(decision.line)
        if decision is not None and not decision.fuse:
            REFUSED.add(key)
            report.declined.append(key)
            continue
        result = check_residual_add(linear.weight.detach())
        report.checked += 1
        if result.ok:
            report.passed.append((name, linear, key))
        else:
            REFUSED.add(key)
            report.failed.append((name, key, result))
    report.seconds = time.perf_counter() - start
    return report


def _reasons(fold: FoldReport) -> dict[str, list[str]]:
    kinds: dict[str, list[str]] = {}
    for name, _, why in fold.not_folded:
        kinds.setdefault(why, []).append(name)
    return kinds


def log_outcome(fold: FoldReport, adds: AddReport) -> None:
    """The load checks in vLLM's log: one line per fusion group (fused or not, and why: the tables' measured
    decision with its margin), a warning per norm kept unfolded (its path, worst error and bound) and per
    refused ``gemv_add`` shape, one line per reason a norm was not folded, one with the checks' cost."""
    for line in fold.decisions + adds.decisions:
        logger.info("tunekit vLLM plugin: %s", line)
    for name, op, result in fold.failed:
        logger.warning("tunekit vLLM plugin: %s (%s) kept unfolded: rms_gemv on its folded weights failed the check "
                       "against the unfolded sequence: %s", name, op, result.describe())
    for name, (_, dtype, n, k, _), result in adds.failed:
        logger.warning("tunekit vLLM plugin: gemv_add %s %dx%d not used (residual adds stay adds): it failed the "
                       "check on %s's weight: %s", dtype, n, k, name, result.describe())
    for why, names in _reasons(fold).items():
        logger.info("tunekit vLLM plugin: %d decoder norm(s) not folded: %s (%s%s)", len(names), why,
                    ", ".join(names[:3]), ", ..." if len(names) > 3 else "")
    if fold.checked or adds.checked:
        logger.info("tunekit vLLM plugin: load checks took %.2f s: %d folded norm(s) (%d kept unfolded), %d linear(s) "
                    "for gemv_add (%d shape(s) refused)", fold.seconds + adds.seconds, fold.checked, len(fold.failed),
                    adds.checked, len(adds.failed))


def outcome_text(fold: FoldReport, adds: AddReport) -> str:
    """One line: folded, kept unfolded (failed the check), not folded and why, the checks' cost."""
    parts = [f"folded {len(fold.folded)}", f"kept unfolded {len(fold.failed)} (failed the check)"]
    reasons = _reasons(fold)
    if reasons:
        parts.append("not folded " + ", ".join(f"{len(names)} ({why})" for why, names in reasons.items()))
    parts.append(f"gemv_add shapes refused {len(adds.failed)}")
    if adds.declined:
        parts.append(f"gemv_add shapes not fused per the table {len(adds.declined)}")
    parts.append(f"checks {fold.seconds + adds.seconds:.2f} s over {fold.checked} norm(s) and {adds.checked} "
                 f"linear(s)")
    return "; ".join(parts)
