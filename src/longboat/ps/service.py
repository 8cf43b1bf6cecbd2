"""Who serves and who trains, and the server's side of ``longboat.initialize``.

[Note: parameter server roles] With ``strategy = "parameter_server"`` the last
``parameter_server.servers`` global ranks are servers and the others workers, so global rank 0
(which logs) is a worker. Every rank runs the same script: on a server, ``initialize`` serves
until every worker has left or died, then ends the process with exit code 0
(:class:`ServerExit`, a ``SystemExit``), as MXNet's servers do on import; on a worker it
returns the engine. The workers' mesh (``[mesh]``) covers the workers only. Groups, all made
here collectively in one order: the servers' point-to-point group (gloo, every rank), a gloo
group of the workers (the start's broadcast of worker 0's weights), and, in ``sync`` mode only,
the workers' topology (the servers take part in making it and then never use it). In ``async``
and ``ssp`` the workers have no collective between them after the start, so a worker that dies
cannot stop the others: each worker's doorways are its own (a world of one) while the loader
and the batch arithmetic still count every worker.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from longboat import roles
from longboat.comm.collectives import Collectives
from longboat.comm.commlog import CommLog
from longboat.config.compositions import refuse_built
from longboat.config.errors import ConfigError
from longboat.config.sections import Config
from longboat.mesh import Mesh
from longboat.optim.checks import facts_of
from longboat.ps.client import Connection
from longboat.ps.records import OptimizerFactory
from longboat.ps.server import Server, Settings
from longboat.ps.wire import Link
from longboat.topology import DoorwayOptions, Topology

log = logging.getLogger("longboat")


class ServerExit(SystemExit):
    """Raised on a server rank when its work is done (exit code 0, or 1 if it stopped the
    job or no worker finished); ``summary`` is what it served."""

    def __init__(self, summary: dict[str, Any]) -> None:
        super().__init__(1 if summary.get("aborted") or none_finished(summary) else 0)
        self.summary = summary


# [Note: workers that fail] In async and ssp the servers drop dead workers and go on, and the
# launcher lets the others run ([Note: keeping survivors]); a worker whose script raised still
# says goodbye (from the engine's exit handler) and tells the servers its host and its error.
# With no worker left that finished, the job trained nothing to its end: each server names
# every worker (rank, host, error or death) and exits 1, so the job's status says so on every
# node, also where no launcher sees the workers (the servers on another host, or srun).


def none_finished(summary: dict[str, Any]) -> bool:
    """True when no worker finished its training: each one died or failed."""
    workers = summary.get("workers") or []
    return bool(workers) and all(w["dead"] or w.get("error") for w in workers)


def worker_fate(i: int, w: dict[str, Any]) -> str:
    """``worker 0 (rank 0 on h1) failed: RuntimeError: ...`` from a summary's worker entry."""
    where = f"rank {w['rank']} on {w['host']}" if w.get("host") else f"rank {w['rank']}"
    if w["dead"]:
        return f"worker {i} ({where}) died at clock {w['clock']}"
    if w.get("error"):
        return f"worker {i} ({where}) failed: {w['error']}"
    return f"worker {i} ({where}) finished"


