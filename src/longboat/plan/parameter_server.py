"""The parameter server in ``longboat plan``: a row for a worker and a row per server.

A worker is simulated like every other strategy (the engine and the ``parameter_server``
strategy on fake tensors, see ``simulate.py``), with :class:`MetaService` in place of the
servers: its :class:`MetaConnection` lays keys out with the servers' own arithmetic
(``ps/layout.py``), allocates the push and pull buffers the real connection allocates, and
counts the bytes they carry instead of sending them. With ``update_on_server`` the worker's
optimizer never steps, so its row holds no optimizer state.

A server is not an engine: its row is built from the same layouts. On fake tensors it holds its
range of every key and, with ``update_on_server``, the optimizer over it, stepped twice as the
server steps it (so the optimizer state and the step's transients are the optimizer's own);
beside them the summed pushes it may hold per key (``held_pushes`` in ``ps/server.py``: none in
async, one in sync, ``staleness + 1`` in ssp), and for the peak one push arriving and one pull's
reply being made.

Bytes per step: a worker's are those it sends (pushes, and a header per request) and those it
receives (pulls); a server's, what every worker's pushes and pulls move through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longboat.config.sections import Config
from longboat.observe.memory import CATEGORIES, optimizer_state_tensors
from longboat.plan.simulate import Simulated, simulate
from longboat.plan.target import PlanInputError, Target
from longboat.plan.tracker import LiveBytes
from longboat.ps.layout import KeyLayout, Planner
from longboat.ps.server import Settings, held_pushes
from longboat.ps.wire import HEADER_LEN

_HEADER_BYTES = HEADER_LEN * 8  # float64 numbers


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class MetaConnection:
    """:class:`~longboat.ps.client.Connection`'s interface for the engine, moving nothing."""

    servers: int
    sent: dict[str, int]
    planner: Planner = field(init=False)
    clock: dict[int, int] = field(default_factory=dict)
    dtypes: dict[int, torch.dtype] = field(default_factory=dict)
    commlog: None = None

    def __post_init__(self) -> None:
        self.planner = Planner(self.servers)

    @property
    def layouts(self) -> list[KeyLayout]:
        return self.planner.layouts

    def declare(self, tensors: Sequence[torch.Tensor], group: int = 0) -> int:
        lay = self.planner.add(tuple(t.numel() for t in tensors))
        self.clock[lay.key] = 0
        self.dtypes[lay.key] = tensors[0].dtype
        return lay.key

    def _count(self, op: str, nbytes: int) -> None:
        self.sent[op] = self.sent.get(op, 0) + nbytes

    def push(
        self, key: int, flat: torch.Tensor, used: Sequence[bool] | None = None, lr: Any = None
    ) -> None:
        lay = self.layouts[key]
        for s in lay.holders():
            lo, hi = lay.ranges[s]
            flags = torch.zeros(len(lay.segments(s)), dtype=flat.dtype)
            payload = torch.cat([flat[lo:hi], flags])  # as the connection builds it
            self._count("push", _HEADER_BYTES + _nbytes(payload))
        self.clock[key] += 1

    def pull(self, key: int, out: torch.Tensor) -> list[bool]:
        lay = self.layouts[key]
        for s in lay.holders():
            lo, hi = lay.ranges[s]
            payload = torch.empty(hi - lo + len(lay.segments(s)), dtype=out.dtype)
            out[lo:hi].copy_(payload[: hi - lo])
            self._count("pull request", _HEADER_BYTES)
            self._count("pull (received)", _HEADER_BYTES + _nbytes(payload))
        return [True] * len(lay.sizes)

    def barrier(self) -> None:
        pass

    def close(self, error: str | None = None) -> int:
        del error  # a simulated worker has no server to tell why it left
        return 0


