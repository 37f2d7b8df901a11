"""The console the command line's reports print on (rich), sized for a terminal or for a file.

Imports rich only: the command line takes its console from here at start-up.
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

#: Columns of a report that is not printed on a terminal. Rich assumes 80 there and
#: cuts table cells to fit ("(1.00…"); a file or a pipe has no width to respect.
PIPE_WIDTH = 200


def make_console() -> Console:
    """The console reports print on: a terminal's own width; piped or redirected, PIPE_WIDTH
    columns (or $COLUMNS) and long lines left unwrapped, so no table cell is truncated."""
    if sys.stdout.isatty():
        return Console()
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() else PIPE_WIDTH, soft_wrap=True)
