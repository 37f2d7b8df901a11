"""The dependency ranges in pyproject.toml are tested at both ends.

CI (``.ci/run``) builds two fresh virtualenvs from the project's own files:
one with the newest versions the ranges allow (what pip gives a new user) and
one pinned by ``constraints/oldest.txt``. These tests tie the two together:
whatever environment runs them must satisfy the declared ranges, and the
oldest-end file must pin exactly the lower bound of every ranged dependency
that has broken the project before, so "tested at both ends" stays true when a
range moves.
"""

from __future__ import annotations

import importlib.metadata as metadata

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
#: Dependencies whose new releases broke the project (Triton 3.9's interpreter,
#: typer 0.26's own copy of click, numpy 2.4 in Triton's interpreter): each has
#: a tested range, both ends run in CI.
RANGED = ("triton", "typer", "numpy")
#: What serving a table needs (``pip install tunekit``), and what only the commands need (the ``search`` extra:
#: tests/test_serving_install.py checks that serving imports none of it).
SERVING = {"torch", "triton", "numpy"}
SEARCH = {"optuna", "pandas", "matplotlib", "typer", "rich"}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _requirements() -> dict[str, Requirement]:
    """The dependencies and the search extra: what scripts/setup.sh installs, the ranges CI tests at both ends."""
    project = _project()
    reqs = [Requirement(text) for text in project["dependencies"] + project["optional-dependencies"]["search"]]
    return {r.name.lower(): r for r in reqs}


def test_a_serving_install_pulls_only_torch_triton_and_numpy() -> None:
    project = _project()
    assert {Requirement(t).name.lower() for t in project["dependencies"]} == SERVING
    assert {Requirement(t).name.lower() for t in project["optional-dependencies"]["search"]} == SEARCH


def test_setup_installs_the_search_extra_for_developers() -> None:
    """The README's two commands (setup, then a search) need the commands' extra on a fresh machine."""
    commands = [line.strip() for line in (REPO / "scripts" / "setup.sh").read_text().splitlines()
                if not line.strip().startswith(("#", "echo"))]
    installs = [line for line in commands if "pip install" in line and " -e " in line and "--no-deps" not in line]
    assert any("search" in line.partition(" -e ")[2] for line in installs), installs


def _oldest_pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints" / "oldest.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints/oldest.txt pins with ==: {line}"
            pins[req.name.lower()] = Version(spec.version)
    return pins


def test_every_ranged_dependency_has_a_lower_and_an_upper_bound() -> None:
    reqs = _requirements()
    for name in RANGED:
        ops = {spec.operator for spec in reqs[name].specifier}
        assert ">=" in ops and "<" in ops, f"{name}: {reqs[name]} is not a closed range"


def test_oldest_constraints_pin_the_lower_bound_of_every_range() -> None:
    reqs, pins = _requirements(), _oldest_pins()
    for name in RANGED:
        (lower,) = [Version(s.version) for s in reqs[name].specifier if s.operator == ">="]
        assert name in pins, f"constraints/oldest.txt does not pin {name}"
        # the pin is the lowest release of the range's lowest minor line
        assert pins[name] in reqs[name].specifier, f"{name}=={pins[name]} is outside {reqs[name]}"
        assert pins[name].release[:2] == lower.release[:2], f"{name}: oldest pin {pins[name]}, range from {lower}"


@pytest.mark.parametrize("name", sorted(_requirements()))
def test_this_environment_satisfies_the_declared_ranges(name: str) -> None:
    req = _requirements()[name]
    try:
        installed = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{req.name} is a dependency of tunekit but is not installed (pip install -e .)")
    assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed} is outside {req}"
