"""Runs tests/vllm (the plugin against real vLLM 0.33 on the CPU) in vLLM's own virtualenv.

vLLM pins its own torch, so it lives in a separate virtualenv outside the
clone (``scripts/setup.sh --vllm-tier`` creates it, ~8 minutes and
~9.4 GB, and reuses it): by default ``~/.cache/tunekit/vllm-venv``, or
``TUNEKIT_VLLM_VENV``. This test starts that interpreter on tests/vllm with
the clone first on its path; without the virtualenv it is skipped, saying how
to make one.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# The slow tier (`python -m pytest -q -m slow`, run by .ci/run): the vLLM 0.33 tier in its own virtualenv,
# skipped where there is none (failed instead under TUNEKIT_REQUIRE_VLLM_TIER=1: tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.needs("vllm")]

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("TUNEKIT_VLLM_VENV", Path.home() / ".cache" / "tunekit" / "vllm-venv"))
PYTHON = VENV / "bin" / "python"


def test_vllm_plugin_in_the_vllm_virtualenv() -> None:
    env = {**os.environ, "TUNEKIT_VLLM_TESTS": "1", "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    # vLLM would otherwise pick its own platform plugins from these variables
    for name in ("VLLM_TARGET_DEVICE", "VLLM_PLUGINS"):
        env.pop(name, None)
    cmd = [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
           "--import-mode=importlib", "tests/vllm"]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"vLLM tier failed (rc {run.returncode}):\n{tail}"
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail
