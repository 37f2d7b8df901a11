"""The typer app every verb registers on, and the console they print to (the bottom of ``tunekit.cli``)."""

from __future__ import annotations

import typer
from rich.console import Console

from tunekit.evidence.console import make_console

_EPILOG = (
    "Exit status: 0 done; 1 check-serving found a failed check; 2 a user error (unknown model, malformed "
    "config, corrupt or invalid table, a bad option or option value, a file that cannot be read, a place that "
    "cannot be written, a search's storage lost mid-run: one `error:` line on stderr, never a traceback) or no "
    "command; 3 serve-bench stopped by --stop-after (rerun to resume); 130 Ctrl-C (one `interrupted:` line; "
    "finished trials are stored, rerun the same command to resume); 143 / 129 a search stopped by SIGTERM / "
    "SIGHUP (the same).\n\n"
    "Printed to a pipe or a file, reports are 200 columns wide (COLUMNS overrides), so no table cell is cut. "
    "Every command's options: docs/commands.md."
)
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tunekit: tune decode GEMVs per real model shape and serve the winners.", epilog=_EPILOG)
console: Console = make_console()
