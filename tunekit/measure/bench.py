"""The ONE timing path: CUDA/HIP graphs, rotated weights, median and spread.

Why this shape:
- A graph of many launches removes Python and launch overhead, which at
  decode sizes (a 96x5120 GEMV takes ~3 us) would otherwise dominate.
- The large operand (the GEMV weight) is rotated over enough copies that the
  working set is >= 4x the device's L2: otherwise consecutive calls hit in L2
  and the figure is not what a decode step, which streams every weight once,
  gets.
- Each replay is timed with events; the figure is the median per launch and
  the spread (p25..p75, min) is kept so noise can be judged.
- Candidates that must be *ranked* are timed interleaved (A B C A B C ...) so
  drift of clocks or temperature hits all of them alike.

On the CPU (Triton interpreter) the same API times with perf_counter and marks
the result ``kind="cpu"``: usable to exercise the pipeline, never as evidence.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tunekit.measure.device import DeviceInfo
from tunekit.problems.opspec import OpSpec
from tunekit.problems.shapes import Problem

Kernel = Callable[[tuple[torch.Tensor, ...], torch.Tensor | tuple[torch.Tensor, ...]], None]

#: Working set of rotated operands, in multiples of L2.
L2_ROTATION_FACTOR = 4
MIN_LAUNCHES_PER_GRAPH = 20
GPU_WARMUP_REPLAYS = 3
GPU_REPEATS = 15


@dataclass
class Timing:
    median_us: float
    min_us: float
    p25_us: float
    p75_us: float
    repeats: int
    launches: int  # launches per timed replay
    copies: int  # rotated copies of the large operand
    kind: str  # "gpu" (graph + events) or "cpu" (interpreter, tests only)

    @property
    def spread(self) -> float:
        """Inter-quartile range relative to the median."""
        return (self.p75_us - self.p25_us) / self.median_us if self.median_us > 0 else float("nan")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["spread"] = self.spread
        return out


def _summarise(samples: list[float], launches: int, copies: int, kind: str) -> Timing:
    ordered = sorted(samples)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return Timing(
        median_us=statistics.median(ordered),
        min_us=ordered[0],
        p25_us=q[0],
        p75_us=q[2],
        repeats=len(ordered),
        launches=launches,
        copies=copies,
        kind=kind,
    )


#: Device memory returned to the driver is cleared by it in the background, and a bandwidth-bound kernel
#: timed meanwhile runs slow: on an H200 a 34816x5120 GEMV took 13% longer for 0.3 s after 120 GB were
#: freed, for 0.15 s after 60 GB (about 400 GB/s; benchmarks/results/h200-memory-state-bd038d3).
#: :func:`release_memory` waits at half that rate.
FREED_CLEAR_BYTES_PER_S = 200e9


def release_memory() -> float:
    """Return the caching allocator's unused device memory to the driver (``torch.cuda.empty_cache``) and
    wait until the driver has cleared it, so that nothing timed next shares the memory system with that
    clearing. Returns the seconds waited (0 where no GPU was used or nothing was returned)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0.0
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    wait = max(0, before - torch.cuda.memory_reserved()) / FREED_CLEAR_BYTES_PER_S
    if wait > 0:
        time.sleep(wait)
    return wait


def rotation_copies(operand_bytes: int, l2_bytes: int) -> int:
    """Copies of the large operand so that their sum is >= 4x L2 (at least 2)."""
    return max(2, math.ceil(L2_ROTATION_FACTOR * l2_bytes / max(operand_bytes, 1)))


def rotation_size(spec: OpSpec, problem: Problem, device: DeviceInfo) -> tuple[int, int]:
    """(copies, bytes of all copies) of the operands a :class:`Rotation` of ``problem`` rotates.

    The copies' rotated operands (``OpSpec.rotated_inputs``) together reach >= 4x L2, capped by
    ``OpSpec.max_copies``; two on a CPU. Sized from the op's own inputs built as meta tensors, so a
    caller can decide whether a rotation fits before any memory is taken."""
    meta = spec.make_inputs(problem, torch.device("meta"), torch.Generator())
    one = sum(meta[i].numel() * meta[i].element_size() for i in spec.rotated_inputs)
    copies = rotation_copies(one, device.l2_bytes) if device.is_gpu else 2
    if spec.max_copies is not None:
        copies = max(2, min(copies, spec.max_copies))
    return copies, copies * one


class Rotation:
    """Fresh random inputs for one problem with the large operands in ``copies`` copies.

    The rotated inputs are ``OpSpec.rotated_inputs`` (the GEMV weight; the
    activations of an elementwise op); their bytes together set the copies
    (>= 4x L2), capped by ``OpSpec.max_copies`` when the op sets one. Every copy
    has its own outputs (a tensor, or a tuple for a multi-output op).
    """

    def __init__(self, spec: OpSpec, problem: Problem, device: DeviceInfo, seed: int = 1234) -> None:
        tdev = torch.device(device.torch_device)
        gen = torch.Generator(device=tdev).manual_seed(seed)
        base = spec.make_inputs(problem, tdev, gen)
        rotated = spec.rotated_inputs
        copies, _ = rotation_size(spec, problem, device)
        self.copies = copies
        self.inputs: list[tuple[torch.Tensor, ...]] = []
        for i in range(copies):
            items = list(base)
            if i > 0:
                fresh = spec.make_inputs(problem, tdev, gen)
                for index in rotated:
                    items[index] = fresh[index]
            self.inputs.append(tuple(items))
        self.outputs = [spec.make_output(problem, tdev) for _ in range(copies)]
        self.device = device
        if device.is_gpu:
            self.launches = max(copies, MIN_LAUNCHES_PER_GRAPH)
        else:
            self.launches = copies

    def run(self, kernel: Kernel) -> None:
        for i in range(self.launches):
            j = i % self.copies
            kernel(self.inputs[j], self.outputs[j])