class ParameterServerService:
    """The servers beside the workers of one job (see [Note: parameter server roles])."""

    def __init__(self, config: Config, world_size: int) -> None:
        cfg = config.parameter_server
        self.config = config
        self.cfg = cfg
        if world_size <= cfg.servers:
            raise ConfigError(
                f"parameter_server.servers = {cfg.servers} leaves no worker at world size "
                f"{world_size}; launch at least {cfg.servers + 1} processes, or use fewer servers"
            )
        self.ranks = cfg.servers
        self.workers = list(range(world_size - cfg.servers))
        self.servers = list(range(world_size - cfg.servers, world_size))
        self.link: Link | None = None
        self._setup_group: Any = None
        self._setup_comm: Collectives | None = None
        #: The doorway every parameter-server message goes through (after :meth:`start`); its
        #: comm log stays readable once closed.
        self.comm: Collectives | None = None
        self.serving: Server | None = None  # this rank's server, while it serves

    @property
    def sync(self) -> bool:
        return self.cfg.mode == "sync"

    def serves(self, rank: int) -> bool:
        return rank in self.servers

    def start(self, timeout_s: float) -> None:
        """Make the servers' group and the workers' start group (collective, every rank)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        everyone = self.workers + self.servers
        group = dist.new_group(everyone, backend="gloo", timeout=timeout)
        c = self.config.comm
        # Messages only: a desync check would need every rank in each one, which the servers'
        # receive-from-any never is.
        comm = Collectives(
            group,
            log=c.log,
            log_verbose=c.log_verbose,
            timeout_s=timeout_s,
            name="parameter servers",
        )
        self.comm = comm
        self.link = Link(group, comm)
        self._setup_group = (
            dist.new_group(self.workers, backend="gloo", timeout=timeout)
            if len(self.workers) > 1
            else None
        )
        rank = dist.get_rank()
        if self._setup_group is not None and not self.serves(rank):
            # The workers' doorway for the start's broadcast; its desync check runs on the
            # group itself (gloo), so that no group is made by the workers alone.
            self._setup_comm = Collectives(
                self._setup_group,
                desync_check=c.desync_check,
                check_group=self._setup_group,
                log=c.log,
                log_verbose=c.log_verbose,
                timeout_s=timeout_s,
                name="parameter-server workers",
            )
        if self.serves(rank):
            roles.announce(rank, roles.Role(f"parameter server {self.servers.index(rank)}"))
        else:  # async and ssp go on without a worker that dies: the launcher may too
            what = f"parameter-server worker {self.workers.index(rank)} ({self.cfg.mode})"
            roles.announce(rank, roles.Role(what, droppable=not self.sync))

    # -- the workers' side ---------------------------------------------------------------------

    def topology(self, mesh: Mesh, options: DoorwayOptions, device: torch.device) -> Topology:
        """The workers' topology: real groups in sync mode, a world of one each otherwise."""
        if self.sync:
            return Topology.build(mesh, options, device, outside=self.ranks)
        rank = dist.get_rank()
        return Topology.of(
            mesh, rank, lambda size, r, axis: Collectives.alone(rank, name=f"{axis} (own)")
        )

    def setup_group(self) -> Any:
        """A gloo group of the workers (None with one worker): the start's broadcast."""
        return self._setup_group

    def setup_comm(self) -> Collectives | None:
        """The doorway of :meth:`setup_group` on a worker (None with one worker): the start's
        broadcast of worker 0's (group rank 0's) parameters and buffers."""
        return self._setup_comm

    def connect(self, worker: int) -> Connection:
        assert self.link is not None, "start() first"
        c = self.config.comm
        log = (
            CommLog(len(self.workers) + len(self.servers), worker, c.log_verbose) if c.log else None
        )
        return Connection(self.link, worker, self.servers, self.cfg.heartbeat_s, log)

    # -- the servers' side ---------------------------------------------------------------------

    def serve(
        self, optimizer: torch.optim.Optimizer, mesh: Mesh, options: DoorwayOptions
    ) -> NoReturn:
        """The engine's servers: the user's optimizer class and hyperparameters step each key
        (see :func:`optimizer_factory`); serve, then end the process (ServerExit)."""
        check_optimizer(optimizer, self.config)
        if self.sync:  # the workers' groups are made by every rank ([Note: group creation])
            Topology.stand_aside(mesh, options, outside=self.ranks)
        self.serve_with(optimizer_factory(optimizer))

    def serve_beside(
        self, optimizer: torch.optim.Optimizer, mesh: Mesh, options: DoorwayOptions
    ) -> ServingThread:
        """:meth:`serve` from a thread, once the groups every rank makes together are made
        (on this thread, so their order is the other ranks'); the caller goes on."""
        check_optimizer(optimizer, self.config)
        if self.sync:
            Topology.stand_aside(mesh, options, outside=self.ranks)
        thread = ServingThread(self, optimizer_factory(optimizer))
        thread.start()
        return thread

    def serve_with(self, make_optimizer: OptimizerFactory) -> NoReturn:
        """Serve until every worker has left or died, then end the process (ServerExit)."""
        assert self.link is not None, "start() first"
        rank = dist.get_rank()
        index = self.servers.index(rank)
        settings = Settings(
            mode=self.cfg.mode,
            staleness=self.cfg.staleness if self.cfg.mode == "ssp" else 0,
            update_on_server=self.cfg.update_on_server,
            dead_after_s=self.cfg.dead_after_s,
        )
        log.info(
            "rank %d: parameter server %d of %d (%s) for %d workers",
            rank,
            index,
            len(self.servers),
            self.cfg.mode,
            len(self.workers),
        )
        server = Server(self.link, index, len(self.servers), self.workers, make_optimizer, settings)
        self.serving = server
        try:
            summary = server.run()
        finally:
            group, self.link = self.link.group, None
            if self.comm is not None:
                self.comm.close()
            if self._setup_group is not None:
                dist.destroy_process_group(self._setup_group)
            dist.destroy_process_group(group)
        report(summary)
        raise ServerExit(summary)

    def close(self) -> None:
        """Release the groups (a worker, after saying goodbye)."""
        if self.link is not None:
            assert self.comm is not None
            self.comm.close()
            dist.destroy_process_group(self.link.group)
            self.link = None
        if self._setup_comm is not None:
            self._setup_comm.close()
            self._setup_comm = None
        if self._setup_group is not None:
            dist.destroy_process_group(self._setup_group)
            self._setup_group = None


