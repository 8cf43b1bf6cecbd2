"""Optimizers that reduce across the data-parallel ranks themselves.

[Note: self-reducing optimizer] An optimizer such as 1-bit Adam (:mod:`longboat.optim.onebit_adam`)
stops the strategy's gradient all-reduce after a warm-up and all-reduces its own state instead.
The protocol between the two is :class:`ReducesItself`:

- at setup, a strategy that supports it hands the optimizer its data-parallel doorway
  (:meth:`ReducesItself.longboat_bind`); ``replicate`` and ``single`` do, ZeRO (whose optimizer
  sees shards), the parameter server and pipelines do not, and the table of compositions
  refuses those pairings ([Note: compositions] in ``config/compositions.py``);
- before each step's gradients are reduced, the strategy asks
  :meth:`ReducesItself.longboat_reduces_gradients`: when True it leaves every ``p.grad`` as this
  rank's own (accumulated) gradient, ``None`` where this rank did not use the parameter, and
  calls ``step()`` once; the optimizer then owns every collective of the step.

The answer may change only between steps, and must be the same on every rank (it depends on
the step count, which every rank shares).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from longboat.comm.protocol import Comm


@runtime_checkable
class ReducesItself(Protocol):
    """An optimizer that reduces across the data-parallel ranks itself ([Note: self-reducing
    optimizer])."""

    def longboat_bind(self, comm: Comm) -> None:
        """The data-parallel doorway the optimizer's own collectives go over."""
        ...

    def longboat_bound(self) -> bool:
        """Whether a strategy has bound the optimizer to its doorway."""
        ...

    def longboat_reduces_gradients(self) -> bool:
        """True when the coming step's gradients must stay local (the optimizer reduces)."""
        ...


def check_bound(optimizer: torch.optim.Optimizer, strategy: str) -> None:
    """After setup: an optimizer that reduces itself was bound to a doorway. What does not
    combine with one is refused before setup ([Note: compositions]); a strategy the table lets
    through but that did not bind it is a fault of that strategy, named here."""
    if isinstance(optimizer, ReducesItself) and not optimizer.longboat_bound():
        raise RuntimeError(
            f"strategy {strategy!r} did not bind optimizer {type(optimizer).__name__}, which "
            "reduces itself, to its doorway: the strategy must call longboat_bind in setup, "
            "or the table of compositions (longboat/config/compositions.py) refuse the pair"
        )
