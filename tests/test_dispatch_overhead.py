"""Cheap dispatch: the routed ops' per-call cost, the bound launcher's fallback, exact counting, the facade's API.

CPU tier (Triton on the interpreter): the bound launcher never binds here, so
these tests check that its fallback is taken and serves bit-identical results;
the GPU side (binding, replay, timings) is benchmarks/probes/dispatch_overhead.py.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tunekit.ops as ops
from tunekit import backends
from tunekit import table as table_mod
from tunekit.dispatch import canary, elementwise, launch
from tunekit.dispatch import gemv as serving_gemv
from tunekit.dispatch.state import STATE, CallCounter
from tunekit.measure.device import detect
from tunekit.problems.shapes import Problem

pytestmark = pytest.mark.usefixtures("clean_ops")  # conftest.py: no table, markers or vendor GEMM leak

GEMV_PARAMS = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 1, "num_stages": 1}
NORM_PARAMS = {"BLOCK_N": 64, "ROWS": 1, "num_warps": 1, "VLLM_ROUNDING": 1}
N, K = 24, 192


def _table(path: Path, rows: list[tuple[str, int, int, int, dict]]) -> Path:
    entries = [{"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "backend": "triton", "params": json.dumps(p),
                "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0} for op, m, n, k, p in rows]
    return table_mod.save(table_mod.build_table(entries, detect().as_dict(), {}, 0.0, ["triton"]), path)


# (a) the vendor path's cost --------------------------------------------------------------------------

_LIB = torch.library.Library("tunekit_test_floor", "DEF")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_LIB.impl("linear", lambda x, weight, bias=None: F.linear(x, weight, bias), "CPU")


def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _interleaved_ratio(arms: dict, num: str, den: str, rounds: int = 15, calls: int = 400,
                       ) -> tuple[float, dict[str, float]]:
    """Median over rounds of the per-round ratio of arm ``num``'s per-call time to arm ``den``'s.

    The arms run interleaved in each round, so a ratio is of two calls timed moments apart,
    under the same load; the arms' median times come back for the message. Each arm is warmed
    first (a route is made by its first call)."""
    for fn in arms.values():
        _per_call_us(fn, 300)
    samples: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            samples[name].append(_per_call_us(fn, calls))
    ratio = statistics.median(n / d for n, d in zip(samples[num], samples[den], strict=True))
    return ratio, {a: round(statistics.median(v), 2) for a, v in samples.items()}


def _best_of_five(measure, bound: float) -> tuple[float, dict[str, float]]:
    """The lowest (ratio, medians) of up to five ``measure()`` calls, stopping at the first within
    ``bound``: noise has to hit all five to fail a test."""
    results = []
    for _ in range(5):
        results.append(measure())
        if results[-1][0] <= bound:
            break
    return min(results, key=lambda r: r[0])


def _overhead_ratio() -> tuple[float, dict[str, float]]:
    """The vendor path's per-call time over that of a custom op that just calls F.linear.

    Arms: ``direct`` F.linear; ``floor`` a custom op whose Python impl is just F.linear (torch's
    own dispatch into a Python kernel: what any torch.ops call pays); ``op``
    torch.ops.tunekit.gemv with no table (the vendor path). Ratio op / floor.
    """
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    arms = {"direct": lambda: F.linear(x, w, None), "floor": lambda: torch.ops.tunekit_test_floor.linear(x, w, None),
            "op": lambda: torch.ops.tunekit.gemv(x, w, None)}
    return _interleaved_ratio(arms, "op", "floor")


def test_vendor_path_costs_little_more_than_any_custom_op() -> None:
    # The bound: a vendor-path call through torch.ops.tunekit.gemv takes at most 1.9x a custom op
    # that only calls F.linear, i.e. tunekit's own Python per call (route lookup, stride checks,
    # one counter tick) stays below ~0.9x of what torch's dispatch plus F.linear cost. Measured on
    # a 2-core x86 CPU (tiny F.linear ~2.2 us, the floor op ~4.6 us): 1.4-1.5x; before the
    # per-shape routes (a key, a shape string, the decision-cache key and a locked dict per call)
    # it was 2.2-2.3x. The ratio is of two calls timed moments apart, so the machine's load mostly
    # cancels; best of five measurements (~0.5 s each), so noise has to hit all five to fail the test.
    ratio, med = _best_of_five(_overhead_ratio, 1.9)
    assert ratio <= 1.9, f"vendor path costs {ratio:.2f}x a custom op around F.linear (median us: {med})"
    assert [(r["impl"], r["vendor"]) for r in ops.dispatch_stats()] == [("fallback:no_table", "F.linear")]


#: The uncovered call's figures (issue 52, item 3): :func:`_uncovered_costs` on a 2-core x86 CPU (Python
#: 3.11, torch 2.13 CPU build) shared with other jobs (load average 10-12), 12 measurements per arm from 6
#: processes each, the arms' processes alternated; median [range] (one "after" process was disturbed):
#:
#: - over ``F.linear`` (2.1 us): before 4.03 [3.51-4.24] us, after 3.75 [3.31-5.97] us;
#: - over a custom op whose Python kernel only calls ``F.linear`` (torch's dispatch into a Python kernel,
#:   2.3-2.9 us over ``F.linear`` here, and the same for a kernel that only ticks a counter and calls it):
#:   before 1.35 [1.06-1.48] us, after 1.09 [0.97-1.80] us: tunekit's own Python per call. With no
#:   table (``fallback:no_table``) and with the shape in a table of another TP size
#:   (``fallback:tp_mismatch``), 3 processes per arm: 1.24-1.27 before, 0.99-1.03 after.
#:
#: Before, per call, the route key held two ``torch.device`` objects (made and hashed per call) and the
#: route was checked against the decision cache (a second key hashed) and the vendor hook; after, the
#: key holds the device indices and the check is one comparison with the serving epoch. Under 3 us over
#: ``F.linear`` is out of reach here for any Python kernel that looks anything up: the dispatch alone
#: takes 2.3-2.9 us of it. The bounds fail a return to 5 us over ``F.linear`` (per-call decisions).
#: Another day the same machine, idle (load 0.7), ran everything slower: F.linear 2.7 us, the dispatch
#: 3.8-4.3 us, tunekit's own 1.9-2.0 us, 5.8-6.2 us over F.linear (3 measurements): the figures in us are
#: judged only where the dispatch runs at the cost above, their ratio always.
UNCOVERED_OVER_LINEAR_US = 4.5
UNCOVERED_OVER_CUSTOM_OP_US = 1.75
#: torch's dispatch into a Python custom-op kernel over F.linear on that machine at low load: 2.3-2.9 us.
DISPATCH_IDLE_US = 3.0
#: tunekit's own cost over that dispatch's: 0.4-0.5 at any load measured (1.09 / 2.6 idle, 2.1-2.7 / 4.6 at
#: load 3); a return to per-call decisions (5 us over F.linear) is about 0.9.
OWN_PER_DISPATCH = 0.8


def _uncovered_costs(rounds: int = 200, calls: int = 100) -> tuple[float, dict[str, float]]:
    """(the uncovered op's median per-call us over F.linear's, the arms' medians).

    Arms, interleaved (order reversed every other round, so drift hits all alike), short blocks (a burst
    of load spoils a few blocks, not the medians): ``F.linear``; ``floor``, a custom op whose Python
    kernel just calls it; ``op``, ``torch.ops.tunekit.gemv`` at a shape no loaded table covers
    (``fallback:no_entry``: a table is loaded, the call's dtype and shape are not in it)."""
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    arms = {"F.linear": lambda: F.linear(x, w, None), "floor": lambda: torch.ops.tunekit_test_floor.linear(x, w, None),
            "op": lambda: torch.ops.tunekit.gemv(x, w, None)}
    for fn in arms.values():
        _per_call_us(fn, 500)
    samples: dict[str, list[float]] = {a: [] for a in arms}
    order = list(arms.items())
    for i in range(rounds):
        for name, fn in (order if i % 2 else order[::-1]):
            samples[name].append(_per_call_us(fn, calls))
    med = {a: round(statistics.median(v), 3) for a, v in samples.items()}
    return med["op"] - med["F.linear"], med


def test_an_uncovered_call_costs_little_more_than_f_linear(tmp_path: Path) -> None:
    # The figures and the machine: UNCOVERED_OVER_LINEAR_US's comment. Up to five measurements (~0.5 s each),
    # stopping at the first within the bounds: load has to spoil all five to fail the test.
    ops.load_tables(str(_table(tmp_path / "t.json", [("gemv", 1, N, K, GEMV_PARAMS)])))  # bf16 24x192 only

    def failure(over: float, med: dict[str, float]) -> str | None:
        dispatch, own = med["floor"] - med["F.linear"], med["op"] - med["floor"]
        # Load stretches torch's dispatch and tunekit's Python alike (CI's xdist workers at load 3: dispatch
        # 4.6-4.7 us, tunekit's own 2.1-2.7 us), so their ratio is judged always, the figures in us only
        # where the dispatch ran at its idle cost.
        if own > OWN_PER_DISPATCH * dispatch:
            return f"tunekit's own {own:.2f} us is over {OWN_PER_DISPATCH} x torch's dispatch ({dispatch:.2f} us)"
        if dispatch <= DISPATCH_IDLE_US and over > UNCOVERED_OVER_LINEAR_US:
            return f"an uncovered call costs {over:.2f} us over F.linear"
        if dispatch <= DISPATCH_IDLE_US and own > UNCOVERED_OVER_CUSTOM_OP_US:
            return f"an uncovered call costs {own:.2f} us over a custom op around F.linear"
        return None

    failures = []
    for _ in range(5):
        over, med = _uncovered_costs()
        failures.append(failure(over, med))
        if failures[-1] is None:
            break
        failures[-1] += f" (medians: {med})"
    assert failures[-1] is None, "in each of five measurements: " + "; ".join(failures)
    assert [(r["impl"], r["vendor"]) for r in ops.dispatch_stats()] == [("fallback:no_entry", "F.linear")]


def test_a_cached_route_follows_new_tables_tp_changes_and_demotions(tmp_path: Path) -> None:
    # The route a call resolved is kept per key and checked per call only against the serving epoch:
    # each thing that may change its decision bumps the epoch, so the next call of the same key sees it.
    from tunekit.dispatch import decisions, tables

    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn((1, K), generator=gen).bfloat16(), torch.randn((N, K), generator=gen).bfloat16()
    other = torch.randn((2 * N, K), generator=gen).bfloat16()  # a shape no table here holds
    key = (x.shape, w.shape, x.dtype, w.dtype, -1, -1)

    def served(vendor: bool) -> list[tuple[str, int]]:
        """Two calls of the key and two of another shape: the key's marker rows."""
        ops.reset_stats()
        for _ in range(2):
            y = torch.ops.tunekit.gemv(x, w, None)
            assert torch.equal(y, F.linear(x, w)) or not vendor
            torch.ops.tunekit.gemv(x, other, None)
        return sorted((r["impl"], r["calls"]) for r in ops.dispatch_stats() if r["shape"] == f"{N}x{K}")

    def tp_table(name: str, tp: int | None) -> str:
        path = _table(tmp_path / name, [("gemv", 1, N, K, GEMV_PARAMS)])
        doc = json.loads(path.read_text())
        doc["tp"] = tp
        path.write_text(json.dumps(doc))
        return str(path)

    ops.load_tables(str(_table(tmp_path / "none.json", [("gemv", 1, 2 * N + 8, K, GEMV_PARAMS)])))
    assert served(vendor=True) == [("fallback:no_entry", 2)]
    vendor_route = serving_gemv._ROUTES[key]
    ops.load_tables(tp_table("tp2.json", 2))  # a new table that holds the shape: the cached route goes
    try:
        assert served(vendor=False) == [("tuned:triton", 2)] and serving_gemv._ROUTES[key] is not vendor_route
        tables.set_tensor_parallel(1)  # no reload: the TP check alone moves the same key to the vendor path
        assert served(vendor=True) == [("fallback:tp_mismatch", 2)]
        # what an integration asks per layer call (cached as well, and as well forgotten on a TP change)
        assert [tables.other_tp("gemv", "bf16", N, K, "cpu") for _ in range(2)] == [2, 2]
        tables.set_tensor_parallel(2)
        assert served(vendor=False) == [("tuned:triton", 2)]
        assert tables.other_tp("gemv", "bf16", N, K, "cpu") is None
        # a demotion (the canary's or a raising kernel's: decisions.mark_broken) takes the next call
        other_key = (x.shape, other.shape, x.dtype, x.dtype, -1, -1)
        route, kept = serving_gemv._ROUTES[key], serving_gemv._ROUTES[other_key]
        decisions.mark_broken("gemv", "bf16", 1, N, K, x.device, canary.CanaryMismatch("a drift"))
        assert served(vendor=True) == [("fallback:canary_mismatch", 2)] and serving_gemv._ROUTES[key] is not route
        # the other key's route was checked again and kept (its decision still held), not made anew
        assert serving_gemv._ROUTES[other_key] is kept and kept.epoch == STATE.epoch
    finally:
        tables.set_tensor_parallel(None)


def test_a_direct_call_on_another_device_type_leaves_no_route_for_the_cpu() -> None:
    # Routes are keyed by device index, and a meta tensor's is the CPU's (-1): its "device" fallback
    # must not be kept, or the CPU calls of the shape would be served and counted as that fallback.
    x, w = torch.randn(1, 7, device="meta"), torch.randn(5, 7, device="meta")  # shapes no other test calls
    assert serving_gemv.gemv_impl(x, w).device.type == "meta"  # as a patched module on "meta" calls it
    for _ in range(2):
        assert torch.equal(serving_gemv.gemv_impl(torch.ones(1, 7), torch.full((5, 7), 2.0)), torch.full((1, 5), 14.0))
    assert sorted((r["impl"], r["calls"]) for r in ops.dispatch_stats()) == [("fallback:device", 1),
                                                                             ("fallback:no_table", 2)]


def _patched_linear_ratio() -> tuple[float, dict[str, float]]:
    """A patched nn.Linear's per-call time (no table: the vendor path) over the unpatched module's."""
    import copy

    import tunekit

    plain = torch.nn.Linear(64, 32, bias=False)
    patched = copy.deepcopy(plain)
    assert tunekit.patch(patched, only_covered=False) == {"linear": 1}
    x = torch.randn(1, 64)
    with torch.no_grad():
        return _interleaved_ratio({"plain": lambda: plain(x), "patched": lambda: patched(x)}, "patched", "plain")


def test_a_patched_linear_on_the_vendor_path_costs_about_what_the_module_does() -> None:
    # Eager, a patched forward calls the op's impl without torch's dispatcher, and a shape it met on
    # the vendor path goes straight to F.linear (tunekit.dispatch.gemv.EagerLinear). Measured on a
    # 2-core x86 CPU (unpatched ~5.0 us, patched ~6.1 us): 1.2x; through torch.ops.tunekit.gemv it
    # was 7.1 us (1.4x), and 1.7x before the vendor route skipped the stride checks. Bound 1.45x.
    ratio, med = _best_of_five(_patched_linear_ratio, 1.45)
    assert ratio <= 1.45, f"a patched linear costs {ratio:.2f}x the unpatched module (median us: {med})"
    assert [(r["impl"], r["vendor"]) for r in ops.dispatch_stats()] == [("fallback:no_table", "F.linear")]


def test_an_uncovered_linear_in_a_patched_eager_model_costs_about_what_the_module_does(tmp_path: Path) -> None:
    # Issue 52's case: the linear an eager model (tunekit.patch) runs that no table covers, with a table
    # loaded (fallback:no_entry). Its forward calls the op's impl without torch's dispatcher, so it pays
    # tunekit's own Python and not the dispatch (3.8-4.3 us there on the same machine, idle: the custom op's
    # figure above). Measured on a 2-core x86 CPU, idle (unpatched 7.1-7.4 us, F.linear 4.3 us): 1.9-2.2 us
    # over the unpatched module, under the 3 us. Judged as a ratio (a loaded machine stretches both
    # alike), the bound of the vendor path's test above.
    import copy

    import tunekit

    ops.load_tables(str(_table(tmp_path / "t.json", [("gemv", 1, N, K, GEMV_PARAMS)])))  # bf16 24x192 only
    plain = torch.nn.Linear(64, 32, bias=False)
    patched = copy.deepcopy(plain)
    assert tunekit.patch(patched, only_covered=False) == {"linear": 1}
    x = torch.randn(1, 64)

    def ratio() -> tuple[float, dict[str, float]]:
        with torch.no_grad():
            return _interleaved_ratio({"plain": lambda: plain(x), "patched": lambda: patched(x)}, "patched", "plain")

    measured, med = _best_of_five(ratio, 1.45)
    assert measured <= 1.45, f"an uncovered patched linear costs {measured:.2f}x the module (median us: {med})"
    assert [(r["impl"], r["vendor"]) for r in ops.dispatch_stats()] == [("fallback:no_entry", "F.linear")]


def test_patched_eager_calls_skip_the_dispatcher_and_follow_table_reloads(tmp_path: Path) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    import tunekit

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(K, N, bias=False).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn((N, K), generator=gen))
    assert tunekit.patch(lin, only_covered=False) == {"linear": 1}
    x = torch.randn((1, K), generator=gen).bfloat16()
    with torch.no_grad():
        with Seen() as seen:
            for _ in range(3):  # the first call resolves the route, the next ones take the shortcut
                assert torch.equal(lin(x), F.linear(x, lin.weight))
        assert seen.ops and not any(op.startswith("tunekit.") for op in seen.ops)  # F.linear's aten ops only
        ops.load_tables(str(_table(tmp_path / "t.json", [("gemv", 1, N, K, GEMV_PARAMS)])))
        kernel = backends.get("triton").build(Problem("gemv", "bf16", 1, N, K), GEMV_PARAMS, detect())
        ref = torch.empty(1, N, dtype=torch.bfloat16)
        kernel((x, lin.weight), ref)
        for _ in range(2):  # the reload bumped the epoch: the vendor shortcut is gone, the tuned kernel serves
            assert torch.equal(lin(x), ref)
        # the kept route is for this x shape, dtypes and devices only: another dtype is F.linear's business
        with pytest.raises(RuntimeError):
            lin(x.float())
        lin.weight.data = lin.weight.data.float()  # as Module.to() does: same Parameter, new dtype
        assert torch.equal(lin(x.float()), F.linear(x.float(), lin.weight))
        lin.weight.data = lin.weight.data.bfloat16()
        assert torch.equal(lin(x), ref)
        ops.load_tables([])
        assert torch.equal(lin(x), F.linear(x, lin.weight))
    rows = [(r["impl"], r["calls"], r["dtype"]) for r in ops.dispatch_stats()]
    # the fp32 call on the bf16 weight raised inside F.linear, counted as the dtype fallback it was
    assert sorted(rows) == [("fallback:dtype", 1, "fp32"), ("fallback:no_entry", 1, "fp32"),
                            ("fallback:no_table", 4, "bf16"), ("tuned:triton", 3, "bf16")]


# (b) the fast path: bound launcher fallback, bit-identical results, exact counts -----------------------

def test_interpreter_never_binds_and_the_normal_launch_serves(tmp_path: Path) -> None:
    assert launch.unsupported_reason() == "interpreter"
    problem = Problem("gemv", "bf16", 1, N, K)
    kernel = backends.get("triton").build(problem, GEMV_PARAMS, detect())
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn((1, K), generator=gen).bfloat16(), torch.randn((N, K), generator=gen).bfloat16()
    ref, out = torch.empty(1, N, dtype=torch.bfloat16), torch.full((1, N), float("nan"), dtype=torch.bfloat16)
    kernel((x, w), ref)
    assert launch.bind(kernel, (x, w), out) is None
    assert torch.equal(out, ref)  # bind() launched it the normal way
    assert launch.bound(kernel) == (True, None)  # tried once, remembered: never recorded again


def test_gemv_fast_path_is_bit_identical_and_counted_exactly(tmp_path: Path) -> None:
    ops.load_tables(str(_table(tmp_path / "t.json", [("gemv", 1, N, K, GEMV_PARAMS)])))
    gen = torch.Generator().manual_seed(1)
    w = torch.randn((N, K), generator=gen).bfloat16()
    xs = [torch.randn((1, K), generator=gen).bfloat16() for _ in range(3)]
    kernel = backends.get("triton").build(Problem("gemv", "bf16", 1, N, K), GEMV_PARAMS, detect())
    calls = 0
    for x in xs:
        ref = torch.empty(1, N, dtype=torch.bfloat16)
        kernel((x, w), ref)
        for _ in range(3):  # first call: resolve and route; then the route alone
            y = torch.ops.tunekit.gemv(x, w, None)
            calls += 1
            assert torch.equal(y, ref)
        y3 = torch.ops.tunekit.gemv(x.view(1, 1, K), w, None)  # another route, same decision
        calls += 1
        assert y3.shape == (1, 1, N) and torch.equal(y3.view(1, N), ref)
    route = serving_gemv._ROUTES[(xs[0].shape, w.shape, w.dtype, w.dtype, -1, -1)]  # -1: get_device() on the CPU
    assert route.choice.impl == "tuned:triton" and route.launcher is None and not route.bind
    assert launch.bound(route.kernel) == (True, None)  # the fallback was taken, once
    assert [(r["impl"], r["shape"], r["calls"]) for r in ops.dispatch_stats()] == [("tuned:triton", f"{N}x{K}", calls)]


def test_routes_follow_table_reloads_and_strided_calls(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn((1, K), generator=gen).bfloat16(), torch.randn((N, K), generator=gen).bfloat16()
    torch.ops.tunekit.gemv(x, w, None)  # no table: a vendor route
    ops.load_tables(str(_table(tmp_path / "t.json", [("gemv", 1, N, K, GEMV_PARAMS)])))
    torch.ops.tunekit.gemv(x, w, None)  # the cached route is stale: the new decision serves
    wide = torch.randn((N, 2 * K), generator=gen).bfloat16()[:, ::2]  # W not unit-stride along K
    assert torch.equal(torch.ops.tunekit.gemv(x, wide, None), F.linear(x, wide))
    bias = torch.randn(N, generator=gen).bfloat16()
    torch.ops.tunekit.gemv(x, w, bias)
    rows = {(r["impl"], r["bias"]): r["calls"] for r in ops.dispatch_stats()}
    assert rows == {("fallback:no_table", False): 1, ("tuned:triton", False): 1, ("fallback:strided", False): 1,
                    ("tuned:triton", True): 1}


def test_rms_norm_fast_path_is_bit_identical_and_counted_exactly(tmp_path: Path) -> None:
    ops.load_tables(str(_table(tmp_path / "t.json", [("rms_norm", 2, 64, 64, NORM_PARAMS)])))
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn((2, 64), generator=gen).bfloat16(), torch.randn(64, generator=gen).bfloat16()
    kernel = backends.get("triton").build(Problem("rms_norm", "bf16", 2, 64, 64), NORM_PARAMS, detect())
    ref = torch.empty(2, 64, dtype=torch.bfloat16)
    kernel((x, w), ref)
    for _ in range(4):
        assert torch.equal(torch.ops.tunekit.rms_norm(x, w, 1e-6), ref)
    route = elementwise._EW_ROUTES[("rms_norm", 2, 64, 64, x.dtype, x.device, 1e-6)]
    assert route.launcher is None and not route.bind
    assert [(r["impl"], r["calls"]) for r in ops.dispatch_stats()] == [("tuned:triton", 4)]


def test_counters_are_exact_across_threads_reads_and_resets() -> None:
    from tunekit.dispatch.markers import counter

    c = counter("gemv", "bf16", "8x8", 1, False, "fallback:no_table", False, "F.linear")
    assert isinstance(c, CallCounter) and counter("gemv", "bf16", "8x8", 1, False, "fallback:no_table", False,
                                                  "F.linear") is c

    def work() -> None:
        for _ in range(20000):
            c.tick()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(50):  # settle while the threads tick: nothing is lost or counted twice
        ops.dispatch_stats()
    for t in threads:
        t.join()
    assert [r["calls"] for r in ops.dispatch_stats(reset=True)] == [80000]
    c.tick()
    saved = dict(STATE.stats)  # what prepare() does around its warm-up calls
    c.tick()
    c.tick()
    STATE.stats = saved  # the warm-up's ticks are dropped with the counts they were added to
    assert [r["calls"] for r in ops.dispatch_stats()] == [1]


# (c) the facade ------------------------------------------------------------------------------------

def test_ops_exposes_its_documented_api() -> None:
    assert set(ops.__all__) >= {"covers", "dispatch_log", "dispatch_stats", "dtype_name", "gemv", "load_tables",
                                "loaded_tables", "prepare", "reset_stats", "set_vendor_gemm",
                                "set_vendor_elementwise", "clear_vendor_elementwise", "vendor_kernels",
                                "write_dispatch_log"}
    for name in ops.__all__:
        value = getattr(ops, name)
        if name.isupper():  # the vocabularies and constants: DEFAULT_VENDOR, FALLBACK_REASONS, DEFAULT_EPS ...
            assert isinstance(value, (str, dict, float)) and value, name
        else:
            assert callable(value), name
    for op in ("gemv", "rms_norm", "gemma_rms_norm", "fused_add_rms_norm", "gemma_fused_add_rms_norm",
               "gated_rms_norm", "silu_and_mul", "bias_gelu"):
        assert callable(getattr(torch.ops.tunekit, op)), op


# the bound launcher's replay and guard, against a stand-in for Triton's driver ---------------------------

def test_launcher_replays_recorded_arguments_and_guards_the_layout(monkeypatch) -> None:
    # No GPU here: Triton's driver and a compiled kernel are stand-ins, so this checks what the
    # generated launch passes (JITFunction.run's call: grid, stream, function, metadata, no hooks,
    # then every bound argument in order) and when its guard refuses (benchmarks/probes/dispatch_overhead.py
    # checks the real replay on a GPU, bit for bit).
    import sys
    import types

    class Chain:
        calls: list = []

    knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(launch_enter_hook=Chain(), launch_exit_hook=Chain()))
    driver = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 1234)
    fake = types.SimpleNamespace(runtime=types.SimpleNamespace(driver=types.SimpleNamespace(active=driver)),
                                 knobs=knobs)
    monkeypatch.setitem(sys.modules, "triton", fake)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    launched = []
    compiled = types.SimpleNamespace(run=lambda *a: launched.append(a), function="fn", packed_metadata="md")
    x, w, out = torch.zeros(1, 8), torch.zeros(4, 8), torch.zeros(1, 4)
    slots = [("io", 0), ("io", 1), ("io", 2), ("const", 8), ("scratch", ((2, 4), torch.float32, "cpu")),
             ("const", None)]
    launcher = launch.Launcher([{"compiled": compiled, "grid": (4, 1, 1), "slots": slots}], (x, w, out), False, 2)
    assert launcher((x, w), out) and launcher((x.clone(), w), torch.empty(1, 4), None, True)
    args = launched[0]
    assert args[:9] == (4, 1, 1, 1234, "fn", "md", None, None, None)
    assert args[9] is x and args[10] is w and args[11] is out and args[12] == 8 and args[14] is None
    assert args[13].shape == (2, 4) and args[13] is not launched[1][13]  # scratch: fresh per call
    wide = torch.zeros(1, 16)
    assert not launcher((wide[:, ::2], w), out)  # another stride along K: not this specialization
    assert not launcher((torch.zeros(2, 8), w), torch.zeros(2, 4))  # another shape (untrusted call)
    shifted = torch.zeros(16)[1:9].view(1, 8)  # same shape and strides, 4 bytes off
    assert shifted.stride() == x.stride() and not launcher((shifted, w), out, None, True)  # assumed 16-byte aligned
    knobs.runtime.launch_enter_hook.calls = [print]  # a profiler's hook: the normal launch serves
    assert not launcher((x, w), out)
    knobs.runtime.launch_enter_hook.calls = []
    assert len(launched) == 2


