"""The tunekit verbs a plan step may name, and their options, read from the CLI's typer app.

One source of truth: a step's options are checked against the very options ``tunekit VERB`` takes
(names, flags, repeatable or not, value type), so a plan cannot drift from the CLI. The names and
flags come from the click command typer builds (attributes click 8.2 and typer's own copy of click
share); the value types from the annotations of the verb's function. The CLI hands its app in
(:func:`read_verbs`): the library never imports ``tunekit.cli``, which imports it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path

import typer

#: Verbs a campaign does not run as a step: itself (no nesting).
EXCLUDED = ("campaign",)


@dataclass(frozen=True)
class OptionSpec:
    """One option or argument of a verb.

    ``key`` is how a plan names it: the long flag without its dashes (``seed-from``, ``json``); ``flag`` the
    long flag (an argument's metavar); ``kind`` one of ``str``, ``int``, ``float``, ``bool``, ``Path``.
    """

    key: str
    name: str
    flag: str
    negative: str | None
    multiple: bool
    kind: type
    argument: bool
    required: bool = False

    @property
    def is_path(self) -> bool:
        return self.kind is Path


def _base_kind(annotation: object) -> tuple[type, bool]:
    """(value type, is a list) of a parameter annotation: Annotated, Optional and list[...] unwrapped."""
    is_list = False
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (list, tuple):
            is_list = True
            annotation = typing.get_args(annotation)[0]
        elif origin is typing.Union or type(annotation).__name__ == "UnionType":
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0]
        else:
            break
    kind = annotation if annotation in (str, int, float, bool, Path) else str
    return kind, is_list


Verbs = dict[str, dict[str, OptionSpec]]


def read_verbs(app: typer.Typer) -> Verbs:
    """{verb: {plan key: OptionSpec}} for every verb of ``app`` (``tunekit.cli.app``) a step may run."""
    group = typer.main.get_command(app)
    callbacks = {}
    for info in app.registered_commands:
        name = info.name or info.callback.__name__.lower().replace("_", "-")
        callbacks[name] = info.callback
    out: Verbs = {}
    for name, command in group.commands.items():
        if name in EXCLUDED or name not in callbacks:
            continue
        hints = typing.get_type_hints(callbacks[name], include_extras=True)
        options: dict[str, OptionSpec] = {}
        for param in command.params:
            if param.name == "help" or not getattr(param, "expose_value", True):
                continue
            kind, _ = _base_kind(hints.get(param.name, str))
            argument = getattr(param, "param_type_name", "option") == "argument"
            if argument:  # flag: how messages name it (its metavar, as the help shows it)
                key, negative = param.name.replace("_", "-"), None
                flag = getattr(param, "metavar", None) or param.name.upper()
            else:
                longs = [o for o in param.opts if o.startswith("--")]
                flag = longs[0] if longs else param.opts[0]
                secondary = [o for o in getattr(param, "secondary_opts", []) if o.startswith("--")]
                negative = secondary[0] if secondary else None
                key = flag.lstrip("-")
            options[key] = OptionSpec(key=key, name=param.name, flag=flag, negative=negative,
                                      multiple=bool(getattr(param, "multiple", False)), kind=kind, argument=argument,
                                      required=bool(getattr(param, "required", False)))
        out[name] = options
    return out
