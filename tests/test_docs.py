"""The reference pages in docs/ follow the code: the command reference is regenerated from the CLI's help
and compared."""

from __future__ import annotations

import difflib
from pathlib import Path

from tunekit import docgen

ROOT = Path(__file__).resolve().parents[1]


def test_commands_md_is_generated_from_the_current_help() -> None:
    page = ROOT / docgen.PAGE
    want = docgen.render()
    have = page.read_text() if page.exists() else ""
    if have != want:
        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(docgen.PAGE),
                                                 "generated", n=1))[:40])
        raise AssertionError(f"docs/commands.md is stale: run `{docgen.REGENERATE}` and commit it\n{diff}")


def test_commands_md_names_every_command() -> None:
    text = docgen.render()
    for name in docgen._group().commands:
        assert f"\n## tunekit {name}\n" in text
