"""tunekit.integrations.vllm.graph_routes: a compiled graph's tunekit ops handed back to the stock math.

Inductor on the CPU, with the rewrite as its post-grad custom pass (as vLLM
runs it per compile range): the rewritten nodes must compile to exactly what
the stock composition compiles to, the kept ones must stay tunekit ops, and
the token dimension stays symbolic throughout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import tunekit.ops  # noqa: F401 - defines torch.ops.tunekit.*
from tunekit.dispatch import elementwise
from tunekit.integrations.vllm import graph_routes


class _Pass(CustomGraphPass):
    """The rewrite as Inductor's post-grad custom pass; records what it replaced and what stayed."""

    def __init__(self, keep) -> None:
        self.keep, self.replaced, self.left = keep, {}, []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.replaced = graph_routes.unroute(graph, self.keep)
        self.left = [graph_routes.tunekit_op(n) for n in graph.nodes if graph_routes.tunekit_op(n)]

    def uuid(self) -> str:
        return f"test-{id(self)}"


def _block(x, r, w, wu, wd):
    h, res = torch.ops.tunekit.fused_add_rms_norm(x, r, w, 1e-5)
    a = torch.ops.tunekit.silu_and_mul(torch.ops.tunekit.gemv(h, wu, None))
    return torch.ops.tunekit.rms_norm(torch.ops.tunekit.gemv(a, wd, None), w, 1e-5), res


def _stock_block(x, r, w, wu, wd):
    h, res = elementwise._vendor_fused_add(x, r, w, 1e-5, False)
    a = elementwise._vendor_silu_and_mul(F.linear(h, wu))
    return elementwise._vendor_rms_norm(F.linear(a, wd), w, 1e-5, False), res


