"""One engine's in-job recovery ([Note: in-job recovery] in ``longboat/recovery/__init__.py``):
what it records while training goes well, and the regroup when a collective fails."""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from longboat import roles
from longboat.config.errors import ConfigError
from longboat.config.sections import Config
from longboat.data import Loader
from longboat.mesh import Mesh
from longboat.recovery.membership import ROOT, Arrival, agree
from longboat.topology import Topology
from longboat.world import World, destroy_process_group, device_for, init_process_group

log = logging.getLogger("longboat")


@runtime_checkable
class Regroupable(Protocol):
    """A strategy that can go on over a new data-parallel group (``replicate``)."""

    name: str

    def keep_steps_whole(self) -> None:
        """Move no parameter in a step until all of its reduction arrived."""
        ...

    def regroup(self, topology: Topology, world: World) -> None:
        """Go on over ``topology``'s data-parallel axis, the state as it is."""
        ...


def in_job(config: Config, world: World, strategy: object, model: nn.Module) -> InJob | None:
    """The recovery of an engine whose config asks for it (None otherwise, or alone)."""
    if not config.recovery.in_job or not world.distributed:
        return None
    if not isinstance(strategy, Regroupable):
        raise ConfigError(
            f"recovery.in_job = true with strategy {getattr(strategy, 'name', strategy)!r}: "
            "only strategy = 'replicate' regroups its state so far"
        )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise ConfigError(
            "recovery.in_job = true needs the store to outlive any rank: start the job with "
            "longboat run (or torchrun), whose agent serves it; started otherwise, rank 0 "
            "serves the store and the job cannot survive losing it"
        )
    strategy.keep_steps_whole()
    return InJob(config, world, model)


class InJob:
    """The generation this rank is in, its members, and where the loaders and the model's
    buffers stood at the start of the current step."""

    def __init__(self, config: Config, world: World, model: nn.Module) -> None:
        self.config = config
        self.world = world
        self.id = world.rank  # the rank at launch, the id in every generation
        self.generation = 0
        self.members: tuple[int, ...] = tuple(range(world.world_size))
        # Generation 0's store (the launcher's, through its group's namespace): kept, so the
        # agreement outlives the group it was opened with.
        self._store = dist.distributed_c10d._get_default_store()
        self._loaders: list[tuple[weakref.ref[Loader], tuple[int, int]]] = []
        # The failed step's forwards moved the buffers (BatchNorm's statistics and count):
        # the redone step starts from these, the same on every replica after a step.
        self._model = model
        self._buffers = [b.detach().clone() for b in model.buffers()]
        roles.announce(
            world.rank,
            roles.Role(
                f"replica {world.rank}", droppable=True, after="the others regroup without it"
            ),
        )

    def track(self, loader: Loader) -> None:
        """Re-deal ``loader`` at each regroup; refused (ConfigError) for a loader that cannot
        be ([Note: regrouped loader])."""
        try:
            where = loader.where()
        except NotImplementedError as e:
            raise ConfigError(f"recovery.in_job = true: {e}") from None
        self._loaders = [(r, w) for r, w in self._loaders if r() is not None]
        self._loaders.append((weakref.ref(loader), where))

    def stepped(self) -> None:
        """A step completed on every rank: the next one starts where the loaders stand."""
        self._loaders = [(r, lo.where()) for r, _ in self._loaders if (lo := r()) is not None]
        with torch.no_grad():
            for kept, b in zip(self._buffers, self._model.buffers(), strict=True):
                kept.copy_(b)

    def recover(self, step: int, old: Topology, error: BaseException) -> tuple[World, Topology]:
        """Agree on the next generation, leave ``old``'s groups and the default group, join the
        new one and build its topology; the loaders continue from the failed step's start.
        Returns this rank's new world and topology."""
        t0 = time.monotonic()
        with torch.no_grad():
            for kept, b in zip(self._buffers, self._model.buffers(), strict=True):
                b.copy_(kept)
        gen = self.generation + 1
        live = [(lo, w) for r, w in self._loaders if (lo := r()) is not None]
        mine = Arrival(self.id, step, tuple(w for _, w in live))
        wait_s = self.config.recovery.wait_s
        m = agree(self._store, gen, self.members, mine, wait_s=wait_s, dead=roles.dead)
        options = old.options
        assert options is not None, "a distributed engine's topology has its options"
        old.close()
        destroy_process_group()
        w = self.world
        world = World(
            rank=m.rank_of(self.id),
            local_rank=w.local_rank,  # the same device
            world_size=len(m.members),
            local_world_size=w.local_world_size,
            node_rank=w.node_rank,
            master_addr=w.master_addr,
            master_port=w.master_port,
            source=f"{w.source}, generation {gen}",
        )
        c = self.config.comm
        init_process_group(world, c.backend, c.timeout_s, store_prefix=f"{ROOT}/{gen}/group/")
        topology = Topology.build(Mesh.resolve(world.world_size), options, device_for(world))
        for loader, (epoch, samples) in live:
            loader.regroup(world.rank, world.world_size, epoch, samples)
        self.generation, self.members, self.world = gen, m.members, world
        log.warning(
            "in-job recovery: lost rank(s) %s (launch numbering) at step %d (%s); generation "
            "%d: ranks %s go on as ranks 0..%d, this one as rank %d; redoing step %d from "
            "sample %s, no restart, no checkpoint read (%.2f s)",
            ", ".join(map(str, m.lost)) or "none",
            step + 1,
            type(error).__name__,
            gen,
            ", ".join(map(str, m.members)),
            world.world_size - 1,
            world.rank,
            step + 1,
            ", ".join(f"{s} of epoch {e}" for e, s in m.loaders) or "(no loader)",
            time.monotonic() - t0,
        )
        return world, topology


__all__ = ["InJob", "Regroupable", "in_job"]
