"""The ``fusions`` section of a dispatch table: per layer group, whether serving fuses it, measured.

A fusion rewrites what serving runs for every M at once (a folded norm rewrites the consumers' weights;
the residual add moves into the GEMV epilogue in every compile range the tables serve), so whether it
pays is decided for the whole group, from one measurement: the search's fusion phase
(``tunekit.search.fusion_phase``) times, at every M the table covers, the fused sequence against the
unfused one serving would otherwise run, interleaved in one session, each step as the table serves it
(the entry, or the stock path where the table has none). Serving follows the decision
(``tunekit.dispatch.fusions``); it never re-derives it from entries of different studies.

Groups (:class:`FusionGroup`), by family:

* ``rms_gemv``: a decoder norm folded into its consumers: ``rms_gemv`` on each consumer against the norm
  (in the form the model runs it: the fused-add form for every decoder norm but layer 0's input norm)
  plus each consumer's ``gemv``. The residual add a folded fused-add norm leaves is priced as serving
  runs it: free where every GEMV writing it (``writers``) is a ``gemv_add`` group that fuses (the epilogue
  takes it; that group measured ``gemv_add`` against ``gemv`` + add), else a standalone add in the
  fused sequence;
* ``sibling_rms_gemv``: the same for sibling consumers that serving joins into one weight (Qwen3.5's
  ``in_proj_qkvz`` + ``in_proj_ba``): one ``rms_gemv`` on the joined rows against the norm plus the
  siblings' separate ``gemv``;
* ``gemv_add``: the residual add in a GEMV's epilogue: ``gemv_add`` against ``gemv`` then the add.

The decision is per M (:func:`decide`): the group is fused (weights folded, the fused op in place) where
the fused sequence was measured faster at one M at least, and the op runs the fused kernel at those Ms
(``fused_m``) and the unfused path, on the same folded weights, at every other M (an M where the fused
op has no entry or that could not be measured is one of those: it vetoes no other M). vLLM captures one
graph per batch size and the op decides once per M, so the choice costs nothing per call. A section
written before ``fused_m`` keeps its all-or-nothing ``fuse``, and serving says so once. Schema
(``"fusions"`` of ``tunekit.table``; absent in tables written before it: serving then keeps its older
rule and says so once)::

    "fusions": {GROUP KEY: {"family", "norm", "dtype", "consumers": [[N, K], ...], "names": [...],
                            "count", "fuse": bool, "fused_m": [M, ...], "margin": float or null, "why": str,
                            "per_m": {"M": {"fused_us", "unfused_us", "fused": [step, ...],
                                            "unfused": [step, ...], "note"}}}}

GROUP KEY is :func:`group_key`: ``family|norm|dtype|NxK+NxK`` (``-`` for no norm; the consumers' shapes
sorted). ``margin``: the worst fused M's saving, (unfused - fused) / unfused (where no M is fused: the
best M's, negative or zero); null where no M has figures. Each step is ``op NxK@backend`` as it was timed.
No torch, no optuna: read by both paths.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("rms_gemv", "sibling_rms_gemv", "gemv_add")
#: norm conventions of the ``rms_gemv`` families -> their fused-add forms
NORM_FORMS = {"rms_norm": "fused_add_rms_norm", "gemma_rms_norm": "gemma_fused_add_rms_norm"}


def group_key(family: str, norm: str | None, dtype: str, consumers: Iterable[tuple[int, int]]) -> str:
    """``family|norm|dtype|NxK+NxK``: the consumers' shapes sorted (their order does not change the cost)."""
    shapes = "+".join(f"{n}x{k}" for n, k in sorted((int(n), int(k)) for n, k in consumers))
    return f"{family}|{norm or '-'}|{dtype}|{shapes}"


