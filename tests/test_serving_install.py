"""A serving-only install (``pip install tunekit``: torch, Triton, numpy) serves tables and imports nothing of
the search extra (optuna, pandas, matplotlib, typer, rich); without that extra the commands say so in one line.

Each check runs in a clean interpreter: the other tests of this process have imported the search's libraries
long ago. A missing package is simulated by a meta-path blocker in a ``sitecustomize`` put first on the
child's path, not by a second virtualenv. The vLLM plugin's half of the rule runs in the vLLM tier
(``tests/vllm/test_vllm_lean.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_ops import _entry, make_table  # tests/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
#: pyproject.toml's search extra, and what only it brings (optuna's SQLAlchemy and alembic, typer's click).
SEARCH_EXTRA = ("optuna", "pandas", "matplotlib", "typer", "rich")
SEARCH_ONLY = (*SEARCH_EXTRA, "sqlalchemy", "alembic", "click")

BLOCKER = """
import importlib.abc, sys

BLOCKED = NAMES


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""

#: The child's serving calls: patch a small model with the table, run a forward, report what got imported.
PATCH_AND_SERVE = """
import json, sys
import torch
from torch import nn
import tunekit

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 192, bias=False), nn.Linear(192, 64, bias=False)).to(torch.bfloat16)
routed = tunekit.patch(model, table=sys.argv[1])
with torch.no_grad():
    model(torch.randn(1, 64, dtype=torch.bfloat16))
impls = sorted({row["impl"] for row in tunekit.dispatch_stats()})
heavy = sorted({m.partition(".")[0] for m in sys.modules} & set(sys.argv[2].split(",")))
print(json.dumps({"routed": routed, "impls": impls, "heavy": heavy}))
"""


def _child_env(tmp_path: Path, blocked: tuple[str, ...] = ()) -> dict[str, str]:
    path = [str(REPO)]
    env = {k: v for k, v in os.environ.items() if k not in ("TUNEKIT_TABLE", "PYTHONPATH")}
    if blocked:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(BLOCKER.replace("NAMES", repr(sorted(blocked))))
        path.insert(0, str(site))
    return {**env, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(path)}


@pytest.fixture
def table(tmp_path: Path) -> Path:
    # the second linear (N=64, K=192) is tuned at M=1; the first has no entry and takes the stock path
    return make_table(tmp_path / "table.json", [_entry("gemv", 1, 64, 192)])


@pytest.mark.parametrize("blocked", [(), SEARCH_EXTRA], ids=["installed", "not-installed"])
def test_patch_and_a_forward_import_nothing_of_the_search_extra(tmp_path: Path, table: Path, blocked) -> None:
    """``tunekit.patch(model, table=...)`` and a forward call: with the search extra installed none of it is
    imported (sys.modules), and with it absent the same calls serve the same way."""
    done = subprocess.run([sys.executable, "-c", PATCH_AND_SERVE, str(table), ",".join(SEARCH_ONLY)],
                          cwd=tmp_path, env=_child_env(tmp_path, blocked), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["routed"] == {"linear": 1, "linear (not in the tables)": 1}
    assert out["impls"] == ["tuned:triton"]
    assert out["heavy"] == [], f"the serving path imported {out['heavy']}"


def _tunekit(tmp_path: Path, blocked: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tunekit", *args], cwd=tmp_path,
                          env=_child_env(tmp_path, blocked), capture_output=True, text=True, timeout=300)


def _one_line(res: subprocess.CompletedProcess, missing: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: the tunekit commands need the search extra "), lines[0]
    assert f"({missing} is not installed)" in lines[0] and "pip install 'tunekit[search]'" in lines[0], lines[0]


@pytest.mark.parametrize("args", [(), ("--help",), ("models",), ("search", "--shape", "96x256")])
def test_without_the_search_extra_every_command_is_one_line_naming_it(tmp_path: Path, args) -> None:
    res = _tunekit(tmp_path, SEARCH_EXTRA, *args)
    _one_line(res, "typer")  # the first the command line imports
    assert res.stdout == ""


def test_a_command_that_reaches_a_missing_package_later_names_it(tmp_path: Path) -> None:
    """typer and rich present, optuna not: the command line starts, the search's import of optuna is the
    one line (not a traceback from inside the search)."""
    res = _tunekit(tmp_path, ("optuna",), "search", "--shape", "96x256", "--backend", "triton", "--trials", "1",
                   "--out", str(tmp_path / "run"))
    _one_line(res, "optuna")


def test_the_blocker_blocks_only_what_it_names(tmp_path: Path) -> None:
    """The simulation is faithful: the blocked packages do not import, the rest of the command line does."""
    code = ("import importlib.util, json; import tunekit.cli; "
            "print(json.dumps([importlib.util.find_spec(n) is None for n in ('numpy', 'torch')]))")
    blocked = subprocess.run([sys.executable, "-c", "import optuna"], cwd=tmp_path,
                             env=_child_env(tmp_path, ("optuna",)), capture_output=True, text=True, timeout=120)
    assert blocked.returncode == 1 and "ModuleNotFoundError: No module named 'optuna'" in blocked.stderr
    fine = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_child_env(tmp_path, ("optuna",)),
                          capture_output=True, text=True, timeout=120)
    assert fine.returncode == 0, fine.stderr
    assert json.loads(fine.stdout) == [False, False]
