"""Errors the CLI turns into one clear line and a non-zero exit."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (unknown model, malformed config, bad table...).

    The CLI prints ``error: <message>`` and exits with status 2; library
    callers can catch it like any exception.
    """