@dataclass(frozen=True)
class FusionGroup:
    """One layer group a fusion changes: its family, norm convention and the form serving runs unfused
    (``norm_op``), the consumers' (N, K), the GEMVs writing the residual a folded norm adds (``writers``),
    the layers' names and calls per token."""

    family: str
    dtype: str
    consumers: tuple[tuple[int, int], ...]
    norm: str | None = None
    norm_op: str | None = None
    writers: tuple[tuple[int, int], ...] = ()
    names: tuple[str, ...] = ()
    count: int = 1

    @property
    def key(self) -> str:
        return group_key(self.family, self.norm, self.dtype, self.consumers)

    @property
    def fused_op(self) -> str:
        return "gemv_add" if self.family == "gemv_add" else "rms_gemv"

    @property
    def fused_shapes(self) -> tuple[tuple[int, int], ...]:
        """The (N, K) the fused sequence runs: the consumers', or their joined rows (``sibling_rms_gemv``)."""
        if self.family == "sibling_rms_gemv":
            return ((sum(n for n, _ in self.consumers), self.consumers[0][1]),)
        return self.consumers

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "dtype": self.dtype, "consumers": [list(c) for c in self.consumers],
                "norm": self.norm, "norm_op": self.norm_op, "writers": [list(w) for w in self.writers],
                "names": list(self.names), "count": self.count}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FusionGroup:
        return cls(data["family"], data["dtype"], tuple(tuple(c) for c in data["consumers"]), data.get("norm"),
                   data.get("norm_op"), tuple(tuple(w) for w in data.get("writers", ())),
                   tuple(data.get("names", ())), int(data.get("count", 1)))


def model_groups(spec: Any, tp: int = 1, dtype: str = "bf16") -> list[FusionGroup]:
    """The groups vLLM's plugin fuses in ``spec``'s model (a ``tunekit.problems.models.ModelSpec``), one rank's
    shards at ``tp``: each decoder norm's consumers (``rms_gemv``; Gated DeltaNet's two input projections as
    ``sibling_rms_gemv``), and each GEMV writing the residual stream (``gemv_add``, at tp 1 only: a
    row-parallel output is all-reduced before the add)."""
    shapes = {name: (n, k) for name, n, k, _ in spec.linears(tp)}
    layers, mlp = spec.num_layers, spec.mlp_prefix
    norm = "gemma_rms_norm" if spec.norm_style == "gemma" else "rms_norm"
    fused_add = NORM_FORMS[norm]
    full, linear = spec.num_full_attention_layers, spec.num_linear_attention_layers
    down = shapes[f"{mlp}down_proj"]
    attn_writers = tuple(sorted({shapes[w] for w in ("o_proj", "linear_attn.out_proj") if w in shapes}))
    input_form = fused_add if layers > 1 else norm  # layer 0's input norm has no residual yet
    out = []
    if full:
        out.append(FusionGroup("rms_gemv", dtype, (shapes["qkv_proj"],), norm, input_form, (down,),
                               ("input_layernorm+qkv_proj",), full))
    if linear:
        out.append(FusionGroup("sibling_rms_gemv", dtype, (shapes["linear_attn.in_proj_qkvz"],
                                                           shapes["linear_attn.in_proj_ba"]), norm, input_form,
                               (down,), ("input_layernorm+linear_attn.in_proj_qkvz+in_proj_ba",), linear))
    out.append(FusionGroup("rms_gemv", dtype, (shapes[f"{mlp}gate_up_proj"],), norm, fused_add, attn_writers,
                           (f"post_attention_layernorm+{mlp}gate_up_proj",), layers))
    if tp == 1:
        writers: dict[tuple[int, int], list[str]] = {}
        counts: dict[tuple[int, int], int] = {}
        for name, n, k, count in spec.linears(tp):
            if name in ("o_proj", "linear_attn.out_proj", f"{mlp}down_proj"):
                writers.setdefault((n, k), []).append(name)
                counts[(n, k)] = counts.get((n, k), 0) + count
        out += [FusionGroup("gemv_add", dtype, (shape,), names=tuple(names), count=counts[shape])
                for shape, names in writers.items()]
    return out


