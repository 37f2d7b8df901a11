"""``tunekit chain``: load the tables, build the model's chain and measure every variant at each M.

Call protocol: ``run(spec, tables, m_list, ...)`` returns the report as a JSON-ready dict (the command
writes it as chain.json). Here the tables' entries become the chain's ``served`` and ``fused`` lookups:
a fused entry serves only where its standalone time beats the tuned steps it replaces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from tunekit.errors import UserError
from tunekit.evidence.chain.kernels import vendor_elementwise
from tunekit.evidence.chain.results import compare_eager, predicted_saving_us, result_line
from tunekit.evidence.chain.select import check_fusions, excluding
from tunekit.evidence.chain.steps import VARIANTS, Step, chain_steps
from tunekit.evidence.chain.timing import measure
from tunekit.evidence.chain.variants import Chain
from tunekit.measure.bench import release_memory
from tunekit.problems.models.spec import ModelSpec
from tunekit.problems.shapes import FUSED_GEMV_OPS, Problem
from tunekit.table import Entry


def run(spec: ModelSpec, tables: Sequence[str], m_list: Sequence[int], tp: int = 1, layers: int | None = None,
        iters: int = 20, repeats: int = 15, seed: int = 0, log: Callable[[str], None] = print,
        profile_replays: int = 0) -> dict[str, Any]:
    """Build the chain of ``spec`` and measure every variant at each M (or, without a GPU, compare the
    variants' logits eagerly). Returns the report as a JSON-ready dict (``tunekit chain`` writes it).
    ``profile_replays``: each variant's row also holds ``by_launch`` (:func:`measure`)."""
    from tunekit import ops
    from tunekit.measure.device import detect

    if not tables:
        raise UserError("give at least one --table")
    ops.load_tables(list(tables))
    broken = [f"{t['path']}: {t['error']}" for t in ops.loaded_tables() if t.get("error")]
    if broken:
        raise UserError("table not usable: " + "; ".join(broken))
    info = detect()
    device = torch.device("cuda", torch.cuda.current_device()) if info.is_gpu else torch.device("cpu")
    steps = chain_steps(spec, tp, layers)
    prepared = ops.prepare(device, ms=m_list)
    # tunekit.ops does not serve the fused ops (no torch.ops.tunekit.*_gemv): prepare reports their
    # entries as errors; the chain builds them itself (``fused_kernel`` below)
    errors = [e for e in prepared["errors"] if e.split(" ", 1)[0] not in FUSED_GEMV_OPS]
    if errors:
        raise UserError("building the tabulated kernels failed: " + "; ".join(errors[:3]))
    fallback = ", ".join(f"{k} x{v}" for k, v in prepared["fallback"].items())
    log(f"{spec.name}: {len(steps)} calls per step ({len(spec.layer_types[: layers or spec.num_layers])} layers), "
        f"device {info.name}; tables: {prepared['tuned']} tuned kernels ready"
        + (f", vendor path for {fallback}" if fallback else ""))
    report: dict[str, Any] = {
        "model": spec.name, "tp": tp, "layers": layers or spec.num_layers, "calls_per_step": len(steps),
        "device": info.as_dict(), "tables": list(tables), "timed": device.type == "cuda",
        "iters": iters, "repeats": repeats, "results": [],
    }
    weights = None
    dtype = "bf16"
    unpaid: set[tuple] = set()  # fused entries slower than the tuned steps they would replace (logged once)
    for m in m_list:
        chain = Chain(steps, m, device, seed, weights=weights)
        weights = chain.weights

        def entry_for(step: Step, m: int = m) -> Entry | None:
            return ops.served_entry(step.op, dtype, m, step.n, step.k, str(device))

        def fused_kernel(op: str, n: int, k: int, replaced: list[Step], added: list[Step],
                         m: int = m) -> Callable[..., None] | None:
            entry = ops.served_entry(op, dtype, m, n, k, str(device))
            extra = [entry_for(step) for step in added]
            if entry is None or None in extra:
                return None  # a step the fusion adds (gemv_add's plain norm) must be tuned: its cost is known
            # Fuse only where it pays: the fused kernel (and what it adds) must beat the tuned kernels
            # of the steps it replaces (standalone times of the tables; a step no table serves counts 0
            # here, so the vendor part of the pair is the fused kernel's margin, never its excuse).
            fused_us = entry.time_us + sum(e.time_us for e in extra)
            tuned_us = sum(e.time_us for e in map(entry_for, replaced) if e is not None)
            if tuned_us and fused_us >= tuned_us:
                key = (m, op, n, k)
                if key not in unpaid:
                    unpaid.add(key)
                    plus = "".join(f" + {s.op} {e.time_us:.2f}" for s, e in zip(added, extra, strict=True))
                    log(f"M={m} {op} {n}x{k}: fused {entry.time_us:.2f} us{plus} >= the tuned steps it "
                        f"replaces {tuned_us:.2f} us ({'+'.join(s.name for s in replaced)}): left unfused")
                return None
            return _build_fused(entry, Problem(op, dtype, m, n, k), info)

        fns = vendor_elementwise(device)

        def served(step: Step) -> bool:
            return entry_for(step) is not None

        for variant in VARIANTS:
            chain.build(variant, fns, served, fused_kernel)
        families = sorted({step.op for step in chain.fused["tuned_fused"]})
        excluded: frozenset[str] = frozenset()
        if families and device.type == "cuda":
            excluded = check_fusions(chain, families, fns, served, fused_kernel, m, report, log)
            chain.build("tuned_fused", fns, served, excluding(fused_kernel, excluded))
        # tuned_fused equals tuned where nothing is fused at this M: not measured twice
        variants = [v for v in VARIANTS if v != "tuned_fused" or chain.fused[v]]
        if len(variants) < len(VARIANTS):
            log(f"M={m} tuned_fused: " + ("the fusion check left every family out" if families else
                                          "no fused entry serves this M") + " (same as tuned), not measured")
        results = measure(chain, variants, iters, repeats, profile_replays) if device.type == "cuda" \
            else compare_eager(chain, variants)
        vendor_us = results[0].step_us
        for r in results:
            row = asdict(r) | {"m": m, "predicted_saving_us": predicted_saving_us(chain, entry_for, r.variant)}
            if r.variant == "tuned_fused":
                row["left_out"] = sorted(excluded)  # fused families the check left unfused
            if device.type == "cuda":
                row["measured_saving_us"] = vendor_us - r.step_us
                row["speedup"] = vendor_us / r.step_us
            report["results"].append(row)
            log(result_line(row, device.type == "cuda"))
        del chain
        if device.type == "cuda":
            release_memory()  # the next M's chain is timed after the driver has cleared this one's weights
    return report


def _build_fused(entry: Entry, problem: Problem, device: Any) -> Callable[..., None]:
    """The kernel of a fused op's table entry, built through its backend for this M (a UserError if
    it does not build: the table promised it)."""
    from tunekit import backends

    try:
        return backends.get(entry.backend).build(problem, dict(entry.params), device)
    except Exception as exc:  # noqa: BLE001 - named in one line
        raise UserError(f"building the fused kernel {problem.key} ({entry.backend}) failed: {exc}") from None
