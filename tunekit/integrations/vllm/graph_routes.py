"""Compile-time routing: hand a traced graph's tunekit ops back to the stock math where no table serves.

A vLLM layer that a table covers calls a tunekit op for every token count,
since the decision is made once per trace and vLLM traces with a dynamic
token dimension. Inside the op, a token count the table has no entry for
takes the op's fallback; that costs nothing in a CUDA graph, but an eager
prefill pays the op's Python on every call (about 190 calls per Llama-8B
forward), where vLLM's compiled code would have run a fused kernel straight
from Inductor's wrapper.

vLLM compiles each piece of the graph once per token-count range
(``CompilationConfig.compile_ranges_endpoints``) and runs its post-grad
passes per range. :func:`unroute` is the pass body: every tunekit node whose
(op, dtype, N, K) the tables serve at no token count of the range is
replaced, in place, by the op's stock composition (``F.linear``; the
PyTorch math of vLLM's native norms and activation, the op's own vendor
path), traced with Inductor's decompositions, so Inductor compiles and
fuses it as it does in a graph traced without tunekit. Nodes the range can
use stay. A fused GEMV op handed back in a range that keeps the plain GEMV at
its shape becomes its composition around ``tunekit::gemv`` (:data:`ON_GEMV`):
the GEMV stays tuned. ``tunekit.integrations.vllm.compile`` adds the range
endpoints (each op's largest M in the tables) and installs the pass.

:func:`fuse_residual_adds` is the other rewrite, for graphs the tables do
serve: a GEMV whose one use is a residual add becomes ``gemv_add`` (the add
in the GEMV's epilogue), where a table holds that fused op. Folded norms
(``tunekit.integrations.vllm.fold``) leave exactly that add between a
layer's output projection and the next layer's consumers.
:func:`merge_siblings` makes the GEMVs of one x whose weights the load step
laid out as one tensor (``tunekit.integrations.vllm.merge``) one
``sibling_gemv``, where a table holds the joined shape.

Call protocol::

    counts = unroute(graph, keep)  # keep(op, dtype, n, k, device) -> bool; {op: nodes replaced}
    unroute(graph, lambda *key: within_table(*key, start=9))  # vLLM's pass for the range [9, ...]
    fused = fuse_residual_adds(graph, keep)  # gemv -> add pairs rewritten to gemv_add where keep says
    merged = merge_siblings(graph, keep, {((16384, 96), 5120)})  # GEMVs of one x on joined weights: one launch

Pure FX over torch: no vLLM import, so the main test tier checks it.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from tunekit import ops
from tunekit.ops import DTYPE_NAMES, NAMESPACE


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _gemv_nk(args: tuple) -> tuple[int | None, int | None]:
    return _shape(args[1]) or (None, None)  # the weight [N, K]


def _norm_nk(args: tuple) -> tuple[int | None, int | None]:
    width = _shape(args[-2])  # the weight: second to last (eps last)
    return (width[0], width[0]) if width else (None, None)


def _gated_nk(args: tuple) -> tuple[int | None, int | None]:
    width = _shape(args[2])  # the weight: one group's width
    return (None, width[0]) if width else (None, None)


def _silu_nk(args: tuple) -> tuple[int | None, int | None]:
    shape = _shape(args[0])  # x [..., 2 * N]
    return (shape[-1] // 2, shape[-1]) if shape else (None, None)


def _rms_gemv_on_gemv(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.tunekit.gemv(ops.unweighted_rms_norm(x, eps), weight)


def _gemv_add_on_gemv(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return torch.ops.tunekit.gemv(x, weight) + residual


#: op -> how its table key's (N, K) is read from a node's argument values. The keys are those the vLLM
#: plugin's routes check (``coverage.covered``): the gated norm by row width alone (N None).
_KEYS: dict[str, Callable[[tuple], tuple[int | None, int | None]]] = {
    "gemv": _gemv_nk, "rms_norm": _norm_nk, "gemma_rms_norm": _norm_nk, "fused_add_rms_norm": _norm_nk,
    "gemma_fused_add_rms_norm": _norm_nk, "gated_rms_norm": _gated_nk, "silu_and_mul": _silu_nk,
    "rms_gemv": _gemv_nk, "gemv_add": _gemv_nk,
}

#: op -> (stock composition: the op's own vendor path, as its fallback computes it, from its record
#: (``tunekit.ops.stock``); its table key's (N, K) from the node's argument values).
COMPOSITIONS: dict[str, tuple[Callable[..., Any], Callable[[tuple], tuple[int | None, int | None]]]] = {
    op: (ops.stock(op), key) for op, key in _KEYS.items()}


#: fused GEMV op -> its stock composition around ``tunekit::gemv``: what :func:`unroute` splices in where
#: a range hands the fused op back but keeps the GEMV at its (N, K) (a fused table searched at fewer Ms
#: than the main one), so that the GEMV stays tuned and Inductor fuses the rest
ON_GEMV: dict[str, Callable[..., Any]] = {"rms_gemv": _rms_gemv_on_gemv, "gemv_add": _gemv_add_on_gemv}


def tunekit_op(node: fx.Node) -> str | None:
    """The tunekit op a graph node calls (``torch.ops.tunekit.<op>.default``), or None."""
    if node.op != "call_function":
        return None
    target = node.target
    name = getattr(target, "name", None)  # OpOverload.name(): "tunekit::rms_norm"
    if not callable(name):
        return None
    qualified = name()
    prefix = NAMESPACE + "::"
    if not qualified.startswith(prefix):
        return None
    op = qualified[len(prefix):].split(".", 1)[0]
    return op if op in COMPOSITIONS else None


def _meta(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def within_table(op: str, dtype: str, n: int | None, k: int, device: str, start: int) -> bool:
    """True if the tables serving ``device`` tune (op, dtype, N, K) at some token count >= ``start``:
    then a graph for token counts from ``start`` up keeps the op (its Ms the table lacks fall back
    inside it), else the stock composition serves that whole graph."""
    top = ops.largest_m(op, dtype, n, k, device)
    return top is not None and top >= start


def unroute(graph: fx.Graph, keep: Callable[[str, str, int | None, int, str], bool]) -> dict[str, int]:
    """Replace every tunekit node that ``keep(op, dtype, n, k, device)`` refuses by its stock composition.

    A node whose argument values (``meta["val"]``, as Dynamo and AOT
    autograd leave them) are missing, or whose key cannot be read, is kept:
    the op serves it at run time, as before. Returns {op: nodes replaced}.
    """
    replaced: dict[str, int] = {}
    for node in list(graph.nodes):
        op = tunekit_op(node)
        if op is None:
            continue
        values = tuple(_meta(a) for a in node.args)
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if not tensors or any(isinstance(a, fx.Node) and _meta(a) is None for a in node.args) or node.kwargs:
            continue
        composition, key = COMPOSITIONS[op]
        n, k = key(values)
        dtype = DTYPE_NAMES.get(tensors[0].dtype)
        device = str(tensors[0].device)
        if dtype is None or not isinstance(k, int) or keep(op, dtype, n, k, device):
            continue
        if op in ON_GEMV and keep("gemv", dtype, n, k, device):
            composition = ON_GEMV[op]
        if _inline(graph, node, composition, values):
            replaced[op] = replaced.get(op, 0) + 1
    if replaced:
        graph.eliminate_dead_code()
        graph.lint()
    return replaced


def _inline(graph: fx.Graph, node: fx.Node, composition: Callable[..., Any], values: tuple) -> bool:
    """Trace ``composition`` on the node's argument values and splice the trace in place of the node.

    True when the node is gone. A multi-output node used other than through ``getitem`` stays
    (its spliced copy is dead code, removed with the graph's dead code)."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import detect_fake_mode
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    tensor_at = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]

    def traced(*tensors: torch.Tensor) -> Any:
        args = list(values)
        for i, t in zip(tensor_at, tensors, strict=True):
            args[i] = t
        return composition(*args)

    inputs = [values[i] for i in tensor_at]
    fake_mode = detect_fake_mode(inputs)
    # Traced as Inductor's pattern matcher traces a replacement (its fwd_only): the graph's own
    # fake tensors, symbolic token counts included, with Inductor's decompositions.
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), enable_python_dispatcher():
        sub = make_fx(traced, select_decomp_table(), tracing_mode="real")(*inputs)
    placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
    env = {p: node.args[i] for p, i in zip(placeholders, tensor_at, strict=True)}
    with graph.inserting_before(node):
        out = graph.graph_copy(sub.graph, env)
    if isinstance(out, (tuple, list)):
        # a multi-output op: its users are getitem nodes
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem and not user.kwargs:
                user.replace_all_uses_with(out[user.args[1]])
                graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    if node.users:
        return False
    graph.erase_node(node)
    return True


