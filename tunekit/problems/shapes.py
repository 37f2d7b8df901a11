"""Model spec x TP x M list -> the per-token problems tunekit tunes.

A ``Problem`` is one distinct (op, dtype, m, n, k); ``count`` is how many times
per decoded token the model executes it (layers sharing a shape are merged, as
out_proj and o_proj of Qwen3.5 are: both 5120x6144).

Ops: ``gemv``, the fused elementwise decode ops (``ELEMENTWISE_OPS``) and the
fused GEMV families (``FUSED_GEMV_OPS``). The weight convention of a norm is
part of the op name (``gemma_rms_norm``: y = x/rms * (1 + w), ``rms_norm``:
y = x/rms * w), so ``Problem.key`` keeps its form ``op|dtype|mM|nN|kK`` and
stays unique. What n and k mean per op is in the ``Problem`` docstring. What a
model's search tunes by default: ``MODEL_OPS`` at ``MODEL_M``
(``search_selection``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tunekit.errors import UserError
from tunekit.problems import oprecords

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

#: Largest decode batch the GEMV kernels take (MAX_M of gemv.hip, the "rows" accumulators and the one MMA
#: tile of kernels_triton/gemv.py): decode batches and speculative decoding's verify steps (M = 1 + k).
GEMV_MAX_M = 16
#: Largest M the elementwise ops take: prefill-sized chunks (4096) with headroom.
ELEMENTWISE_MAX_M = 65536

#: The op groups below are read from the op records (``tunekit.problems.oprecords``: one record per op,
#: in its order), so a registered op joins its kind's group. Hidden-size norms: n = k = the normalised
#: row length.
NORM_OPS = oprecords.names(group="norm")
ELEMENTWISE_OPS = oprecords.names(kind="elementwise")
OPS = ("gemv",) + ELEMENTWISE_OPS
#: RMSNorm in the GEMV prologue (kernels_triton/rms_norm_gemv.py): n, k are the GEMV's, the
#: norm width is k. Opt-in (``--ops rms_norm_gemv``, ``--shape OP:NxK``) and in no default op set:
#: nothing serves them, so a default search must not tune them.
NORM_GEMV_OPS = oprecords.names(group="norm_gemv")
#: SiLU-and-mul in the GEMV prologue (kernels_triton/silu_mul_gemv.py): act_fn -> down_proj; n, k
#: are the GEMV's (the input gate_up is [m, 2k]). Opt-in as the norm family.
ACT_GEMV_OPS = oprecords.names(group="act_gemv")
#: The residual add in the GEMV epilogue (kernels_triton/gemv.py, ``residual=``): o_proj /
#: out_proj / down_proj -> the residual stream; n, k are the GEMV's. Served (``SERVED_FUSED_OPS``).
GEMV_ADD_OPS = oprecords.names(group="gemv_add")
#: The GEMV of an RMSNorm whose weight is folded into W (kernels_triton/gemv.py, ``rms_eps=``):
#: y = (x / rms(x)) @ W'^T for every consumer of a norm; n, k are the GEMV's. Served (``SERVED_FUSED_OPS``).
RMS_GEMV_OPS = oprecords.names(group="rms_gemv")
#: SiLU-and-mul in gate_up_proj's epilogue (kernels_triton/gemv.py, ``glu=``): W's rows are
#: (gate, up) pairs, y[m, n / 2] = silu(x W_gate^T) * (x W_up^T); the ``rms_`` form also
#: scales by 1/rms (a folded norm before it). n, k are gate_up's. Opt-in as the norm family.
GLU_GEMV_OPS = oprecords.names(group="glu_gemv")
#: Every op that fuses an elementwise step into a GEMV, before or after it (the problem's n, k
#: are the GEMV's).
FUSED_GEMV_OPS = oprecords.names(kind="fused_gemv")
#: The fused GEMV families the vLLM plugin serves: ``rms_gemv`` for the consumers of a folded norm
#: (``integrations.vllm.fold``; a folded sibling group's ``sibling_gemv`` is one launch of the joined
#: rows' ``rms_gemv`` entry, which ``ModelSpec.rms_gemvs`` lists), ``gemv_add`` where the compile pass
#: moves a residual add into the GEMV (``integrations.vllm.graph_routes``). The others are used by
#: ``tunekit chain`` only.
SERVED_FUSED_OPS = oprecords.names(kind="fused_gemv", served=True)
#: What ``tunekit search --model/--config`` tunes unless ``--ops`` narrows it: every op the model
#: runs and the fused families serving uses, so the default search yields the default served table.
MODEL_OPS = tuple(r.name for r in oprecords.RECORDS.values() if r.default_search)
#: ... at these M unless ``--m`` narrows it: the small decode batches vLLM captures as CUDA graphs, and 16,
#: the top of the GEMV kernels' 1..16 (speculative decoding's verify steps run M = 1 + k draft tokens). A
#: call between two of them is served by the next one above whose config runs at its M (docs/serving.md).
MODEL_M = (1, 2, 4, 8, 16)
#: ``--ops`` names -> the ops they select (a family selects both weight conventions;
#: the model's norm style decides which one its problems use; ``fused_gemv``: every fused family).
OP_FAMILIES: dict[str, tuple[str, ...]] = {}
for _record in oprecords.RECORDS.values():
    for _family in _record.selected_by:
        OP_FAMILIES[_family] = OP_FAMILIES.get(_family, ()) + (_record.name,)
del _record, _family


@dataclass(frozen=True, order=True)
class Problem:
    """One distinct per-token problem.

    What n and k mean, per op (activations are [m, ...] rows, one per token):

    * ``gemv``: y[m, n] = x[m, k] @ W[n, k]^T, W in ``dtype``;
    * ``rms_norm`` / ``gemma_rms_norm``: y[m, n] = x / rms(x) * w (gemma: * (1 + w)),
      w[n]; k = n (the normalised length);
    * ``fused_add_rms_norm`` / ``gemma_...``: s = x + residual, then the same norm of
      s; outputs y[m, n] and the updated residual s[m, n]; k = n;
    * ``gated_rms_norm``: x, z, y [m, n]; each group of k elements normalised on its
      own, y = x / rms_group(x) * w * silu(z), w[k] shared by the n / k groups
      (vLLM RMSNormGated, norm_before_gate=True);
    * ``silu_and_mul``: x[m, k] with k = 2n -> y[m, n] = silu(x[:, :n]) * x[:, n:];
    * ``bias_gelu``: y[m, n] = gelu_tanh(x[m, n] + b[n]); k = n;
    * ``FUSED_GEMV_OPS``: the GEMV's n, k; the norm family normalises x[m, k],
      ``silu_mul_gemv`` reads gate_up[m, 2k] (gate, then up) -> silu(gate) * up,
      ``gemv_add`` writes y[m, n] = x @ W^T + residual[m, n], ``rms_gemv`` y[m, n] =
      (x / rms(x)) @ W^T (rms per row of x), ``gemv_silu_mul`` y[m, n / 2] = silu(gate) *
      up of x @ W^T with W's rows (gate, up) pairs (``rms_gemv_silu_mul``: of x / rms(x)).

    ``names`` lists the model layers that execute it (for reports).
    """

    op: str
    dtype: str
    m: int
    n: int
    k: int
    count: int = field(default=1, compare=False)
    names: tuple[str, ...] = field(default=(), compare=False)

    @property
    def key(self) -> str:
        """Stable identifier, used for study names and table lookups."""
        return f"{self.op}|{self.dtype}|m{self.m}|n{self.n}|k{self.k}"

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight read per call (GEMV: the matrix, its roofline numerator;
        norms: the weight vector; bias_gelu: the bias; silu_and_mul: none)."""
        return oprecords.layout(self.op).weight_elems(self.n, self.k) * DTYPE_BYTES[self.dtype]

    @property
    def shape_text(self) -> str:
        """Human form of the per-token shape: ``NxK`` (gemv), ``GROUPSxSIZE`` (gated
        norm), ``2N->N`` (silu_and_mul), ``N`` (the other elementwise ops)."""
        return oprecords.layout(self.op).text(self.n, self.k)

    def as_dict(self) -> dict:
        return {
            "op": self.op,
            "dtype": self.dtype,
            "m": self.m,
            "n": self.n,
            "k": self.k,
            "count": self.count,
            "names": list(self.names),
        }