def _inputs(m: int):
    g = torch.Generator().manual_seed(m)
    x, r = (torch.randn(m, 64, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(64, generator=g).bfloat16()
    wu, wd = torch.randn(96, 64, generator=g).bfloat16() * 0.1, torch.randn(64, 48, generator=g).bfloat16() * 0.1
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(r, 0)
    return x, r, w, wu, wd


def _compiled(fn, custom_pass=None, inputs=_inputs, ms=(5, 9)):
    """{m: fn compiled by Inductor (one graph, the token dim dynamic) on inputs(m)}."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_post_pass=custom_pass, fx_graph_cache=False):
        compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=None)
        return {m: compiled(*inputs(m)) for m in ms}


def test_a_range_above_the_tables_compiles_to_the_stock_math_bit_for_bit() -> None:
    every = _Pass(lambda *key: False)
    got = _compiled(_block, every)
    assert every.replaced == {"fused_add_rms_norm": 1, "gemv": 2, "silu_and_mul": 1, "rms_norm": 1}
    assert every.left == []
    want = _compiled(_stock_block)
    for m in (5, 9):  # one graph, symbolic in the token count, serves both
        assert all(torch.equal(a, b) for a, b in zip(got[m], want[m], strict=True)), m


def test_nodes_the_tables_serve_stay_tunekit_ops() -> None:
    seen = []

    def keep(op, dtype, n, k, device):
        seen.append((op, dtype, n, k, device))
        return op == "gemv" and (n, k) == (96, 64)

    some = _Pass(keep)
    got = _compiled(_block, some)
    assert some.left == ["gemv"] and some.replaced == {"fused_add_rms_norm": 1, "silu_and_mul": 1, "gemv": 1,
                                                         "rms_norm": 1}
    # the keys asked: the vLLM routes' (op, dtype, N, K), widths as plain ints
    assert sorted(set(seen)) == sorted({("fused_add_rms_norm", "bf16", 64, 64, "cpu"), ("gemv", "bf16", 96, 64, "cpu"),
                                        ("silu_and_mul", "bf16", 48, 96, "cpu"), ("gemv", "bf16", 64, 48, "cpu"),
                                        ("rms_norm", "bf16", 64, 64, "cpu")})
    eager = {m: _block(*_inputs(m)) for m in (5, 9)}
    for m in (5, 9):
        for a, b in zip(got[m], eager[m], strict=True):
            assert (a.float() - b.float()).abs().max() <= 0.0625  # a few BF16 roundings apart, not garbage


@pytest.mark.parametrize("top, start, kept", [(None, 1, False), (8, 9, False), (8, 8, True), (1, 2, False),
                                              (4, 1, True)])
def test_a_range_keeps_an_op_only_where_the_tables_reach_it(monkeypatch, top, start, kept) -> None:
    asked = []

    def largest_m(op, dtype, n, k, device):
        asked.append((op, dtype, n, k, device))
        return top

    monkeypatch.setattr(tunekit.ops, "largest_m", largest_m)
    assert graph_routes.within_table("rms_norm", "bf16", 64, 64, "cuda:0", start=start) is kept
    assert asked == [("rms_norm", "bf16", 64, 64, "cuda:0")]


def test_largest_m_reads_the_serving_tables(tmp_path) -> None:
    from tunekit import ops
    from tunekit import table as table_mod
    from tunekit.measure.device import detect

    def entry(op, m, n, k):
        return {"op": op, "dtype": "bf16", "m": m, "n": n, "k": k, "backend": "triton", "params": {},
                "kernel": "t", "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0}

    path = table_mod.save({"format": table_mod.FORMAT, "created": "test",
                           "environment": table_mod.environment_stamp(detect().as_dict(), []),
                           "read_limit_gbps": None,
                           "entries": [entry("gemv", 1, 96, 64), entry("gemv", 8, 96, 64), entry("gemv", 4, 32, 64),
                                       entry("gated_rms_norm", 2, 512, 128)]}, tmp_path / "t.json")
    ops.load_tables(str(path))
    try:
        assert ops.largest_m("gemv", "bf16", 96, 64, "cpu") == 8
        assert ops.largest_m("gemv", "bf16", 32, 64, "cpu") == 4
        assert ops.largest_m("gemv", "fp16", 96, 64, "cpu") is None
        assert ops.largest_m("gated_rms_norm", "bf16", None, 128, "cpu") == 2  # by row width, as covers()
        # rows of K one call is served in, whatever layout it comes in: M x N / K = 2 x 512 / 128
        assert ops.largest_rows("gated_rms_norm", "bf16", 128, "cpu") == 8
        assert ops.largest_rows("gemv", "bf16", 64, "cpu") == 12  # 8 x 96 / 64 beats 4 x 32 / 64
        assert ops.largest_rows("gated_rms_norm", "bf16", 64, "cpu") is None
        assert ops.largest_m("gemv", "bf16", 96, 64, "cpu") == 8  # the two caches keep apart
    finally:
        ops.load_tables([])


def _gemma_block(x, r, w, z):
    h, res = torch.ops.tunekit.gemma_fused_add_rms_norm(x, r, w, 1e-6)
    g = torch.ops.tunekit.gated_rms_norm(h.view(-1, 4, 16), z, w[:16], 1e-6)
    return torch.ops.tunekit.gemma_rms_norm(g.reshape(-1, 64), w, 1e-6), res


def _stock_gemma_block(x, r, w, z):
    h, res = elementwise._vendor_fused_add(x, r, w, 1e-6, True)
    g = elementwise._vendor_gated(h.view(-1, 4, 16), z, w[:16], 1e-6)
    return elementwise._vendor_rms_norm(g.reshape(-1, 64), w, 1e-6, True), res


def _gemma_inputs(m: int):
    g = torch.Generator().manual_seed(m)
    x, r = (torch.randn(m, 64, generator=g).bfloat16() for _ in range(2))
    z = torch.randn(m, 4, 16, generator=g).bfloat16()
    w = torch.randn(64, generator=g).bfloat16() * 0.1
    for t in (x, r, z):
        torch._dynamo.mark_dynamic(t, 0)
    return x, r, w, z


def test_the_gemma_and_gated_norms_compile_to_their_stock_math_bit_for_bit() -> None:
    every = _Pass(lambda *key: False)
    got = _compiled(_gemma_block, every, _gemma_inputs, (3, 10))
    assert every.replaced == {"gemma_fused_add_rms_norm": 1, "gated_rms_norm": 1, "gemma_rms_norm": 1}
    want = _compiled(_stock_gemma_block, None, _gemma_inputs, (3, 10))
    for m in (3, 10):
        assert all(torch.equal(a, b) for a, b in zip(got[m], want[m], strict=True)), m


class _FusePass(CustomGraphPass):
    """fuse_residual_adds then unroute, as vLLM's range pass runs them; records the graph it left."""

    def __init__(self, keep_fused, keep=lambda *key: True) -> None:
        self.keep_fused, self.keep, self.fused, self.targets = keep_fused, keep, 0, []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.fused = graph_routes.fuse_residual_adds(graph, self.keep_fused)
        graph_routes.unroute(graph, self.keep)
        self.targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]

    def uuid(self) -> str:
        return f"test-fuse-{id(self)}"


def _folded_layers(a, r, wo, wq, wd):
    """A layer's output projection, the folded norm's residual add, the next consumer (rms_gemv),
    and a second output projection whose result is used twice (never fused)."""
    s = torch.ops.tunekit.gemv(a, wo, None) + r
    q = torch.ops.tunekit.rms_gemv(s, wq, 1e-6)
    d = torch.ops.tunekit.gemv(q, wd, None)
    return s, d + d


def _stock_folded_layers(a, r, wo, wq, wd):
    s = F.linear(a, wo) + r
    d = F.linear(F.linear(tunekit.ops.unweighted_rms_norm(s, 1e-6), wq), wd)
    return s, d + d


def _folded_inputs(m: int):
    g = torch.Generator().manual_seed(m)
    a, r = torch.randn(m, 48, generator=g).bfloat16(), torch.randn(m, 64, generator=g).bfloat16()
    wo = torch.randn(64, 48, generator=g).bfloat16() * 0.1
    wq, wd = torch.randn(80, 64, generator=g).bfloat16() * 0.1, torch.randn(64, 80, generator=g).bfloat16() * 0.1
    torch._dynamo.mark_dynamic(a, 0)
    torch._dynamo.mark_dynamic(r, 0)
    return a, r, wo, wq, wd


def test_a_gemv_feeding_a_residual_add_becomes_gemv_add_where_the_tables_serve_it() -> None:
    seen = []

    def keep_fused(op, dtype, n, k, device):
        seen.append((op, dtype, n, k, device))
        return True

    fuse = _FusePass(keep_fused)
    got = _compiled(_folded_layers, fuse, inputs=_folded_inputs)
    assert fuse.fused == 1 and seen == [("gemv_add", "bf16", 64, 48, "cpu")], seen
    ops = [t for t in fuse.targets if t.startswith("tunekit.")]
    # the add went into the first GEMV; the second GEMV's output has two uses and stays
    assert ops == ["tunekit.gemv_add.default", "tunekit.rms_gemv.default", "tunekit.gemv.default"], ops
    want = _compiled(_folded_layers, inputs=_folded_inputs)  # no pass: the ops' own (vendor) paths, the same math
    for m in (5, 9):
        assert all(torch.equal(x, y) for x, y in zip(got[m], want[m], strict=True)), m


def test_no_gemv_add_where_the_tables_lack_it_and_above_them_the_stock_math() -> None:
    none = _FusePass(lambda *key: False)
    _compiled(_folded_layers, none, inputs=_folded_inputs)
    assert none.fused == 0 and "tunekit.gemv_add.default" not in none.targets
    assert none.targets.count("aten.add.Tensor") == 2, none.targets
    # a range above the tables: nothing fused, and rms_gemv back to the unweighted norm and F.linear
    above = _FusePass(lambda *key: False, keep=lambda *key: False)
    got = _compiled(_folded_layers, above, inputs=_folded_inputs)
    assert not [t for t in above.targets if t.startswith("tunekit.")], above.targets
    # the stock math's values (eager: Inductor's own compile of it may turn mm + add into addmm, one
    # rounding fewer; the pass runs after that pattern and leaves the spliced add apart)
    for m in (5, 9):
        want = _stock_folded_layers(*_folded_inputs(m))
        assert all(torch.equal(x, y) for x, y in zip(got[m], want, strict=True)), m


def _fused_ops_block(a, r, wo, wq, wd):
    s = torch.ops.tunekit.gemv_add(a, wo, r)
    return s, torch.ops.tunekit.gemv(torch.ops.tunekit.rms_gemv(s, wq, 1e-6), wd, None)


@pytest.mark.parametrize("gemv_kept", [True, False])
def test_fused_ops_handed_back_keep_the_gemv_where_the_range_does(gemv_kept) -> None:
    """A range above the fused ops' entries but within the GEMV's (a fused table searched at fewer Ms
    than the main one): rms_gemv and gemv_add become their unfused math around tunekit::gemv, so the
    GEMVs stay tuned; where the range keeps no GEMV either, F.linear."""
    handed = _FusePass(lambda *key: False, keep=lambda op, *key: gemv_kept and op == "gemv")
    got = _compiled(_fused_ops_block, handed, inputs=_folded_inputs)
    left = [t for t in handed.targets if t.startswith("tunekit.")]
    assert left == (["tunekit.gemv.default"] * 3 if gemv_kept else []), handed.targets
    for m in (5, 9):
        a, r, wo, wq, wd = _folded_inputs(m)
        s = F.linear(a, wo) + r
        want = (s, F.linear(F.linear(tunekit.ops.unweighted_rms_norm(s, 1e-6), wq), wd))
        for x, y in zip(got[m], want, strict=True):
            assert (x.float() - y.float()).abs().max() <= 0.0625 * y.float().abs().max(), m  # BF16 roundings apart


@pytest.mark.parametrize("case", ["bias", "broadcast", "alpha", "promoted"])
def test_adds_the_epilogue_cannot_take_stay(case) -> None:
    def fn(a, r, wo, wq, wd):
        bias = wq[:64, 0] if case == "bias" else None
        y = torch.ops.tunekit.gemv(a, wo, bias)
        if case == "broadcast":
            return y + r[0]  # [N] against [M, N]
        if case == "alpha":
            return torch.add(y, r, alpha=2)
        if case == "promoted":
            return y + r.float()
        return y + r

    fuse = _FusePass(lambda *key: True)
    _compiled(fn, fuse, inputs=_folded_inputs)
    assert fuse.fused == 0 and "tunekit.gemv_add.default" not in fuse.targets, fuse.targets


class _MergePass(CustomGraphPass):
    """merge_siblings as vLLM's range pass runs it; records the graph it left."""

    def __init__(self, keep, joined) -> None:
        self.keep, self.joined, self.merged, self.targets, self.seen = keep, joined, 0, [], []

    def __call__(self, graph: torch.fx.Graph) -> None:
        def keep(*key):
            self.seen.append(key)
            return self.keep(*key)

        self.merged = graph_routes.merge_siblings(graph, keep, self.joined)
        self.targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]

    def uuid(self) -> str:
        return f"test-merge-{id(self)}"


