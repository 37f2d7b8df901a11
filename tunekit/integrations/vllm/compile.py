"""The vLLM plugin's compile hooks: the tables join vLLM's compile-cache key, and token counts above
the tables compile vLLM's own math.

* ``compile_cache_key``: which layers reach a tunekit op is decided while
  vLLM traces the model and baked into the graph, so the tables' digest
  (:data:`COMPILE_FACTOR` = ``TUNEKIT_TABLE_DIGEST``, :func:`tables_digest`)
  joins vLLM's compile-cache factors: a graph traced under one table (or
  under plain vLLM) is never loaded under another. So does what the load
  checks decided (:func:`load_outcome`: the norms folded, the fused keys
  refused), read when vLLM compiles, after the load.
* ``compile_ranges``: vLLM compiles each graph piece once per token-count
  range (``CompilationConfig.compile_ranges_endpoints``) and runs its
  post-grad passes per range. The hook adds endpoints, each op's largest M
  in the tables (2 at least: vLLM takes endpoints above 1;
  :func:`range_endpoints` says why every op's), and
  one post-grad pass (``PostGradPassManager.configure`` gains it): in a
  range that starts above the largest M a table holds for a node's (op,
  dtype, N, K), the node is replaced by the stock math
  (``tunekit.integrations.vllm.graph_routes``, the pass's body), so
  prefills and captured sizes above the tables run the graph vLLM compiles
  without tunekit, with none of the op's per-call Python. Off where vLLM's
  compile mode is not its Inductor one (no post-grad passes): there the op
  decides per call, as before. In the ranges the tables serve, the same
  pass makes sibling GEMVs on joined weights one ``sibling_gemv`` and moves
  residual adds into ``gemv_add`` where tabulated. What each range's pass
  did is kept in :data:`RANGE_ROUTES`, :data:`RANGE_FUSIONS` and
  :data:`RANGE_MERGES`.

No route branches on M: vLLM traces with dynamic token counts and drops
shape guards, so inside a compile range every choice that depends on M is
made inside the op; the ranges split the token counts once, at compile time.

Call protocol::

    done, why = install_compile_factor()   # the plugin's hooks; each (installed, what) or (False, why not)
    load_outcome()                         # "" before a load that folded or refused anything, else "+<hash>"
    done, why = install_compile_ranges()
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

from tunekit.integrations.vllm.marks import REFUSED
from tunekit.integrations.vllm.state import MARK, STATE, fold_requested, logger, merge_requested, table_paths

__all__ = ["COMPILE_FACTOR", "RANGE_FUSIONS", "RANGE_MERGES", "RANGE_ROUTES", "install_compile_factor",
           "install_compile_ranges", "load_outcome", "range_endpoints", "tables_digest", "tables_tops"]


# ---------------------------------------------------------------------------
# vLLM's compile cache key
# ---------------------------------------------------------------------------

#: The name under which the tables' digest joins vLLM's compile-cache factors.
COMPILE_FACTOR = "TUNEKIT_TABLE_DIGEST"


def tables_digest() -> str:
    """sha256 over the named tables' paths and bytes (an unreadable one: its path and the error) and
    the fold and merge switches (a folded or joined model traces another graph)."""
    h = hashlib.sha256(f"fold={fold_requested()} merge={merge_requested()}".encode())
    for path in table_paths():
        h.update(os.path.abspath(path).encode() + b"\0")
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError as exc:
            h.update(f"unreadable: {exc}".encode())
        h.update(b"\0")
    return h.hexdigest()


def load_outcome() -> str:
    """What the load checks decided that a traced graph bakes in (the norms folded, ``marks.REFUSED``, the
    entries the shipped tables' check kept: which layers they cover): "" where nothing was folded, refused or
    checked, else "+" and a hash of them."""
    folded = STATE.get("fold_outcome") or []
    shipped = STATE.get("shipped_outcome") or ""
    if not folded and not REFUSED and not shipped:
        return ""
    # the shipped check's digest joins only where one ran: every other key stays as it was
    decided = [folded, sorted(REFUSED)] + ([shipped] if shipped else [])
    return "+" + hashlib.sha256(json.dumps(decided).encode()).hexdigest()[:16]


def install_compile_factor() -> tuple[bool, str]:
    """The hook ``compile_cache_key``: :func:`tables_digest` as vLLM's compile factor :data:`COMPILE_FACTOR`."""
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
    digest = tables_digest()  # hashed here (bytes only): the tables are parsed at the first op call
    factors[COMPILE_FACTOR] = lambda: digest + load_outcome()  # read at compile time, after the load
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


def tables_tops(tp: int | None = None) -> dict[str, int]:
    """Per op, the largest M of the entries serving keeps of the named tables at TP size ``tp`` (None: any) on
    this host: the index the ops serve from (``tunekit.ops.host_index``: no GPU touched, a table stamped for
    other software or another TP size left out as the ops leave it out)."""
    from tunekit import ops

    # The shipped tables (auto) count here unchecked, every entry of every GPU's (host_index): their check
    # needs the GPU, which no vLLM process may touch at config time. Harmless: the check only drops entries,
    # so the endpoints bound the checked tables' Ms from above. A layer whose key the check dropped whole
    # traces vLLM's own code (coverage is read at trace time, after the check); a key whose kept entries end
    # below an endpoint is what any table whose ops end at unequal Ms gives: the range pass reads the checked
    # tables when it compiles (graph_routes.within_table) and hands its node back to vLLM's math in the
    # ranges above them, and up to the endpoint its calls above them run vLLM's own kernel inside the op.
    # Every shipped table ends at M=8 today, so the endpoint is the one the checked tables give.
    index = ops.host_index(tp, table_paths())
    return {} if index is None else index.tops()


def range_endpoints(tops: dict[str, int]) -> list[int]:
    """The compile-range endpoints for tables whose ops end at ``tops`` (vLLM takes endpoints above 1
    only, so an M=1 table ends the range [1, 2]): every op's largest M. Why every op's and not only the
    largest: above an op's entries the op's fallback runs inside the op, where Inductor cannot fuse it. A
    fused GEMV op's fallback is its unfused sequence (a folded norm's is a norm launch before the GEMM, a
    residual add one after it); an elementwise op's is vLLM's kernel or tunekit's default-config kernel,
    which no search timed against the Inductor kernel vanilla compiles (issue 55: at batch 4 SiLU-and-mul,
    tabulated at M=1 only, ran the default kernel 1152 times). A range that starts above an op's entries
    hands its nodes back to the stock math (``graph_routes.unroute``), which Inductor compiles as vLLM
    would; only the Ms up to that endpoint keep the op's fallback. Each distinct endpoint is one more
    range vLLM compiles each piece for (engine start, cached after the first)."""
    if not tops:
        return []
    return sorted({max(2, m) for m in tops.values()})


def install_compile_ranges() -> tuple[bool, str]:
    """The hook ``compile_ranges``: :func:`range_endpoints` join vLLM's compile ranges and the range pass
    joins its post-grad passes (``VllmConfig._set_compile_ranges`` and ``PostGradPassManager.configure``
    wrapped once, marked)."""
    # A covered layer calls the tunekit op at every token count, since the route is decided once
    # per trace. An eager prefill above the tables then pays the op's Python per call (~190 calls
    # per Llama-8B forward) for a fallback, where vLLM's compiled code runs a fused kernel from
    # Inductor's wrapper. vLLM compiles each graph piece per token-count range and runs its
    # post-grad passes per range: one range ends at the tables' largest M, and in the ranges above
    # it a pass hands every tunekit node back to the stock math (graph_routes.unroute).
    tops = tables_tops()
    if not tops:
        return False, "the named tables hold no entry"
    top, endpoints = max(tops.values()), range_endpoints(tops)
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

    if not getattr(set_ranges, MARK, False):
        @functools.wraps(set_ranges)
        def _set_compile_ranges(self: Any) -> Any:
            # the endpoints of the entries serving keeps at this engine's TP size (known here, at config time)
            tp = getattr(getattr(self, "parallel_config", None), "tensor_parallel_size", None)
            ends = range_endpoints(tables_tops(tp if isinstance(tp, int) else None))
            cc = self.compilation_config
            cc.compile_ranges_endpoints = sorted(set(cc.compile_ranges_endpoints or ()) | set(ends))
            return set_ranges(self)

        setattr(_set_compile_ranges, MARK, True)
        VllmConfig._set_compile_ranges = _set_compile_ranges
    if not getattr(configure, MARK, False):
        @functools.wraps(configure)
        def configure_with_tunekit(self: Any, config: Any) -> Any:
            result = configure(self, config)
            self.add(route_pass)
            return result

        setattr(configure_with_tunekit, MARK, True)
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
                return graph_routes.within_table(*key, start=start) and key not in REFUSED

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

                # the stock compositions' own modules (tunekit's: torch's is in vLLM's key already)
                modules = {inspect.getmodule(fn) for fn, _ in graph_routes.COMPOSITIONS.values()}
                stock = sorted((m for m in modules if m is not None and m.__name__.startswith("tunekit.")),
                               key=lambda m: m.__name__)
                sources = (inspect.getsource(obj) for obj in (graph_routes, *stock, _range_pass))
                self._uuid = base.hash_dict({"source": base.hash_source(*sources),
                                             "tables": tables_digest() + load_outcome()})
            return self._uuid

    return TunekitRangeRoutes()
