"""The strategies by name: ``strategy = "zero"`` in the config builds :class:`Zero`, and so on."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from longboat.config.errors import ConfigError
from longboat.config.sections import Config
from longboat.ps.worker import ParameterServer
from longboat.strategies.base import Strategy, StrategyContext, StrategyDefaults
from longboat.strategies.replicate import Replicate
from longboat.strategies.single import Single
from longboat.strategies.zero.strategy import Zero
from longboat.topology import Topology
from longboat.world import World

# A new strategy is a new file and one line here, never a branch in the engine.
REGISTRY: dict[str, Callable[[StrategyContext], Strategy]] = {
    "single": Single,
    "replicate": Replicate,
    "zero": Zero,
    "parameter_server": ParameterServer,
}


def build_strategy(
    name: str,
    world: World,
    topology: Topology,
    config: Config,
    isolated: frozenset[int] = frozenset(),
    service: Any = None,
    param_init_fn: Callable[[Any], object] | None = None,
    device: torch.device | None = None,
) -> Strategy:
    """Instantiate the strategy called ``name`` with its own config section (the section of
    the config named like the strategy, if there is one)."""
    if name not in REGISTRY:
        raise ConfigError(
            f"key 'strategy' has unknown value {name!r}; choose one of {sorted(REGISTRY)}"
        )
    section = name if name in type(config).model_fields else None
    return REGISTRY[name](
        StrategyContext.of(
            world, topology, config, section, isolated, service, param_init_fn, device
        )
    )


def build_service(config: Config, world_size: int) -> Any:
    """The ranks that serve the configured strategy beside the mesh (its parameter servers),
    or None for a strategy that has none ([Note: parameter server roles])."""
    if not config.service_ranks():
        return None
    from longboat.ps.service import ParameterServerService

    return ParameterServerService(config, world_size)


def zero_stage(name: str) -> int | None:
    """The stage named by ``name`` as the tools spell a ZeRO strategy (``zero2`` in
    ``longboat bench``, ``zero-2`` in ``longboat plan`` and the memory report), else None."""
    m = re.fullmatch(r"zero-?([123])", name.strip())
    return int(m.group(1)) if m else None


__all__ = [
    "REGISTRY",
    "Strategy",
    "StrategyContext",
    "StrategyDefaults",
    "build_service",
    "build_strategy",
    "zero_stage",
]