def _same_sizes(a: tuple, b: tuple) -> bool:
    """Equal shapes, symbolic token counts included, without adding a guard (none can be added here)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return all(statically_known_true(x == y) for x, y in zip(a, b, strict=True))


def fuse_residual_adds(graph: fx.Graph, keep: Callable[[str, str, int | None, int, str], bool]) -> int:
    """Rewrite ``tunekit::gemv(x, W)`` whose only use is ``aten.add(that, r)`` into ``tunekit::gemv_add(x, W, r)``.

    The residual add of a layer's output projection moves into that GEMV's
    epilogue (one launch, where the folded norm that follows would otherwise
    run the add on its own: ``tunekit.integrations.vllm.fold``). Only where
    ``keep("gemv_add", dtype, N, K, device)`` says the tables serve the fused
    op in this graph's token counts; a GEMV with a bias, other uses of its
    output, an add with ``alpha`` or a residual of another shape or dtype
    (a broadcast, a promotion) stays as it is. The op checks the residual's
    layout per call and takes its vendor path (GEMM, then the add) where it
    cannot serve it. Returns the number of rewrites.
    """
    add_targets = (torch.ops.aten.add.Tensor,)
    fused = 0
    for node in list(graph.nodes):
        if tunekit_op(node) != "gemv" or node.kwargs or len(node.users) != 1:
            continue
        x, weight, *rest = node.args
        if rest and rest[0] is not None:  # bias
            continue
        add = next(iter(node.users))
        if add.op != "call_function" or add.target not in add_targets or add.kwargs or len(add.args) != 2:
            continue
        residual = add.args[1] if add.args[0] is node else add.args[0]
        y, r, w = _meta(node), _meta(residual), _meta(weight)
        if residual is node or not all(isinstance(t, torch.Tensor) for t in (y, r, w)) \
                or r.dtype != y.dtype or r.dim() != y.dim() or not _same_sizes(r.shape, y.shape):
            continue
        dtype = DTYPE_NAMES.get(y.dtype)
        n, k = w.shape
        if dtype is None or not isinstance(k, int) or not keep("gemv_add", dtype, n, k, str(y.device)):
            continue
        with graph.inserting_before(add):
            new = graph.call_function(torch.ops.tunekit.gemv_add.default, (x, weight, residual))
        new.meta.update(add.meta)
        add.replace_all_uses_with(new)
        graph.erase_node(add)
        graph.erase_node(node)
        fused += 1
    if fused:
        graph.lint()
    return fused


def _fake_value(target: Any, *args: Any) -> Any:
    """``target`` run on the graph's fake values (a new node's ``meta["val"]``, as tracing leaves it)."""
    from torch._guards import detect_fake_mode

    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [t for a in args if isinstance(a, list) for t in a]
    fake_mode = detect_fake_mode(tensors)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        return target(*args)


def merge_siblings(graph: fx.Graph, keep: Callable[[str, str, int | None, int, str], bool],
                   joined: set[tuple[tuple[int, ...], int]]) -> int:
    """Rewrite the ``tunekit::gemv`` (no bias) or ``rms_gemv`` nodes that read one x into one
    ``tunekit::sibling_gemv`` whose output columns their users read as slices.

    Only groups whose weights' row counts, in graph order, and K are in ``joined`` (what the load
    step laid out as consecutive row blocks of one tensor: ``vllm_merge.JOINED``), with the same
    eps, and where ``keep(op, dtype, sum N, K, device)`` says the tables serve the joined shape in
    this graph's token counts. The op checks at run time that the weights still are one tensor's
    row blocks (else one GEMV per weight). Returns the number of groups rewritten.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[tuple[Any, str, Any], list[fx.Node]] = {}
    for node in graph.nodes:
        op = tunekit_op(node)
        if op not in ("gemv", "rms_gemv") or node.kwargs:
            continue
        x, _weight, *rest = node.args
        if op == "gemv" and rest and rest[0] is not None:  # bias
            continue
        groups.setdefault((x, op, rest[0] if op == "rms_gemv" else None), []).append(node)
    merged = 0
    for (x, op, eps), nodes in groups.items():
        weights = [node.args[1] for node in nodes]
        values = [_meta(w) for w in weights]
        if len(nodes) < 2 or not all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in values):
            continue
        rows = tuple(v.shape[0] for v in values)
        k = values[0].shape[1]
        dtype = DTYPE_NAMES.get(values[0].dtype)
        first = nodes[0]
        if (rows, k) not in joined or dtype is None or any(v.dtype != values[0].dtype for v in values) \
                or not keep(op, dtype, sum(rows), k, str(values[0].device)) \
                or any(isinstance(w, fx.Node) and order[w] > order[first] for w in weights):
            continue
        target = torch.ops.tunekit.sibling_gemv.default
        with graph.inserting_before(first):
            new = graph.call_function(target, (x, weights, eps))
            new.meta["val"] = _fake_value(target, _meta(x), values, eps)
            start = 0
            for node, width in zip(nodes, rows, strict=True):
                dim = new.meta["val"].dim() - 1
                part = graph.call_function(torch.ops.aten.slice.Tensor, (new, dim, start, start + width))
                part.meta["val"] = _fake_value(torch.ops.aten.slice.Tensor, new.meta["val"], dim, start, start + width)
                node.replace_all_uses_with(part)
                start += width
        for node in nodes:
            graph.erase_node(node)
        merged += 1
    if merged:
        graph.lint()
    return merged
