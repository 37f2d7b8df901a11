"""The serving vocabulary and the one process-wide serving state.

Every other module of ``tunekit.dispatch`` reads and mutates :data:`STATE`
(never a copy of it): the loaded tables, the per-device merged tables, the
decision cache, the built kernels, the dispatch markers, the installed
vendor kernels and the dispatch log's writer. Every mutation happens under
``STATE.lock``; hot-path reads of single dict entries are lock-free (atomic
under the GIL). Also here: the names the markers use (fallback reasons,
vendor names), the op schemas and the epsilon the kernels are built with,
and the one logger of serving (``tunekit.ops``, the name users configure).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tunekit.problems import oprecords
from tunekit.table import Entry

logger = logging.getLogger("tunekit.ops")

NAMESPACE = "tunekit"
LOG_ENV = "TUNEKIT_DISPATCH_LOG"
STATS_FORMAT = "tunekit.dispatch_stats/1"

#: torch dtype -> the dtype names of tables (tunekit.problems.shapes.DTYPE_BYTES).
DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

#: Every reason a call can take the vendor path, with what it means (for reports and docs).
FALLBACK_REASONS: dict[str, str] = {
    "no_table": "no dispatch table loaded (TUNEKIT_TABLE unset, or tunekit.patch/load_tables without tables)",
    "table_error": "a table file could not be read or is invalid (logged once)",
    "env_mismatch": "every loaded table was tuned for another device or software (warned once per table)",
    "tp_mismatch": "the tables that hold this (op, dtype, N, K) were tuned for another tensor-parallel size than "
                   "the one this process serves (warned once per table); with counted_at='layer', an "
                   "integration's layer that kept its own code for that reason",
    "no_entry": "no tabulated entry for this (op, dtype, N, K)",
    "m_above_table": "entries exist for (op, dtype, N, K) but none with M >= this call's M",
    "dtype": "dtype not tabulated (bf16/fp16/fp32 only) or x and W differ",
    "strided": "x or W not unit-stride along K (or x not viewable as [M, K])",
    "bias": "bias not a contiguous 1-D tensor of the output dtype and N elements",
    "device": "x and W on different devices, or a device other than CUDA/HIP/CPU",
    "bad_input": "shapes that are not a linear (W not 2-D, K mismatch); the vendor path reports them",
    "empty": "M, N or K is zero",
    "eps": "a norm's eps other than the tuned kernel's fixed one (the kernel takes no eps argument)",
    "interpreter_off": "CPU tensors while TRITON_INTERPRET is not set (Triton runs on GPUs only then)",
    "interpreter_on": "GPU tensors while TRITON_INTERPRET=1 (interpreted kernels take CPU tensors)",
    "backend_unavailable": "the entry's backend cannot run here (logged once with the reason)",
    "config_invalid_at_m": "every entry at a larger M holds a config this M cannot run (M_MODE=\"rows\" at "
                           "M=1; an entry that can is taken over one that cannot); logged once",
    "unfused_at_m": "a fused op (rms_gemv, gemv_add) at an M where its layer group measured the unfused path "
                    "faster (the table's fusions section, fused_m): the unit-gain norm and the GEMV, or the GEMV "
                    "and the add, run on the same folded weights, each through its own route",
    "build_error": "the entry's kernel failed to build (logged once with the error)",
    "not_built_at_capture": "met first under CUDA-graph capture, where kernels are never built: the graph keeps "
                            "the vendor path for this size (call tunekit.ops.prepare() or run a warm-up first)",
    "kernel_error": "the tuned kernel raised at launch (logged once; the key stays on the vendor path)",
    "canary_mismatch": "TUNEKIT_CANARY checked a call of the tuned kernel and found it outside the op's error "
                       "bound of the fp64 reference (logged once; the key stays on the vendor path)",
}

#: The ``vendor`` of an elementwise fallback served by tunekit's Triton kernel at a config valid for every M:
#: the table's nearest-M Triton entry for the shape, else the op's default config.
DEFAULT_VENDOR = "tunekit:triton-default"

#: The ``vendor`` of a fallback row when tunekit's own PyTorch composition served it (elementwise ops).
EAGER_VENDORS: dict[str, str] = {
    "eager": "tunekit's PyTorch composition of the native math: no integration installed a vendor kernel for "
             "this op and no table serves this device (so no default-config kernel either), or the inputs "
             "failed a per-call check before the lookup",
    "eager:no_vendor_kernel": "an integration looked for a vendor kernel for this op and device and found none, "
                              "and no table serves this device (so no default-config kernel either)",
    "eager:vendor_error": "the installed vendor kernel raised (logged once); the composition served the call",
    "eager:default_unavailable": f"no vendor kernel, and {DEFAULT_VENDOR} cannot run here (the Triton "
                                 "backend's unavailable reason, logged once)",
    "eager:default_dtype": f"no vendor kernel, and {DEFAULT_VENDOR} serves BF16 only (its kernels round to BF16)",
    "eager:default_eps": f"no vendor kernel, and {DEFAULT_VENDOR} is built for DEFAULT_EPS (takes no eps)",
    "eager:default_invalid": "no vendor kernel, and the default config is invalid at this shape (logged once)",
    "eager:default_build_error": f"no vendor kernel, and {DEFAULT_VENDOR} failed to build (logged once)",
    "eager:default_kernel_error": f"no vendor kernel, and {DEFAULT_VENDOR} raised at launch (logged once; the "
                                  "key keeps the composition)",
    "eager:default_not_built_at_capture": f"no vendor kernel, and {DEFAULT_VENDOR} was first needed under "
                                          "CUDA-graph capture, where kernels are never built (the graph keeps "
                                          "the composition; tunekit.ops.prepare(ms=...) or a warm-up builds it)",
}

CAPTURE_NOTE = (
    "rows with counted_at='capture' were counted once when a CUDA graph was captured; graph replays run "
    "without Python and are not counted, so their calls are captures, not executions"
)


def _built_eps() -> float:
    from tunekit.problems import opspec

    return float(getattr(opspec, "EPS", 1e-6))


#: The epsilon a built elementwise kernel runs at when called without ``eps=``
#: (``tunekit.problems.opspec.EPS``, what the search times). The Triton kernels take
#: ``eps=`` per call, as the HIP ones do (Llama-3.1's 1e-5 is served tuned; only
#: this epsilon takes Triton's bound launcher, which replays the call it
#: recorded); a kernel without it (a plug-in backend's, built for this epsilon)
#: serves another as ``fallback:eps``.
DEFAULT_EPS = _built_eps()

#: Elementwise ops and their schemas, from the op records (``tunekit.problems.oprecords``). Table keys
#: (m, n, k) as in tunekit.problems.shapes.Problem: rows m = all leading dims; norms n = k = row length;
#: gated_rms_norm n = G*K, k = len(w); silu_and_mul k = 2n; bias_gelu k = n.
ELEMENTWISE_SCHEMAS: dict[str, str] = {
    op: oprecords.get(op).schema for op in oprecords.names(kind="elementwise", served=True)}


@dataclass
class LoadedTable:
    path: str
    table: dict[str, Any] | None  # None: it failed to load (error holds why)
    error: str | None = None


@dataclass(frozen=True)
class VendorKernel:
    """An elementwise op's vendor path installed by an integration (:func:`set_vendor_elementwise`)."""

    fn: Callable[..., Any] | None  # None: the integration looked and found no kernel
    name: str  # the marker's ``vendor`` (what served), or why none was found
    device_types: frozenset[str]
    #: False for a vendor path of several launches (vLLM's in-place fused add served functionally:
    #: an add, then its rms_norm): tunekit's default-config kernel, one launch, is tried first
    single_launch: bool = True


