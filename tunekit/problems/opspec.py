"""The ops' specs by name: what each op *is*, independent of any implementation.

:func:`get` gives the spec of an op, the one its record names
(``tunekit.problems.oprecords``: one record per op, built-in or registered);
:data:`OPS` maps every tabulated op's name to its spec, read from the records
when looked up (an op registered later is in it). The protocol itself
(``OpSpec``, the kernel call protocol, ``EPS``) lives in
``tunekit.problems.opspec_base`` and is importable from here too; the
built-in specs live by family:

* ``tunekit.problems.opspec_gemv``: the GEMV and the fused GEMV families;
* ``tunekit.problems.opspec_elementwise``: the norms and the pointwise ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from tunekit.problems import oprecords
from tunekit.problems.opspec_base import EPS, OpSpec

__all__ = ["EPS", "OPS", "OpSpec", "get"]


def get(op: str) -> OpSpec:
    """The spec of ``op``; ``KeyError`` naming the known ops for an unknown one."""
    record = oprecords.RECORDS.get(op)
    if record is None or record.spec is None:
        raise KeyError(f"unknown op {op!r} (known: {', '.join(oprecords.names(tabulated=True))})")
    return oprecords.resolve(record.spec)


class _Specs(Mapping):
    """Op name -> spec for every tabulated op of the records, as they are when read."""

    def __getitem__(self, op: str) -> OpSpec:
        return get(op)

    def __iter__(self) -> Iterator[str]:
        return iter(oprecords.names(tabulated=True))

    def __len__(self) -> int:
        return len(oprecords.names(tabulated=True))


OPS: Mapping[str, OpSpec] = _Specs()
