"""``longboat checkpoint inspect|consolidate``: read a checkpoint without training."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from longboat.cli.app import checkpoint_app, usage_error


@checkpoint_app.command("inspect")
def checkpoint_inspect(
    directory: Path = typer.Argument(
        ...,
        metavar="DIR",
        help="a checkpoint (tag directory), or a directory of checkpoints (its latest is shown)",
    ),
) -> None:
    """Show what a checkpoint holds and whether every file matches its SHA-256 (exit 1 if not)."""
    from longboat.checkpoint import CheckpointNotFoundError
    from longboat.checkpoint.inspect import describe

    if not directory.is_dir():
        raise usage_error(
            f"checkpoint directory {str(directory)!r} does not exist: give the "
            "directory save_checkpoint wrote, or one of its tag directories"
        )
    try:
        found = describe(directory)
    except CheckpointNotFoundError as e:
        raise usage_error(str(e)) from None
    print(found.text)
    raise typer.Exit(0 if found.verified else 1)


@checkpoint_app.command("consolidate")
def checkpoint_consolidate(
    directory: Path = typer.Argument(
        ...,
        metavar="DIR",
        help="a checkpoint (tag directory), or a directory of checkpoints (its latest is used)",
    ),
    out: Path = typer.Argument(..., metavar="OUT.safetensors", help="the file to write"),
) -> None:
    """Write the model's full weights as one plain safetensors file (model.load_state_dict
    accepts it after safetensors.torch.load_file; nothing of longboat is needed to read it)."""
    from longboat.checkpoint import CheckpointError, CheckpointNotFoundError
    from longboat.checkpoint.inspect import consolidate

    if not directory.is_dir():
        raise usage_error(
            f"checkpoint directory {str(directory)!r} does not exist: give the "
            "directory save_checkpoint wrote, or one of its tag directories"
        )
    if out.suffix != ".safetensors":
        raise usage_error(f"output {str(out)!r} must end in .safetensors, e.g. model.safetensors")
    if not out.parent.is_dir():
        raise usage_error(f"output directory {str(out.parent)!r} does not exist: create it first")
    try:
        written = consolidate(directory, out)
    except CheckpointNotFoundError as e:
        raise usage_error(str(e)) from None
    except CheckpointError as e:
        print(f"longboat: error: {e}", file=sys.stderr, flush=True)
        raise typer.Exit(1) from None
    print(f"wrote {written} ({written.stat().st_size:,} bytes)")