@dataclass
class Measured:
    """One M of a group: the two sequences' times (None: not measured, ``note`` says why) and their steps."""

    fused_us: float | None = None
    unfused_us: float | None = None
    fused: list[str] = field(default_factory=list)
    unfused: list[str] = field(default_factory=list)
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"fused_us": self.fused_us, "unfused_us": self.unfused_us, "fused": list(self.fused),
                "unfused": list(self.unfused), "note": self.note}


def decide(per_m: Mapping[int, Measured]) -> tuple[bool, float | None, str, list[int]]:
    """(fuse, margin, why, fused Ms) from a group's measurements, decided per M: the group is fused (its
    weights folded, its fused op in place) where the fused sequence was faster at one M at least, and the
    op runs the fused kernel at exactly those Ms (``fused_m``); at every other M it runs the unfused path
    on the same weights (the unit-gain norm and the GEMV, or the GEMV and the add). An M without both
    figures is unfused (its note says why); it vetoes no other M. ``margin``: the worst fused M's saving."""
    if not per_m:
        return False, None, "not measured (no M)", []
    saving = {m: (got.unfused_us - got.fused_us) / got.unfused_us for m, got in per_m.items()
              if got.fused_us is not None and got.unfused_us is not None}
    fused_m = sorted(m for m, s in saving.items() if s > 0)

    def figures(m: int) -> str:
        got = per_m[m]
        return f"{got.fused_us:.2f} us fused against {got.unfused_us:.2f} us unfused ({saving[m]:+.1%})"

    unfused = [f"slower at M={m}: {figures(m)}" if m in saving else f"M={m}: {per_m[m].note or 'not measured'}"
               for m in sorted(per_m) if m not in fused_m]
    if not fused_m:
        return False, (max(saving.values()) if saving else None), "; ".join(unfused), []
    margin = min(saving[m] for m in fused_m)
    if len(fused_m) == 1:
        won = f"faster at M={fused_m[0]}: {figures(fused_m[0])}"
    else:
        worst = min(fused_m, key=lambda m: (saving[m], m))
        best = max(fused_m, key=lambda m: (saving[m], -m))
        won = (f"faster at {'every M' if not unfused else 'M=' + ','.join(map(str, fused_m))}: by "
               f"{saving[worst]:.1%} at M={worst} ({figures(worst)}) to {saving[best]:.1%} at M={best}")
    if not unfused:
        return True, margin, won, fused_m
    return True, margin, f"{won}; {'; '.join(unfused)}", fused_m


def record(group: FusionGroup, per_m: Mapping[int, Measured]) -> dict[str, Any]:
    """A group's entry of the ``fusions`` section."""
    fuse, margin, why, fused_m = decide(per_m)
    return {"family": group.family, "norm": group.norm, "dtype": group.dtype,
            "consumers": [list(c) for c in group.consumers], "names": list(group.names), "count": group.count,
            "fuse": fuse, "fused_m": fused_m, "margin": margin, "why": why,
            "per_m": {str(m): per_m[m].as_dict() for m in sorted(per_m)}}


