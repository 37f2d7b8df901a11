"""The project's exception types (the bottom of the package: imports nothing of tunekit). ``UserError`` and
``Interrupted`` are what the CLI turns into one clear line and a non-zero exit; ``BuildError`` is a kernel that
did not compile (raised by the backends and by ``tunekit.rtc``, below them)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (unknown model, malformed config, bad table...).

    The CLI prints ``error: <message>`` and exits with status 2; library
    callers can catch it like any exception.
    """


class Interrupted(BaseException):  # noqa: N818 - named for what happened, like KeyboardInterrupt
    """The user stopped the run (SIGINT, Ctrl-C), raised by the CLI's SIGINT handler.

    A BaseException like KeyboardInterrupt, so ``except Exception`` in library
    code lets it through; but not a KeyboardInterrupt, which typer and click
    catch and turn into their own exits (an exit code returned in one
    version, an ``Abort`` in another). The CLI prints one ``interrupted:``
    line and exits with status 130.
    """


class BuildError(RuntimeError):
    """A candidate could not be compiled; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(message)
        self.log = log
