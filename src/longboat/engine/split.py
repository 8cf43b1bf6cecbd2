"""The engine's side of a pipeline stage's split backward ([Note: split backward] in
``longboat/pipeline/split_backward.py``). The engine inherits these
(``longboat.engine.core.Engine``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from longboat.precision import Precision


class _Engine(Protocol):
    precision: Precision

    def _share(self) -> float: ...

    def _backward(self, run: Callable[[], None]) -> None: ...


class SplitBackwardMethods:
    """What a schedule that splits backwards asks of the engine."""

    def scaled_loss(self: _Engine, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as :meth:`~longboat.engine.Engine.backward` differentiates it (divided by
        the accumulation, fp16-scaled): where the last stage's input-gradient pass starts."""
        return self.precision.scale(loss / self._share())

    def backward_with(self: _Engine, run: Callable[[], None]) -> None:
        """``run``, which puts this micro-batch's gradients into the parameters (a split
        backward's weight pass), as the micro-batch's backward: the strategy sees it begin and
        end, and synchronises gradients after the step's last, as after any backward."""
        self._backward(run)
