"""Adding an op is its files plus one record: a toy op (``tests/toy_op.py``: spec, Triton kernel, search space,
vendor composition, serving impl) registered through its record alone is searched (space, predicate, build,
verified against its fp64 reference), tabulated, and served as ``torch.ops.tunekit.toy_scale`` from a table
entry, tuned where the table holds it and on its fallback where it does not; taken out, every registry
forgets it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import toy_op

from tunekit import backends, ops
from tunekit import table as table_mod
from tunekit.measure import verify
from tunekit.measure.device import detect
from tunekit.problems import oprecords, opspec
from tunekit.problems.shapes import Problem

pytestmark = pytest.mark.usefixtures("clean_ops")
CPU = torch.device("cpu")


@pytest.fixture
def toy():
    with oprecords.registered(toy_op.RECORD):
        ops.register()  # defines torch.ops.tunekit.toy_scale from the record
        yield toy_op.RECORD
    ops.load_tables([])
    ops.register()  # the record is gone: its op is undefined again


def test_the_search_side_reads_the_record(toy) -> None:
    triton = backends.get("triton")
    problem = Problem(toy_op.OP, "bf16", 3, 80, 80)
    assert toy_op.OP in triton.ops and toy_op.OP in backends.get("vendor").ops
    space = triton.space(problem)  # the record's own space file
    assert space.domains["BLOCK_N"] == [16, 32, 64, 128] and space.default == {"BLOCK_N": 64, "num_warps": 4}
    assert triton.invalid_reason(problem, {"BLOCK_N": 48, "num_warps": 4}) == "BLOCK_N=48 is not a power of two"
    kernel = triton.build(problem, space.default, detect())
    spec = opspec.get(toy_op.OP)
    assert verify.verify(kernel, spec, problem, CPU, seed=0).ok
    assert verify.verify(backends.get("vendor").build(problem, {}, detect()), spec, problem, CPU, seed=0).ok
    wrong = lambda inputs, out: toy_op.vendor((inputs[0], inputs[1] + 1), out)  # noqa: E731
    assert not verify.verify(wrong, spec, problem, CPU, seed=0).ok


def test_the_toy_op_is_served_from_a_table_entry(toy, tmp_path: Path) -> None:
    params = backends.get("triton").space(Problem(toy_op.OP, "bf16", 4, 80, 80)).default
    row = {"op": toy_op.OP, "dtype": "bf16", "m": 4, "n": 80, "k": 80, "backend": "triton", "params": params,
           "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0}
    path = tmp_path / "toy.json"
    table_mod.save(table_mod.build_table([row], detect().as_dict(), {}, 0.0, ["triton"]), path)
    assert json.loads(path.read_text())["entries"][0]["kernel"] == "toy_op"
    ops.load_tables([str(path)])
    x, w = torch.randn(3, 80).bfloat16(), torch.randn(80).bfloat16()
    y = torch.ops.tunekit.toy_scale(x, w)
    ref = x.double() * w.double()  # within the spec's bound (the interpreter truncates BF16, a GPU rounds)
    assert ((y.double() - ref).abs() <= 2 * 2.0**-8 * ref.abs()).all()
    # M = 3 takes the M = 4 entry; M = 5 is above the table: the op's fallback, the same products
    y5 = torch.ops.tunekit.toy_scale(torch.cat([x, x[:2]]), w)
    assert ((y5[:3].double() - ref).abs() <= 2 * 2.0**-8 * ref.abs()).all()
    impls = {(r["op"], r["m"]): r["impl"] for r in ops.dispatch_stats()}
    assert impls == {(toy_op.OP, 3): "tuned:triton", (toy_op.OP, 5): "fallback:m_above_table"}, impls
    assert ops.covers(toy_op.OP, "bf16", 80, 80, "cpu") and ops.largest_m(toy_op.OP, "bf16", 80, 80, "cpu") == 4
    # traced: one opaque node, its fake impl gives the shape
    assert torch.compile(lambda a: torch.ops.tunekit.toy_scale(a, w), backend="eager")(x).shape == x.shape


def test_taken_out_every_registry_forgets_it() -> None:
    with oprecords.registered(toy_op.RECORD):
        ops.register()
        assert hasattr(torch.ops.tunekit, toy_op.OP) and toy_op.OP in backends.get("triton").ops
    ops.register()
    assert toy_op.OP not in backends.get("triton").ops and toy_op.OP not in opspec.OPS
    with pytest.raises((AttributeError, RuntimeError)):
        torch.ops.tunekit.toy_scale  # noqa: B018
    with pytest.raises(table_mod.TableError, match="unknown op 'toy_scale'"):
        table_mod.validate({**table_mod.build_table([], detect().as_dict(), {}, 0.0, ["triton"]), "entries": [
            {"op": toy_op.OP, "dtype": "bf16", "m": 1, "n": 8, "k": 8, "backend": "triton", "kernel": "toy_op",
             "params": {"BLOCK_N": 64}, "time_us": 1.0, "baseline_us": 2.0, "speedup": 2.0, "gbps": 1.0}]})