def test_a_patched_norm_launches_a_known_shape_through_its_kept_express_route(tmp_path: Path) -> None:
    # On the CPU no launcher binds, so the kept-route path is checked with a stand-in launcher in
    # the op's express table (tunekit.dispatch.elementwise._EXPRESS), as a bound Triton launch leaves it.
    from tunekit.integrations.torch_patch import _ELEMENTWISE_FORWARDS

    ops.load_tables(str(_table(tmp_path / "t.json", [("rms_norm", 2, 64, 64, NORM_PARAMS)])))
    gen = torch.Generator().manual_seed(5)
    norm = torch.nn.Module()
    norm.weight, norm.variance_epsilon = torch.nn.Parameter(torch.randn(64, generator=gen).bfloat16()), 1e-6
    forward = _ELEMENTWISE_FORWARDS["rms_norm"](norm)
    x = torch.randn((2, 64), generator=gen).bfloat16()
    with torch.no_grad():
        ref = forward(x)  # the full path: the tuned kernel, launched the normal way
        key = ("rms_norm", x.shape, x.dtype, x.device, norm.weight.shape, norm.weight.dtype, norm.weight.device, 1e-6)
        route = elementwise._EW_ROUTES[("rms_norm", 2, 64, 64, x.dtype, x.device, 1e-6)]  # this call's (an earlier
        # test's routes of other shapes may still be in the module's table)
        launches = []

        def launcher(inputs, out, _scratch=None, trusted=False):
            launches.append(inputs[0].shape)
            if inputs[0].stride(0) != 64:  # a guard, as the bound launcher's: another row stride
                return False
            route.choice.kernel(inputs, out)  # the launch the bound launcher replays
            return True

        route.launcher = launcher
        elementwise._EXPRESS[key] = route
        for _ in range(3):  # the first call keeps the route, the next two take it
            assert torch.equal(forward(x), ref)
        assert len(launches) == 3
        wide = torch.randn((2, 128), generator=gen).bfloat16()[:, :64]  # same shape, rows 128 apart
        assert wide.shape == x.shape and torch.equal(forward(wide), forward(wide.contiguous()))
        # wide: refused by the kept route, the op's express route and its full path's launch; then the
        # contiguous rows take the kept route
        assert len(launches) == 7
        ops.load_tables([])  # the epoch moved: nothing kept serves, the vendor path does, and the
        for _ in range(2):  # stale express route of the earlier table is not kept either
            assert torch.equal(forward(x), torch.ops.tunekit.rms_norm(x, norm.weight, 1e-6)) and len(launches) == 7
    rows = {(r["impl"], r["calls"]) for r in ops.dispatch_stats()}
    assert rows == {("fallback:no_table", 4), ("tuned:triton", 6)}  # 4 x, wide and its contiguous copy


