"""The small protocol every strategy implements.

The engine drives the step; a strategy decides where parameters, gradients and optimizer state
live and when they move. Nothing in the engine branches on a strategy's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from longboat.comm.collectives import Collectives
from longboat.config import Config
from longboat.world import World


@dataclass(frozen=True)
class StrategyContext:
    """What a strategy may use: who we are, how to talk, what was asked."""

    world: World
    comm: Collectives
    config: Config


class Strategy(Protocol):
    """How state is placed and synchronised; one implementation per file."""

    name: str

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Prepare the model (sync initial state, install hooks); return the module to call."""
        ...

    def before_forward(self) -> None:
        """Called before each forward."""
        ...

    def before_backward(self, sync: bool) -> None:
        """Called before each backward; ``sync`` is True on the accumulation boundary."""
        ...

    def finish_gradients(self) -> None:
        """After the boundary backward: start whatever communication is still outstanding."""
        ...

    def wait_gradients(self) -> None:
        """Block until each trainable ``p.grad`` holds the gradient averaged over ranks.

        ``clip_grad_norm`` and ``optimizer_step`` wait by themselves (the latter possibly
        piece by piece, overlapping the optimizer with communication); this is for callers
        that want to read the gradients before the step.
        """
        ...

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip gradients to ``max_norm`` by their global 2-norm; return the norm before."""
        ...

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply the optimizer to the (synchronised) gradients."""
        ...

    def close(self) -> None:
        """Remove hooks and free buffers."""
        ...
