"""What checkpoints need of a training engine, as a protocol the engine satisfies, so that this
package never imports the engine (which imports it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from longboat.comm.protocol import Comm

if TYPE_CHECKING:
    from longboat.checkpoint.tracker import Checkpointing


class Trained(Protocol):
    """An engine as a checkpoint sees it: the model, its optimizer and schedule, the strategy
    that places their state, the world's control plane, and the counters of the run."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # an LR scheduler, or None
    strategy: Any  # a longboat.strategies.Strategy
    schedule: Any  # a longboat.pipeline.schedule.Schedule (its ``ties``: weights on several stages)
    topology: Any  # a longboat.topology.Topology
    config: Any  # longboat.config.Config
    batch: Any  # longboat.config.ResolvedBatch
    comm: Comm  # the data-parallel axis's data plane (its size divides the batch)
    control: Comm  # the world's control plane: one rank file per rank
    checkpointing: Checkpointing
    global_step: int
    micro_step: int

    @property
    def accumulation_steps(self) -> int: ...

    def step(self) -> bool: ...