def _siblings(x, wa, wb, wc):
    """Two folded consumers of one x (a Gated DeltaNet's in_proj_qkvz and in_proj_ba), their outputs
    split and reshaped as vLLM's layer does, and a GEMV of another input (never merged)."""
    h = torch.ops.tunekit.rms_gemv(x, wa, 1e-6)
    g = torch.ops.tunekit.rms_gemv(x, wb, 1e-6)
    q, z = h.split([40, 40], dim=-1)
    return q * 2, z.reshape(z.shape[0], -1, 8), g + 1, torch.ops.tunekit.gemv(h, wc, None)


def _sibling_inputs(m: int, joined: bool = True):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 64, generator=g).bfloat16()
    both = torch.randn(88, 64, generator=g).bfloat16() * 0.1
    wa, wb = (both[:80], both[80:]) if joined else (both[:80].clone(), both[80:].clone())
    wc = torch.randn(16, 80, generator=g).bfloat16() * 0.1
    torch._dynamo.mark_dynamic(x, 0)
    return x, wa, wb, wc


def _stock_siblings(x, wa, wb, wc):
    normed = tunekit.ops.unweighted_rms_norm(x.float(), 1e-6)
    h, g = normed @ wa.float().T, normed @ wb.float().T
    return h[:, :40] * 2, h[:, 40:].reshape(x.shape[0], -1, 8), g + 1, h @ wc.float().T


