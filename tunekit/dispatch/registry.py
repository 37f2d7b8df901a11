"""``torch.library`` registration of the ``tunekit`` namespace: schemas, run-time impls, fake impls.

Call protocol: :func:`register` once per process (``import tunekit.ops``
calls it); it defines ``torch.ops.tunekit.<op>`` for every op whose record
(``tunekit.problems.oprecords``) has a schema, from the record's run-time
impl (one Python impl for the CUDA and CPU keys) and fake impl, so
``torch.compile`` keeps each op as one opaque node. Each op is defined in a
library fragment of its own; a later call defines the ops registered since
(a plug-in op, a test's) and takes back those whose record is gone. An op
already defined in the process (a reload of ``tunekit.ops``) is left as it is.
"""

from __future__ import annotations

import torch

from tunekit.dispatch.state import NAMESPACE
from tunekit.problems import oprecords

#: op -> the library fragment that defines it (kept alive: a fragment's destruction undefines its op)
_LIBS: dict[str, torch.library.Library] = {}


def _defined(op: str) -> bool:
    try:
        getattr(torch.ops.tunekit, op)
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> None:
    """Define the ops of the records with a schema not defined yet; take back those whose record is gone."""
    for op in [op for op in _LIBS if op not in oprecords.RECORDS]:
        _LIBS.pop(op)._destroy()
    for op in oprecords.names(served=True):
        if op in _LIBS or _defined(op):
            continue
        record = oprecords.get(op)
        lib = torch.library.Library(NAMESPACE, "FRAGMENT")
        lib.define(record.schema)
        impl = oprecords.resolve(record.impl)
        # One Python kernel for both device keys: the choice (tuned or vendor)
        # is made inside, at run time, so traced graphs hold a single opaque
        # node and never branch on M in Python.
        lib.impl(op, impl, "CUDA")
        lib.impl(op, impl, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{op}", oprecords.resolve(record.fake), lib=lib)
        _LIBS[op] = lib


def impl(op: str):
    """The run-time impl of ``torch.ops.tunekit.<op>`` (its record's ``impl``): what torch's dispatcher runs for a
    CUDA or CPU tensor, callable directly in eager code (skipping only the dispatch). ``KeyError`` for an op
    that is not served."""
    record = oprecords.get(op)
    if record.impl is None:
        raise KeyError(f"op {op!r} is not served as torch.ops.tunekit.{op}")
    return oprecords.resolve(record.impl)


def stock(op: str):
    """The stock composition of a served op (its record's ``stock``), called as the op is: what the op
    replaces in plain torch, for a compile pass to splice in where no table serves. ``KeyError`` if none."""
    record = oprecords.get(op)
    if record.stock is None:
        raise KeyError(f"op {op!r} has no stock composition")
    return oprecords.resolve(record.stock)