@dataclass(frozen=True)
class DefaultKernel:
    """The default-config kernel of one (op, dtype, m, n, k, device), or why there is none."""

    kernel: Callable[..., None] | None
    #: None with a kernel; with none, the EAGER_VENDORS key saying why, or None where the default path
    #: does not apply at all (no table serves the device: the vendor of an untouched fallback)
    why: str | None = None
    takes_eps: bool = False


@dataclass
class Choice:
    """What serves one (op, dtype, m, n, k, device): a built kernel, or the vendor path and why."""

    impl: str  # "tuned:<backend>" or "fallback:<reason>"
    kernel: Callable[..., None] | None = None
    entry: Entry | None = None
    #: the built kernel takes ``eps=`` (the norms); without it only DEFAULT_EPS is served tuned
    takes_eps: bool = False


class State:
    """Process-wide serving state; every mutation under ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.tables: list[LoadedTable] | None = None  # None: not loaded yet (TUNEKIT_TABLE read lazily)
        #: device key ("cuda:0", "cpu") -> (the index of the tables serving it at this TP size, or None and
        #: the fallback reason): ``tunekit.dispatch.tables.tables_for``, cleared on a load or a TP change
        self.device_tables: dict[str, tuple[Any, str | None]] = {}
        #: (op, dtype, m, n, k, device key) -> Choice
        self.choices: dict[tuple, Choice] = {}
        #: bumped (under ``lock``) whenever a cached choice or the vendor hook may change: a table
        #: load, ``set_vendor_gemm``, a kernel marked broken. A cache stamped with it (the eager
        #: linear path, ``tunekit.dispatch.gemv.EagerLinear``) is valid while it is unchanged.
        self.epoch = 0
        #: gated_rms_norm (dtype, m, n, k, device key) -> the (m, n) rows it is served as
        self.gated_layouts: dict[tuple, tuple[int, int]] = {}
        #: built kernels by (backend, op, dtype, build M, n, k, params, device): one HIP build serves all M <= MAX_M
        self.built: dict[tuple, Callable[..., None]] = {}
        #: (op, dtype, shape, m, bias, impl, counted_at, vendor) -> calls settled so far; read and
        #: assigned through :attr:`stats`, which first settles the live :class:`CallCounter` ticks
        self._stats: dict[tuple, int] = {}
        #: the same keys -> the live counter the hot path ticks (one C call, no lock, no key built)
        self.counters: dict[tuple, CallCounter] = {}
        self.logged: set[str] = set()
        self.vendor_gemm: Callable[..., torch.Tensor] | None = None
        self.vendor_gemm_name = "F.linear"
        #: elementwise op -> the kernel an integration installed as its vendor path
        self.vendor_ew: dict[str, VendorKernel] = {}
        #: elementwise ops whose installed vendor kernel the engine itself would not run in this process
        #: (``set_engine_runs_vendor``): their fallbacks try tunekit's default-config kernel first
        self.vendor_off_engine_path: set[str] = set()
        #: (op, dtype, m, n, k, device key) -> the default-config kernel serving fallbacks that have no
        #: vendor kernel (or why none does); cleared with the tables
        self.defaults: dict[tuple, DefaultKernel] = {}
        #: the tensor-parallel size this process serves (``tunekit.dispatch.tables.set_tensor_parallel``, set by
        #: an integration that knows it); None: unknown, every table serves whatever TP it records
        self.tp: int | None = None
        self.atexit_registered = False
        #: writes the dispatch log (``tunekit.dispatch.log.write_dispatch_log``, installed when that module is
        #: imported): what the write schedule (``tunekit.dispatch.markers``) calls, so that the tables, which
        #: start the schedule, need not import the log that reports them
        self.log_writer: Callable[[], Any] | None = None

    @property
    def stats(self) -> dict[tuple, int]:
        """Every call counted so far (the counters' ticks settled into the dict first)."""
        with self.lock:
            for key, counter in self.counters.items():
                calls = counter.settle()
                if calls:
                    self._stats[key] = self._stats.get(key, 0) + calls
            return self._stats

    @stats.setter
    def stats(self, value: dict[tuple, int]) -> None:
        # Replacing the counts (a reset, or prepare() putting the markers back after its warm-up)
        # also drops the ticks not settled yet: they belong to the counts being replaced.
        with self.lock:
            for counter in self.counters.values():
                counter.settle()
            self._stats = value


class CallCounter:
    """One marker row's live count: ``tick()`` is one C call (``itertools.count.__next__``),
    atomic under the GIL, so the hot path counts exactly without taking the lock.

    :meth:`settle` (under ``STATE.lock``) returns the ticks since the last settle; the count
    only grows, so a tick racing a settle is counted by the next one, never lost.
    """

    __slots__ = ("tick", "_it", "_settled")

    def __init__(self) -> None:
        self._it = itertools.count()
        self.tick = self._it.__next__
        self._settled = 0

    def settle(self) -> int:
        total = int(repr(self._it)[6:-1])  # "count(N)": N ticks so far (a C call, atomic)
        calls, self._settled = total - self._settled, total
        return calls


STATE = State()


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name of a torch dtype ("bf16", "fp16", "fp32"), else torch's own name."""
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def log_once(key: str, level: int, message: str, *args: Any) -> None:
    with STATE.lock:
        if key in STATE.logged:
            return
        STATE.logged.add(key)
    logger.log(level, message, *args)
