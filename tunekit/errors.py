"""Errors the CLI turns into one clear line and a non-zero exit."""

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
