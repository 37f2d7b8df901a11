"""Every Triton kernel compiles for real GPU targets (sm_90 PTX, gfx90a AMDGCN), checked on the CPU.

The rest of the CPU tier runs kernels on Triton's interpreter, which accepts
code the GPU compiler rejects (a kernel reading a plain module global passed
every CPU test and failed on the GPU). ``tests/triton_targets.py`` captures
the launches of the real wrappers and compiles them ahead of time for both
targets; it runs in a subprocess because conftest.py has already set
TRITON_INTERPRET=1 in this one (triton.jit then makes interpreter objects).

The negative case below proves the check can fail: a kernel that reads a
plain global runs on the interpreter but must be reported as an error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from filelock import FileLock

# The slow tier (`python -m pytest -q -m slow`, run by .ci/run):
# every launched Triton kernel compiled to PTX and AMDGCN.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"cuda:sm_90", "hip:gfx90a"}
NEGATIVE = "negative: kernel reads a plain (non-constexpr) module global"

#: Deliberately *not* ``tl.constexpr``: the interpreter reads it, the compiler must refuse.
_PLAIN_SCALE = 0.5


@triton.jit
def _reads_plain_global_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) * _PLAIN_SCALE, mask=mask)


def negative_cases():
    """Loaded by the compile subprocess (``--cases this_file.py:negative_cases``), never run here."""
    x = torch.ones(10)
    return [(NEGATIVE, lambda: _reads_plain_global_kernel[(1,)](x, x.numel(), BLOCK=16))]


def _launched_kernels() -> set[str]:
    """``module.name`` of every @triton.jit function of kernels_triton that is launched (``name[grid](...)``).

    Read from the sources so that a kernel added without a case here fails the
    coverage test instead of going unchecked (jit helpers called from kernels
    are compiled as part of them and are not launched).
    """
    names = set()
    for path in sorted((REPO / "kernels_triton").glob("*.py")):
        src = path.read_text()
        for name in re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\ndef (\w+)", src):
            if re.search(rf"\b{name}\[", src):
                names.add(f"kernels_triton.{path.stem}.{name}")
    return names


@pytest.fixture(scope="module")
def report(session_dir: Path) -> dict:
    """One compile run for all tests of this module (~140 s of compiles on one core of two busy ones), shared by
    the test run's workers: the first to need it compiles, the others wait on the lock and read its report."""
    out = session_dir / "triton_targets_report.json"
    with FileLock(f"{out}.lock"):
        if not out.exists():
            _compile_report(out)
    return json.loads(out.read_text())


def _compile_report(out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_ALLOW_NON_CONSTEXPR_GLOBALS")}
    cmd = [sys.executable, str(REPO / "tests" / "triton_targets.py"), "--json", str(out),
           "--cases", "repo", "--cases", f"{Path(__file__).resolve()}:negative_cases"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    # rc 1 is expected (the negative case fails); anything else, or no report, is a crash
    if proc.returncode not in (0, 1) or not out.exists():
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode} without a report:\n{proc.stderr[-8000:]}")


def _format_failures(rows: list[dict]) -> str:
    """Failures grouped by error text (one broken kernel usually fails many configs the same way)."""
    by_error: dict[str, list[str]] = {}
    for row in rows:
        by_error.setdefault(row["error"] or "?", []).append(f"{row['case']} -> {row['kernel']} @ {row['target']}")
    parts = []
    for error, where in by_error.items():
        shown = "\n  ".join(where[:5]) + (f"\n  ... and {len(where) - 5} more" if len(where) > 5 else "")
        parts.append(f"{len(where)} failure(s):\n  {shown}\n{error}")
    return "\n\n".join(parts)


def test_every_kernel_compiles_for_gpu_targets(report):
    failed = [row for row in report["rows"] if row["case"] != NEGATIVE and not row["ok"]]
    assert not failed, "Triton kernels the GPU compiler rejects:\n\n" + _format_failures(failed)


def test_cases_cover_every_launched_kernel_and_target(report):
    """Guards against a vacuous pass: nothing captured, a target dropped, a new kernel without a case."""
    rows = [row for row in report["rows"] if row["case"] != NEGATIVE]
    assert set(report["targets"]) == TARGETS
    assert {row["target"] for row in rows} == TARGETS
    expected = _launched_kernels()
    assert "kernels_triton.gemv._gemv_kernel" in expected  # the source scan itself works
    missing = expected - {row["kernel"] for row in rows}
    assert not missing, f"kernels with no compile case in tests/triton_targets.py: {sorted(missing)}"


def test_plain_module_global_fails_to_compile(report):
    """The check can fail: the interpreter-only bug it exists for is reported for both targets."""
    rows = [row for row in report["rows"] if row["case"] == NEGATIVE]
    assert {row["target"] for row in rows} == TARGETS
    for row in rows:
        assert not row["ok"], f"{row['target']} compiled a kernel that reads a plain global"
        assert "_PLAIN_SCALE" in row["error"] and "constexpr" in row["error"], row["error"]
