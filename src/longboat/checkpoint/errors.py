"""What a checkpoint operation raises when the user (or the disk) got something wrong."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the file,
    tensor, parameter or rank concerned, and the fix."""


class CheckpointNotFoundError(CheckpointError):
    """No complete checkpoint where one was asked for."""
