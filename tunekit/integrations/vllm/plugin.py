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
  and the tables' keys, decided once per trace and baked into the graph: a
  covered layer calls the tunekit op, any other runs vLLM's own forward /
  GEMM; an eager call above the tables' largest M for the layer runs vLLM's
  own path (``coverage``).
* Inside a covered layer's op, per call (M is dynamic under vLLM's
  compile): a tuned kernel where the table has one for this M, else the
  fallback, which runs what vLLM itself would have run (``F.linear`` or
  vLLM's ROCm GEMM for GEMMs, ``gemm``; vLLM's own elementwise kernels or
  tunekit's default-config kernel, ``vendors``). Every call is counted with
  its impl and the vendor that served it.
* The tables' digest joins vLLM's compile-cache key, so a graph traced under
  one table (or under plain vLLM) is never loaded under another; token
  counts above the tables compile vLLM's own math (``compile``).

Guarantees (an exception escaping a general plugin stops vLLM's start-up):

* idempotent per process: a second :func:`register` is a no-op;
* catches its own exceptions: a hook that cannot be installed is skipped
  and logged, the others still go in;
* touches no GPU at load: ROCm is told by ``torch.version.hip`` and the
  tables are parsed at the first op call, not here (only their bytes are
  hashed, for the compile-cache key, and their Ms read for the compile
  ranges); the shipped tables (``TUNEKIT_TABLE=auto``) are checked on the
  device in the worker, after the weights load (hook ``check_shipped``);
* logs once, at INFO, which hooks it installed and which it skipped and why.

Hooks, one module of this package each (this module only installs them and
reports; ``state`` holds what they share):

* ``linear`` (``gemm``): vLLM's plain unquantized GEMM through
  ``torch.ops.tunekit.gemv`` for covered weights;
* ``RMSNorm``, ``GemmaRMSNorm``, ``RMSNormGated``, ``SiluAndMul``
  (``custom_ops``): ``CustomOp.register_oot`` subclasses that put the
  coverage check in front of vLLM's own forward, with vLLM's kernels as
  their ops' vendor path (``vendors``);
* ``compile_cache_key`` and ``compile_ranges`` (``compile``): the tables'
  digest as a compile factor; compile-range endpoints at the tables' Ms and
  a post-grad pass (``graph_routes``) that hands ranges above the tables
  back to vLLM's math, merges sibling GEMVs and fuses residual adds;
* ``check_shipped`` (``load``, only where ``TUNEKIT_TABLE`` names ``auto``):
  after the weights load, on the worker's device, the shipped tables are
  checked (another GPU's refused, each entry verified; one line logged) and
  served with what passed, before the fold and the first forward read them;
* ``fold_norms`` and ``merge_siblings`` (``load``): after the weights load,
  decoder norms folded into their consumers (``fold``) and sibling linears'
  weights joined (``merge``), each only where the tables pay; each fold,
  and each linear ``gemv_add`` could serve, checked on the loaded weights
  first (``fold``, ``verify_fold``), and folded and checked again when
  weights are written later (``refold``). What the last load folded, kept
  unfolded and why, and what the checks cost, is the end of the
  ``fold_norms`` line of :func:`installed`.

Every vLLM name is feature-detected; an older vLLM (the forks DCU users run)
missing one gets that hook skipped with a log line naming what is missing.
"""

from __future__ import annotations

import os

from tunekit.integrations.vllm import state
from tunekit.integrations.vllm.compile import install_compile_factor, install_compile_ranges
from tunekit.integrations.vllm.custom_ops import OOT_SPECS, oot_installer
from tunekit.integrations.vllm.gemm import install_linear
from tunekit.integrations.vllm.load import install_fold, install_merge, install_shipped_check, shipped_named
from tunekit.integrations.vllm.state import logger, table_paths

__all__ = ["installed", "register", "skipped"]


def register() -> None:
    """Entry point of ``vllm.general_plugins``: install the hooks once per process; never raises."""
    with state.LOCK:
        if state.STATE["registered"]:
            return
        state.STATE["registered"] = True
    try:
        if not table_paths():
            _install_nothing()
            return
        installed, skipped = _install()
    except Exception as exc:  # nothing may escape a general plugin
        logger.exception("tunekit vLLM plugin: not installed (%s); vLLM runs without tunekit", exc)
        return
    state.STATE["installed"], state.STATE["skipped"] = installed, skipped
    logger.info(
        "tunekit vLLM plugin: installed %s; skipped %s; tables from %s=%r (read at the first call)",
        ", ".join(f"{k} ({v})" for k, v in installed.items()) or "nothing",
        ", ".join(f"{k} ({v})" for k, v in skipped.items()) or "nothing",
        "TUNEKIT_TABLE", os.pathsep.join(table_paths()),
    )


def _hook_names() -> list[str]:
    return ["linear", *OOT_SPECS, "compile_cache_key", "compile_ranges", "fold_norms", "merge_siblings"]


def _install_nothing() -> None:
    """No table named: vLLM must run exactly as without tunekit, so no hook goes in at all."""
    # The ops are still defined (no GPU work, no table read): a compiled graph
    # that names them, loaded from a cache, resolves instead of failing.
    from tunekit import ops

    why = f"{ops.TABLE_ENV} is not set: no table, so nothing is routed and vLLM's own layers run unchanged"
    state.STATE["installed"], state.STATE["skipped"] = {}, {name: why for name in _hook_names()}
    logger.info("tunekit vLLM plugin: nothing installed (%s)", why)


def installed() -> dict[str, str]:
    """Hook name -> what it does, for the hooks :func:`register` installed in this process."""
    return dict(state.STATE["installed"])


def skipped() -> dict[str, str]:
    """Hook name -> why it was not installed."""
    return dict(state.STATE["skipped"])


def _install() -> tuple[dict[str, str], dict[str, str]]:
    import tunekit.ops  # noqa: F401 - defines torch.ops.tunekit.* (no GPU work, no table read)

    installed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    hooks = (("linear", install_linear), *[(n, oot_installer(n)) for n in OOT_SPECS],
             ("compile_cache_key", install_compile_factor), ("compile_ranges", install_compile_ranges),
             ("fold_norms", install_fold), ("merge_siblings", install_merge),
             # named tables need no check after the load: the hook is listed only where auto is named
             *([("check_shipped", install_shipped_check)] if shipped_named() else []))
    for name, hook in hooks:
        try:
            done, why = hook()
        except Exception as exc:  # one failing hook must not cost the others
            logger.debug("tunekit vLLM plugin: hook %s failed", name, exc_info=True)
            done, why = False, f"error: {type(exc).__name__}: {exc}"
        (installed if done else skipped)[name] = why
    return installed, skipped

