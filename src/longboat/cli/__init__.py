"""The ``longboat`` command line: one module per command, parsing only; the work is in the
package each names. Shared option definitions are in :mod:`longboat.cli.options`."""

# Importing each command's module registers it on the app.
from longboat.cli import (  # noqa: F401
    bench,
    checkpoint,
    config,
    doctor,
    horovodrun,
    plan,
    run,
    tune,
)
from longboat.cli.app import USAGE_EXIT, app

__all__ = ["USAGE_EXIT", "app", "main"]


def main() -> None:
    """Console entry point ``longboat``."""
    app()
