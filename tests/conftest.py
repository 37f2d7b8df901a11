"""CPU test tier: Triton kernels run on the interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Must be set before triton is imported anywhere in the test process, and is
# inherited by the search worker processes the tests start.
os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture
def clean_ops():
    """Each test of tunekit.ops' serving state starts and ends with no table, no markers and the
    default vendor GEMM (modules opt in with ``pytestmark = pytest.mark.usefixtures("clean_ops")``)."""
    from tunekit import ops

    def reset() -> None:
        ops.load_tables([])
        ops.reset_stats()
        ops.set_vendor_gemm(None)

    reset()
    yield
    reset()


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL server for a test module (tests/postgres_server.py); skips where none can start,
    fails instead under TUNEKIT_REQUIRE_POSTGRES=1 (CI)."""
    import postgres_server

    reason = postgres_server.unavailable_reason()
    if reason is not None:
        if os.environ.get("TUNEKIT_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"TUNEKIT_REQUIRE_POSTGRES=1 but {reason}")
        pytest.skip(reason)
    server = postgres_server.start()
    yield server
    server.stop()
