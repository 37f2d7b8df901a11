"""Thin CLI verbs; the library does the work.

User errors (unknown model, malformed config, corrupt table, bad option or
option value, a file or folder that cannot be read or written) are one
``error:`` line on stderr and exit status 2, never a traceback; Ctrl-C is one
``interrupted:`` line and exit status 130. A bare ``tunekit`` prints the help
and exits 2 (no command is a usage error). Without the ``search`` extra (a
serving-only install) every command is one ``error:`` line naming it, exit 2.

Verbs register on ``tunekit.cli.app.app`` in two modules: ``tune`` (models, shapes, search, export,
compare, show, probe) and ``evidence`` (chain, serve-bench, check-serving, campaign); this module holds
``main``, which turns every user error into one line.
"""

from __future__ import annotations

import errno
import importlib
import signal
import sys

from tunekit.errors import Interrupted, UserError

#: The packages of pyproject.toml's ``search`` extra: the commands need them, serving does not (a serving-only
#: install has torch, Triton and numpy), so without them every command is one line naming the extra.
SEARCH_EXTRA = ("optuna", "pandas", "matplotlib", "typer", "rich")


def _missing_extra(exc: ModuleNotFoundError) -> str | None:
    """The one-line error for a package of the search extra that is not installed, else None."""
    name = (exc.name or "").partition(".")[0]
    if name not in SEARCH_EXTRA:
        return None
    return (f"the tunekit commands need the search extra ({name} is not installed): pip install 'tunekit[search]' "
            "(pip install -e '.[search]' in a checkout)")


_MISSING: str | None = None
try:
    from tunekit.cli.app import app
    from tunekit.cli.tune import search  # noqa: F401  (the tuning verbs, registered first)

    # the evidence verbs register after the tuning ones: the order of `tunekit --help` and docs/commands.md
    importlib.import_module("tunekit.cli.evidence")
except ModuleNotFoundError as exc:
    _MISSING = _missing_extra(exc)
    if _MISSING is None:
        raise


_INTERRUPTED = "interrupted: finished trials are stored; rerun the same command to resume\n"
#: OSErrors that mean a path the user gave cannot be used: one line, exit 2.
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOENT,
                errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG}


def _on_sigint(signum: int, frame: object) -> None:
    raise Interrupted()


def _click_error(exc: BaseException) -> str | None:
    """The one-line message of a usage error from click or typer, else None.

    typer >= 0.26 raises the exceptions of its own copy of click
    (``typer._click``), which are not click's classes; every version's have
    ``format_message()`` and an int ``exit_code``, so they are told by those.
    """
    format_message = getattr(exc, "format_message", None)
    if not callable(format_message) or not isinstance(getattr(exc, "exit_code", None), int):
        return None
    ctx = getattr(exc, "ctx", None)
    if type(exc).__name__ == "NoArgsIsHelpError":  # its message is the help text itself
        if ctx is not None:
            sys.stdout.write(ctx.get_help() + "\n")
        return "missing command (the commands are listed above)"
    message = " ".join(str(format_message()).split())
    path = getattr(ctx, "command_path", None)
    return f"{message} (try {path} --help)" if path else message


def main() -> None:
    # Ctrl-C raises Interrupted, not KeyboardInterrupt: typer and click would catch that one and
    # turn it into an exit of their own (version-dependent); the search decides what stops.
    if _MISSING is not None:  # a serving-only install: no traceback, the extra named
        sys.stderr.write(f"error: {_MISSING}\n")
        sys.exit(2)
    signal.signal(signal.SIGINT, _on_sigint)
    code: object = None
    try:
        if not sys.argv[1:]:
            app(["--help"], standalone_mode=False)  # the help on stdout; no command is a usage error
            raise UserError("missing command (the commands are listed above; try tunekit COMMAND --help)")
        code = app(standalone_mode=False)  # a command returns None; --help an exit code
    except UserError as exc:
        # plain write: rich would wrap a long message over several lines
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
    except (Interrupted, KeyboardInterrupt):
        sys.stderr.write(_INTERRUPTED)
        sys.exit(130)
    except ModuleNotFoundError as exc:  # a command's lazy import of the search extra (optuna, pandas ...)
        message = _missing_extra(exc)
        if message is None:
            raise
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)
    except Exception as exc:  # click's / typer's usage errors arrive here in non-standalone mode
        message = _click_error(exc)
        if message is not None:
            sys.stderr.write(f"error: {message}\n")
            sys.exit(2)
        if type(exc).__name__ == "Abort":  # click's answer to EOF at a prompt, or a Ctrl-C it caught itself
            sys.stderr.write(_INTERRUPTED if isinstance(exc.__context__, KeyboardInterrupt) else "error: aborted\n")
            sys.exit(130 if isinstance(exc.__context__, KeyboardInterrupt) else 2)
        if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS:
            # a path no explicit check caught: still one line
            where = f"{exc.filename}: " if exc.filename else ""
            sys.stderr.write(f"error: {where}{exc.strerror or exc}\n")
            sys.exit(2)
        raise
    if code == 130:  # a typer that caught a KeyboardInterrupt itself returns its exit code
        sys.stderr.write(_INTERRUPTED)
    if isinstance(code, int) and code:
        sys.exit(code)