class _Graphed:
    """A captured graph that runs ``rotation.launches`` calls of one kernel."""

    def __init__(self, kernel: Kernel, rotation: Rotation) -> None:
        self.rotation = rotation
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            rotation.run(kernel)  # compile/warm outside capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            rotation.run(kernel)
        torch.cuda.synchronize()

    def replay_us(self) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / self.rotation.launches


def time_kernel(kernel: Kernel, rotation: Rotation, repeats: int | None = None) -> Timing:
    """Median time per call of ``kernel`` over the rotated inputs."""
    return time_interleaved({"k": kernel}, rotation, repeats)["k"]


def time_interleaved(kernels: dict[str, Kernel], rotation: Rotation, repeats: int | None = None) -> dict[str, Timing]:
    """Time several kernels in interleaved rounds (the fair way to rank them)."""
    if rotation.device.is_gpu:
        repeats = repeats or GPU_REPEATS
        graphs = {name: _Graphed(kernel, rotation) for name, kernel in kernels.items()}
        for _ in range(GPU_WARMUP_REPLAYS):
            for graphed in graphs.values():
                graphed.graph.replay()
        torch.cuda.synchronize()
        samples: dict[str, list[float]] = {name: [] for name in kernels}
        names = list(kernels)
        for r in range(repeats):
            # rotate the order each round so no kernel always follows another
            for name in names[r % len(names):] + names[: r % len(names)]:
                samples[name].append(graphs[name].replay_us())
        del graphs
        return {n: _summarise(s, rotation.launches, rotation.copies, "gpu") for n, s in samples.items()}
    repeats = repeats or 3
    samples = {name: [] for name in kernels}
    for kernel in kernels.values():
        rotation.run(kernel)  # warm-up (interpreter has no compile, but keeps parity)
    for _ in range(repeats):
        for name, kernel in kernels.items():
            t0 = time.perf_counter()
            rotation.run(kernel)
            samples[name].append((time.perf_counter() - t0) * 1e6 / rotation.launches)
    return {n: _summarise(s, rotation.launches, rotation.copies, "cpu") for n, s in samples.items()}


@dataclass
class BandwidthProbe:
    read_gbps: float  # best streaming-read figure: the GEMV limit
    copy_gbps: float  # device copy, read + write bytes
    buffer_bytes: int
    best_config: dict
    kind: str
    copy_kernel: str = ""  # which copy reached copy_gbps ("torch" or the streaming kernel's config)

    def as_dict(self) -> dict:
        return asdict(self)


def probe_bandwidth(device: DeviceInfo, buffer_bytes: int | None = None) -> BandwidthProbe:
    """Measure the read-bandwidth limit (best of a small grid of read kernels) and copy bandwidth."""
    from kernels_triton import stream_read

    tdev = torch.device(device.torch_device)
    if buffer_bytes is None:
        buffer_bytes = max(1 << 30, 16 * device.l2_bytes) if device.is_gpu else 256 << 10
    numel = buffer_bytes // 2
    src = torch.randn(numel, device=tdev, dtype=torch.float32).to(torch.bfloat16)
    best_gbps, best_cfg = 0.0, {}
    configs = stream_read.PROBE_CONFIGS if device.is_gpu else stream_read.PROBE_CONFIGS[:1]
    for cfg in configs:
        partial = stream_read.make_partials(numel, cfg, tdev)

        def read(_inputs, _out, cfg=cfg, partial=partial):
            stream_read.stream_read(src, partial, cfg)

        t = _time_once(read, device, launches=10 if device.is_gpu else 1)
        gbps = buffer_bytes / (t * 1e-6) / 1e9
        if gbps > best_gbps:
            best_gbps, best_cfg = gbps, dict(cfg)
    # Copy: the best of torch's copy and the streaming copy kernel over the same grid.
    dst = torch.empty_like(src)
    copies: dict[str, Kernel] = {"torch": lambda _inputs, _out: dst.copy_(src)}
    for cfg in configs:
        copies[f"triton {cfg}"] = lambda _inputs, _out, cfg=cfg: stream_read.stream_copy(src, dst, cfg)
    copy_gbps, copy_kernel = 0.0, ""
    for name, fn in copies.items():
        t = _time_once(fn, device, launches=10 if device.is_gpu else 1)
        gbps = 2 * buffer_bytes / (t * 1e-6) / 1e9
        if gbps > copy_gbps:
            copy_gbps, copy_kernel = gbps, name
    return BandwidthProbe(best_gbps, copy_gbps, buffer_bytes, best_cfg, device.timing_kind, copy_kernel)


class _Repeated:
    """Runs a self-contained callable ``launches`` times, no rotation: for the
    probe, whose buffer is itself many times the L2."""

    copies = 1

    def __init__(self, device: DeviceInfo, launches: int) -> None:
        self.device = device
        self.launches = launches

    def run(self, kernel: Kernel) -> None:
        for _ in range(self.launches):
            kernel((), None)  # type: ignore[arg-type]


def _time_once(fn: Kernel, device: DeviceInfo, launches: int) -> float:
    runner = _Repeated(device, launches)
    return time_interleaved({"probe": fn}, runner)["probe"].median_us  # type: ignore[arg-type]
