"""Schedules: the order in which one optimizer step's micro-batches run forward and backward.

``engine.train_step(batch, loss_fn)`` hands its micro-batches to a schedule, which decides when
each one's forward and backward run. The engine counts the backwards: the step's last one, in
whatever order the schedule runs them, is where the data-parallel strategy synchronises
gradients, once. Without pipeline stages the
schedule is :class:`Sequential`: forward and backward of each micro-batch in turn, as a plain
gradient-accumulation loop does. A pipeline schedule (GPipe, 1F1B) implements the same protocol
and interleaves micro-batches across stages, where only the last stage has a loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.config.errors import ConfigError
from longboat.pipeline.tied import TiedWeights

#: ``loss_fn(output, micro_batch)``: the micro-batch's loss from the model's output.
LossFn = Callable[[Any, Any], torch.Tensor]


class Steps(Protocol):
    """What a schedule drives: the engine's forward and backward of one micro-batch."""

    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch's loss (divided by the accumulation, fp16-scaled)."""
        ...

    def backward_from(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward from ``output``'s gradient (a pipeline stage before the last)."""
        ...

    def scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as :meth:`backward` differentiates it: where a split backward of the last
        stage starts ([Note: split backward])."""
        ...

    def backward_with(self, run: Callable[[], None]) -> None:
        """``run`` (a split backward's weight pass) as a micro-batch's backward."""
        ...


class Schedule(Protocol):
    """Runs one optimizer step's micro-batches; returns their losses.

    ``prepare`` gives the module this rank trains (a pipeline keeps its stages' layers; it may
    time the model's layers on ``example_input``, one micro-batch's model inputs);
    ``restrict`` drops from the user's optimizer what this rank does not train;
    ``stages_per_rank`` backwards run per micro-batch on a rank; ``norm_groups`` are the groups
    over which ranks hold disjoint parameters (beside the strategy's). ``held_stages`` are the
    stages this rank runs, of ``stages`` in all; a rank that holds neither the first (it reads
    the inputs) nor the last (the labels) reads no batch (``reads_data``)."""

    stages_per_rank: int
    ties: TiedWeights  # weights whose copies on other ranks must stay equal to this rank's

    @property
    def stages(self) -> int: ...

    @property
    def held_stages(self) -> list[int]: ...

    @property
    def reads_data(self) -> bool: ...

    def prepare(self, model: nn.Module, example_input: Any = None) -> nn.Module: ...

    def restrict(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None: ...

    def norm_groups(self) -> list[Comm]: ...

    def check(self, micro_batches: int) -> None:
        """Raise a ConfigError if a step of ``micro_batches`` cannot run."""
        ...

    def run(
        self,
        steps: Steps,
        micro_batches: Sequence[Any],
        loss_fn: LossFn,
        inputs: Callable[[Any], tuple[Any, ...]],
    ) -> list[float]: ...

    def evaluate(
        self,
        steps: Steps,
        micro_batches: Sequence[Any],
        loss_fn: LossFn,
        inputs: Callable[[Any], tuple[Any, ...]],
    ) -> list[float]:
        """The forwards of :meth:`run` alone (the caller disables gradients): each
        micro-batch's loss, on every rank."""
        ...


class Sequential:
    """Forward and backward of each micro-batch in turn."""

    stages_per_rank = 1

    def __init__(self) -> None:
        self.ties = TiedWeights()  # nothing is tied across ranks without stages

    @property
    def stages(self) -> int:
        return 1

    @property
    def held_stages(self) -> list[int]:
        return [0]

    @property
    def reads_data(self) -> bool:
        return True

    def prepare(self, model: nn.Module, example_input: Any = None) -> nn.Module:
        build = getattr(model, "build_all", None)  # a PipelineModule: build its layer specs
        if callable(build):
            build()
        return model

    def restrict(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        pass

    def norm_groups(self) -> list[Comm]:
        return []

    def check(self, micro_batches: int) -> None:
        pass

    def run(
        self,
        steps: Steps,
        micro_batches: Sequence[Any],
        loss_fn: LossFn,
        inputs: Callable[[Any], tuple[Any, ...]],
    ) -> list[float]:
        losses = []
        for mb in micro_batches:
            loss = loss_fn(steps.forward(*inputs(mb)), mb)
            steps.backward(loss)
            losses.append(float(loss.detach()))
        return losses

    def evaluate(
        self,
        steps: Steps,
        micro_batches: Sequence[Any],
        loss_fn: LossFn,
        inputs: Callable[[Any], tuple[Any, ...]],
    ) -> list[float]:
        return [float(loss_fn(steps.forward(*inputs(mb)), mb)) for mb in micro_batches]


def steps_of(schedule: Schedule, batch: Any, micro_batch_size: int, count: int) -> list[Any]:
    """``batch`` split into ``count`` micro-batches of ``micro_batch_size``; for None (a rank
    whose stages read no batch), ``count`` Nones."""
    if batch is not None:
        return split(batch, micro_batch_size, count)
    if schedule.reads_data:
        raise ConfigError(
            f"train_step(None) on a rank that runs stage(s) {schedule.held_stages} of "
            f"{schedule.stages}: the first stage reads the inputs and the last the labels; "
            "give this rank's batch (only a rank with neither may pass None)"
        )
    return [None] * count


def default_inputs(micro_batch: Any) -> tuple[Any, ...]:
    """The model's positional inputs in a micro-batch: a tensor itself, or the first element of
    a tuple or list (``(x, y)`` -> ``(x,)``). Anything else needs ``inputs=``."""
    if isinstance(micro_batch, torch.Tensor):
        return (micro_batch,)
    if isinstance(micro_batch, (tuple, list)) and micro_batch:
        return (micro_batch[0],)
    raise TypeError(
        f"train_step cannot tell the model's inputs in a {type(micro_batch).__name__}"
        "; pass inputs=lambda mb: (...) to say which they are"
    )


def split(batch: Any, size: int, count: int) -> list[Any]:
    """``batch`` (a tensor, or a tuple, list or dict of tensors with the samples in dim 0) as
    ``count`` micro-batches of ``size`` samples, in order."""
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] != size * count:
            raise ValueError(
                f"train_step got a batch of {batch.shape[0]} samples; a step on "
                f"this rank takes {count} micro-batches of {size} = {size * count}"
            )
        return list(torch.split(batch, size))
    if isinstance(batch, dict):
        by_key = {k: split(v, size, count) for k, v in batch.items()}
        return [{k: v[i] for k, v in by_key.items()} for i in range(count)]
    if isinstance(batch, (tuple, list)):
        parts = [split(v, size, count) for v in batch]
        return [type(batch)(p[i] for p in parts) for i in range(count)]
    raise TypeError(f"train_step cannot split a {type(batch).__name__} into micro-batches")
