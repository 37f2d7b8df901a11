"""What a problem's (n, k) mean: one layout per form of shape, named by each op's record.

An op record (``tunekit.problems.oprecords``) names its layout; everything that reads a
problem's dimensions (the weight bytes a report divides by, the shape a table prints, the
``--shape OP:...`` form a user types, the sizes a model config gives) asks the layout, never
the op's name:

* ``matrix``: the GEMV's N x K weight (``gemv`` and every fused GEMV family);
* ``row``: one row of n per token, k = n, a weight (or bias) of n (the norms, ``bias_gelu``);
* ``glu``: an input row of k = 2n, an output of n, no weight (``silu_and_mul``);
* ``groups``: a row of n in groups of k, each normalised alone, a weight of k (``gated_rms_norm``).

Pure Python (no torch): ``oprecords`` sits below everything and reads this.
"""

from __future__ import annotations

from dataclasses import dataclass

from tunekit.errors import UserError


@dataclass(frozen=True)
class Layout:
    """One form of (n, k); see the module docstring."""

    name: str

    def weight_elems(self, n: int, k: int) -> int:
        """Elements of weight read per call (the GEMV's matrix, a norm's gain, a bias; none)."""
        return {"matrix": n * k, "row": n, "glu": 0, "groups": k}[self.name]

    def text(self, n: int, k: int) -> str:
        """The per-token shape as reports print it: ``NxK``, ``N``, ``2N->N``, ``GROUPSxSIZE``."""
        return {"matrix": f"{n}x{k}", "row": str(n), "glu": f"{k}->{n}", "groups": f"{n // max(k, 1)}x{k}"}[self.name]

    def dims(self, op: str, size: int, group: int | None = None) -> tuple[int, int]:
        """(n, k) from an op's natural sizes: ``size`` the per-token output width, ``group`` the group size."""
        if self.name == "matrix":
            raise UserError(f"{op}: a GEMV's shape is its NxK, not one size")
        if size < 1:
            raise UserError(f"{op}: size must be positive, got {size}")
        if self.name == "groups":
            if group is None or group < 1 or size % group:
                raise UserError(f"{op}: width {size} is not a whole number of groups of {group}")
            return size, group
        if group is not None:
            raise UserError(f"{op} takes no group size")
        return (size, 2 * size) if self.name == "glu" else (size, size)

    def parse(self, op: str, text: str, first: int, second: int | None) -> tuple[int, int]:
        """(n, k) of ``--shape OP:FIRST[xSECOND]`` (``text`` the whole argument, for messages)."""
        if self.name == "matrix":
            if second is None or first < 1 or second < 1:
                raise UserError(f"bad --shape {text!r}: {op} takes the GEMV's NxK, for example {op}:96x5120")
            return first, second
        if self.name == "groups":
            if second is None:
                raise UserError(f"bad --shape {text!r}: {op} takes GROUPSxSIZE, for example 48x128")
            if first < 1 or second < 1:
                raise UserError(f"bad --shape {text!r}: groups and group size must be positive")
            return self.dims(op, first * second, second)
        if second is not None:
            raise UserError(f"bad --shape {text!r}: {op} takes one size (OP:SIZE)")
        if first < 1:
            raise UserError(f"bad --shape {text!r}: the size must be positive")
        return self.dims(op, first)


LAYOUTS: dict[str, Layout] = {name: Layout(name) for name in ("matrix", "row", "glu", "groups")}