def _stand_in_binding(monkeypatch) -> tuple[list, list]:
    """``launch.bind`` as a GPU binds: it runs the callable it is given once and returns a launcher
    that replays that callable (here by calling it). Returns (bound callables, launcher replays)."""
    binds, replays = [], []

    def bind(kernel, inputs, out):
        binds.append(kernel)
        kernel(inputs, out)

        def launcher(inputs, out, _scratch=None, trusted=False):
            replays.append(kernel)
            kernel(inputs, out)
            return True

        return launcher

    monkeypatch.setattr(launch, "bind", bind)
    return binds, replays


def test_a_tuned_norm_binds_at_the_callers_epsilon(tmp_path: Path, monkeypatch) -> None:
    # Llama's norms run at eps 1e-5, not the kernels' built 1e-6: their launcher must record and replay
    # the caller's epsilon (before, any other epsilon kept Triton's slow launch path for good).
    binds, replays = _stand_in_binding(monkeypatch)
    ops.load_tables(str(_table(tmp_path / "t.json", [("rms_norm", 2, 64, 64, NORM_PARAMS)])))
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn((2, 64), generator=gen).bfloat16(), torch.randn(64, generator=gen).bfloat16()
    kernel = backends.get("triton").build(Problem("rms_norm", "bf16", 2, 64, 64), NORM_PARAMS, detect())
    at_half, at_default = torch.empty(2, 64, dtype=torch.bfloat16), torch.empty(2, 64, dtype=torch.bfloat16)
    kernel((x, w), at_half, eps=0.5)  # an epsilon large enough to change every row's scale
    kernel((x, w), at_default)
    assert not torch.equal(at_half, at_default)
    for _ in range(3):
        assert torch.equal(torch.ops.tunekit.rms_norm(x, w, 0.5), at_half)
    assert len(binds) == 1 and len(replays) == 2  # bound at the first call, replayed by the next two
    for _ in range(2):  # the same key at the built epsilon: its own route, its own launcher
        assert torch.equal(torch.ops.tunekit.rms_norm(x, w, 1e-6), at_default)
    assert len(binds) == 2 and len(replays) == 3
    assert [(r["impl"], r["calls"]) for r in ops.dispatch_stats()] == [("tuned:triton", 5)]