_SHAPE_RE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


def parse_shape(text: str) -> tuple[int, int]:
    """Parse an ad-hoc ``NxK`` problem given on the command line."""
    match = _SHAPE_RE.match(text)
    if not match:
        raise UserError(f"bad --shape {text!r}: expected NxK, for example 96x5120")
    n, k = int(match.group(1)), int(match.group(2))
    if n <= 0 or k <= 0:
        raise UserError(f"bad --shape {text!r}: N and K must be positive")
    return n, k


def parse_m_list(text: str | Sequence[int], ops: Iterable[str] = ("gemv",)) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8].

    With ``gemv`` among ``ops`` M must be 1..16 (decode batch sizes, the unrolled M
    loops of the GEMV kernels); the elementwise ops take M up to
    ``ELEMENTWISE_MAX_M`` (one row per token, also prefill-sized chunks).
    """
    if isinstance(text, str):
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise UserError(f"bad --m {text!r}: expected a comma list such as 1,2,4,8") from None
    else:
        values = list(text)
    if not values:
        raise UserError("bad --m: the list is empty")
    ops = tuple(ops)
    if "gemv" in ops or set(ops) & set(FUSED_GEMV_OPS):
        bad = [m for m in values if not 1 <= m <= GEMV_MAX_M]
        if bad:
            extra = " (elementwise ops take larger M: leave gemv out of --ops)" if len(ops) > 1 else ""
            raise UserError(f"bad --m: {bad} outside 1..{GEMV_MAX_M} (decode batch sizes tunekit tunes "
                            f"for gemv){extra}")
    bad = [m for m in values if not 1 <= m <= ELEMENTWISE_MAX_M]
    if bad:
        raise UserError(f"bad --m: {bad} outside 1..{ELEMENTWISE_MAX_M}")
    return sorted(set(values))


def parse_ops(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"gemv,rms_norm"`` -> the op names selected (families expand to both weight conventions)."""
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else [str(p).strip() for p in text]
    parts = [p for p in parts if p]
    if not parts:
        raise UserError("bad --ops: the list is empty")
    selected: list[str] = []
    for part in parts:
        if part not in OP_FAMILIES:
            raise UserError(f"bad --ops: unknown op {part!r} (known: {', '.join(OP_FAMILIES)})")
        selected.extend(op for op in OP_FAMILIES[part] if op not in selected)
    return tuple(selected)


