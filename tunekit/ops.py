"""Serving the dispatch table: ``torch.library`` custom ops in the ``tunekit`` namespace.

``torch.ops.tunekit.gemv(x, weight, bias=None)`` computes ``F.linear(x, weight,
bias)`` (y[..., N] = x[..., K] @ W[N, K]^T + b). It is functional (returns a new
tensor), has a fake (meta) implementation, so ``torch.compile`` keeps it as one
opaque node, and one implementation for the CUDA (also HIP) and CPU dispatch
keys that chooses, *at run time*, between a tuned kernel from the loaded
dispatch tables and the vendor path.

Call protocol::

    import tunekit.ops as ops                       # registers torch.ops.tunekit.*
    ops.load_tables(["runs/a/table.json"])          # or TUNEKIT_TABLE=a.json:b.json (read at the first call)
    ops.check_shipped()                             # auto named where no GPU work may happen: load now, the
                                                    # shipped tables checked here -> (level, line, digest)
    ops.prepare()                                   # optional: build + warm every tabulated kernel (before capture)
    y = torch.ops.tunekit.gemv(x, w, None)          # tuned kernel or vendor path; never raises for tunekit's sake
    ops.dispatch_stats()                            # [{"op", "dtype", "shape", "m", "impl", "calls", ...}]

Choice inside the op (one decision per (op, dtype, M, N, K, device), cached):

1. cheap per-call checks: dtype (bf16/fp16/fp32, x and W alike), W 2-D with
   unit stride along K (padded rows, as vLLM's ROCm weight padding makes, are
   fine), x viewable as [M, K] with unit stride along K, same device, bias
   1-D contiguous of the output dtype; anything else -> vendor path;
2. tables: those of ``TUNEKIT_TABLE`` (``:``-separated, first path wins on a
   duplicate key) whose environment stamp matches the running device and
   software (``tunekit.table.environment_mismatch``; a mismatch is one logged
   warning per table and its entries are ignored);
3. the M rule of ``tunekit.table.lookup``: the exact M, else the smallest
   tabulated M >= m, else the vendor path;
4. build through the entry's backend (``tunekit.backends``): Triton launches
   ``kernels_triton`` with the table's config (on CPU tensors only under
   ``TRITON_INTERPRET=1``); HIP compiles through the run-time compile cache.
   Building happens on the first call that is *not* under CUDA-graph capture
   (or in :func:`prepare`); a capture that meets an unbuilt kernel takes the
   vendor path, counted as ``fallback:not_built_at_capture`` (the graph then
   replays the vendor path for that size).

The vendor path is ``F.linear`` or, once the vLLM plugin set it on ROCm, vLLM's
``torch.ops.vllm.rocm_unquantized_gemm`` (LLMM1 / wvSplitK / hipBLASLt), see
:func:`set_vendor_gemm`. Errors of tunekit's own path (a table that does not
load, a build or launch failure) are logged once and become a counted
fallback; errors the vendor path itself raises (a genuine shape mismatch)
propagate exactly as they would without tunekit.

Dispatch markers: every call is counted by (op, dtype, shape, m, bias,
implementation, counted at). Under CUDA-graph capture Python runs once, at
capture; replays run no Python, so those rows say ``counted_at: "capture"``
and count captures, not executions. ``TUNEKIT_DISPATCH_LOG=path`` writes the
markers as JSON at interpreter exit (``{pid}`` in the path is replaced by the
process id, for multi-process servers).

Fused GEMVs (``tunekit.dispatch.fused_gemv``), the GEMV's rules; the fallback is the unfused
vendor sequence (the norm's PyTorch math, the vendor GEMM; the vendor GEMM, the add)::

    torch.ops.tunekit.rms_gemv(x, w, eps)                 # (x / rms(x)) @ w^T: a norm folded into w
    torch.ops.tunekit.gemv_add(x, w, r)                   # x @ w^T + r: the residual add in the epilogue

Elementwise ops (the fused decode ops of ``tunekit.problems.opspec``), same rules::

    torch.ops.tunekit.rms_norm(x, w, eps)                 # w * x / rms(x); gemma_rms_norm: (1 + w)
    torch.ops.tunekit.fused_add_rms_norm(x, r, w, eps)    # -> (norm(x + r), x + r); gemma_fused_add_rms_norm
    torch.ops.tunekit.gated_rms_norm(x, z, w, eps)        # per group of len(w): norm(x) * w * silu(z)
    torch.ops.tunekit.silu_and_mul(x)                     # silu(x[..., :d]) * x[..., d:]
    torch.ops.tunekit.bias_gelu(x, b)                     # gelu_tanh(x + b)

Their table key is (m, n, k) as in ``tunekit.problems.shapes.Problem`` (m = rows, the
leading dims; gated_rms_norm: the leading dims but [heads, head_dim], so
vLLM's [T, H, D] call is m = T, n = H * D, k = D). Each input must view as
[m, row width] with unit stride inside a row; the rows may be strided (HF's
q_norm normalises a q view whose rows are 2 * head_dim apart). Results are
contiguous.
The tuned kernel is ``backend.build(...)(inputs, out[, eps=eps])`` with
``inputs``/``out`` laid out as ``tunekit.problems.opspec`` makes them; a kernel without
an ``eps`` parameter serves only ``eps == DEFAULT_EPS``; the Triton and HIP
kernels take any (Llama-3.1's 1e-5 as well). Their vendor path is
the kernel an integration installed with :func:`set_vendor_elementwise` (the
vLLM plugin: vLLM's own CUDA / Triton kernels); where none is installed for
the op and device, tunekit's own Triton kernel at its default config (the
kernel module's ``DEFAULT``, the search space's default; valid for every M), built and cached per
key as a tuned entry is (``vendor: "tunekit:triton-default"``, see
``tunekit.dispatch.elementwise_fallback._ew_default``); else, or where that cannot serve, the PyTorch math of
vLLM's native implementations (``vllm.ir.ops.rms_norm`` ...), rounding where
those round. Each fallback row's ``vendor`` says which served it, and why the
composition did (:data:`EAGER_VENDORS`).

This module is the facade: the implementation lives in ``tunekit.dispatch``
(one module per responsibility, one shared state object; see that package's
docstring), and importing this module registers the ops. Adding an op: its
record (``tunekit.problems.oprecords``: schema, run-time impl, fake impl,
stock composition, by ``"module:ATTR"``), its impl on ``decisions.resolve`` /
``markers.count`` as ``elementwise._ew_serve`` does; :func:`register` defines
every record's op (an op registered after this module's import: call it again).
"""