def test_a_fallback_default_kernel_binds_when_its_size_comes_back(tmp_path: Path, monkeypatch) -> None:
    # Above the table's M (an eager prefill) the default-config kernel serves; a size seen once is not
    # worth binding (three checked launches and a sync), a size seen twice is: later calls replay.
    binds, replays = _stand_in_binding(monkeypatch)
    ops.load_tables(str(_table(tmp_path / "t.json", [("fused_add_rms_norm", 1, 64, 64, NORM_PARAMS)])))
    gen = torch.Generator().manual_seed(8)
    x, r, w = (torch.randn(shape, generator=gen).bfloat16() for shape in ((6, 64), (6, 64), (64,)))
    kernel = backends.get("triton").build(Problem("fused_add_rms_norm", "bf16", 6, 64, 64), NORM_PARAMS, detect())
    ref = (torch.empty(6, 64, dtype=torch.bfloat16), torch.empty(6, 64, dtype=torch.bfloat16))
    kernel((x, r, w), ref, eps=1e-5)
    for call in range(4):
        y, s = torch.ops.tunekit.fused_add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(y, ref[0]) and torch.equal(s, ref[1])
        assert (len(binds), len(replays)) == [(0, 0), (1, 0), (1, 1), (1, 2)][call]
    rows = [(r["impl"], r["vendor"], r["calls"]) for r in ops.dispatch_stats()]
    assert rows == [("fallback:m_above_table", "tunekit:triton-default", 4)]
