"""The peer kit's carrier (benchmarks/peer_kit/kit.py): parts that reassemble byte-identical, checked by
SHA256SUMS, a damaged or missing part refused with its name, and the same tree packed to the same bytes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KIT_PY = ROOT / "benchmarks" / "peer_kit" / "kit.py"


def _kit():
    spec = importlib.util.spec_from_file_location("peer_kit", KIT_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path) -> dict[str, bytes]:
    files = {
        "wheels/a-1.0-py3-none-any.whl": os.urandom(300_000),
        "wheels/b-2.0-cp312-cp312-manylinux_2_28_x86_64.whl": os.urandom(123_457),
        "site/vllm/__init__.py": b'"""shim"""\n',
        "site/vllm/model_executor/kernels/linear/cute_dsl/skinny_gemm.py": b"x = 1\n",
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def test_parts_reassemble_byte_identical(tmp_path: Path) -> None:
    kit = _kit()
    files = _tree(tmp_path / "tree")
    parts = kit.pack(tmp_path / "tree", tmp_path / "kit", part_bytes=100_000)
    assert len(parts) >= 4 and all(p.stat().st_size <= 100_000 for p in parts)
    sums = (tmp_path / "kit" / "SHA256SUMS").read_text().splitlines()
    assert len(sums) == len(parts) + 1 and sums[-1].endswith("  peers.tar")
    kit.unpack(tmp_path / "kit", tmp_path / "out")
    got = {str(p.relative_to(tmp_path / "out")): p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert got == files
    # the same tree packs to the same bytes (fixed order and metadata): a rebuilt kit keeps its checksums
    (tmp_path / "tree" / "wheels" / "a-1.0-py3-none-any.whl").touch()
    kit.pack(tmp_path / "tree", tmp_path / "again", part_bytes=100_000)
    assert (tmp_path / "again" / "SHA256SUMS").read_text() == (tmp_path / "kit" / "SHA256SUMS").read_text()


def test_a_damaged_or_missing_part_is_refused_by_name(tmp_path: Path) -> None:
    kit = _kit()
    _tree(tmp_path / "tree")
    parts = kit.pack(tmp_path / "tree", tmp_path / "kit", part_bytes=100_000)
    damaged = bytearray(parts[1].read_bytes())
    damaged[500] ^= 0xFF
    parts[1].write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"peers\.tar\.part-01: checksum mismatch"):
        kit.unpack(tmp_path / "kit", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    parts[2].unlink()
    assert kit.missing(tmp_path / "kit") == ["peers.tar.part-02"]
    with pytest.raises(ValueError, match=r"parts missing in .*: peers\.tar\.part-02"):
        kit.unpack(tmp_path / "kit", tmp_path / "out")


def test_the_command_line_stashes_part_by_part(tmp_path: Path) -> None:
    """As on the GPU machine: parts arrive one call at a time; `missing` exits 1 until all are there."""
    _tree(tmp_path / "tree")
    run = lambda *a: subprocess.run([sys.executable, str(KIT_PY), *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True)
    assert run("pack", tmp_path / "tree", tmp_path / "kit", "--part-mib", "1").returncode == 0
    stash = tmp_path / "stash"
    stash.mkdir()
    (stash / "SHA256SUMS").write_bytes((tmp_path / "kit" / "SHA256SUMS").read_bytes())
    first = run("missing", stash)
    assert first.returncode == 1 and "peers.tar.part-00" in first.stdout
    for part in sorted((tmp_path / "kit").glob("peers.tar.part-*")):
        (stash / part.name).write_bytes(part.read_bytes())
    assert run("missing", stash).stdout.strip() == "missing: none"
    done = run("unpack", stash, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "site" / "vllm" / "__init__.py").read_bytes() == b'"""shim"""\n'
    bad = run("unpack", tmp_path / "nowhere", tmp_path / "out2")
    assert bad.returncode == 2 and bad.stderr.startswith("error: parts missing")


def test_the_wheel_list_pins_every_wheel() -> None:
    lines = [ln.strip() for ln in (ROOT / "benchmarks" / "peer_kit" / "wheels.txt").read_text().splitlines()]
    pins = [ln for ln in lines if ln and not ln.startswith("#")]
    assert pins and all("==" in ln for ln in pins), pins
    names = {ln.split("==")[0] for ln in pins}
    assert {"flashinfer-python", "nvidia-cutlass-dsl", "quack-kernels", "apache-tvm-ffi"} <= names
