"""CPU test tier: Triton kernels run on the interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
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


@pytest.fixture(scope="session")
def session_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder all pytest-xdist workers of this test run share (the run's own temp root; one process: its
    base temp): for work a module fixture would otherwise repeat on every worker that runs one of its tests
    (``test_triton_targets``'s compile run). Guard what goes in it with a ``filelock.FileLock``."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if hasattr(request.config, "workerinput") else base


@pytest.fixture
def one_thread():
    """torch on one thread for the test (modules opt in with ``pytest.mark.usefixtures("one_thread")``): on two
    shared cores its default thread pool only contends (a 64-wide forward ran 60x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------- what a test needs beyond [test]
# `pip install -e .[test]` alone runs the whole suite: a test that needs more (an optional extra of pyproject.toml,
# a system compiler, the vLLM tier's virtualenv) says so with ``@pytest.mark.needs("EXTRA")`` (or a module's
# ``pytestmark``), or takes a fixture that does (``postgres``), and is skipped where it is missing, the reason
# naming it and how to install it. Under the extra's TUNEKIT_REQUIRE_* switch (.ci/run, whose virtualenv has them
# all) a missing one is a failure instead, so CI cannot go green by skipping.


@dataclass(frozen=True)
class Extra:
    what: str  #: its name in a reason: "the nvrtc extra"
    install: str  #: how to get it
    switch: str  #: the variable that turns its absence into a failure
    modules: dict[str, str]  #: module -> the distribution that installs it (found without importing it)
    programs: tuple[str, ...] = ()  #: programs it puts on PATH
    check: Callable[[], str | None] | None = None  #: what else must hold once all of it is installed


def _nvrtc_loads() -> str | None:
    from tunekit import rtc

    why = rtc.unavailable_reason("nvidia")
    if why:
        return why
    try:
        rtc.compiler_for("nvidia")
    except Exception as exc:  # noqa: BLE001 - libnvrtc missing or broken: its one line
        return f"the NVRTC library does not load: {type(exc).__name__}: {exc}"
    return None


def vllm_venv() -> Path:
    """The vLLM tier's virtualenv (scripts/setup.sh --vllm-tier makes it; TUNEKIT_VLLM_VENV moves it)."""
    return Path(os.environ.get("TUNEKIT_VLLM_VENV", Path.home() / ".cache" / "tunekit" / "vllm-venv"))


def _vllm_venv_exists() -> str | None:
    venv = vllm_venv()
    if not (venv / "bin" / "python").exists():
        return f"no vLLM 0.33.0 virtualenv at {venv}"
    if not list(venv.glob("lib/python*/site-packages/vllm/__init__.py")):
        return f"the virtualenv at {venv} has no vLLM"
    return None


EXTRAS: dict[str, Extra] = {
    "nvrtc": Extra("the nvrtc extra", "pip install -e .[nvrtc]", "TUNEKIT_REQUIRE_NVRTC",
                   {"cuda.core": "cuda-core", "cuda.bindings": "cuda-bindings"}, check=_nvrtc_loads),
    "postgres": Extra("the postgres extra", "pip install -e .[postgres]", "TUNEKIT_REQUIRE_POSTGRES",
                      {"psycopg": "psycopg"}),
    "hf": Extra("the hf extra", "pip install -e .[hf]", "TUNEKIT_REQUIRE_HF", {"transformers": "transformers"}),
    "hipcc": Extra("hipcc", "apt-get install hipcc libamdhip64-dev rocm-device-libs (scripts/setup.sh does, as root)",
                   "TUNEKIT_REQUIRE_HIPCC", {}, programs=("hipcc",)),
    "vllm": Extra("the vLLM tier",
                  "bash scripts/setup.sh --vllm-tier (TUNEKIT_VLLM_VENV says where)", "TUNEKIT_REQUIRE_VLLM_TIER",
                  {}, check=_vllm_venv_exists),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


@functools.cache
def missing_reason(name: str) -> str | None:
    """Why the test extra ``name`` (a key of EXTRAS) is not usable here, in one line naming it, else None."""
    extra = EXTRAS[name]
    lacking = sorted({dist for module, dist in extra.modules.items() if not _installed(module)}
                     | {program for program in extra.programs if shutil.which(program) is None})
    detail = ", ".join(lacking) + " missing" if lacking else (extra.check() if extra.check else None)
    return None if detail is None else f"needs {extra.what} ({detail}): {extra.install}"


def need(name: str) -> None:
    """Skip the running test for lack of the extra ``name``; fail instead under its TUNEKIT_REQUIRE_* switch."""
    reason = missing_reason(name)
    if reason is None:
        return
    switch = EXTRAS[name].switch
    if os.environ.get(switch) == "1":
        pytest.fail(f"{switch}=1 but this test {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the cores. Many tests wait rather than compute (searches in subprocesses,
    the fixed-cost backend's sleeps, a stopped server's restart), and the extra worker fills a core meanwhile: the
    fast tier ran 9% shorter with 3 workers than with 2 on a 2-core machine (537 s against 592 s); pyproject's
    ``--maxprocesses`` still caps it."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) + 1


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(extra, ...): the test needs these extras of tests/conftest.py's EXTRAS "
                                       f"({', '.join(EXTRAS)}); skipped without one, failed under its switch")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # the tests of the postgres fixture need its extra too: marked, `-m needs` selects every test that needs one
    for item in items:
        if "postgres" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.needs("postgres"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        for name in mark.args:
            if name not in EXTRAS:
                raise pytest.UsageError(f"needs({name!r}): no such extra in tests/conftest.py (known: "
                                        f"{', '.join(EXTRAS)})")
            need(name)


@pytest.fixture(scope="module")
def postgres():
    """A throwaway PostgreSQL server for a test module (tests/postgres_server.py): needs the postgres extra and
    the server's programs; skips without them, fails instead under TUNEKIT_REQUIRE_POSTGRES=1 (CI)."""
    import postgres_server

    need("postgres")
    reason = postgres_server.unavailable_reason()
    if reason is not None:
        if os.environ.get("TUNEKIT_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"TUNEKIT_REQUIRE_POSTGRES=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    server = postgres_server.start()
    yield server
    server.stop()
