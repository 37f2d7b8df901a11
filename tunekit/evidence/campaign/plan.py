"""A campaign plan (TOML): the steps of a device campaign, each a tunekit CLI invocation as data.

    [campaign]
    name = "serve-fold"                 # required: [A-Za-z0-9][A-Za-z0-9_.-]*
    about = "what the campaign measures"
    env = { HF_HUB_OFFLINE = "1" }      # environment of every step ($VAR / ${VAR} expanded)

    [[step]]
    name = "main"                       # required, unique
    verb = "search"                     # a tunekit verb (search, chain, serve-bench, check-serving, probe,
                                        # export, ...) or "script"
    out = "main"                        # the step's folder under the campaign folder (default: its name)
    estimate_s = 200                    # required: the device seconds it takes
    min_s = 60                          # optional: start it with at least this much budget left (a step that
                                        # resumes: serve-bench, search), else the whole estimate must fit
    about = "one line for the README"
    continue_on_failure = false         # a failure stops the campaign unless true
    env = { TUNEKIT_PROFILE_KERNELS = "1" }
    [step.options]                      # the verb's options by their long flag: seed-from = [...] repeats it,
    model = "qwen3.5-27b"               # true / false give --flag / --no-flag
    m = "1,2,4,8"

    [[step]]
    name = "dispatch"
    verb = "script"                     # a script of the repository: .py runs with this Python, .sh with bash
    run = ["benchmarks/probes/dispatch_overhead.py", "--table", "{out}/main/table.json", "--out", "{step}/d.json"]
    estimate_s = 100

``args = [...]`` gives a verb's positional arguments (``export`` RUN, ``show`` TABLE, ``compare`` RUN).
Placeholders in options, args, run and env: ``{out}`` the campaign folder, ``{step}`` this step's folder,
``{repo}`` the repository root (steps run there, so relative paths are the repository's). A verb that
takes ``--out`` gets ``--out {step}`` from the runner (the plan does not set it).

Call protocol: :func:`load_plan` parses and checks the plan's structure and every option against the
CLI's own; :func:`resolve` renders the commands for a campaign folder and checks that every input file
exists or is written by an earlier step. Both raise :class:`tunekit.errors.UserError` (one line) before
anything runs.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from tunekit.errors import UserError
from tunekit.evidence.campaign.verbs import OptionSpec, Verbs

SCRIPT = "script"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_CAMPAIGN_KEYS = {"name", "about", "env"}
_STEP_KEYS = {"name", "verb", "out", "estimate_s", "min_s", "about", "continue_on_failure", "env", "options",
              "args", "run"}
_PLACEHOLDERS = ("out", "step", "repo")
#: ``{name}``; not ``${NAME}``, an environment variable in an env value
_PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_]\w*)\}")
_ENV_VAR = re.compile(r"\$(?:([A-Za-z_]\w*)|\{([A-Za-z_]\w*)\})")
#: Path options that a step writes, not reads (the rest must exist before the step runs).
_OUTPUT_KEYS = {"out", "output"}
#: Words a path option takes that name no file: search's --seed-from auto (the shipped tables of its GPU) and
#: none (no seeds).
_PATH_WORDS = {"auto", "none"}
#: Folders of the campaign folder the runner itself writes.
RESERVED = {"logs", "campaign.json", "README.md", "plan.toml"}


@dataclass(frozen=True)
class Step:
    """One step as the plan wrote it (values still hold their placeholders)."""

    name: str
    verb: str
    out: str
    estimate_s: float
    min_s: float
    about: str = ""
    continue_on_failure: bool = False
    env: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    run: tuple[str, ...] = ()

    def spec_hash(self) -> str:
        """Identity of the step's definition: a rerun keeps a recorded state only while this is unchanged."""
        doc = {"verb": self.verb, "out": self.out, "env": self.env, "options": self.options,
               "args": list(self.args), "run": list(self.run)}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Plan:
    path: Path
    name: str
    about: str
    env: dict[str, str]
    steps: tuple[Step, ...]
    text: str
    verbs: Verbs = field(default_factory=dict, repr=False, compare=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


@dataclass(frozen=True)
class Rendered:
    """A step made concrete for one campaign folder: the command (less the runner's own options)."""

    step: Step
    argv: tuple[str, ...]
    env: dict[str, str]
    step_dir: Path
    takes_out: bool
    takes_stop_after: bool


def repo_root() -> Path:
    """The folder holding the tunekit package this runs (the repository root of a checkout)."""
    return Path(__file__).resolve().parents[3]


def load_plan(path: Path, verbs: Verbs) -> Plan:
    """Parse and check a plan file (structure, verbs, option names and value types); UserError if not.

    ``verbs``: the CLI's verbs and options (``verbs.read_verbs(tunekit.cli.app)``).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"no such plan: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"plan {path}: cannot be read ({exc})") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"plan {path}: not valid TOML ({exc})") from None
    where = f"plan {path}"
    _unknown(doc, {"campaign", "step"}, where, "top-level key")
    head = doc.get("campaign")
    if not isinstance(head, dict):
        raise UserError(f"{where}: needs a [campaign] table with its name")
    _unknown(head, _CAMPAIGN_KEYS, f"{where}: [campaign]", "key")
    name = _name(head.get("name"), f"{where}: [campaign] name")
    raw_steps = doc.get("step")
    if not isinstance(raw_steps, list) or not raw_steps or not all(isinstance(s, dict) for s in raw_steps):
        raise UserError(f"{where}: needs at least one [[step]]")
    steps: list[Step] = []
    for index, raw in enumerate(raw_steps, 1):
        named = f" {raw['name']!r}" if isinstance(raw.get("name"), str) else ""
        step = _step(raw, verbs, f"{where}: step {index}{named}")
        if any(s.name == step.name for s in steps):
            raise UserError(f"{where}: two steps are named {step.name!r}")
        steps.append(step)
    campaign_env = _env(head.get("env", {}), f"{where}: [campaign] env")
    for text in campaign_env.values():
        _check_placeholders(text, f"{where}: [campaign] env")
    return Plan(path=path, name=name, about=_text(head.get("about", ""), f"{where}: [campaign] about"),
                env=campaign_env, steps=tuple(steps), text=text,
                verbs=verbs)


def _unknown(table: dict, known: set[str], where: str, what: str) -> None:
    for key in table:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(known))})"
            raise UserError(f"{where}: unknown {what} {key!r}{hint}")


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise UserError(f"{where}: expected a name of letters, digits, '_', '.', '-' (got {value!r})")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: expected a string (got {value!r})")
    return value.strip()


def _seconds(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UserError(f"{where}: expected seconds > 0 (got {value!r})")
    return float(value)


def _env(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a table of NAME = \"value\"")
    out = {}
    for key, item in value.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key) or isinstance(item, bool) \
                or not isinstance(item, (str, int, float)):
            raise UserError(f"{where}: {key} = {item!r}: expected NAME = \"value\"")
        out[key] = str(item)
    return out


def _strings(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) and not isinstance(v, bool)
                                              for v in value):
        raise UserError(f"{where}: expected a list of strings")
    return tuple(str(v) for v in value)


def _step(raw: dict, known: Verbs, where: str) -> Step:
    _unknown(raw, _STEP_KEYS, where, "key")
    name = _name(raw.get("name"), f"{where}: name")
    verb = raw.get("verb")
    if verb != SCRIPT and verb not in known:
        close = difflib.get_close_matches(str(verb), [*known, SCRIPT], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"{where}: unknown verb {verb!r} ({hint}known: {', '.join([*known, SCRIPT])})")
    if "estimate_s" not in raw:
        raise UserError(f"{where}: needs estimate_s (the device seconds it takes)")
    estimate = _seconds(raw["estimate_s"], f"{where}: estimate_s")
    min_s = _seconds(raw.get("min_s", estimate), f"{where}: min_s")
    if min_s > estimate:
        raise UserError(f"{where}: min_s {min_s:g} is above estimate_s {estimate:g}")
    out = raw.get("out", name)
    if not isinstance(out, str) or not out or Path(out).is_absolute() or ".." in Path(out).parts \
            or out.startswith(".") or Path(out).parts[0] in RESERVED:
        raise UserError(f"{where}: out {out!r}: expected a folder name inside the campaign folder "
                        f"(not {', '.join(sorted(RESERVED))})")
    continue_on_failure = raw.get("continue_on_failure", False)
    if not isinstance(continue_on_failure, bool):
        raise UserError(f"{where}: continue_on_failure: expected true or false")
    options = raw.get("options", {})
    if not isinstance(options, dict):
        raise UserError(f"{where}: options: expected a table")
    args = _strings(raw.get("args", []), f"{where}: args")
    run = _strings(raw.get("run", []), f"{where}: run")
    if verb == SCRIPT:
        if options or args:
            raise UserError(f"{where}: a script step takes `run = [SCRIPT, ARGS...]`, not options or args")
        if not run:
            raise UserError(f"{where}: a script step needs run = [SCRIPT, ARGS...]")
    else:
        if run:
            raise UserError(f"{where}: `run` is for verb = \"script\"; give `tunekit {verb}` options instead")
        _check_options(known[verb], verb, options, args, where)
    for text in [*_flat(options), *args, *run, *_env(raw.get("env", {}), f"{where}: env").values()]:
        _check_placeholders(text, where)
    return Step(name=name, verb=verb, out=out, estimate_s=estimate, min_s=min_s,
                about=_text(raw.get("about", ""), f"{where}: about"), continue_on_failure=continue_on_failure,
                env=_env(raw.get("env", {}), f"{where}: env"), options=dict(options), args=args, run=run)


def _flat(options: dict[str, Any]) -> list[str]:
    out = []
    for value in options.values():
        out.extend(str(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, str))
    return out


def _check_placeholders(text: str, where: str) -> None:
    for match in _PLACEHOLDER.finditer(text):
        if match.group(1) not in _PLACEHOLDERS:
            raise UserError(f"{where}: {text!r}: unknown placeholder {match.group(0)} "
                            f"(known: {', '.join('{' + p + '}' for p in _PLACEHOLDERS)})")


def _check_options(specs: dict[str, OptionSpec], verb: str, options: dict[str, Any], args: tuple[str, ...],
                   where: str) -> None:
    flags = {k: s for k, s in specs.items() if not s.argument}
    positional = [s for s in specs.values() if s.argument]
    if len(args) > len(positional):
        raise UserError(f"{where}: `tunekit {verb}` takes {len(positional)} positional argument(s), "
                        f"got args = {list(args)}")
    needed = [s.flag for s in positional if s.required]
    if len(args) < len(needed):
        raise UserError(f"{where}: `tunekit {verb}` needs args = [{', '.join(needed)}]")
    given = {flags[k].key for k in (o if o in flags else o.replace("_", "-") for o in options) if k in flags}
    missing = [s.flag for s in flags.values() if s.required and s.key != "out" and s.key not in given]
    if missing:
        raise UserError(f"{where}: `tunekit {verb}` needs the option(s) {', '.join(missing)}")
    for key, value in options.items():
        spec = flags.get(key) or flags.get(key.replace("_", "-"))
        if spec is None:
            close = difflib.get_close_matches(key, sorted(flags), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"{where}: unknown option {key!r} of `tunekit {verb}` ({hint}known: "
                            f"{', '.join(sorted(flags))})")
        if spec.key == "out":
            raise UserError(f"{where}: options.out: the runner gives `--out` the step's folder; set the step's "
                            "`out` key instead")
        _check_value(spec, value, f"{where}: {key}")


def _check_value(spec: OptionSpec, value: object, where: str) -> None:
    if isinstance(value, list):
        if not spec.multiple:
            raise UserError(f"{where}: takes one value (a comma list is one string, e.g. \"1,2,4\")")
        for item in value:
            _check_value(_single(spec), item, where)
        return
    kind = spec.kind
    if kind is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false (got {value!r})")
        if value is False and spec.negative is None:
            raise UserError(f"{where}: {spec.flag} has no negative form: leave it out instead of false")
    elif isinstance(value, bool) or isinstance(value, (dict, list)):
        raise UserError(f"{where}: expected a {kind.__name__}, got {value!r}")
    elif kind is int and not isinstance(value, int):
        raise UserError(f"{where}: expected an integer (got {value!r})")
    elif kind is float and not isinstance(value, (int, float)):
        raise UserError(f"{where}: expected a number (got {value!r})")
    elif kind is Path and not isinstance(value, str):
        raise UserError(f"{where}: expected a path string (got {value!r})")


def _single(spec: OptionSpec) -> OptionSpec:
    return OptionSpec(spec.key, spec.name, spec.flag, spec.negative, False, spec.kind, spec.argument, spec.required)


def _fill(text: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def resolve(plan: Plan, out_dir: Path) -> list[Rendered]:
    """Every step's command for the campaign folder ``out_dir`` (absolute); UserError where an input is missing.

    An input path (a path option the verb reads, a script) must exist, or lie in the folder of an earlier step
    (which writes it before this step runs).
    """
    out_dir = Path(out_dir).resolve()
    repo = repo_root()
    rendered: list[Rendered] = []
    for index, step in enumerate(plan.steps):
        where = f"plan {plan.path}: step {step.name!r}"
        step_dir = out_dir / step.out
        values = {"out": str(out_dir), "step": str(step_dir), "repo": str(repo)}
        earlier = [out_dir / s.out for s in plan.steps[:index]]
        inputs: list[tuple[str, str]] = []
        if step.verb == SCRIPT:
            run = [_fill(a, values) for a in step.run]
            script = _abs(run[0], repo)
            inputs.append(("script", run[0]))
            if script.suffix == ".py":
                argv = [sys.executable, str(script), *run[1:]]
            elif script.suffix == ".sh":
                argv = ["bash", str(script), *run[1:]]
            else:
                argv = [str(script), *run[1:]]
            takes_out = takes_stop = False
        else:
            specs = plan.verbs[step.verb]
            argv = [sys.executable, "-m", "tunekit", step.verb]
            for key, value in step.options.items():
                spec = specs.get(key) or specs[key.replace("_", "-")]
                for item in value if isinstance(value, list) else [value]:
                    if spec.kind is bool:
                        argv.append(spec.flag if item else spec.negative)
                        continue
                    text = _fill(item, values) if isinstance(item, str) else str(item)
                    argv += [spec.flag, text]
                    if spec.is_path and spec.key not in _OUTPUT_KEYS and text not in _PATH_WORDS:
                        inputs.append((spec.flag, text))
            positional = [s for s in specs.values() if s.argument]
            for spec, arg in zip(positional, step.args, strict=False):
                text = _fill(arg, values)
                argv.append(text)
                if spec.is_path and spec.key not in _OUTPUT_KEYS:
                    inputs.append((spec.flag, text))
            takes_out = "out" in specs
            takes_stop = "stop-after" in specs and "stop-after" not in step.options \
                and "stop_after" not in step.options
        for what, text in inputs:
            path = _abs(text, repo)
            if path == out_dir or out_dir in path.parents:
                if not any(path == d or d in path.parents for d in earlier):
                    raise UserError(f"{where}: {what} {text}: inside the campaign folder, but no earlier step "
                                    "writes there")
            elif not path.exists():
                raise UserError(f"{where}: {what} {text}: no such file")
        env = {**plan.env, **step.env}
        env = {k: _expand(_fill(v, values)) for k, v in env.items()}
        rendered.append(Rendered(step=step, argv=tuple(argv), env=env, step_dir=step_dir, takes_out=takes_out,
                                 takes_stop_after=takes_stop))
    return rendered


def _expand(text: str) -> str:
    """``$NAME`` and ``${NAME}`` from the runner's environment, empty where unset (as a shell does)."""
    return _ENV_VAR.sub(lambda m: os.environ.get(m.group(1) or m.group(2), ""), text)


def _abs(text: str, repo: Path) -> Path:
    path = Path(text)
    return path if path.is_absolute() else repo / path
