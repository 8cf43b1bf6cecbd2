"""One model for both halves of a search: the bench's :class:`~longboat.bench.ModelSpec` (what
is measured) and the planner's :class:`~longboat.plan.Target` (what is planned), made from it so
that both build the same model and feed it batches of the same shapes."""

from __future__ import annotations

from typing import Any

import torch

from longboat.bench.models import ModelSpec
from longboat.plan.target import Target


def plan_target(spec: ModelSpec) -> Target:
    """The planner's view of ``spec``: its model, zero batches shaped and typed as
    ``spec.batch`` draws them, and its loss against a zero target of the target's shape.

    The shapes come from one real sample drawn here, outside the planner's fake tensors; the
    planner's inputs are then made inside them, so they allocate nothing and are counted as a
    real run's batch is."""
    sample = spec.batch(1, torch.Generator().manual_seed(0))
    shapes = [(tuple(t.shape[1:]), t.dtype) for t in sample]
    inputs, (target_shape, target_dtype) = shapes[:-1], shapes[-1]

    def example_input(_model: torch.nn.Module, micro_batch: int) -> tuple[Any, ...]:
        return tuple(torch.zeros(micro_batch, *s, dtype=d) for s, d in inputs)

    def loss(out: Any, args: tuple[Any, ...]) -> torch.Tensor:
        target = torch.zeros(args[0].shape[0], *target_shape, dtype=target_dtype)
        return spec.loss(out, target)

    return Target(spec.name, spec.build, example_input, loss)
