"""The ``longboat`` Typer application and what every command shares: how a usage mistake ends
(exit 2, naming the flag, the value and the fix)."""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    name="longboat",
    help="Distributed PyTorch training by configuration.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Inspect a longboat configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
checkpoint_app = typer.Typer(
    help="Inspect or consolidate a longboat checkpoint.", no_args_is_help=True
)
app.add_typer(checkpoint_app, name="checkpoint")

USAGE_EXIT = 2


def usage_error(message: str) -> typer.Exit:
    """Say what is wrong with the command line; the caller raises the returned exit (2)."""
    print(f"longboat: error: {message}", file=sys.stderr, flush=True)
    return typer.Exit(USAGE_EXIT)