from __future__ import annotations

from tunekit.dispatch.decisions import refuse
from tunekit.dispatch.elementwise import EagerNorm, serve_elementwise
from tunekit.dispatch.fused_gemv import unweighted_rms_norm
from tunekit.dispatch.fusions import add_decision, fold_decision
from tunekit.dispatch.gemv import EagerLinear, gemv
from tunekit.dispatch.index import TABLE_ENV, TableIndex, table_paths
from tunekit.dispatch.log import dispatch_log, write_dispatch_log
from tunekit.dispatch.markers import count_layer, dispatch_stats, maybe_register_atexit, reset_stats, uncounted
from tunekit.dispatch.registry import impl, register, stock
from tunekit.dispatch.state import (
    DEFAULT_EPS,
    DEFAULT_VENDOR,
    DTYPE_NAMES,
    EAGER_VENDORS,
    ELEMENTWISE_SCHEMAS,
    FALLBACK_REASONS,
    LOG_ENV,
    NAMESPACE,
    STATS_FORMAT,
    dtype_name,
)
from tunekit.dispatch.tables import (
    check_shipped,
    covers,
    holds,
    host_index,
    largest_m,
    largest_rows,
    load_tables,
    loaded_tables,
    other_tp,
    served_entry,
    serving_table,
    set_tensor_parallel,
    tabulated_ms,
)
from tunekit.dispatch.vendors import (
    clear_vendor_elementwise,
    set_engine_runs_vendor,
    set_vendor_elementwise,
    set_vendor_gemm,
    vendor_kernels,
)
from tunekit.dispatch.warmup import prepare

#: The serving API: what integrations and users may import (``tests/test_layout.py`` holds
#: ``tunekit/integrations/`` to these names; nothing of ``tunekit.dispatch``'s modules directly).
__all__ = [
    # constants and vocabulary
    "DEFAULT_EPS", "DEFAULT_VENDOR", "DTYPE_NAMES", "EAGER_VENDORS", "ELEMENTWISE_SCHEMAS", "FALLBACK_REASONS",
    "LOG_ENV", "NAMESPACE", "STATS_FORMAT", "TABLE_ENV", "dtype_name",
    # the tables: TUNEKIT_TABLE's paths, load (the shipped ones checked where a caller chooses), the index per
    # device and TP, what it covers, the entry for a call
    "TableIndex", "check_shipped", "covers", "holds", "host_index", "largest_m", "largest_rows", "load_tables",
    "loaded_tables", "other_tp", "served_entry", "serving_table", "set_tensor_parallel", "table_paths", "tabulated_ms",
    # the registered ops: define, their impls and stock compositions, eager callers, a serving body
    "EagerLinear", "EagerNorm", "gemv", "impl", "register", "serve_elementwise", "stock", "unweighted_rms_norm",
    # decisions of the load step
    "add_decision", "fold_decision", "prepare", "refuse",
    # markers and the dispatch log
    "count_layer", "dispatch_log", "dispatch_stats", "reset_stats", "uncounted", "write_dispatch_log",
    # the stock path an integration installs
    "clear_vendor_elementwise", "set_engine_runs_vendor", "set_vendor_elementwise", "set_vendor_gemm",
    "vendor_kernels",
]

# Importing the facade is what defines torch.ops.tunekit.* (integrations and users rely on it).
register()
maybe_register_atexit()
