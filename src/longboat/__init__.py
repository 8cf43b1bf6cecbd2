"""longboat: distributed PyTorch training by configuration, not by rewrites."""

from longboat.config import Config, ConfigError, load_config
from longboat.engine import Engine, initialize, seed_everything
from longboat.world import World

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "Engine", "World", "initialize", "load_config",
           "seed_everything"]
