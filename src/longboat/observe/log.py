"""Rank-aware logging: info from rank 0, warnings and errors from every rank, each with its rank."""

from __future__ import annotations

import logging
import sys

from longboat.world import World


class _RankFilter(logging.Filter):
    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.world.rank
        return self.world.is_main or record.levelno >= logging.WARNING


def setup_logging(world: World, level: str = "INFO") -> logging.Logger:
    """Configure the ``longboat`` logger for this rank (idempotent) and return it."""
    logger = logging.getLogger("longboat")
    logger.setLevel(level)
    logger.propagate = False
    for h in list(logger.handlers):
        if getattr(h, "_longboat", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._longboat = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(world))
    fmt = (
        "longboat %(levelname)s [rank %(rank)d] %(message)s"
        if world.distributed
        else ("longboat %(levelname)s %(message)s")
    )
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    return logger
