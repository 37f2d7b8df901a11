"""``torch.library`` registration of the ``tunekit`` namespace: schemas, run-time impls, fake impls.

Call protocol: :func:`register` once per process (``import tunekit.ops``
calls it); it defines ``tunekit::gemv``, every op of
``ELEMENTWISE_SCHEMAS`` and of ``FUSED_GEMV_SCHEMAS`` (``rms_gemv``,
``gemv_add``) with one Python impl for the CUDA and CPU keys and a fake
impl, so ``torch.compile`` keeps each op as one opaque node. A second
call (a reload of ``tunekit.ops``) finds the ops defined and does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tunekit.dispatch.elementwise import ELEMENTWISE_IMPLS
from tunekit.dispatch.fused_gemv import FUSED_GEMV_IMPLS, FUSED_GEMV_SCHEMAS
from tunekit.dispatch.gemv import gemv_fake, gemv_impl
from tunekit.dispatch.state import ELEMENTWISE_SCHEMAS, NAMESPACE

_LIB: torch.library.Library | None = None


def register() -> None:
    """Define ``tunekit::gemv`` and the elementwise ops once per process (a reload reuses them)."""
    global _LIB
    try:
        torch.ops.tunekit.gemv  # noqa: B018 - already defined (e.g. the module was reloaded)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    impls: dict[str, tuple[str, Callable[..., Any], Callable[..., Any]]] = {
        "gemv": ("gemv(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor", gemv_impl, gemv_fake),
    }
    for op, (impl, fake) in ELEMENTWISE_IMPLS.items():
        impls[op] = (ELEMENTWISE_SCHEMAS[op], impl, fake)
    for op, (impl, fake) in FUSED_GEMV_IMPLS.items():
        impls[op] = (FUSED_GEMV_SCHEMAS[op], impl, fake)
    for op, (schema, impl, fake) in impls.items():
        lib.define(schema)
        # One Python kernel for both device keys: the choice (tuned or vendor)
        # is made inside, at run time, so traced graphs hold a single opaque
        # node and never branch on M in Python.
        lib.impl(op, impl, "CUDA")
        lib.impl(op, impl, "CPU")
        torch.library.register_fake(f"{NAMESPACE}::{op}", fake, lib=lib)
    _LIB = lib