def search_selection(whole_model: bool, m: str | None, ops: str | None) -> tuple[str, str]:
    """``tunekit search``'s ``--m`` and ``--ops`` texts with its defaults filled in (``None``: not given).

    With a model (``--model`` / ``--config``): ``MODEL_M`` and ``MODEL_OPS`` (the model's spec keeps
    the ops it runs); with only ``--shape``: gemv at M=1. Given values are returned as they are, for
    ``parse_m_list`` / ``parse_ops`` to check.
    """
    if m is None:
        m = ",".join(map(str, MODEL_M)) if whole_model else "1"
    if ops is None:
        ops = ",".join(MODEL_OPS) if whole_model else "gemv"
    return m, ops


def gemv_problems(
    linears: Iterable[tuple[str, int, int, int]],
    m_list: Sequence[int],
    dtype: str = "bf16",
) -> list[Problem]:
    """Merge (name, n, k, count) linears by shape and expand over ``m_list``."""
    merged: dict[tuple[int, int], tuple[int, list[str]]] = {}
    for name, n, k, count in linears:
        total, names = merged.get((n, k), (0, []))
        merged[(n, k)] = (total + count, names + [name])
    problems = [
        Problem("gemv", dtype, m, n, k, count, tuple(names))
        for m in m_list
        for (n, k), (count, names) in merged.items()
    ]
    return problems


