"""``longboat config explain``: every resolved value of a config and where it came from."""

from __future__ import annotations

from pathlib import Path

import typer

from longboat.cli.app import config_app, usage_error


@config_app.command("explain")
def config_explain(
    file: Path = typer.Argument(
        ..., metavar="FILE", help="a longboat TOML/JSON/YAML or DeepSpeed JSON config"
    ),
    world_size: int = typer.Option(1, "--world-size", help="number of ranks to explain it for"),
) -> None:
    """Show the resolved configuration and how derived values (the batch triple) follow."""
    from longboat import config

    if not file.is_file():
        raise usage_error(f"config file {str(file)!r} does not exist: give the path of a file")
    if world_size < 1:
        raise usage_error(f"--world-size {world_size} is invalid: use 1 or more")
    try:
        text = config.explain(file, world_size)
    except config.ConfigError as e:
        raise usage_error(str(e)) from None
    print(text)
