"""The reference pages in docs/ follow the code: the command reference is regenerated from the CLI's help
and compared, the environment tables of docs/serving.md name every TUNEKIT_* variable in use (and none
other), the README's, ARCHITECTURE.md's and docs' relative links point at files and headings that exist, and
ARCHITECTURE.md stays a map (at most 200 lines, naming every package and only files that exist)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from tunekit import docgen

ROOT = Path(__file__).resolve().parents[1]
ENV_NAME = re.compile(r"\bTUNEKIT_[A-Z0-9_]+\b")
#: Names that look like variables but are not read from the environment: the HIP header's include guard.
NOT_VARIABLES = {"TUNEKIT_HIP_H"}
#: A read of a variable in Python: os.environ.get("X"), os.environ["X"], os.getenv("X").
ENV_READ = re.compile(r"(?:environ\.get\(|environ\[|getenv\()\s*[\"'](TUNEKIT_[A-Z0-9_]+)")
#: ARCHITECTURE.md holds the layers, their rules, the two paths' data flow and where to add an op, a backend or a
#: serving stack; the decisions with their numbers are docs/evidence.md's. Past this it is a record again.
ARCHITECTURE_MAX_LINES = 200


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


def _names_in(paths: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        names.update(ENV_NAME.findall(path.read_text(errors="replace")))
    return names - NOT_VARIABLES


def _files(folder: str, *patterns: str) -> list[Path]:
    return [p for pattern in patterns for p in (ROOT / folder).rglob(pattern) if "results" not in p.parts]


def _documented() -> set[str]:
    """The names of the environment tables' rows in docs/serving.md (a row starts with the name)."""
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text.partition("\n## Environment variables\n")[2]
    assert section, "docs/serving.md has no '## Environment variables' section"
    return {m.group(1) for m in re.finditer(r"^\| `(TUNEKIT_[A-Z0-9_]+)` \|", section, re.MULTILINE)}


def test_every_variable_tunekit_reads_is_in_the_serving_table() -> None:
    missing = _names_in(_files("tunekit", "*.py")) - _documented()
    assert not missing, (f"docs/serving.md's environment table lacks {sorted(missing)} (named in tunekit/): add a "
                         "row with its default, what it does and who reads it")


def test_every_variable_of_setup_tests_and_ci_is_documented_and_none_is_stale() -> None:
    # tests/ counts what it reads from the environment (its fixtures may make names up)
    tests = {m.group(1) for path in _files("tests", "*.py") for m in ENV_READ.finditer(path.read_text())}
    used = tests | _names_in(_files("tunekit", "*.py") + _files("scripts", "*.sh", "*.py")
                             + _files("benchmarks", "*.py", "*.sh") + [ROOT / ".ci" / "run"])
    documented = _documented()
    assert not used - documented, f"docs/serving.md's environment tables lack {sorted(used - documented)}"
    stale = documented - used - _names_in(_files("tests", "*.py"))
    assert not stale, f"docs/serving.md documents variables nothing uses: {sorted(stale)}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.+)$", page.read_text(), re.MULTILINE)}


def test_relative_links_of_the_readme_and_docs_resolve() -> None:
    broken = []
    for page in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_architecture_md_stays_a_map() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text()
    lines = len(text.splitlines())
    assert lines <= ARCHITECTURE_MAX_LINES, (
        f"ARCHITECTURE.md has {lines} lines (at most {ARCHITECTURE_MAX_LINES}): keep the layers, rules, data flow and "
        "where to add things; move decisions and their numbers to docs/evidence.md")
    packages = sorted(p.parent.name for p in (ROOT / "tunekit").glob("*/__init__.py"))
    unnamed = [name for name in packages if f"`{name}/`" not in text]
    assert not unnamed, f"ARCHITECTURE.md's layers do not name the packages {unnamed}"
    files = set(re.findall(r"([A-Za-z0-9_./]+\.(?:py|toml|hip|h|sh|md))\b", text))
    known = {p.name for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts}
    gone = sorted(f for f in files if Path(f).name not in known)
    assert not gone, f"ARCHITECTURE.md names files that do not exist: {gone}"


#: What rich reads as a markup tag in a help text, and so swallows from the terminal's --help: ``[peers]`` of
#: ``pip install -e .[peers]`` printed as ``pip install -e .``.
RICH_TAG = re.compile(r"(?<!\\)\[/?[a-zA-Z#@][^\[\]]*\]")


def test_no_help_text_loses_a_bracket_to_rich_markup() -> None:
    lost = []
    for name, command in docgen._group().commands.items():
        texts = [("help", command.help or "")] + [(p.name, getattr(p, "help", None) or "") for p in command.params]
        lost += [f"tunekit {name} {where}: {m.group(0)}" for where, text in texts for m in RICH_TAG.finditer(text)]
    assert not lost, "rich would drop these from --help (name the extra in words instead):\n" + "\n".join(lost)
