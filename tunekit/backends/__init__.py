"""Backend registry: name -> module path, imported lazily.

Built-in names are ``triton``, ``hip``, ``vllm_skinny`` (tuned families; the
last is vLLM's CuTe-DSL skinny GEMM searched over its SkinnyGemmConfig, where
vLLM and the CuTe DSL are installed), ``vendor`` (cuBLAS / rocBLAS for GEMV,
the PyTorch eager composition for elementwise ops), ``inductor``
(torch.compile of that composition) and the peers (``PEERS``: other projects'
kernels as their stacks run them, ``vllm_skinny_heuristic``,
``flashinfer``, ``inductor_max_autotune`` and ``triton_autotune``; each
says in one line why it cannot run where it cannot,
``unavailable_reason``, or why a shape is not its, ``invalid_reason``). Any other name of the
form ``package.module:ATTR`` is imported as a third-party backend (used by
tests to inject failing candidates, and by plugins).
"""

from __future__ import annotations

import importlib

from tunekit.backends.base import Backend, BuildError, SearchSpace

__all__ = ["Backend", "BuildError", "SearchSpace", "get", "BUILTIN", "TUNED", "PEERS", "BASELINES", "STOCK"]

BUILTIN: dict[str, str] = {
    "triton": "tunekit.backends.triton:BACKEND",
    "hip": "tunekit.backends.hip:BACKEND",
    "vendor": "tunekit.backends.vendor:BACKEND",
    "inductor": "tunekit.backends.inductor:BACKEND",
    "vllm_skinny": "tunekit.backends.vllm_skinny:BACKEND",
    "vllm_skinny_heuristic": "tunekit.backends.vllm_skinny:HEURISTIC",
    "flashinfer": "tunekit.backends.flashinfer:BACKEND",
    "inductor_max_autotune": "tunekit.backends.inductor:MAX_AUTOTUNE",
    "triton_autotune": "tunekit.backends.triton_autotune:BACKEND",
}
#: Searchable families, in report order. The default ``--backend`` is every one usable here
#: (``unavailable_reason`` None): vllm_skinny only where vLLM and the CuTe DSL run.
TUNED = ("triton", "hip", "vllm_skinny")
#: What a user could pick instead of tunekit (kind "baseline"): vLLM's skinny GEMM at its heuristic config,
#: FlashInfer's BF16 small-M GEMM, torch.compile max-autotune of the linear and a plain @triton.autotune
#: GEMV. Report order.
PEERS = ("vllm_skinny_heuristic", "flashinfer", "inductor_max_autotune", "triton_autotune")
#: Baselines (kind "baseline"), never searched: "vendor" is always measured; the
#: others join the final re-measure for the ops they implement where they can
#: run (else one logged line says why).
BASELINES = ("vendor", "inductor", *PEERS)
#: The stock path: what serves a shape the table holds no entry for (cuBLAS / rocBLAS, the eager
#: composition; Inductor's fusion inside vLLM's compiled graphs). A table entry must beat the fastest of
#: these (tunekit.table). A peer that beats the tuned kernel is reported, not a bar: the plugin falls back
#: to the stock path, never to a peer, so refusing the entry would serve the slower stock path.
STOCK = ("vendor", "inductor")


def get(name: str) -> Backend:
    """The backend called ``name`` (built-in) or at ``module:ATTR``."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise KeyError(f"unknown backend {name!r} (known: {', '.join(BUILTIN)})")
    module_name, attr = target.split(":", 1)
    module = importlib.import_module(module_name)
    return getattr(module, attr)