class ServingThread(threading.Thread):
    """A server's loop beside other work in its process (:meth:`~ParameterServerService.
    serve_beside`); ``summary`` is what it served, once the workers have left."""

    def __init__(self, service: ParameterServerService, make_optimizer: OptimizerFactory) -> None:
        super().__init__(name="longboat-ps-server", daemon=True)
        self.service, self.make_optimizer = service, make_optimizer
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.service.serve_with(self.make_optimizer)
        except ServerExit as done:
            self.summary = done.summary
        except BaseException as e:  # kept for the caller, which joins
            self.error = e

    def memory(self) -> dict[str, int]:
        """Bytes the server holds now (values and optimizer state)."""
        server = self.service.serving
        return server.memory() if server is not None else {}


def optimizer_factory(optimizer: torch.optim.Optimizer) -> OptimizerFactory:
    """Build, for a key's segments, the user's optimizer class with the hyperparameters of the
    parameter group the key came from."""

    def make(key: int, group: int, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        hyper = {k: v for k, v in optimizer.param_groups[group].items() if k != "params"}
        # The user's concrete class, built from its groups alone (they hold every
        # hyperparameter); mypy checks the call against the base class's __init__, which also
        # takes ``defaults``, and which no optimizer in use is an instance of.
        return type(optimizer)([{**hyper, "params": tensors}])  # type: ignore[call-arg]

    return make


def check_optimizer(optimizer: torch.optim.Optimizer, config: Config) -> None:
    """Servers step their ranges of the parameters on their own: what the table of
    compositions refuses of ``optimizer`` under the parameter server, refused on the servers
    too ([Note: compositions])."""
    refuse_built(config, facts_of(optimizer, strategy="parameter_server"))


def report(summary: dict[str, Any]) -> None:
    """One line per worker the server lost or that failed, and the summary as JSON (debug)."""
    failed = none_finished(summary) and not summary.get("aborted")
    for i, w in enumerate(summary["workers"]):
        if w.get("error") and not w["dead"] and not failed:  # the others went on
            log.warning("parameter server %d: %s", summary["server"], worker_fate(i, w))
        if w["dead"]:
            log.warning(
                "parameter server %d: worker %d (rank %d) died at clock %d and lost %d "
                "updates (the furthest worker reached %d)",
                summary["server"],
                i,
                w["rank"],
                w["clock"],
                w["lost_updates"],
                w["clock"] + w["lost_updates"],
            )
    if failed:
        # [Note: workers that fail]
        names = "; ".join(worker_fate(i, w) for i, w in enumerate(summary["workers"]))
        log.error(
            "parameter server %d: no worker finished its training (%s): the job failed; "
            "restart it from the last checkpoint (longboat run --max-restarts N restarts it "
            "for you)",
            summary["server"],
            names,
        )
    log.debug("parameter server summary: %s", json.dumps(summary))
