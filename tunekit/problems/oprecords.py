"""One record per op: everything tunekit knows about an op, found by its name in one place.

An :class:`OpRecord` says what an op is and where each of its parts lives:
its problem spec (``OpSpec``: inputs, fp64 reference, error bound, bytes
moved), its search-space file, its kernel per backend, the eager
composition the vendor baseline times, its ``torch.ops.tunekit`` schema
with the run-time and fake impls that serve it, its stock composition (what
a compile pass puts back where no table serves), and the vLLM plugin's hook
that routes vLLM's layers to it. Code is named by ``"module:ATTR"`` strings
and imported only when used (:func:`resolve`), as a plug-in backend is, so
this module imports no torch (only the pure-Python ``layouts``: what an
op's (n, k) mean) and sits at the bottom of the layers; every other
registry of ops reads it:

* ``problems.shapes``: the op groups (``ELEMENTWISE_OPS``, ``FUSED_GEMV_OPS``
  ...), ``OP_FAMILIES`` (``--ops``) and ``MODEL_OPS`` are derived from here;
* ``problems.opspec``: ``get(op)`` imports the record's spec;
* ``search_spaces.load``: the record's space file;
* ``backends.triton`` / ``backends.hip_elementwise`` / ``backends.vendor`` /
  ``backends.inductor``: the record's kernel module, HIP source, vendor
  composition;
* ``dispatch.registry``: defines ``torch.ops.tunekit.<op>`` for each record
  with a schema, from its impl and fake; ``tunekit.ops`` gives the stock
  compositions to the integrations;
* ``integrations.vllm.custom_ops``: the ops of each CustomOp hook.

Adding an op is its files (spec, kernel per backend, search space, serving
impl) plus one record: :func:`register` (a third party or a test, at run
time) or a line of :data:`RECORDS` (built in). :func:`registered` is the
same as a context manager that takes the record back out.

Names that say what comes first: an op's name lists its steps in the order
they run, the GEMV named ``gemv``. ``rms_norm_gemv`` is the RMSNorm (its own
weight, not folded) in the prologue of the GEMV that reads it; ``rms_gemv``
the unweighted x / rms(x) before a GEMV whose weight holds the norm's
(folded); ``silu_mul_gemv`` SiLU-and-mul in the prologue of the GEMV that
reads it (down_proj); ``gemv_silu_mul`` SiLU-and-mul in the epilogue of the
GEMV that makes gate and up (gate_up_proj); ``gemv_add`` the residual add in
a GEMV's epilogue.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tunekit.problems.layouts import LAYOUTS, Layout

#: What a problem's (n, k) mean, per kind (``tunekit.problems.shapes.Problem``).
KINDS = ("gemv", "elementwise", "fused_gemv", "serving")


@dataclass(frozen=True)
class OpRecord:
    """Everything tunekit knows about one op (see the module docstring)."""

    name: str
    #: "gemv" (the plain GEMV), "elementwise" (norms and pointwise ops: one row per token), "fused_gemv" (an
    #: elementwise step fused into a GEMV; n, k the GEMV's) or "serving" (served as an op, tabulated under
    #: other ops' entries: no spec, no kernels of its own)
    kind: str
    #: the group the op belongs to (``shapes``' tuples: "norm", "norm_gemv", "glu_gemv" ...)
    group: str
    #: ``"module:ATTR"`` of its ``OpSpec`` (None: a "serving" op)
    spec: str | None = None
    #: its search-space file: a stem of ``search_spaces/`` (ops of one kernel share it), or a path to a
    #: ``.toml`` (a plug-in op's)
    space: str | None = None
    #: backend -> its kernel: ``kernels_triton`` module (``triton``), ``kernels_hip`` source stem (``hip``)
    kernels: Mapping[str, str] = field(default_factory=dict)
    #: ``"module:ATTR"`` of the eager composition the ``vendor`` baseline times (``fn(inputs, out)``)
    vendor: str | None = None
    #: ``torch.library`` schema of ``torch.ops.tunekit.<name>`` (None: tabulated and tuned, not an op)
    schema: str | None = None
    #: ``"module:ATTR"`` of the run-time impl and of the fake impl that serve the op
    impl: str | None = None
    fake: str | None = None
    #: ``"module:ATTR"`` of the stock composition, called as the op is: what a compile pass splices in
    #: where no table serves (``tunekit.integrations.vllm.graph_routes``)
    stock: str | None = None
    #: the vLLM plugin's hook that routes vLLM's layers to the op (``tunekit.integrations.vllm.plugin``)
    vllm_hook: str | None = None
    #: the ``--ops`` names that select it (``shapes.OP_FAMILIES``)
    selected_by: tuple[str, ...] = ()
    #: tuned by ``tunekit search --model`` unless ``--ops`` narrows it (``shapes.MODEL_OPS``)
    default_search: bool = False
    #: a norm's gain is its weight plus this (Gemma's zero-centred weights: y = x / rms * (1 + w))
    gain_offset: float = 0.0
    #: the op that adds the residual first, then runs this norm (``fused_add_rms_norm`` for ``rms_norm``); set
    #: on the plain norms a fold can take into the GEMVs that read them
    with_residual: str | None = None
    #: what its problems' (n, k) mean (``tunekit.problems.layouts``): by default "matrix" for a GEMV kind,
    #: "row" for an elementwise one; None for a "serving" op
    layout: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"op {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        object.__setattr__(self, "kernels", MappingProxyType(dict(self.kernels)))
        if self.layout is None and self.kind != "serving":
            object.__setattr__(self, "layout", "row" if self.kind == "elementwise" else "matrix")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"op {self.name!r}: layout {self.layout!r} is not one of {tuple(LAYOUTS)}")

    @property
    def tabulated(self) -> bool:
        """Whether table entries and search problems name this op (it has a spec)."""
        return self.spec is not None


_GEMV = "tunekit.problems.opspec_gemv"
_EW = "tunekit.problems.opspec_elementwise"
_VENDOR = "tunekit.backends.vendor"
_D_GEMV = "tunekit.dispatch.gemv"
_D_FUSED = "tunekit.dispatch.fused_gemv"
_D_EW = "tunekit.dispatch.elementwise"
_NORM_SCHEMA = "{}(Tensor x, Tensor weight, float eps) -> Tensor"
_FUSED_ADD_SCHEMA = "{}(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)"


def _norm(name: str, *, fused_add: bool, gemma: bool) -> OpRecord:
    """A norm of the four conventions: one kernel per residual form, the weight convention in the name."""
    stem = "fused_add_rms_norm" if fused_add else "rms_norm"
    return OpRecord(
        name, "elementwise", "norm", spec=f"{_EW}:{name.upper()}", space=stem,
        kernels={"triton": f"kernels_triton.{stem}", "hip": stem}, vendor=f"{_VENDOR}:{name}",
        schema=(_FUSED_ADD_SCHEMA if fused_add else _NORM_SCHEMA).format(name),
        impl=f"{_D_EW}:{name}_impl", fake=f"{_D_EW}:{'fake_pair' if fused_add else 'fake_like'}",
        stock=f"{_D_EW}:stock_{name}", vllm_hook="GemmaRMSNorm" if gemma else "RMSNorm",
        selected_by=((stem, f"gemma_{stem}") if gemma else (stem,)), default_search=True,
        gain_offset=1.0 if gemma else 0.0,
        with_residual=None if fused_add else ("gemma_" if gemma else "") + "fused_add_rms_norm")


def _norm_gemv(norm: str) -> OpRecord:
    """A norm (with its own weight) in the prologue of the GEMV that reads it: tunekit chain only."""
    return OpRecord(
        f"{norm}_gemv", "fused_gemv", "norm_gemv", spec=f"{_GEMV}:NORM_GEMVS[{norm}_gemv]", space="rms_norm_gemv",
        kernels={"triton": "kernels_triton.rms_norm_gemv"}, vendor=f"{_VENDOR}:{norm}_gemv_unfused",
        selected_by=("rms_norm_gemv", "fused_gemv"))


_BUILTIN: tuple[OpRecord, ...] = (
    OpRecord("gemv", "gemv", "gemv", spec=f"{_GEMV}:GEMV", space="gemv",
             kernels={"triton": "kernels_triton.gemv", "hip": "gemv"}, vendor=f"{_VENDOR}:mm",
             schema="gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
             impl=f"{_D_GEMV}:gemv_impl", fake=f"{_D_GEMV}:gemv_fake", stock="torch.nn.functional:linear",
             vllm_hook="linear", selected_by=("gemv",), default_search=True),
    _norm("rms_norm", fused_add=False, gemma=False),
    _norm("gemma_rms_norm", fused_add=False, gemma=True),
    _norm("fused_add_rms_norm", fused_add=True, gemma=False),
    _norm("gemma_fused_add_rms_norm", fused_add=True, gemma=True),
    OpRecord("gated_rms_norm", "elementwise", "gated_norm", spec=f"{_EW}:GATED_RMS_NORM", space="gated_rms_norm",
             kernels={"triton": "kernels_triton.gated_rms_norm", "hip": "gated_rms_norm"},
             vendor=f"{_VENDOR}:gated_rms_norm", layout="groups",
             schema="gated_rms_norm(Tensor x, Tensor z, Tensor weight, float eps) -> Tensor",
             impl=f"{_D_EW}:gated_rms_norm_impl", fake=f"{_D_EW}:fake_like", stock=f"{_D_EW}:stock_gated_rms_norm",
             vllm_hook="RMSNormGated", selected_by=("gated_rms_norm",), default_search=True),
    OpRecord("silu_and_mul", "elementwise", "pointwise", spec=f"{_EW}:SILU_AND_MUL", space="silu_and_mul",
             kernels={"triton": "kernels_triton.silu_and_mul", "hip": "silu_and_mul"},
             vendor=f"{_VENDOR}:silu_and_mul", layout="glu", schema="silu_and_mul(Tensor x) -> Tensor",
             impl=f"{_D_EW}:silu_and_mul_impl", fake=f"{_D_EW}:fake_silu_and_mul",
             stock=f"{_D_EW}:stock_silu_and_mul", vllm_hook="SiluAndMul", selected_by=("silu_and_mul",),
             default_search=True),
    OpRecord("bias_gelu", "elementwise", "pointwise", spec=f"{_EW}:BIAS_GELU", space="bias_gelu",
             kernels={"triton": "kernels_triton.bias_gelu", "hip": "bias_gelu"}, vendor=f"{_VENDOR}:bias_gelu",
             schema="bias_gelu(Tensor x, Tensor bias) -> Tensor", impl=f"{_D_EW}:bias_gelu_impl",
             fake=f"{_D_EW}:fake_like", stock=f"{_D_EW}:stock_bias_gelu", selected_by=("bias_gelu",),
             default_search=True),
    _norm_gemv("rms_norm"),
    _norm_gemv("gemma_rms_norm"),
    _norm_gemv("fused_add_rms_norm"),
    _norm_gemv("gemma_fused_add_rms_norm"),
    OpRecord("silu_mul_gemv", "fused_gemv", "act_gemv", spec=f"{_GEMV}:SILU_MUL_GEMV", space="silu_mul_gemv",
             kernels={"triton": "kernels_triton.silu_mul_gemv"}, vendor=f"{_VENDOR}:silu_and_mul_then_mm",
             selected_by=("silu_mul_gemv", "fused_gemv")),
    OpRecord("rms_gemv", "fused_gemv", "rms_gemv", spec=f"{_GEMV}:RMS_GEMV", space="rms_gemv",
             kernels={"triton": "kernels_triton.gemv"}, vendor=f"{_VENDOR}:rms_norm_then_mm",
             schema="rms_gemv(Tensor x, Tensor weight, float eps) -> Tensor", impl=f"{_D_FUSED}:rms_gemv_impl",
             fake=f"{_D_FUSED}:fake_gemv_shaped", stock=f"{_D_FUSED}:stock_rms_gemv", vllm_hook="fold_norms",
             selected_by=("rms_gemv", "fused_gemv"), default_search=True),
    OpRecord("gemv_add", "fused_gemv", "gemv_add", spec=f"{_GEMV}:GEMV_ADD", space="gemv",
             kernels={"triton": "kernels_triton.gemv"}, vendor=f"{_VENDOR}:addmm",
             schema="gemv_add(Tensor x, Tensor weight, Tensor residual) -> Tensor", impl=f"{_D_FUSED}:gemv_add_impl",
             fake=f"{_D_FUSED}:fake_gemv_shaped", stock=f"{_D_FUSED}:stock_gemv_add", vllm_hook="compile_ranges",
             selected_by=("gemv_add", "fused_gemv"), default_search=True),
    OpRecord("gemv_silu_mul", "fused_gemv", "glu_gemv", spec=f"{_GEMV}:GLU_GEMVS[gemv_silu_mul]",
             space="gemv_silu_mul", kernels={"triton": "kernels_triton.gemv"},
             vendor=f"{_VENDOR}:mm_then_silu_and_mul", selected_by=("gemv_silu_mul", "fused_gemv")),
    OpRecord("rms_gemv_silu_mul", "fused_gemv", "glu_gemv", spec=f"{_GEMV}:GLU_GEMVS[rms_gemv_silu_mul]",
             space="gemv_silu_mul", kernels={"triton": "kernels_triton.gemv"},
             vendor=f"{_VENDOR}:rms_norm_then_mm_then_silu_and_mul", selected_by=("gemv_silu_mul", "fused_gemv")),
    # GEMVs of linears that read the same x, as one launch of the joined rows' gemv / rms_gemv entry
    OpRecord("sibling_gemv", "serving", "sibling_gemv",
             schema="sibling_gemv(Tensor x, Tensor[] weights, float? eps) -> Tensor",
             impl=f"{_D_FUSED}:sibling_gemv_impl", fake=f"{_D_FUSED}:fake_sibling_gemv", vllm_hook="merge_siblings"),
)

#: Every op by name, built-in first, then those :func:`register` added, in that order.
RECORDS: dict[str, OpRecord] = {record.name: record for record in _BUILTIN}


def get(op: str) -> OpRecord:
    """The record of ``op``; ``KeyError`` naming the known ops for an unknown one."""
    try:
        return RECORDS[op]
    except KeyError:
        raise KeyError(f"unknown op {op!r} (known: {', '.join(RECORDS)})") from None


def names(*, kind: str | None = None, group: str | None = None, tabulated: bool | None = None,
          served: bool | None = None, backend: str | None = None, hook: str | None = None) -> tuple[str, ...]:
    """The ops (in :data:`RECORDS`' order) of a ``kind``, a ``group``, tabulated or not, served as a
    ``torch.ops.tunekit`` op or not, with a kernel on ``backend``, routed by the vLLM ``hook``."""
    return tuple(r.name for r in RECORDS.values()
                 if (kind is None or r.kind == kind) and (group is None or r.group == group)
                 and (tabulated is None or r.tabulated == tabulated)
                 and (served is None or (r.schema is not None) == served)
                 and (backend is None or backend in r.kernels) and (hook is None or r.vllm_hook == hook))


def kernel(op: str, backend: str) -> str | None:
    """Where ``backend``'s kernel of ``op`` lives (see :attr:`OpRecord.kernels`), or None."""
    record = RECORDS.get(op)
    return None if record is None else record.kernels.get(backend)


def layout(op: str) -> Layout:
    """What ``op``'s (n, k) mean (:mod:`tunekit.problems.layouts`); ``KeyError`` for an unknown op or a
    "serving" one (it has no problems of its own)."""
    name = get(op).layout
    if name is None:
        raise KeyError(f"op {op!r} is served under other ops' entries: its problems have no layout")
    return LAYOUTS[name]


def resolve(target: str) -> Any:
    """The object a ``"module:ATTR"`` string names (``"module:DICT[key]"``: an item of a dict), imported now."""
    module_name, _, attr = target.partition(":")
    key = None
    if attr.endswith("]") and "[" in attr:
        attr, key = attr[:-1].split("[", 1)
    obj = getattr(importlib.import_module(module_name), attr)
    return obj if key is None else obj[key]


def register(record: OpRecord) -> OpRecord:
    """Add an op (a plug-in's, a test's): every registry reads it from now on. ``ValueError`` if the name is
    taken. Serving it as ``torch.ops.tunekit.<name>`` takes ``tunekit.ops.register()`` after this."""
    if record.name in RECORDS:
        raise ValueError(f"op {record.name!r} is already registered")
    RECORDS[record.name] = record
    return record


def unregister(name: str) -> None:
    """Take a registered op back out (a built-in one cannot be)."""
    if any(r.name == name for r in _BUILTIN):
        raise ValueError(f"op {name!r} is built in")
    RECORDS.pop(name, None)


@contextlib.contextmanager
def registered(record: OpRecord) -> Iterator[OpRecord]:
    """:func:`register` for the duration of a ``with`` block (tests)."""
    register(record)
    try:
        yield record
    finally:
        unregister(record.name)
