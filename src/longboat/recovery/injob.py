"""One engine's in-job recovery ([Note: in-job recovery] in ``longboat/recovery/__init__.py``):
what it records while training goes well, and the regroup when a collective fails."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from longboat import roles
from longboat.comm.collectives import Collectives
from longboat.comm.watched import Abandoned
from longboat.config.errors import ConfigError
from longboat.config.sections import Config
from longboat.data import Loader
from longboat.mesh import Axis, Mesh
from longboat.recovery import joining
from longboat.recovery.membership import ROOT, Arrival, DeathNotices, Left, Membership, agree
from longboat.topology import DoorwayOptions, Topology
from longboat.world import World, destroy_process_group, device_for, init_process_group

log = logging.getLogger("longboat")


@runtime_checkable
class Regroupable(Protocol):
    """A strategy that can go on over a new data-parallel group (``replicate``; ``zero`` over
    hybrid sharding's replica axis)."""

    name: str

    def replica_ranks(self) -> int:
        """How many consecutive data-parallel ranks hold one replica of the state together
        (1: each rank holds all of it); survivors go on in whole replicas ([Note:
        membership] in ``membership.py``)."""
        ...

    def replica_axis(self) -> Axis:
        """The axis whose group holds, at every rank, the state this rank holds (every
        replica's rank at the same place): a joiner receives its state over it."""
        ...

    def replica_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """The tensors of the state this rank holds that a joiner at its place receives (in
        place, the same order on every rank), besides the optimizer's ``state_dict``."""
        ...

    def keep_steps_whole(self) -> None:
        """Move no parameter in a step until all of its reduction arrived."""
        ...

    def regroup(self, topology: Topology, world: World) -> None:
        """Go on over ``topology``'s data-parallel axis, the state as it is."""
        ...


def in_job(
    config: Config, world: World, strategy: object, model: nn.Module, topology: Topology
) -> InJob | None:
    """The recovery of an engine whose config asks for it (None otherwise, or alone), its
    alarm already given to ``topology``'s doorways (:meth:`InJob.watch`)."""
    if not config.recovery.in_job or not world.distributed or replacing(config):
        return None  # (a replacement's recovery starts as it joins: join_job)
    if not isinstance(strategy, Regroupable):
        raise ConfigError(
            f"recovery.in_job = true with strategy {getattr(strategy, 'name', strategy)!r}: "
            "only strategy = 'replicate' regroups its state so far"
        )
    if strategy.replica_ranks() >= world.world_size:
        raise ConfigError(
            f"recovery.in_job = true with strategy {strategy.name!r}: its {world.world_size} "
            "ranks hold one replica of the state together, so a lost rank takes state no "
            "survivor has; shard within replicas (mesh.dp_replicate = 2 or more) or recover by "
            "restarting from a checkpoint (longboat run --max-restarts)"
        )
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise ConfigError(
            "recovery.in_job = true needs the store to outlive any rank: start the job with "
            "longboat run (or torchrun), whose agent serves it; started otherwise, rank 0 "
            "serves the store and the job cannot survive losing it"
        )
    strategy.keep_steps_whole()
    store = launcher_store(config, world)
    recovery = InJob(config, world, model, store, block=strategy.replica_ranks())
    recovery.watch(topology)
    return recovery


def launcher_store(config: Config, world: World) -> Any:
    """A client of the store ``longboat run``'s agent serves, without the namespaces the
    process groups add (a replacement, which joins no group at first, opens the same)."""
    from torch.distributed import rendezvous  # type: ignore[attr-defined]

    url = f"env://?rank={world.rank}&world_size={world.world_size}"
    store, _, _ = next(rendezvous(url, timeout=_timeout(config)))
    return store


def replacing(config: Config) -> bool:
    """True in a process ``longboat run`` started in place of a dead rank under in-job
    recovery: it joins from a live peer ([Note: joining a replacement])."""
    return config.recovery.in_job and roles.REPLACEMENT_ENV in os.environ


@dataclass(frozen=True)
class Batch:
    """A replacement's batch under hybrid sharding ([Note: joining a replacement]): its ticket,
    the batch's number and how many joiners (a shard group's ranks) it has."""

    ticket: int
    number: int
    size: int

    @property
    def prefix(self) -> str:
        """The namespace of the store the batch's own group rendezvouses under."""
        return f"{ROOT}/batch/{self.number}/group/"


def replacement_world(config: Config, launch: World) -> tuple[World, Batch | None]:
    """The world a replacement builds its engine in before it joins ([Note: joining a
    replacement]): alone, or, under hybrid sharding, with the other joiners of its batch, as
    one shard group, this rank at its launch rank's place in it (found through the launcher's
    store: this waits until the batch is whole)."""
    alone = dataclasses.replace(launch, world_size=1, local_world_size=1)
    replicas = config.mesh.dp_replicate or 1
    if replicas == 1:
        return alone, None
    block = launch.world_size // replicas  # (in-job recovery takes no pp or tp axis)
    store = launcher_store(config, launch)
    id, place = int(os.environ[roles.REPLACEMENT_ENV]), launch.rank % block
    deaths = DeathNotices(store, roles.dead)
    k, b, tickets = joining.form_batch(store, id, place, block, dead=deaths)
    log.info(
        "in-job recovery: replacement (id %d) in batch %d (tickets %s) at place %d of %d",
        id,
        b,
        tickets,
        place,
        block,
    )
    world = dataclasses.replace(alone, rank=place, world_size=block)
    return world, Batch(k, b, block)


def join_job(
    config: Config,
    launch: World,
    strategy: object,
    model: nn.Module,
    old: Topology,
    options: DoorwayOptions,
    batch: Batch | None = None,
) -> tuple[InJob, World, Topology]:
    """In a replacement whose engine was built alone (or with its ``batch``) on ``old``: take
    a ticket (or count itself built), wait to be taken in at the members' next boundary, and
    join their group ([Note: joining a replacement]). Returns the recovery, this rank's world
    and topology in the job."""
    if not isinstance(strategy, Regroupable):
        raise ConfigError(f"a replacement under strategy {getattr(strategy, 'name', strategy)!r}")
    strategy.keep_steps_whole()
    store = launcher_store(config, launch)
    recovery = InJob(config, launch, model, store, block=strategy.replica_ranks())
    t0 = time.monotonic()
    if batch is None:
        k = joining.register(store, recovery.id)
    else:
        k = batch.ticket
        joining.built(store, batch.number, batch.size)
    gen = joining.wait_admitted(store, k, dead=recovery.deaths)
    members = tuple(int(i) for i in json.loads(store.get(f"{ROOT}/{gen}/members")))
    m = Membership(gen, members, (), -1, ())
    world, topology = recovery._regroup(m, old, options)
    recovery.joined = k if batch is None else batch.number
    log.warning(
        "in-job recovery: replacement (id %d) taken in as rank %d of %d in generation %d "
        "after %.2f s; receiving the state from a live peer, no checkpoint read",
        recovery.id,
        world.rank,
        world.world_size,
        gen,
        time.monotonic() - t0,
    )
    return recovery, world, topology


def _failed_key(generation: int) -> str:
    """Set by the first member that starts the agreement on ``generation`` after a failure."""
    return f"{ROOT}/{generation}/failed"


def _timeout(config: Config) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.comm.timeout_s)


