"""Which linears read a decoder norm's output, found from the layer's own code: the structural finder both
fold paths use (``tunekit.integrations.vllm.fold``, ``tunekit.integrations.torch_fold``).

A fold is exact only if every reader of the norm's output is a linear that takes the norm's scale into its
weight: one other reader (an add, an activation, another norm, a module we cannot see into) would get the
unnormalised input. So for each norm child of a decoder layer this module proves the exact set of linear
submodules that read the norm's output, or says why it cannot.

How: a dataflow analysis of the layer's ``forward`` source (``inspect.getsource`` + ``ast``). The names bound
to the norm's output are tracked through the statements (a fused-add call ``h, r = norm(h, r)`` binds only
``h`` to it: ``r`` is the residual sum, which a folded norm still returns); each read of one is classified:

* a call of a linear submodule with it as the input: a reader;
* a call of another submodule (or of a method bound to one, as vLLM's ``self._forward_method``): the
  analysis follows into that forward, the argument bound to its parameter, and so on down to the linears;
* a read of metadata only (``.shape``, ``.size()``, ``.dtype``, ``.device``, ``len``, ``torch.empty_like``,
  ``is None``): nothing;
* anything else refuses the fold with its reason: a residual add, another norm, any other expression or
  function, a module without Python source, a value returned from the layer, a value passed through
  ``*args`` / ``**kwargs``, used in a loop or a ``try``, stored on an object, or a forward deeper than
  :data:`MAX_DEPTH`.

An ``if`` whose test reads only constants and plain attributes of the module (``self.layer_type ==
"linear_attention"``, ``self.use_attn_reduce_scatter_for_moe``) takes the branch those attributes pick now,
as the layer's forward will (they are set when the layer is built); any other ``if`` is analysed both
ways and its readers are the union.

Why source analysis rather than vLLM's compiled graph or forward hooks: it needs no run (the fold happens
right after the weights load, before vLLM compiles anything), it sees every path of the code rather than
the one a dummy input takes, it serves Hugging Face models and vLLM alike, and what it cannot prove it
names. The cost is that a forward written in a way it does not follow is refused, never guessed.

Call protocol::

    for path, layer, norms in decoder_layers(model, is_norm):      # items of a ModuleList with norm children
        found = norm_readers(layer, norms, is_linear, is_norm)     # {norm name: NormReaders}
        found["input_layernorm"].readers                           # ("self_attn.qkv_proj",) or ()
        found["post_attention_layernorm"].reason                   # "read by another norm (...)" or None

No torch import beyond ``nn.Module``, no vLLM import.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["MAX_DEPTH", "NO_SOURCE", "NOT_CALLED", "NOT_PROVEN", "NO_READER", "OTHER_READER", "READ_BY_NORM",
           "RESIDUAL_ADD", "RETURNED", "NormReaders", "decoder_layers", "norm_readers"]

#: Why a norm cannot fold (the words before `` (``: what the counts and the log group by).
READ_BY_NORM = "read by another norm"
RESIDUAL_ADD = "read by a residual add"
RETURNED = "leaves the layer"
OTHER_READER = "read by a non-linear"
NO_SOURCE = "read by a module without source"
NOT_PROVEN = "readers not provable"
NOT_CALLED = "not called by its layer"
NO_READER = "no linear reads it"

#: how many forwards deep the analysis follows a value (a layer's mixer, its core, a helper method ...)
MAX_DEPTH = 6

#: reads of a tensor that do not depend on its values
_META_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout"})
_META_METHODS = frozenset({"size", "dim", "numel", "get_device", "is_contiguous"})
_META_TORCH = frozenset({"empty_like", "zeros_like", "ones_like"})

NORMED, PAIR = "normed", "pair"  # a name bound to the norm's output / to (output, residual sum)
_MISSING = object()  # ``self.x`` where the module has no ``x``


@dataclass(frozen=True)
class NormReaders:
    """A norm child's readers: the paths (relative to the layer) of the linears that read its output, in the
    order the forward first reads them, or why it cannot fold (``readers`` then empty)."""

    norm: str
    readers: tuple[str, ...]
    reason: str | None


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decoder_layers(model: nn.Module, is_norm: Callable[[nn.Module], bool]
                   ) -> Iterator[tuple[str, nn.Module, list[str]]]:
    """(path, layer, its norm children's names) for every item of an ``nn.ModuleList`` with a norm child: the
    repeated blocks of a decoder, whatever their class (vLLM's ``make_layers`` and Hugging Face's
    ``model.layers`` both hold them so). A model's final norm is not in one."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        for index, layer in enumerate(module):
            norms = [child for child, m in layer.named_children() if is_norm(m)]
            if norms:
                yield f"{name}.{index}" if name else str(index), layer, norms


def norm_readers(layer: nn.Module, norms: Iterable[str], is_linear: Callable[[nn.Module], bool],
                 is_norm: Callable[[nn.Module], bool]) -> dict[str, NormReaders]:
    """For each named norm child of ``layer``: the linears that read its output and nothing else, or the
    reason (``is_linear``: where the analysis stops and takes a reader; ``is_norm``: a reader that refuses)."""
    paths = {id(m): p for p, m in layer.named_modules()}
    found = {}
    for name in norms:
        norm = getattr(layer, name)
        analysis = _Analysis(layer, norm, paths, is_linear, is_norm)
        try:
            analysis.run()
            if not analysis.called:
                raise _Refused(f"{NOT_CALLED} ({type(layer).__name__}.forward never calls {name})")
            if not analysis.readers:
                raise _Refused(f"{NO_READER} ({type(layer).__name__}.{name})")
            found[name] = NormReaders(name, tuple(analysis.readers), None)
        except _Refused as refused:
            found[name] = NormReaders(name, (), refused.reason)
    return found


@functools.lru_cache(maxsize=512)
def _parse(code: Any) -> ast.FunctionDef | None:
    """The ``def`` of a function's code object, or None where its source is not there."""
    try:
        source = textwrap.dedent(inspect.getsource(code))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _text(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _function_of(callable_: Any) -> tuple[Any, nn.Module] | None:
    """(plain function, the module bound as its self) of a bound method of a module, else None."""
    if inspect.ismethod(callable_) and isinstance(callable_.__self__, nn.Module):
        return inspect.unwrap(callable_.__func__), callable_.__self__
    return None


class _Analysis:
    """One norm's dataflow through its layer's forward and the forwards it reaches."""

    def __init__(self, layer: nn.Module, norm: nn.Module, paths: dict[int, str],
                 is_linear: Callable[[nn.Module], bool], is_norm: Callable[[nn.Module], bool]) -> None:
        self.layer, self.norm, self.paths = layer, norm, paths
        self.is_linear, self.is_norm = is_linear, is_norm
        self.readers: list[str] = []
        self.called = False

    def run(self) -> None:
        bound = _function_of(self.layer.forward)
        if bound is None:
            raise _Refused(f"{NOT_PROVEN} ({type(self.layer).__name__}.forward is not a method)")
        self._function(bound[0], bound[1], {}, depth=0, top=True)

    # ------------------------------------------------------------------ functions and statements

    def _function(self, func: Any, module: nn.Module, state: dict[str, str], depth: int, top: bool = False) -> None:
        where = getattr(func, "__qualname__", type(module).__name__ + ".forward")
        node = _parse(getattr(func, "__code__", None))
        if node is None:
            raise _Refused(f"{NO_SOURCE} ({where})")
        args = node.args.posonlyargs + node.args.args
        if not args:
            raise _Refused(f"{NOT_PROVEN} ({where} takes no self)")
        frame = _Frame(self, module, args[0].arg, func, where, depth, top)
        frame.block(node.body, state)

    def reader(self, module: nn.Module, frame: _Frame, call: ast.Call, passed: list[tuple[str, Any]]) -> None:
        """A submodule called with the norm's output (``passed``: (parameter or position, ast node))."""
        if module is self.norm or self.is_norm(module):
            raise _Refused(f"{READ_BY_NORM} ({_text(call)} in {frame.where})")
        if self.is_linear(module):
            path = self.paths.get(id(module))
            if path is None:
                raise _Refused(f"{NOT_PROVEN} ({_text(call)} in {frame.where}: not a submodule of the layer)")
            if [p for p, _ in passed] != [0]:
                raise _Refused(f"{OTHER_READER} ({_text(call)} in {frame.where}: not the linear's input)")
            if path not in self.readers:
                self.readers.append(path)
            return
        bound = _function_of(module.forward)
        if bound is None:
            raise _Refused(f"{NO_SOURCE} ({type(module).__name__}.forward)")
        self.follow(bound[0], bound[1], frame, call, passed)

    def follow(self, func: Any, module: nn.Module, frame: _Frame, call: ast.Call,
               passed: list[tuple[str | int, Any]]) -> None:
        """Into ``func`` (self = ``module``) with the norm's output bound to the parameters it was passed as."""
        if frame.depth + 1 > MAX_DEPTH:
            raise _Refused(f"{NOT_PROVEN} ({_text(call)} in {frame.where}: deeper than {MAX_DEPTH} forwards)")
        try:
            params = list(inspect.signature(func).parameters.values())[1:]
        except (TypeError, ValueError):
            raise _Refused(f"{NO_SOURCE} ({getattr(func, '__qualname__', func)!r})") from None
        state = {}
        for key, _ in passed:
            if isinstance(key, int):
                param = params[key] if key < len(params) else None
                if param is not None and param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
                    param = None
            else:
                param = next((p for p in params if p.name == key and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                 p.KEYWORD_ONLY)), None)
            if param is None:
                raise _Refused(f"{NOT_PROVEN} ({_text(call)} in {frame.where}: goes to *args or **kwargs)")
            state[param.name] = NORMED
        self._function(func, module, state, frame.depth + 1)


class _Frame:
    """One function being analysed: its module (bound to ``self_name``), its names' taint."""

    def __init__(self, analysis: _Analysis, module: nn.Module, self_name: str, func: Any, where: str, depth: int,
                 top: bool) -> None:
        self.a, self.module, self.self_name, self.func = analysis, module, self_name, func
        self.where, self.depth, self.top = where, depth, top

    def refuse(self, kind: str, node: ast.AST, extra: str = "") -> None:
        raise _Refused(f"{kind} ({_text(node)} in {self.where}{extra})")

    # ------------------------------------------------------------------ what an expression is

    def resolve(self, node: ast.AST) -> Any:
        """The object ``self.a.b`` names on the module now (:data:`_MISSING` where it has none), or None where
        the expression is anything else."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id == self.self_name) or not attrs:
            return None
        obj: Any = self.module
        for attr in reversed(attrs):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                return _MISSING
        return obj

    def is_norm_call(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and self.resolve(node.func) is self.a.norm

    def taint(self, node: ast.AST, state: dict[str, str]) -> str | None:
        """NORMED / PAIR where ``node`` evaluates to the norm's output / (output, residual sum), else None."""
        if isinstance(node, ast.Name):
            return state.get(node.id)
        if self.is_norm_call(node):
            assert isinstance(node, ast.Call)
            return PAIR if len(node.args) + len(node.keywords) > 1 else NORMED
        if isinstance(node, ast.Subscript) and self.taint(node.value, state) == PAIR:
            if isinstance(node.slice, ast.Constant) and node.slice.value == 0:
                return NORMED
            if isinstance(node.slice, ast.Constant) and node.slice.value == 1:
                return None
            self.refuse(NOT_PROVEN, node)
        return None

    def constant(self, node: ast.AST) -> Any:
        """The value of an ``if`` test made of constants and plain attributes of the module, else ... ."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Attribute):
            root = node
            while isinstance(root, ast.Attribute):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id == self.self_name):
                return ...  # an attribute of something else than the module: its value is not known here
            value = self.resolve(node)
            return value if value is None or isinstance(value, (bool, int, float, str)) else ...
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value = self.constant(node.operand)
            return ... if value is ... else not value
        if isinstance(node, ast.BoolOp):
            for value_node in node.values:
                value = self.constant(value_node)
                if value is ...:
                    return ...
                if bool(value) == isinstance(node.op, ast.Or):
                    return value
            return value
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = self.constant(node.left), self.constant(node.comparators[0])
            if left is ... or right is ...:
                return ...
            compare = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Is: lambda a, b: a is b,
                   ast.IsNot: lambda a, b: a is not b}
            op = compare.get(type(node.ops[0]))
            return ... if op is None else op(left, right)
        return ...

    # ------------------------------------------------------------------ reads

    def mentions(self, node: ast.AST, state: dict[str, str]) -> bool:
        """Whether ``node`` holds a read of a tracked name or a call of the norm anywhere."""
        return any((isinstance(n, ast.Name) and n.id in state) or (isinstance(n, ast.Attribute) and self.resolve(n)
                   is self.a.norm) for n in ast.walk(node))

    def expr(self, node: ast.AST, state: dict[str, str]) -> None:
        """Classify every read of the norm's output in ``node``: readers recorded, the rest refused."""
        if self.is_norm_call(node):  # its output goes where no name tracks it (a tuple, an expression ...)
            self.refuse(NOT_PROVEN, node, ": the output not bound to a name or passed to a call")
        if isinstance(node, ast.Call):
            self.call(node, state)
        elif isinstance(node, ast.Name):
            if node.id in state:
                self.refuse(OTHER_READER, node)
        elif isinstance(node, ast.Attribute):
            if self.taint(node.value, state) == NORMED and node.attr in _META_ATTRS:
                return
            if self.resolve(node) is self.a.norm:  # the norm taken as a value: its calls out of sight
                self.refuse(NOT_PROVEN, node, ": the norm used, not called")
            self.expr(node.value, state)
        elif isinstance(node, ast.BinOp) and any(self.taint(s, state) for s in (node.left, node.right)):
            self.refuse(RESIDUAL_ADD if isinstance(node.op, ast.Add) else OTHER_READER, node)
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)) \
                and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None \
                and self.taint(node.left, state):
            return
        elif self.taint(node, state):
            self.refuse(OTHER_READER, node)
        else:
            for child in ast.iter_child_nodes(node):
                self.expr(child, state)

    def call(self, node: ast.Call, state: dict[str, str]) -> None:
        if self.is_norm_call(node):
            if not self.top:
                self.refuse(NOT_PROVEN, node, ": the norm called outside its layer's forward")
            self.a.called = True
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if self.taint(arg, state):
                    self.refuse(READ_BY_NORM, node)
                self.expr(arg, state)
            return
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _META_METHODS and self.taint(func.value, state) == NORMED:
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                self.expr(arg, state)
            return
        if self._meta_function(func) and node.args and self.taint(node.args[0], state) == NORMED:
            for arg in [*node.args[1:], *(k.value for k in node.keywords)]:
                self.expr(arg, state)
            return
        passed: list[tuple[str | int, Any]] = []
        starred = False
        for i, arg in enumerate(node.args):
            if isinstance(arg, ast.Starred):
                if self.mentions(arg, state):
                    self.refuse(NOT_PROVEN, node, ": the value goes through *args")
                starred = True
            elif self.taint(arg, state) == NORMED:
                if starred:  # its position is not known
                    self.refuse(NOT_PROVEN, node, ": the value after *args")
                passed.append((i, arg))
            else:
                self.expr(arg, state)
        for keyword in node.keywords:
            if keyword.arg is None:
                if self.mentions(keyword.value, state):
                    self.refuse(NOT_PROVEN, node, ": the value goes through **kwargs")
            elif self.taint(keyword.value, state) == NORMED:
                passed.append((keyword.arg, keyword.value))
            else:
                self.expr(keyword.value, state)
        for _, arg in passed:
            if self.is_norm_call(arg):  # norm(x) passed straight on
                self.call(arg, state)  # type: ignore[arg-type]
        if any(self.taint(a, state) == PAIR for a in [*node.args, *(k.value for k in node.keywords)]):
            self.refuse(NOT_PROVEN, node, ": the (output, residual) pair passed whole")
        if not passed:
            self.expr(func, state)
            return
        target = self.resolve(func)
        if isinstance(target, nn.Module):
            self.a.reader(target, self, node, passed)
            return
        bound = _function_of(target)
        if bound is not None:
            self.a.follow(bound[0], bound[1], self, node, passed)
            return
        if target is _MISSING:
            self.refuse(NOT_PROVEN, node, ": names nothing on the module")
        self.refuse(OTHER_READER, node)

    def _meta_function(self, func: ast.AST) -> bool:
        if isinstance(func, ast.Name) and func.id == "len":
            return True
        if isinstance(func, ast.Attribute) and func.attr in _META_TORCH and isinstance(func.value, ast.Name):
            import torch

            return getattr(self.func, "__globals__", {}).get(func.value.id) is torch
        return False

    # ------------------------------------------------------------------ statements

    def block(self, body: list[ast.stmt], state: dict[str, str]) -> dict[str, str]:
        for stmt in body:
            state = self.stmt(stmt, state)
        return state

    def bind(self, target: ast.AST, taint: str | None, state: dict[str, str], node: ast.AST) -> None:
        if isinstance(target, ast.Name):
            if taint is None:
                state.pop(target.id, None)
            else:
                state[target.id] = taint
        elif isinstance(target, (ast.Tuple, ast.List)):
            if taint == NORMED or any(isinstance(e, ast.Starred) for e in target.elts):
                self.refuse(NOT_PROVEN, node)
            for i, element in enumerate(target.elts):
                self.bind(element, NORMED if taint == PAIR and i == 0 else None, state, node)
        else:  # an attribute or an item of another object
            if taint is not None:
                self.refuse(NOT_PROVEN, node, ": stored on an object")
            self.expr(target, state)

    def stmt(self, node: ast.stmt, state: dict[str, str]) -> dict[str, str]:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if value is None:
                return state
            if (len(targets) == 1 and isinstance(targets[0], ast.Tuple) and isinstance(value, ast.Tuple)
                    and len(targets[0].elts) == len(value.elts)
                    and not any(isinstance(e, ast.Starred) for e in [*targets[0].elts, *value.elts])):
                # a, b = x, y: each pair as its own assignment, every value read before any name is bound
                taints = [self.taint(v, state) for v in value.elts]
                for v, taint in zip(value.elts, taints, strict=True):
                    if taint is not None and self.is_norm_call(v):
                        self.call(v, state)  # type: ignore[arg-type]
                    elif taint is None:
                        self.expr(v, state)
                for target, taint in zip(targets[0].elts, taints, strict=True):
                    self.bind(target, taint, state, node)
                return state
            taint = self.taint(value, state)
            if taint is not None and self.is_norm_call(value):
                self.call(value, state)  # type: ignore[arg-type]
            elif taint is None:
                self.expr(value, state)
            for target in targets:
                self.bind(target, taint, state, node)
            return state
        if isinstance(node, ast.AugAssign):
            if self.taint(node.target, state):
                self.refuse(OTHER_READER, node, ": written in place")
            if self.taint(node.value, state):
                self.refuse(RESIDUAL_ADD if isinstance(node.op, ast.Add) else OTHER_READER, node)
            self.expr(node.value, state)
            self.bind(node.target, None, state, node)
            return state
        if isinstance(node, ast.Return):
            if node.value is not None:
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                if any(self.taint(v, state) for v in values):
                    self.refuse(RETURNED, node)
                self.expr(node.value, state)
            return state
        if isinstance(node, ast.If):
            test = self.constant(node.test)
            if test is not ...:
                return self.block(node.body if test else node.orelse, state)
            self.expr(node.test, state)
            left, right = self.block(node.body, dict(state)), self.block(node.orelse, dict(state))
            for name in set(left) & set(right):
                if left[name] != right[name]:
                    self.refuse(NOT_PROVEN, node.test, f": {name} differs between the branches")
            return {**left, **right}
        if isinstance(node, (ast.Expr, ast.Assert, ast.Raise)):
            for child in ast.iter_child_nodes(node):
                self.expr(child, state)
            return state
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                self.expr(item.context_expr, state)
            return self.block(node.body, state)
        if isinstance(node, ast.Delete):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    state.pop(target.id, None)
            return state
        if isinstance(node, (ast.Pass, ast.Break, ast.Continue, ast.Import, ast.ImportFrom, ast.Global,
                             ast.Nonlocal)):
            return state
        # loops, try, match, nested definitions: followed only where they touch neither the norm nor its output
        if self.mentions(node, state):
            self.refuse(NOT_PROVEN, node, f": in a {type(node).__name__.lower()} statement")
        return state
