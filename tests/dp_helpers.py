"""Shared pieces of the data-parallel tests (tests/test_replicate.py, tests/test_zero.py): the run
against the plain loop of ``reference.py``, and ``reference.TinyNet`` under a strategy for the
tests that look inside a step, with the plain backward they compare it with."""

from __future__ import annotations

from typing import Any

import harness
import reference
import torch
from torch.nn.functional import cross_entropy

import longboat

STEPS = 10
GLOBAL_BATCH = 16


def equals_plain_pytorch(
    ranks: Any, world: int, strategy: dict[str, Any], recipe: reference.Recipe, accum: int
) -> tuple[list[dict[str, Any]], reference.PlainRun]:
    """``recipe`` under ``strategy`` at ``world`` ranks against the plain loop: STEPS steps of
    ``accum`` micro-batches, GLOBAL_BATCH samples each, 1e-5 relative."""
    return harness.run_and_compare(
        ranks, world, strategy, recipe, STEPS, accum, GLOBAL_BATCH, tol=1e-5
    )


def tiny_engine(
    cfg: dict[str, Any], optimizer: type[torch.optim.Optimizer] = torch.optim.SGD, **kwargs: Any
) -> tuple[reference.TinyNet, torch.optim.Optimizer, longboat.Engine]:
    """TinyNet from seed 0 and ``optimizer(its parameters, **kwargs)`` under ``cfg`` (quiet)."""
    torch.manual_seed(0)
    model = reference.TinyNet()
    opt = optimizer(model.parameters(), **kwargs)
    return model, opt, longboat.initialize(model, opt, {**cfg, **harness.QUIET})


def rank_batch(per_rank: int, world: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows of ``reference.dataset(per_rank * world)``: rows r, r + world, ..."""
    return reference.dataset(per_rank * world)[torch.distributed.get_rank() :: world]


def backward(engine: longboat.Engine, x: torch.Tensor, y: torch.Tensor) -> None:
    """The engine's forward and backward of the cross-entropy on ``(x, y)``."""
    engine.backward(cross_entropy(engine(x), y))


def plain_backward(n: int) -> reference.TinyNet:
    """TinyNet from seed 0 after one plain backward of all of ``reference.dataset(n)``."""
    torch.manual_seed(0)
    model = reference.TinyNet()
    x, y = reference.dataset(n)[:]
    cross_entropy(model(x), y).backward()
    return model
