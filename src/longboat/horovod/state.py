"""Horovod's helpers that make every rank start from ``root_rank``'s model and optimizer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from longboat.horovod.collectives import broadcast_, broadcast_object


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """``root_rank``'s values of ``params`` (a ``state_dict``, ``named_parameters()`` or a list
    of tensors) on every rank, in place."""
    items = params.items() if isinstance(params, Mapping) else params
    for item in items:
        name, t = item if isinstance(item, tuple) else (None, item)
        if isinstance(t, torch.Tensor):
            with torch.no_grad():
                broadcast_(t.data if isinstance(t, torch.nn.Parameter) else t, root_rank, name)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """``root_rank``'s optimizer state (and hyper-parameters) on every rank."""
    state = broadcast_object(optimizer.state_dict(), root_rank)
    optimizer.load_state_dict(state)
