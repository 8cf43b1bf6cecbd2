"""What the engine does when a collective of its step fails: carry on without the lost rank
([Note: in-job recovery] in ``longboat/recovery/__init__.py``), or say what may have caused it.
The engine inherits this (``longboat.engine.core.Engine``)."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol, cast

import torch
from torch import nn

from longboat.comm.errors import CollectiveTimeout, PeerLost
from longboat.comm.protocol import Comm
from longboat.config.batch import ResolvedBatch, resolve_batch
from longboat.config.sections import BatchConfig
from longboat.join import UNEVEN_HINT, JoinVote
from longboat.observe.monitor import Monitor
from longboat.precision import Precision
from longboat.recovery import transfer
from longboat.recovery.injob import Batch, InJob, Regroupable, join_job
from longboat.recovery.membership import RecoveryError
from longboat.strategies.base import Strategy
from longboat.topology import DoorwayOptions, Topology
from longboat.world import World

log = logging.getLogger("longboat")


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
    model: nn.Module
    scheduler: Any
    precision: Precision
    schedule: Any
    skipped_steps: int
    _backwards: int
    global_step: int
    micro_step: int
    _begun: int
    _loss_sum: torch.Tensor | float
    _loss_count: int
    _owns_group: bool
    _redo: bool
    _join: JoinVote | None
    _recovery: InJob | None
    config: Any

    @property
    def device(self) -> torch.device: ...


class Recovering:
    """The engine's answer to a failed collective."""

    # A regroup interrupted a step in one of its backwards: the step's remaining backwards are
    # skipped until step() (they would add the failed step's gradients to the redone one's).
    _redo = False
    _loss_sum: torch.Tensor | float  # [Note: the loss stays on the device] in engine/core.py

    def _stepped(self: _Engine) -> None:
        """An optimizer step completed (taken or skipped) on every rank; a replacement waiting
        is taken in now ([Note: joining a replacement] in ``longboat/recovery/joining.py``)."""
        r = self._recovery
        if r is None or not r.stepped(self.global_step):
            return
        world, topology, loaders = r.admit(self.global_step, self.topology)
        b = self.batch
        Recovering._adopt(self, world, topology, b.micro_batch_size, b.gradient_accumulation_steps)
        header = {
            "counters": [self.global_step, self.micro_step, self._begun, self.skipped_steps],
            "batch": [b.micro_batch_size, b.gradient_accumulation_steps],
            "loaders": loaders,
            "precision": self.precision.state_dict(),
        }
        # [Note: what a joiner receives]: every member takes part; the group's rank 0 sends.
        t0 = time.monotonic()
        Recovering._send_state(self, header)
        if world.rank == 0:
            log.info(
                "in-job recovery: state sent to the replacement (%.3f s)", time.monotonic() - t0
            )

    def _send_state(self: _Engine, header: dict[str, Any]) -> tuple[Any, Any, Any, torch.Tensor]:
        """[Note: what a joiner receives], over the strategy's replica axis."""
        strategy = cast(Regroupable, self.strategy)
        axis = strategy.replica_axis()
        return transfer.share(
            self.topology.data(axis),
            self.topology.control(axis),
            header,
            strategy.replica_tensors(self.model),
            self.optimizer,
            self.scheduler,
            self.device,
        )

    def _take_place(self: _Engine, options: DoorwayOptions, batch: Batch | None) -> None:
        """In a replacement whose engine was built alone (or with the rest of its ``batch``):
        join the job at its members' next boundary and take the state a live member sends
        ([Note: joining a replacement])."""
        launch = World.from_env()
        strategy, model = self.strategy, self.model
        r, world, topology = join_job(
            self.config, launch, strategy, model, self.topology, options, batch
        )
        self._recovery = cast("InJob | None", r)
        b = self.batch
        Recovering._adopt(self, world, topology, b.micro_batch_size, b.gradient_accumulation_steps)
        header, optim, sched, rng = Recovering._send_state(self, {})
        self.optimizer.load_state_dict(optim)
        if self.scheduler is not None and sched is not None:
            self.scheduler.load_state_dict(sched)
        torch.set_rng_state(rng)
        self.precision.load_state_dict(header["precision"])
        step, micro_step, begun, skipped = (int(c) for c in header["counters"])
        self.global_step, self.micro_step, self._begun, self.skipped_steps = (
            step,
            micro_step,
            begun,
            skipped,
        )
        micro, accumulation = (int(c) for c in header["batch"])
        Recovering._adopt(self, world, topology, micro, accumulation, again=True)
        self._backwards = int(accumulation * self.schedule.stages_per_rank)
        r.places = [(int(e), int(s)) for e, s in header["loaders"]]

    def _adopt(
        self: _Engine,
        world: World,
        topology: Topology,
        micro: int,
        accumulation: int,
        again: bool = False,
    ) -> None:
        """Go on as rank ``world.rank`` of ``topology``, ``micro`` x ``accumulation`` samples
        per rank and step (``again``: the same topology, only the batch changed)."""
        self.world, self.topology = world, topology
        if self._recovery is not None:
            self._recovery.watch(topology)
        self.comm, self.control = topology.data("dp"), topology.control("world")
        kept = BatchConfig(micro_batch_size=micro, gradient_accumulation_steps=accumulation)
        self.batch = resolve_batch(kept, topology.mesh.dp)
        if not again:
            cast(Regroupable, self.strategy).regroup(topology, world)
        self.monitor.regroup(self.control, topology, self.batch.train_batch_size)
        self._owns_group = world.distributed  # the new default group is the engine's own

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
        # The micro-batch and the accumulation stay: the global batch shrinks with the world.
        b = self.batch
        Recovering._adopt(self, world, topology, b.micro_batch_size, b.gradient_accumulation_steps)
        self.optimizer.zero_grad(set_to_none=True)
        self.micro_step = self._begun  # the failed step's backwards never happened
        self._loss_sum, self._loss_count = 0.0, 0
        self._redo = rest_of_step
        return True

    def _lost_in_forward(self: _Engine, error: CollectiveTimeout | PeerLost) -> Exception:
        """A collective of a forward failed (ZeRO-3 gathers within its shard group). Under
        in-job recovery over hybrid sharding, this rank's replica lost a rank: the agreement
        tells it to leave (:class:`~longboat.recovery.membership.Left`, raised from here).
        Returned, to be raised: ``error`` without recovery; with it, an error saying that a
        rank told to go on cannot resume in the middle of a forward."""
        if self._recovery is None:
            return error
        Recovering._carry_on(self, error, rest_of_step=True)
        return RecoveryError(
            f"in-job recovery: a collective of a forward failed on rank {self.world.rank} "
            f"({error}) and the agreement kept this rank: it cannot resume in the middle of "
            "a forward"
        )

    def _redone(self: _Engine) -> bool:
        """At step(): True (once) when a regroup interrupted this step in a backward; the
        losses of the backwards skipped since are not the redone step's."""
        was, self._redo = self._redo, False
        if was:
            self._loss_sum, self._loss_count = 0.0, 0
        return was
