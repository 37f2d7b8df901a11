"""One record per op (``tunekit.problems.oprecords``): every part a record names exists, and the registries
that used to keep their own lists of ops read the records."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import search_spaces
from tunekit import backends
from tunekit.backends import hip_elementwise, vendor
from tunekit.problems import oprecords, opspec, shapes

RECORDS = list(oprecords.RECORDS.values())


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.name)
def test_every_part_a_record_names_resolves(record: oprecords.OpRecord) -> None:
    if record.tabulated:
        assert opspec.get(record.name).name == record.name
        for backend in ("triton", "hip"):
            if backend in record.kernels:
                assert search_spaces.load(record.name, backend).op == record.name
        assert callable(vendor.composition(record.name))
    for target in (record.impl, record.fake, record.stock):
        if target is not None:
            assert callable(oprecords.resolve(target)), target
    assert (record.impl is None) == (record.schema is None) == (record.fake is None)
    assert record.schema is None or record.schema.startswith(record.name + "(")
    if "triton" in record.kernels:
        module = importlib.import_module(record.kernels["triton"])
        # a kernel module's own list of ops (where it keeps one) is the records' ops that name it
        listed = getattr(module, "OPS", None) or getattr(module, "FUSED_OPS", None)
        if listed is not None:
            named = {r.name for r in RECORDS if r.kernels.get("triton") == record.kernels["triton"]}
            assert set(listed) <= named and record.name in set(listed) | {"gemv"}


def test_the_registries_read_the_records() -> None:
    assert shapes.OPS == ("gemv", *oprecords.names(kind="elementwise"))
    assert set(shapes.FUSED_GEMV_OPS) == set(oprecords.names(kind="fused_gemv"))
    assert set(opspec.OPS) == set(oprecords.names(tabulated=True))
    assert backends.get("triton").ops == oprecords.names(backend="triton")
    assert backends.get("hip").ops == oprecords.names(backend="hip")
    assert set(hip_elementwise.FAMILIES) == set(oprecords.names(kind="elementwise", backend="hip"))
    assert set(backends.get("vendor").ops) == set(oprecords.names(tabulated=True))
    assert set(backends.get("inductor").ops) == set(oprecords.names(kind="elementwise"))


def test_the_names_say_what_comes_first() -> None:
    """The pairs that differ by word order are different ops, and their records say which step runs first."""
    assert oprecords.get("silu_mul_gemv").group == "act_gemv"  # SiLU-and-mul, then the GEMV (down_proj)
    assert oprecords.get("gemv_silu_mul").group == "glu_gemv"  # the GEMV (gate_up_proj), then SiLU-and-mul
    assert oprecords.get("rms_norm_gemv").group == "norm_gemv"  # the weighted norm in the GEMV's prologue
    assert oprecords.get("rms_gemv").group == "rms_gemv"  # x / rms(x) before a GEMV holding the norm's weight


def test_a_record_cannot_take_a_name_twice_nor_remove_a_builtin() -> None:
    with pytest.raises(ValueError, match="already registered"):
        oprecords.register(oprecords.get("gemv"))
    with pytest.raises(ValueError, match="built in"):
        oprecords.unregister("gemv")
    with pytest.raises(KeyError, match="unknown op 'conv2d'"):
        oprecords.get("conv2d")


def test_the_records_import_nothing() -> None:
    """The bottom of the layers: importing the records imports no torch and no other tunekit module than the
    pure-Python layouts (what an op's (n, k) mean) and the error type those raise."""
    code = ("import sys; import tunekit.problems.oprecords; "
            "print(sorted(m for m in sys.modules if m == 'torch' or (m.startswith('tunekit.') "
            "and m not in ('tunekit.problems', 'tunekit.problems.oprecords', 'tunekit.problems.layouts', "
            "'tunekit.errors'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_search_space_key_nothing_reads_is_refused(tmp_path) -> None:
    """A backend table holds domains, default, reference and fixed only: a stale key (the kernel's module,
    which the backend itself names) would read like a setting that works."""
    import pytest

    import search_spaces

    path = tmp_path / "toy.toml"
    path.write_text('[triton]\nkernel = "kernels_triton.gemv"\n[triton.domains]\nA = [1, 2]\n[triton.default]\nA = 1\n')
    with pytest.raises(search_spaces.SpaceError, match=r"unknown keys \['kernel'\]"):
        search_spaces.load(str(path), "triton")
    good = tmp_path / "toy2.toml"
    good.write_text('[triton.domains]\nA = [1, 2]\n[triton.default]\nA = 1\n')
    assert search_spaces.load(str(good), "triton").domains == {"A": [1, 2]}


def test_every_problem_op_has_a_layout_and_the_problem_reads_its_dimensions_from_it() -> None:
    """What (n, k) mean comes from the op's record alone: a new op with the glu layout gets glu's weight bytes,
    shape text and --shape form without a line about it anywhere else."""
    import pytest

    from tunekit.errors import UserError
    from tunekit.problems import layouts, oprecords, shapes

    for record in oprecords.RECORDS.values():
        assert (record.layout is None) == (record.kind == "serving"), record.name
    assert shapes.Problem("gemv", "bf16", 1, 96, 5120).weight_bytes == 96 * 5120 * 2
    assert shapes.Problem("gated_rms_norm", "bf16", 1, 6144, 128).shape_text == "48x128"
    record = oprecords.OpRecord("toy_glu", "elementwise", "pointwise", spec="x:Y", layout="glu")
    with oprecords.registered(record):
        problem = shapes.Problem("toy_glu", "bf16", 1, 64, 128)
        assert (problem.weight_bytes, problem.shape_text) == (0, "128->64")
        assert oprecords.layout("toy_glu").parse("toy_glu", "toy_glu:64", 64, None) == (64, 128)
    with pytest.raises(ValueError, match="layout 'diagonal'"):
        oprecords.OpRecord("bad", "elementwise", "pointwise", layout="diagonal")
    with pytest.raises(KeyError, match="no layout"):
        oprecords.layout("sibling_gemv")
    with pytest.raises(UserError, match="takes GROUPSxSIZE"):
        layouts.LAYOUTS["groups"].parse("gated_rms_norm", "gated_rms_norm:48", 48, None)
