"""What the engine does when a collective of its step fails: carry on without the lost rank
([Note: in-job recovery] in ``longboat/recovery/__init__.py``), or say what may have caused it.
The engine inherits this (``longboat.engine.core.Engine``)."""

from __future__ import annotations

from typing import Protocol, cast

import torch

from longboat.comm.hang import CollectiveTimeout, PeerLost
from longboat.comm.protocol import Comm
from longboat.config.batch import ResolvedBatch, resolve_batch
from longboat.config.sections import BatchConfig
from longboat.join import UNEVEN_HINT, JoinVote
from longboat.observe.monitor import Monitor
from longboat.recovery.injob import InJob, Regroupable
from longboat.strategies.base import Strategy
from longboat.topology import Topology
from longboat.world import World


class _Engine(Protocol):
    """What these methods use of the engine."""

    world: World
    topology: Topology
    comm: Comm
    control: Comm
    batch: ResolvedBatch
    strategy: Strategy
    monitor: Monitor
    optimizer: torch.optim.Optimizer
    global_step: int
    micro_step: int
    _begun: int
    _loss_sum: float
    _loss_count: int
    _owns_group: bool
    _redo: bool
    _join: JoinVote | None
    _recovery: InJob | None


class Recovering:
    """The engine's answer to a failed collective."""

    # A regroup interrupted a step in one of its backwards: the step's remaining backwards are
    # skipped until step() (they would add the failed step's gradients to the redone one's).
    _redo = False

    def _stepped(self: _Engine) -> None:
        """An optimizer step completed (taken or skipped) on every rank."""
        if self._recovery is not None:
            self._recovery.stepped()

    def _carry_on(
        self: _Engine, error: CollectiveTimeout | PeerLost, *, rest_of_step: bool = False
    ) -> bool:
        """True when in-job recovery regrouped the survivors: the step is to be redone (its
        gradients are dropped, the loaders' next batches are its samples). False: the caller
        raises ``error``. Without either recovery or the join policy, ranks that hold
        different numbers of batches are the usual reason a peer never reached a gradient
        collective: raised with that said, and the fix. ``rest_of_step``: the failure came in
        a backward, and the step's remaining ones are to be skipped until :meth:`_redone`."""
        if self._recovery is None:
            if self._join is None:
                raise type(error)(f"{error}; {UNEVEN_HINT}") from None
            return False
        world, topology = self._recovery.recover(self.global_step, self.topology, error)
        self.world, self.topology = world, topology
        self.comm, self.control = topology.data("dp"), topology.control("world")
        # The micro-batch and the accumulation stay: the global batch shrinks with the world.
        kept = BatchConfig(
            micro_batch_size=self.batch.micro_batch_size,
            gradient_accumulation_steps=self.batch.gradient_accumulation_steps,
        )
        self.batch = resolve_batch(kept, topology.mesh.dp)
        cast(Regroupable, self.strategy).regroup(topology, world)
        self.monitor.regroup(self.control, topology, self.batch.train_batch_size)
        self._owns_group = world.distributed  # the new default group is the engine's own
        self.optimizer.zero_grad(set_to_none=True)
        self.micro_step = self._begun  # the failed step's backwards never happened
        self._loss_sum, self._loss_count = 0.0, 0
        self._redo = rest_of_step
        return True

    def _redone(self: _Engine) -> bool:
        """At step(): True (once) when a regroup interrupted this step in a backward; the
        losses of the backwards skipped since are not the redone step's."""
        was, self._redo = self._redo, False
        if was:
            self._loss_sum, self._loss_count = 0.0, 0
        return was
