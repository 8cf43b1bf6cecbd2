"""Optimizers that reduce across the data-parallel ranks themselves.

[Note: self-reducing optimizer] An optimizer such as 1-bit Adam (:mod:`longboat.optim.onebit_adam`)
stops the strategy's gradient all-reduce after a warm-up and all-reduces its own state instead.
The protocol between the two is :class:`ReducesItself`:

- at setup, a strategy that supports it hands the optimizer its data-parallel doorway
  (:meth:`ReducesItself.longboat_bind`); ``replicate`` and ``single`` do, ZeRO (whose optimizer
  sees shards), the parameter server and pipelines do not, and the engine refuses the pairing
  (:func:`check_bound`);
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
from longboat.config.errors import ConfigError
from longboat.config.sections import Config


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


def _why_not(config: Config) -> str | None:
    """What in ``config`` an optimizer that reduces itself does not support (yet)."""
    if config.mesh.pp > 1 or config.mesh.tp > 1:
        return (
            f"mesh.pp = {config.mesh.pp}, mesh.tp = {config.mesh.tp}: it is built and tested "
            "on plain data parallelism only; use mesh.pp = mesh.tp = 1"
        )
    if config.data.remainder == "join":
        return (
            "data.remainder = 'join': a rank without a batch would still send its momentum's "
            "residual; use 'pad' or 'drop'"
        )
    return None


def check_bound(optimizer: torch.optim.Optimizer, strategy: str, config: Config) -> None:
    """Refuse an optimizer that reduces itself under a strategy that did not bind it, or with a
    feature of ``config`` it does not support (pipelines, say); a ConfigError naming both."""
    if not isinstance(optimizer, ReducesItself):
        return
    why_not = _why_not(config)
    name = type(optimizer).__name__
    if not optimizer.longboat_bound():
        raise ConfigError(
            f"optimizer {name} all-reduces its momentum itself after its warm-up, which "
            f"strategy {strategy!r} does not let it do (DeepSpeed refuses 1-bit Adam with ZeRO "
            "too): use strategy = 'replicate', or another optimizer"
        )
    if why_not is not None:
        raise ConfigError(f"optimizer {name} with {why_not}: use another optimizer")