class InJob:
    """The generation this rank is in, its members, and where the loaders and the model's
    buffers stood at the start of the current step."""

    def __init__(
        self, config: Config, world: World, model: nn.Module, store: Any, block: int = 1
    ) -> None:
        self.config = config
        self.world = world
        # ranks that hold one replica together: they go on, or leave, as one
        self.block = block
        # The id in every generation: the rank at launch, or the one a replacement was given
        # ([Note: joining a replacement] in joining.py).
        self.id = int(os.environ.get(roles.REPLACEMENT_ENV, world.rank))
        self.generation = 0
        self.members: tuple[int, ...] = tuple(range(world.world_size))
        # The launcher's store, outside any group's namespace: the agreement outlives the
        # groups, and a replacement reaches the same keys.
        self._store = store
        # the deaths this node's launcher recorded and those any launcher published ([Note:
        # deaths across nodes] in membership.py)
        self.deaths = DeathNotices(store, roles.dead)
        self._loaders: list[tuple[weakref.ref[Loader], tuple[int, int]]] = []
        self.joined = 0  # replacements taken in so far: the next ticket is joined + 1
        self._join_at: int | None = None  # the step after which ticket joined + 1 comes in
        # A replacement: where the members' loaders stood, for its loaders as it creates them.
        self.places: list[tuple[int, int]] = []
        # The groups of the generation this rank left after a failure, and the threads that
        # release earlier ones ([Note: releasing old groups]).
        self._parked: list[Any] = []
        self._releasing: list[threading.Thread] = []
        # The failed step's forwards moved the buffers (BatchNorm's statistics and count):
        # the redone step starts from these, the same on every replica after a step.
        self._model = model
        self._buffers = [b.detach().clone() for b in model.buffers()]
        atexit.register(self._leave)
        roles.announce(
            world.rank,
            roles.Role(
                f"replica {world.rank}",
                droppable=True,
                after="the others regroup without it",
                replaceable=True,
            ),
        )

    def track(self, loader: Loader) -> None:
        """Re-deal ``loader`` at each regroup; refused (ConfigError) for a loader that cannot
        be ([Note: regrouped loader])."""
        try:
            if self.places:  # a replacement's loader starts where the members' stand
                loader.place(*self.places.pop(0))
            where = loader.where()
        except NotImplementedError as e:
            raise ConfigError(f"recovery.in_job = true: {e}") from None
        self._loaders = [(r, w) for r, w in self._loaders if r() is not None]
        self._loaders.append((weakref.ref(loader), where))

    def stepped(self, step: int) -> bool:
        """Step ``step`` completed on every rank: the next one starts where the loaders stand.
        True when a replacement is to be taken in now ([Note: joining a replacement]); costs
        one store round trip while none is announced, nothing while one is."""
        if self._parked:  # every member has left the old groups: [Note: releasing old groups]
            self._release()
        self._loaders = [(r, lo.where()) for r, _ in self._loaders if (lo := r()) is not None]
        with torch.no_grad():
            for kept, b in zip(self._buffers, self._model.buffers(), strict=True):
                kept.copy_(b)
        if self._join_at is None:
            key = joining.waiting_key(self.joined + 1, self.block)
            self._join_at = joining.at_boundary(self._store, key, step)
        if self._join_at is None or step < self._join_at:
            return False
        assert step == self._join_at, (step, self._join_at)  # members are a step apart at most
        return True

    def admit(self, step: int, old: Topology) -> tuple[World, Topology, list[tuple[int, int]]]:
        """Take the waiting replacement in after step ``step``: the members agree on the next
        generation with it last, and join its group. Returns this rank's world and topology,
        and where the loaders stand (the replacement's start there); the caller then sends
        the state ([Note: what a joiner receives])."""
        t0 = time.monotonic()
        k = self.joined + 1
        newcomers = joining.joiners_of(self._store, k, self.block)
        gen = self.generation + 1
        live = [(lo, lo.where()) for r, _ in self._loaders if (lo := r()) is not None]
        m = self._agree(gen, step, live, joining=tuple(id for _, id in newcomers))
        for ticket, _ in newcomers:
            joining.admitted(self._store, ticket, gen, m.members)
        t1 = time.monotonic()
        world, topology = self._regroup(m, old)
        self.joined, self._join_at = k, None
        for loader, (epoch, samples) in live:
            loader.regroup(world.rank, world.world_size, epoch, samples)
        log.warning(
            "in-job recovery: replacement (id %s) taken in after step %d; generation %d: ids "
            "%s as ranks 0..%d, this one as rank %d; lost meanwhile: %s (agree %.3f s, "
            "regroup %.3f s)",
            ", ".join(str(id) for _, id in newcomers),
            step,
            gen,
            ", ".join(map(str, m.members)),
            world.world_size - 1,
            world.rank,
            ", ".join(map(str, m.lost)) or "none",
            t1 - t0,
            time.monotonic() - t1,
        )
        return world, topology, [w for _, w in live]

    def _agree(
        self, gen: int, step: int, live: list[tuple[Loader, tuple[int, int]]], joining: Any = ()
    ) -> Membership:
        """This member's part in the agreement on generation ``gen`` ([Note: membership]):
        it redoes ``step``, its loaders stood where ``live`` says; ``joining``: the ids taken in."""
        mine = Arrival(self.id, step, tuple(w for _, w in live))
        return agree(
            self._store,
            gen,
            self.members,
            mine,
            wait_s=self.config.recovery.wait_s,
            dead=self.deaths,
            joining=joining,
            block=self.block,
        )

    def watch(self, topology: Topology) -> None:
        """Have every doorway of ``topology`` ask :meth:`alarm` while it waits ([Note: watched
        waits] in ``comm/watched.py``): a member blocked in a collective that will never
        complete learns of a failure another survivor noticed, without its own timeout."""
        for d in topology.doorways():
            if isinstance(d, Collectives) and d.active:
                d.alarm = self.alarm

    def alarm(self) -> str | None:
        """Why this generation is known to have failed, or None: another member started the
        agreement on the next one after a failure (:meth:`recover` says so first), or the
        launcher recorded a member dead. One store read and a look at the launcher's records."""
        if self._store.check([_failed_key(self.generation + 1)]):
            return f"another member started the agreement on generation {self.generation + 1}"
        gone = sorted(set(self.members) & roles.dead())
        if gone:
            return f"the launcher recorded rank(s) {', '.join(map(str, gone))} dead"
        return None

    def _release(self) -> None:
        """Note [releasing old groups]: after a failure a survivor leaves the old generation's
        groups with work still pending in them (a collective it gave up, [Note: watched waits]
        in comm/watched.py, or one launched beside the one that failed: hybrid sharding's
        usage vote over every rank). gloo cannot abort that work, and dropping a group's last
        reference waits for it ([Note: teardown] in comm/collectives.py) until it fails: when
        its peers close their sockets, at the latest at comm.timeout_s (measured: a regroup
        held 9.4 s at 10 s, 59 s at 60, by the peers' own waits). So the groups are kept
        (parked) through the regroup. Kept until exit, though, a group can spin: a peer's
        message that arrived for a collective this rank never joined stays unread in its
        socket, and gloo's loop wakes for it again and again (measured: one thread at 70-90%
        of a core after a loss under hybrid sharding, steps 17% slower for the rest of the
        run). They are released at the first step boundary of the new generation, which no
        member reaches before every member left the old groups, on a thread of their own: the
        members release theirs at about the same time, each closing the sockets the others'
        pending work waits on (measured: 0.1 s, no spinning thread left)."""
        groups, self._parked = self._parked, []
        self._releasing = [t for t in self._releasing if t.is_alive()]
        thread = threading.Thread(target=groups.clear, name="longboat-release", daemon=True)
        thread.start()
        self._releasing.append(thread)

    def _leave(self) -> None:
        """At exit: no more boundaries from this member (a replacement waiting for one stops
        once every member left or died)."""
        with contextlib.suppress(Exception):  # the launcher's store may be gone already
            joining.close(self._store, self.id)
        # Released while the interpreter is alive ([Note: teardown] in comm/collectives.py):
        # this waits until the pending work fails, at the latest when the peers of the old
        # group exit and their sockets close (no collective follows this handler).
        self._parked.clear()
        for t in self._releasing:
            t.join()

    def recover(self, step: int, old: Topology, error: BaseException) -> tuple[World, Topology]:
        """Agree on the next generation, leave ``old``'s groups and the default group, join the
        new one and build its topology; the loaders continue from the failed step's start.
        Returns this rank's new world and topology."""
        t0 = time.monotonic()
        with torch.no_grad():
            for kept, b in zip(self._buffers, self._model.buffers(), strict=True):
                b.copy_(kept)
        gen = self.generation + 1
        # First: members still blocked in the old group's collectives see it ([Note: watched
        # waits]) and come to the agreement now rather than at their own timeouts.
        self._store.set(_failed_key(gen), str(self.id))
        if isinstance(error, Abandoned):
            log.warning("in-job recovery: %s", str(error).split("\n")[0])
        live = [(lo, w) for r, w in self._loaders if (lo := r()) is not None]
        try:
            m = self._agree(gen, step, live)
        except Left as e:
            log.warning("in-job recovery: %s", e.message)
            raise
        t1 = time.monotonic()
        # [Note: releasing old groups]: every old group is kept through the regroup, not only
        # the one whose wait failed. (The default group through a private torch API: nothing
        # public returns it.)
        self._parked += [*old.groups(), dist.distributed_c10d._get_default_group()]
        world, topology = self._regroup(m, old)
        for loader, (epoch, samples) in live:
            loader.regroup(world.rank, world.world_size, epoch, samples)
        log.warning(
            "in-job recovery: lost rank(s) %s (ids: the launch rank, or a replacement's) at "
            "step %d (%s); generation %d: ranks %s go on as ranks 0..%d, this one as rank %d; "
            "redoing step %d from sample %s, no restart, no checkpoint read (agree %.3f s, "
            "regroup %.3f s)",
            ", ".join(map(str, m.lost)) or "none",
            step + 1,
            type(error).__name__,
            gen,
            ", ".join(map(str, m.members)),
            world.world_size - 1,
            world.rank,
            step + 1,
            ", ".join(f"{s} of epoch {e}" for e, s in m.loaders) or "(no loader)",
            t1 - t0,
            time.monotonic() - t1,
        )
        return world, topology

    def _regroup(
        self, m: Membership, old: Topology, options: DoorwayOptions | None = None
    ) -> tuple[World, Topology]:
        """Leave ``old``'s groups and the default group, join generation ``m``'s under its
        own namespace of the store, and build its topology (with ``options``, by default
        ``old``'s)."""
        options = options or old.options
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
            source=f"{w.source.split(', generation')[0]}, generation {m.generation}",
        )
        c = self.config.comm
        prefix = f"{ROOT}/{m.generation}/group/"
        init_process_group(world, c.backend, c.timeout_s, store_prefix=prefix)
        # Whole replicas stay ([Note: membership]): each keeps its shard group's size.
        shard = {"dp_shard": self.block} if self.block > 1 else {}
        mesh = Mesh.resolve(world.world_size, **shard)
        topology = Topology.build(mesh, options, device_for(world))
        self.generation, self.members, self.world = m.generation, m.members, world
        if world.rank == 0:
            joining.current(self._store, m.members)
        return world, topology


__all__ = [
    "Batch",
    "InJob",
    "Regroupable",
    "in_job",
    "join_job",
    "replacement_world",
    "replacing",
]
