"""The ops' registry: every op's ``OpSpec`` by name (what each op *is*, independent of any implementation).

:func:`get` gives the spec of an op; :data:`OPS` maps every op name to its
spec. The protocol itself (``OpSpec``, the kernel call protocol, ``EPS``)
lives in ``tunekit.problems.opspec_base`` and is importable from here too;
the specs live by family:

* ``tunekit.problems.opspec_gemv``: the GEMV and the fused GEMV families;
* ``tunekit.problems.opspec_elementwise``: the norms and the pointwise ops.
"""

from __future__ import annotations

from tunekit.problems import opspec_elementwise, opspec_gemv
from tunekit.problems.opspec_base import EPS, OpSpec

__all__ = ["EPS", "OPS", "OpSpec", "get"]

OPS: dict[str, OpSpec] = {
    spec.name: spec for spec in (opspec_gemv.GEMV, *opspec_elementwise.SPECS, *opspec_gemv.FUSED_SPECS)
}


def get(op: str) -> OpSpec:
    """The spec of ``op``; ``KeyError`` naming the known ops for an unknown one."""
    try:
        return OPS[op]
    except KeyError:
        raise KeyError(f"unknown op {op!r} (known: {', '.join(sorted(OPS))})") from None