def elementwise_dims(op: str, size: int, group: int | None = None) -> tuple[int, int]:
    """(n, k) of an elementwise problem from its natural sizes (see ``Problem``).

    ``size`` is the per-token output width (norms: hidden size; silu_and_mul: d);
    ``group`` the gated norm's group size (``size`` must be a multiple of it).
    """
    if op not in ELEMENTWISE_OPS:
        raise UserError(f"unknown elementwise op {op!r} (known: {', '.join(ELEMENTWISE_OPS)})")
    return oprecords.layout(op).dims(op, size, group)


def elementwise_problems(
    items: Iterable[tuple[str, str, int, int, int]],
    m_list: Sequence[int],
    dtype: str = "bf16",
) -> list[Problem]:
    """Merge (name, op, n, k, count) elementwise calls by (op, n, k) and expand over ``m_list``."""
    merged: dict[tuple[str, int, int], tuple[int, list[str]]] = {}
    for name, op, n, k, count in items:
        total, names = merged.get((op, n, k), (0, []))
        merged[(op, n, k)] = (total + count, names + ([name] if name not in names else []))
    return [
        Problem(op, dtype, m, n, k, count, tuple(names))
        for m in m_list
        for (op, n, k), (count, names) in merged.items()
    ]


_OP_SHAPE_RE = re.compile(r"^\s*([a-z_]+)\s*:\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?$")


def parse_op_shape(text: str) -> tuple[str, int, int]:
    """``OP:SIZE`` (``gated_rms_norm:GROUPSxSIZE``) -> (op, n, k) of an ad-hoc elementwise problem.

    Examples: ``bias_gelu:4096``, ``gemma_rms_norm:5120``, ``silu_and_mul:17408``
    (the output width d), ``gated_rms_norm:48x128`` (48 groups of 128),
    ``rms_norm_gemv:96x5120``, ``silu_mul_gemv:5120x17408`` (the GEMV's NxK, ``FUSED_GEMV_OPS``).
    """
    match = _OP_SHAPE_RE.match(text)
    if not match:
        raise UserError(f"bad --shape {text!r}: expected NxK (gemv) or OP:SIZE, for example bias_gelu:4096 "
                        "or gated_rms_norm:48x128")
    op, first, second = match.group(1), int(match.group(2)), match.group(3)
    if op not in FUSED_GEMV_OPS and op not in ELEMENTWISE_OPS:
        raise UserError(f"bad --shape {text!r}: unknown op {op!r} (known: {', '.join(ELEMENTWISE_OPS)})")
    n, k = oprecords.layout(op).parse(op, text, first, None if second is None else int(second))
    return op, n, k


def shape_op(text: str) -> str:
    """The op an ad-hoc ``--shape`` argument is for (``gemv`` for ``NxK``)."""
    return "gemv" if ":" not in text else text.split(":", 1)[0].strip()


def adhoc_problems(shapes: Sequence[str], m_list: Sequence[int], dtype: str = "bf16") -> list[Problem]:
    """Problems for ``--shape`` arguments (count 1 per token): ``NxK`` is a GEMV,
    ``OP:SIZE`` an elementwise op (see ``parse_op_shape``; bias_gelu, which no
    built-in model uses, is tuned this way)."""
    linears = []
    items = []
    for text in shapes:
        if ":" in text:
            op, n, k = parse_op_shape(text)
            items.append((f"shape {text.strip()}", op, n, k, 1))
        else:
            n, k = parse_shape(text)
            linears.append((f"shape {n}x{k}", n, k, 1))
    return gemv_problems(linears, m_list, dtype) + elementwise_problems(items, m_list, dtype)
