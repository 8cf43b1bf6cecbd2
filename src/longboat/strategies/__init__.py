"""Strategies: one file each, behind :class:`~longboat.strategies.base.Strategy`."""

from __future__ import annotations

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


__all__ = ["REGISTRY", "Strategy", "StrategyContext", "build_strategy"]
