"""docs/commands.md from the CLI's own help: every command's usage, description and options as Markdown.

Call protocol::

    python -m tunekit.docgen > docs/commands.md     # regenerate after changing a command or its help
    text = tunekit.docgen.render()                   # the same text (tests/test_docs.py compares the file)

The page is built from the click command objects of ``tunekit.cli.app``, not
from the terminal rendering of ``--help``: typer's rich panels depend on the
terminal width and change between typer versions (the tested range carries two
copies of click), while the objects' names, options, defaults and help strings
are the same in every version, so the page is the same wherever it is made.
Nothing here wraps text: Markdown does.
"""

from __future__ import annotations

import inspect
import sys
import typing
from pathlib import Path
from typing import Any

#: The command that rewrites the page (quoted in the page and in the test's message).
REGENERATE = "python -m tunekit.docgen > docs/commands.md"
#: The page, relative to the repository root.
PAGE = Path("docs") / "commands.md"

# Type labels as click names its parameter types (typer < 0.26 has click's types on the
# parameter; later typers keep the Python annotation instead).
_TYPE_NAMES: dict[Any, str] = {str: "TEXT", int: "INTEGER", float: "FLOAT", bool: "BOOLEAN", Path: "PATH"}


def _group() -> Any:
    """The click group of ``tunekit.cli.app``."""
    import typer

    from tunekit.cli import app

    return typer.main.get_command(app)


def _help_text(text: str | None) -> str:
    """A help string as typer shows it: dedented, cut at a form feed."""
    return inspect.cleandoc(text or "").partition("\f")[0].strip()


def _paragraphs(text: str | None) -> str:
    """The help's paragraphs, each on one line: a docstring's line breaks are not Markdown's to read (a
    line that starts with ``-`` or ``+`` would become a list item)."""
    return "\n\n".join(" ".join(p.split()) for p in _help_text(text).split("\n\n") if p.strip())


def _first_line(text: str | None) -> str:
    return _paragraphs(text).split("\n\n")[0]


def _escape(text: str, table: bool = False) -> str:
    """Markdown-safe text: ``<`` and ``>`` outside code spans would read as HTML; in a table cell
    a ``|`` ends the cell, even inside a code span."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    out = "`".join(parts)
    return out.replace("|", "\\|") if table else out


def _type_label(param: Any) -> str:
    kind = getattr(param, "type", None)
    name = getattr(kind, "name", None)
    if isinstance(name, str):
        return name.upper()
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if typing.get_origin(annotation) in (list, tuple) and typing.get_args(annotation):
        annotation = typing.get_args(annotation)[0]
    return _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)).upper())


def _default(param: Any) -> str:
    if getattr(param, "required", False):
        return "required"
    if getattr(param, "show_default", True) is False:
        return ""
    value = param.default
    if callable(value) or value is None or value == [] or value == ():
        return ""
    if getattr(param, "is_flag", False):
        if param.secondary_opts:
            return f"`{param.opts[0] if value else param.secondary_opts[0]}`"
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return f"`{value}`"


def _is_argument(param: Any) -> bool:
    return getattr(param, "param_type_name", None) == "argument" or not any(o.startswith("-") for o in param.opts)


def _usage(path: str, command: Any) -> str:
    pieces = [path, "[OPTIONS]"]
    for param in command.params:
        if _is_argument(param):
            name = param.metavar or param.name.upper()
            pieces.append(name if param.required else f"[{name}]")
    return " ".join(pieces)


def _param_rows(command: Any) -> list[str]:
    """The options table (none for a command without options)."""
    rows: list[str] = []
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        if _is_argument(param):
            names = f"`{param.metavar or param.name.upper()}`"
            value = _type_label(param)
        else:
            names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
            value = "" if getattr(param, "is_flag", False) else _type_label(param)
        if getattr(param, "multiple", False):
            value += ", repeatable"
        help_text = " ".join(_help_text(getattr(param, "help", None)).split())
        rows.append(f"| {names} | {value} | {_default(param)} | {_escape(help_text, table=True)} |")
    return ["", "| option | value | default | |", "| --- | --- | --- | --- |", *rows] if rows else []


def _commands(group: Any) -> list[tuple[str, Any]]:
    return [(name, command) for name, command in group.commands.items() if not getattr(command, "hidden", False)]


def render() -> str:
    """The whole page, as ``python -m tunekit.docgen`` prints it."""
    group = _group()
    lines = [
        f"<!-- Generated from tunekit/cli/ by `{REGENERATE}`; edit the help there, not here. -->",
        "",
        "# tunekit commands",
        "",
        _escape(_paragraphs(group.help)),
        "",
        "Run them as `tunekit COMMAND` (after `pip install -e '.[search]'`) or `python -m tunekit COMMAND` from the "
        "repository root; `tunekit COMMAND --help` prints the same in the terminal.",
        "",
        "| command | what it does |",
        "| --- | --- |",
    ]
    commands = _commands(group)
    for name, command in commands:
        lines.append(f"| [`{name}`](#tunekit-{name}) | {_escape(_first_line(command.help), table=True)} |")
    if getattr(group, "epilog", None):
        lines += ["", _escape(_paragraphs(group.epilog))]
    for name, command in commands:
        lines += ["", f"## tunekit {name}", "", "```", _usage(f"tunekit {name}", command), "```", "",
                  _escape(_paragraphs(command.help))]
        lines += _param_rows(command)
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
