"""Model spec x TP x M list -> the per-token problems tunekit tunes.

A ``Problem`` is one distinct (op, dtype, m, n, k); ``count`` is how many times
per decoded token the model executes it (layers sharing a shape are merged, as
out_proj and o_proj of Qwen3.5 are: both 5120x6144).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tunekit.errors import UserError

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, order=True)
class Problem:
    """One distinct per-token problem.

    For ``op == "gemv"``: y[m, n] = x[m, k] @ W[n, k]^T, W in ``dtype``.
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
        """Bytes of weight streamed per call (the GEMV roofline numerator)."""
        return self.n * self.k * DTYPE_BYTES[self.dtype]

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


def parse_m_list(text: str | Sequence[int]) -> list[int]:
    """``"1,2,4,8"`` -> [1, 2, 4, 8]; M must be 1..8 (decode batch sizes)."""
    if isinstance(text, str):
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise UserError(f"bad --m {text!r}: expected a comma list such as 1,2,4,8") from None
    else:
        values = list(text)
    if not values:
        raise UserError("bad --m: the list is empty")
    bad = [m for m in values if not 1 <= m <= 8]
    if bad:
        raise UserError(f"bad --m: {bad} outside 1..8 (decode batch sizes tunekit tunes)")
    return sorted(set(values))


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


def adhoc_problems(shapes: Sequence[str], m_list: Sequence[int], dtype: str = "bf16") -> list[Problem]:
    """Problems for ``--shape NxK`` arguments (count 1 per token)."""
    linears = []
    for text in shapes:
        n, k = parse_shape(text)
        linears.append((f"shape {n}x{k}", n, k, 1))
    return gemv_problems(linears, m_list, dtype)
