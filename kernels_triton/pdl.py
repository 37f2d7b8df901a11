"""Programmatic dependent launch (PDL): a kernel starts while the one before it in the stream drains.

A decode step is hundreds of short launches in a row (about 546 for Qwen3.5-27B), and every boundary
costs the next kernel's launch and ramp-up plus the previous one's tail, which no standalone timing of
one kernel shows. On sm_90 and later a kernel launched with the programmatic-stream-serialization
attribute (Triton's ``launch_pdl=True``) may be scheduled before its predecessor finished; it must then
wait (``griddepcontrol.wait``, Triton's ``gdc_wait``) before it reads or writes anything a predecessor
may touch. The predecessor lets it start early with ``griddepcontrol.launch_dependents``
(``gdc_launch_dependents``), issued here once a program's main loop is done.

What runs before the wait may only touch what no kernel of the step writes: a GEMV's weight. The GEMV
family prefetches its programs' first W tile into L2 there (``prefetch.global.L2``: a hint, coherent
with any write, since L2 is the device's point of coherence), so the weight stream is already moving
when the activations become readable. Both instructions are no-ops for a kernel launched without the
attribute, so a PDL build is correct in any stream; the launch attribute is what turns the overlap on.

Where PDL cannot run, :func:`unsupported_reason` says why and the launchers build and launch the
plain kernel: the Triton interpreter, AMD/HIP, a GPU below sm_90, a Triton without ``gdc_wait``
(added in 3.4). Where it can, it is opt-in (``TUNEKIT_PDL=1``, or ``use_pdl=True`` at a launcher), as
no measurement of a whole step shows a gain yet:
- on an H100, this form (a GEMV prefetches its first tile, BLOCK_N x BLOCK_K, before the wait; an
  elementwise kernel releases the next at once) made a token's 305 GEMVs at M=1 0.45-0.46% faster in
  one CUDA graph and the MLP blocks 0.95-0.99% faster, the same bits
  (``benchmarks/results/h100-pdl-chain-3594146``);
- on an H200, an earlier form (4 KB per row prefetched before the wait) made ``tunekit chain`` 3.5%
  (M=1) to 14% (M=8) slower (``docs/evidence.md``);
- on an H100, ``tunekit chain`` of the default table ran every variant 0.6-1.6% shorter in the process
  with it, the vendor variant (no kernel of this package) as much, so the same-run ratio tuned / vendor
  did not gain (``benchmarks/results/h100-chain-pdl-loadcheck-f9e2499``).
It becomes the default once a same-run measurement of a whole step and a served run show a gain. The
search's worker times candidates without it unless ``TUNEKIT_PDL=1`` (``tunekit.search.worker``).
Kernels of this package import nothing from tunekit.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

#: the switch that turns PDL on for every launch that does not ask (``1``; unset or anything else: off)
ENV = "TUNEKIT_PDL"


def _triton_reason() -> str | None:
    extra = getattr(getattr(tl, "extra", None), "cuda", None)
    if extra is None or not hasattr(extra, "gdc_wait") or not hasattr(extra, "gdc_launch_dependents"):
        return f"Triton {triton.__version__} has no gdc_wait / gdc_launch_dependents"
    return None


@functools.cache
def _device_reason(device_type: str, index: int | None) -> str | None:
    if device_type != "cuda":
        return f"a {device_type} device"
    if torch.version.hip:
        return "AMD GPUs have no programmatic dependent launch"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"sm_{major}{minor} (PDL needs sm_90 or later)"
    return _triton_reason()


def unsupported_reason(device: torch.device) -> str | None:
    """None if kernels on ``device`` can launch with PDL, else why not (one short phrase). Cheap: the
    device's answer is cached; the interpreter is read each call."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "the Triton interpreter"
    return _device_reason(device.type, device.index)


def default_on() -> bool:
    """Whether launchers asked nothing (``use_pdl=None``) use PDL where supported: ``TUNEKIT_PDL=1``."""
    return os.environ.get(ENV, "0") == "1"


def enabled(device: torch.device, requested: bool | None = None) -> bool:
    """Whether a launch on ``device`` uses PDL: ``requested`` None follows :func:`default_on`; True asks
    for it; False turns it off. A request never makes an unsupported launch."""
    if requested is False or (requested is None and not default_on()):
        return False
    return unsupported_reason(device) is None


def launch_options(on: bool) -> dict:
    """The launch keywords of a kernel call: ``launch_pdl`` only where PDL is on (the interpreter and
    older launchers are never handed a keyword they may not know)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def prefetch_l2(ptrs):
    """Hint the lines of ``ptrs`` into L2 (one ``prefetch.global.L2`` per element: pass one pointer per
    128-byte line). Issued before ``gdc_wait``: it reads only weights, which no step kernel writes."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def wait():
    """``griddepcontrol.wait``: block until the stream's previous kernel has completed and its writes are
    visible (a no-op for a kernel launched without PDL)."""
    tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents():
    """``griddepcontrol.launch_dependents``: once every program of this grid has issued it (or exited), the
    next kernel in the stream may be scheduled; it still waits for this one in its own :func:`wait`."""
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def release_then_wait():
    """The prologue of a short kernel before a GEMV (the norms, SiLU-and-mul): release the next kernel at
    once, so that it prefetches its weight while this one runs (it waits for this grid before it reads
    anything), then wait for the previous kernel."""
    launch_dependents()
    wait()
