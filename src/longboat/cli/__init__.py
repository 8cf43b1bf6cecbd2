"""The ``longboat`` command line: one module per command, parsing only; the work is in the
package each names. Shared option definitions are in :mod:`longboat.cli.options`."""

from longboat.cli import bench, checkpoint, config, doctor, plan, run  # noqa: F401  (registers)
from longboat.cli.app import USAGE_EXIT, app

__all__ = ["USAGE_EXIT", "app", "main"]


def main() -> None:
    """Console entry point ``longboat``."""
    app()