def test_sibling_gemvs_on_joined_weights_become_one_launch() -> None:
    from tunekit.dispatch.markers import dispatch_stats

    merge = _MergePass(lambda *key: True, {((80, 8), 64)})
    dispatch_stats(reset=True)
    got = _compiled(_siblings, merge, inputs=_sibling_inputs)
    assert merge.merged == 1 and merge.seen == [("rms_gemv", "bf16", 88, 64, "cpu")], merge.seen
    ops = [t for t in merge.targets if t.startswith("tunekit.")]
    assert ops == ["tunekit.sibling_gemv.default", "tunekit.gemv.default"], ops
    # one rms_gemv call per forward, at the joined shape; nothing ran per sibling
    rows = {(r["op"], r["shape"], r["impl"]) for r in dispatch_stats()}
    assert ("rms_gemv", "88x64", "fallback:no_table") in rows and not {r for r in rows if r[0] == "sibling_gemv"}
    assert not {r for r in rows if r[0] == "rms_gemv" and r[1] != "88x64"}, rows
    for m in (5, 9):
        want = _stock_siblings(*_sibling_inputs(m))
        for a, b in zip(got[m], want, strict=True):
            torch.testing.assert_close(a.float(), b, atol=0.02, rtol=0.02)


def test_merged_siblings_whose_weights_are_apart_run_one_gemv_each() -> None:
    from tunekit.dispatch.markers import dispatch_stats

    merge = _MergePass(lambda *key: True, {((80, 8), 64)})
    dispatch_stats(reset=True)
    got = _compiled(_siblings, merge, inputs=lambda m: _sibling_inputs(m, joined=False))
    assert merge.merged == 1
    rows = {(r["op"], r["shape"], r["impl"]) for r in dispatch_stats()}
    assert ("sibling_gemv", "80x64+8x64", "fallback:not_joined") in rows, rows
    assert {("rms_gemv", "80x64"), ("rms_gemv", "8x64")} <= {(op, shape) for op, shape, _ in rows}, rows
    for m in (5, 9):
        want = _stock_siblings(*_sibling_inputs(m))
        for a, b in zip(got[m], want, strict=True):
            torch.testing.assert_close(a.float(), b, atol=0.02, rtol=0.02)


@pytest.mark.parametrize("case", ["not joined", "not in the tables", "other order", "other eps", "bias"])
def test_siblings_stay_apart(case) -> None:
    def fn(x, wa, wb, wc):
        if case == "other eps":
            return torch.ops.tunekit.rms_gemv(x, wa, 1e-6), torch.ops.tunekit.rms_gemv(x, wb, 1e-5)
        if case == "bias":
            return torch.ops.tunekit.gemv(x, wa, None), torch.ops.tunekit.gemv(x, wb, wa[:8, 0])
        if case == "other order":
            return torch.ops.tunekit.gemv(x, wb, None), torch.ops.tunekit.gemv(x, wa, None)
        return torch.ops.tunekit.gemv(x, wa, None), torch.ops.tunekit.gemv(x, wb, None)

    joined = set() if case == "not joined" else {((80, 8), 64)}
    merge = _MergePass(lambda *key: case != "not in the tables", joined)
    _compiled(fn, merge, inputs=_sibling_inputs)
    assert merge.merged == 0 and "tunekit.sibling_gemv.default" not in merge.targets, merge.targets
    assert (merge.seen != []) == (case == "not in the tables"), merge.seen
