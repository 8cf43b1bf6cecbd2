"""longboat: distributed PyTorch training by configuration, not by rewrites."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Imported on first use, so that `longboat --help` and usage errors do not pay for importing torch.
_LAZY = {
    "Config": "longboat.config",
    "ConfigError": "longboat.config",
    "load_config": "longboat.config",
    "Engine": "longboat.engine",
    "initialize": "longboat.engine",
    "seed_everything": "longboat.engine",
    "World": "longboat.world",
    "CheckpointError": "longboat.checkpoint",
    "CheckpointNotFoundError": "longboat.checkpoint",
}

if TYPE_CHECKING:
    from longboat.checkpoint import CheckpointError, CheckpointNotFoundError
    from longboat.config.errors import ConfigError
    from longboat.config.loading import load_config
    from longboat.config.sections import Config
    from longboat.engine import Engine, initialize, seed_everything
    from longboat.world import World


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'longboat' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "Config",
    "ConfigError",
    "Engine",
    "World",
    "initialize",
    "load_config",
    "seed_everything",
]