@dataclass
class MetaService:
    """:class:`~longboat.ps.service.ParameterServerService` for one simulated worker."""

    config: Config
    workers: list[int]
    sent: dict[str, int]
    connection: MetaConnection | None = None

    @property
    def cfg(self) -> Any:
        return self.config.parameter_server

    @property
    def sync(self) -> bool:
        mode: str = self.cfg.mode
        return mode == "sync"

    def connect(self, worker: int) -> MetaConnection:
        self.connection = MetaConnection(self.cfg.servers, self.sent)
        return self.connection

    def setup_comm(self) -> None:
        return None  # the start's broadcast: counted nowhere (once per run, not per step)

    def close(self) -> None:
        pass


def _server_row(
    index: int,
    keys: list[tuple[KeyLayout, torch.dtype]],
    settings: Settings,
    workers: int,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    worker: Simulated,
) -> Simulated:
    held_n = held_pushes(settings)
    tracker = LiveBytes()
    state: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    comm = {"push (received)": 0, "pull": 0}
    with FakeTensorMode(), tracker:
        held = []
        for lay, dtype in keys:
            segs = lay.segments(index)
            if not segs:
                continue
            values = [torch.zeros(g.numel, dtype=dtype) for g in segs]
            opt = make_optimizer(values) if settings.update_on_server else None
            kept = [torch.empty(lay.span(index) + len(segs), dtype=dtype) for _ in range(held_n)]
            held.append((lay, segs, values, opt, kept))
            message = _HEADER_BYTES + (lay.span(index) + len(segs)) * values[0].element_size()
            comm["push (received)"] += workers * message
            comm["pull"] += workers * message
        for _ in range(2):  # the second step holds the state the first made
            for lay, segs, values, opt, _kept in held:
                payload = torch.empty(lay.span(index) + len(segs), dtype=values[0].dtype)
                if opt is not None:
                    grads = torch.split(payload[: lay.span(index)], [g.numel for g in segs])
                    for v, g in zip(values, grads, strict=True):
                        v.grad = g
                    opt.step()
                    for v in values:
                        v.grad = None
                del payload
                reply = torch.cat([*values, torch.ones(len(segs), dtype=values[0].dtype)])
                del reply
        for _lay, _segs, values, opt, kept in held:
            state["parameters"] += sum(_nbytes(v) for v in values)
            state["gradients"] += sum(_nbytes(k) for k in kept)  # summed pushes
            if opt is not None:
                state["optimizer_state"] += sum(_nbytes(t) for t in optimizer_state_tensors(opt))
    total = sum(state.values())
    return Simulated(
        strategy=worker.strategy,
        world_size=worker.world_size,
        trainable_params=worker.trainable_params,
        model_state=state,
        peak=tracker.max_peak,
        activations=0,
        transient=max(tracker.max_peak - total, 0),
        comm_bytes=comm,
    )


def parameter_server_roles(
    target: Target,
    cfg: Config,
    world_size: int,
    micro_batch: int,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
) -> list[tuple[str, Simulated]]:
    """A worker's row and each server's, for ``world_size`` ranks of which the last
    ``parameter_server.servers`` serve."""
    ps = cfg.parameter_server
    workers = world_size - ps.servers
    if workers < 1:
        raise PlanInputError(
            f"--world-size {world_size} with parameter_server.servers = {ps.servers} leaves no "
            f"worker: plan at least {ps.servers + 1} ranks, or use fewer servers"
        )
    made: list[MetaService] = []

    def service(sent: dict[str, int]) -> MetaService:
        made.append(MetaService(cfg, list(range(workers)), sent))
        return made[-1]

    worker = simulate(target, cfg, workers, micro_batch, make_optimizer, service=service)
    conn = made[0].connection
    assert conn is not None
    keys = [(lay, conn.dtypes[lay.key]) for lay in conn.layouts]
    settings = Settings(
        mode=ps.mode,
        staleness=ps.staleness if ps.mode == "ssp" else 0,
        update_on_server=ps.update_on_server,
    )
    rows = [("worker", worker)]
    for s in range(ps.servers):
        rows.append(
            (f"server {s}", _server_row(s, keys, settings, workers, make_optimizer, worker))
        )
    return rows


__all__ = ["MetaConnection", "MetaService", "parameter_server_roles"]