def fused_shapes_of(rec: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """(fused op, N, K) a group's record serves: ``gemv_add`` or ``rms_gemv`` on each consumer, one
    ``rms_gemv`` on the joined rows of ``sibling_rms_gemv``."""
    consumers = [(int(n), int(k)) for n, k in rec["consumers"]]
    if rec["family"] == "sibling_rms_gemv":
        return [("rms_gemv", sum(n for n, _ in consumers), consumers[0][1])]
    op = "gemv_add" if rec["family"] == "gemv_add" else "rms_gemv"
    return [(op, n, k) for n, k in consumers]


def per_m_choices(section: Mapping[str, Any]) -> dict[tuple[str, str, int, int], frozenset[int]]:
    """(fused op, dtype, N, K) -> the Ms at which serving runs the fused kernel, from the records that
    decide per M (``fused_m``); a record without it (a table written before) is not in the map and its
    group is served at every M or none, by its ``fuse``. Two groups sharing a fused shape: the union."""
    out: dict[tuple[str, str, int, int], frozenset[int]] = {}
    for rec in section.values():
        if not isinstance(rec.get("fused_m"), list) or not rec.get("fuse"):
            continue
        for op, n, k in fused_shapes_of(rec):
            key = (op, rec["dtype"], n, k)
            out[key] = out.get(key, frozenset()) | frozenset(int(m) for m in rec["fused_m"])
    return out


def describe(key: str, rec: Mapping[str, Any]) -> str:
    """One line: what the group is, whether it is fused and why (with the margin)."""
    names = "".join(f" {name}" if i == 0 else f", {name}" for i, name in enumerate(rec.get("names") or ()))
    verdict = "fused" if rec.get("fuse") else "not fused"
    fused_m, measured = rec.get("fused_m"), rec.get("per_m") or {}
    if rec.get("fuse") and isinstance(fused_m, list) and len(fused_m) < len(measured):
        verdict = f"fused at M={','.join(map(str, fused_m))}"
    return f"{verdict}: {rec.get('family')}{names} ({key.split('|', 1)[1]}): {rec.get('why')}"


def _number_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def section_problem(section: Any) -> str | None:
    """Why a table's ``fusions`` section is malformed, else None (``tunekit.table.validate`` raises it)."""
    if not isinstance(section, dict):
        return "'fusions' must be an object (group key -> decision)"
    for key, rec in section.items():
        if not isinstance(rec, dict):
            return f"fusions {key!r}: not an object"
        if rec.get("family") not in FAMILIES:
            return f"fusions {key!r}: family {rec.get('family')!r} (known: {', '.join(FAMILIES)})"
        consumers = rec.get("consumers")
        if not (isinstance(consumers, list) and consumers and all(
                isinstance(c, list) and len(c) == 2 and all(type(v) is int and v > 0 for v in c) for c in consumers)):
            return f"fusions {key!r}: consumers must be a non-empty list of [N, K]"
        if not isinstance(rec.get("dtype"), str) or not (rec.get("norm") is None or isinstance(rec["norm"], str)):
            return f"fusions {key!r}: dtype must be a string, norm a string or null"
        if key != group_key(rec["family"], rec.get("norm"), rec["dtype"], consumers):
            return f"fusions {key!r}: the key does not name its record's group"
        if not isinstance(rec.get("fuse"), bool) or not isinstance(rec.get("why"), str):
            return f"fusions {key!r}: fuse must be true or false and why a string"
        if not _number_or_null(rec.get("margin")):
            return f"fusions {key!r}: margin={rec.get('margin')!r} (a number or null)"
        fused_m = rec.get("fused_m")
        if fused_m is not None and not (isinstance(fused_m, list) and all(type(m) is int and m > 0 for m in fused_m)
                                        and bool(fused_m) == rec["fuse"]):
            return (f"fusions {key!r}: fused_m={fused_m!r} (a list of Ms, empty exactly where fuse is false; "
                    "absent in tables written before the per-M choice)")
        per_m = rec.get("per_m")
        if not isinstance(per_m, dict):
            return f"fusions {key!r}: per_m must be an object"
        for m, got in per_m.items():
            if not (isinstance(m, str) and m.isdigit() and int(m) > 0 and isinstance(got, dict)):
                return f"fusions {key!r}: per_m {m!r} must be an M (a whole number > 0) -> an object"
            for name in ("fused_us", "unfused_us"):
                value = got.get(name)
                if not _number_or_null(value) or (value is not None and value <= 0):
                    return f"fusions {key!r}: M={m} {name}={value!r} (a number > 0 or null)"
    return None
