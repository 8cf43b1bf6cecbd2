"""Checkpoints: a directory per tag with a JSON manifest (checksums, fingerprint, layout),
safetensors shards and JSON state; atomic saves; verified loads into any world size and strategy.

See ``layout.py`` for the directory, ``manifest.py`` for what is recorded and checked,
``save.py`` for [Note: atomic save] and ``load.py`` for [Note: verified load]. Nothing here
reads or writes a pickle.
"""

from longboat.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from longboat.checkpoint.load import LoadedCheckpoint, load
from longboat.checkpoint.save import PHASES, save
from longboat.checkpoint.statedict import StateDictSource
from longboat.checkpoint.tracker import Checkpointing

__all__ = [
    "PHASES",
    "CheckpointError",
    "CheckpointNotFoundError",
    "Checkpointing",
    "LoadedCheckpoint",
    "StateDictSource",
    "load",
    "save",
]
