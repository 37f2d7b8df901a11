"""Where a serve-bench run's code came from: the package root the runners are started with, and its git commit.

Standard library only; the offline bench and the endpoint mode both record the commit in ``serve.json``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def package_root() -> str:
    """The folder that holds the ``tunekit`` package (first on every runner's ``PYTHONPATH``)."""
    import tunekit

    return str(Path(tunekit.__file__).resolve().parents[1])


def git_commit() -> str | None:
    """HEAD of the checkout tunekit runs from, or None when that is not a git checkout of its own.

    A copy of the sources inside some other repository (an exported tree on a
    GPU machine) must not report that repository's HEAD: the toplevel must be
    the package root itself.
    """
    root = package_root()
    try:
        res = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = res.stdout.split()
    if res.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != Path(root).resolve():
        return None
    # A tree whose tracked files differ from HEAD did not run HEAD: say so (a synced copy on a GPU
    # machine can carry an older .git than the sources it runs).
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return lines[1] + "+unknown"
    return lines[1] + ("+dirty" if status.returncode != 0 or status.stdout.strip() else "")
