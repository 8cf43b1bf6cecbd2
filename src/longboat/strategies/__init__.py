"""Strategies: one file each, behind :class:`~longboat.strategies.base.Strategy`."""

from __future__ import annotations

import re
from collections.abc import Callable

from longboat.config import ConfigError
from longboat.strategies.base import Strategy, StrategyContext
from longboat.strategies.replicate import Replicate
from longboat.strategies.single import Single
from longboat.strategies.zero import Zero

# A new strategy is a new file and one line here, never a branch in the engine.
REGISTRY: dict[str, Callable[[StrategyContext], Strategy]] = {
    "single": Single,
    "replicate": Replicate,
    "zero": Zero,
}


def build_strategy(name: str, ctx: StrategyContext) -> Strategy:
    """Instantiate the strategy called ``name``."""
    if name not in REGISTRY:
        raise ConfigError(
            f"key 'strategy' has unknown value {name!r}; choose one of {sorted(REGISTRY)}"
        )
    return REGISTRY[name](ctx)


def zero_stage(name: str) -> int | None:
    """The stage named by ``name`` as the tools spell a ZeRO strategy (``zero2`` in
    ``longboat bench``, ``zero-2`` in ``longboat plan`` and the memory report), else None."""
    m = re.fullmatch(r"zero-?([123])", name.strip())
    return int(m.group(1)) if m else None


__all__ = ["REGISTRY", "Strategy", "StrategyContext", "build_strategy", "zero_stage"]
