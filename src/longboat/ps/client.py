"""The worker side: declare keys, push gradients, pull values (MXNet's KVStore, by key).

:class:`Connection` speaks to the servers in flat tensors (what the engine's strategy uses);
:class:`KVStore` puts MXNet's names on it for users who drive a parameter server directly.
Every worker must declare (``init``) the same keys in the same order.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from longboat.comm.commlog import CommLog
from longboat.comm.trace import CallRecord
from longboat.ps.layout import KeyLayout, Planner
from longboat.ps.wire import CONTROL_KEY, PAYLOAD, Header, Link, Op, decode_json, encode_json


class ServerAbort(RuntimeError):
    """A server stopped the job (a worker died in sync mode)."""


class ServerLost(RuntimeError):
    """A server went away (its process ended, or the link to it broke): it held part of the
    parameters and their optimizer state, so the job cannot go on."""

    def __init__(self, index: int, rank: int, cause: RuntimeError) -> None:
        super().__init__(
            f"parameter server {index} (rank {rank}) is gone ({cause}); it held part of the "
            "parameters and their optimizer state, so the job cannot go on: restart it from "
            "the last checkpoint (longboat run --max-restarts N restarts it for you)"
        )
        self.index, self.rank = index, rank


class Connection:
    """Worker ``worker`` (of ``workers``) of a job whose servers are the global ranks
    ``servers``; heartbeats every ``heartbeat_s`` ([Note: parameter server liveness])."""

    def __init__(
        self,
        link: Link,
        worker: int,
        servers: list[int],
        heartbeat_s: float = 1.0,
        commlog: CommLog | None = None,
    ) -> None:
        self.link = link
        link.peer_error = self._lost
        # ``comm.log``: each push and pull (to every server holding the key) as one entry
        self.commlog = commlog
        self._seq = 0
        self.worker = worker
        self.servers = servers
        self.planner = Planner(len(servers))
        self.clock: dict[int, int] = {}  # pushes made, per key
        self.dtypes: dict[int, torch.dtype] = {}
        # From the last pull: the slowest live worker's clock, this pull's staleness (clocks
        # not yet applied), and how many workers the servers dropped.
        self.min_clock = 0
        self.staleness = 0
        self.max_staleness = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._beats = threading.Thread(
            target=self._beat, args=(heartbeat_s,), name="longboat-ps-heartbeat", daemon=True
        )
        self._beats.start()
        self.closed = False

    def _lost(self, rank: int, cause: RuntimeError) -> Exception:
        if rank not in self.servers:
            return cause
        return ServerLost(self.servers.index(rank), rank, cause)

    # -- keys ----------------------------------------------------------------------------------

    @property
    def layouts(self) -> list[KeyLayout]:
        return self.planner.layouts

    def declare(
        self, tensors: Sequence[torch.Tensor], group: int = 0, values: bool | None = None
    ) -> int:
        """Declare a key made of ``tensors`` (their values count if ``values``, by default on
        worker 0 only); returns its id."""
        sizes = tuple(t.numel() for t in tensors)
        lay = self.planner.add(sizes)
        self.clock[lay.key] = 0
        dtype = tensors[0].dtype if tensors else torch.float32
        self.dtypes[lay.key] = dtype
        meta = encode_json(
            {"sizes": list(sizes), "dtype": str(dtype).removeprefix("torch."), "group": group}
        )
        send_values = self.worker == 0 if values is None else values
        flat = _flat(tensors, dtype) if send_values else None
        for s, server in enumerate(self.servers):
            holds = lay.span(s) > 0
            self.link.request(
                Header(
                    Op.INIT,
                    lay.key,
                    worker=self.worker,
                    a=meta.numel(),
                    b=float(holds and send_values),
                ),
                server,
            )
            self.link.send(meta, server, PAYLOAD)
            if holds and flat is not None:
                lo, hi = lay.ranges[s]
                self.link.send(flat[lo:hi].contiguous(), server, PAYLOAD)
        return lay.key

    # -- push and pull -------------------------------------------------------------------------

    def push(
        self,
        key: int,
        flat: torch.Tensor,
        used: Sequence[bool] | None = None,
        lr: float | None = None,
    ) -> None:
        """Push the key's gradient ``flat`` (its tensors end to end) and which tensors this
        worker used (default: all); ``lr``: the learning rate the server applies it with."""
        lay = self.layouts[key]
        clock = self.clock[key]
        start, sent = time.perf_counter(), 0
        for s in lay.holders():
            lo, hi = lay.ranges[s]
            segs = lay.segments(s)
            flags = torch.tensor(
                [1.0 if used is None or used[g.index] else 0.0 for g in segs], dtype=flat.dtype
            )
            payload = torch.cat([flat[lo:hi], flags])
            self.link.request(
                Header(
                    Op.PUSH,
                    key,
                    clock,
                    self.worker,
                    a=0.0 if lr is None else lr,
                    b=float(lr is not None),
                ),
                self.servers[s],
            )
            self.link.send(payload, self.servers[s], PAYLOAD)
            self.link.count("push", payload.numel() * payload.element_size())
            sent += payload.numel() * payload.element_size()
        self.clock[key] = clock + 1
        self._log("push", key, flat, sent, start)

    def pull(self, key: int, out: torch.Tensor) -> list[bool]:
        """Fill ``out`` (the key's tensors end to end) with what the mode allows at this
        worker's clock: values, or (without ``update_on_server``) the mean gradient; returns
        which tensors some worker used."""
        lay = self.layouts[key]
        holders = lay.holders()
        start, got = time.perf_counter(), 0
        for s in holders:
            self.link.request(Header(Op.PULL, key, self.clock[key], self.worker), self.servers[s])
        used = [False] * len(lay.sizes)
        for s in holders:
            h = self.link.await_reply(key, self.servers[s])
            self._check(h, s)
            lo, hi = lay.ranges[s]
            segs = lay.segments(s)
            payload = torch.empty(hi - lo + len(segs), dtype=out.dtype)
            self.link.reply_payload(payload, key, self.servers[s])
            self.link.count("pull", payload.numel() * payload.element_size())
            got += payload.numel() * payload.element_size()
            out[lo:hi].copy_(payload[: hi - lo])
            for g, f in zip(segs, payload[hi - lo :].tolist(), strict=True):
                used[g.index] = used[g.index] or f > 0
            self.min_clock, self.staleness, self.dropped = int(h.a), int(h.b), int(h.c)
            self.max_staleness = max(self.max_staleness, self.staleness)
        self._log("pull", key, out, got, start)
        return used

    def _log(self, op: str, key: int, t: torch.Tensor, nbytes: int, start: float) -> None:
        if self.commlog is None:
            return
        self._seq += 1
        rec = CallRecord(
            self._seq,
            op,
            str(t.dtype).removeprefix("torch."),
            tuple(t.shape),
            None,
            "",
            "parameter servers",
            "",
            f"Connection.{op}",
            tag=f"key {key}",
        )
        self.commlog.add(rec, nbytes, time.perf_counter() - start)

    def clocks(self) -> list[int]:
        """Every worker's clock as the first server counts it (pushes it has taken)."""
        self.link.request(Header(Op.STATS, worker=self.worker), self.servers[0])
        h = self.link.await_reply(CONTROL_KEY, self.servers[0])
        self._check(h, 0)
        out = torch.empty(int(h.a), dtype=torch.uint8)
        self.link.reply_payload(out, CONTROL_KEY, self.servers[0])
        return [int(c) for c in decode_json(out)]

    def barrier(self) -> None:
        """Return when every live worker has called it (the first server counts)."""
        self.link.request(Header(Op.BARRIER, worker=self.worker), self.servers[0])
        self._check(self.link.await_reply(CONTROL_KEY, self.servers[0]), 0)

    def _check(self, h: Header, s: int) -> None:
        if h.op == Op.ABORT:
            raise ServerAbort(
                f"parameter server {s} (rank {self.servers[s]}) stopped the job: worker "
                f"{int(h.a)} stopped answering, and sync mode needs every worker's gradient "
                "each step; restart from the last checkpoint (or use mode = 'async' or 'ssp', "
                "which go on without it)"
            )

    # -- state (checkpoints) -------------------------------------------------------------------

    def state(self, key: int) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """Each holder's description of its range (values, optimizer state, clocks) and its
        flat tensors, in server order."""
        lay = self.layouts[key]
        out = []
        for s in lay.holders():
            self.link.request(Header(Op.STATE, key, worker=self.worker), self.servers[s])
        for s in lay.holders():
            h = self.link.await_reply(key, self.servers[s])
            self._check(h, s)
            meta = torch.empty(int(h.a), dtype=torch.uint8)
            self.link.reply_payload(meta, key, self.servers[s])
            flat = torch.empty(int(h.b), dtype=self.dtypes[key])  # the key's dtype
            out.append((decode_json(meta), flat))
            self.link.reply_payload(flat, key, self.servers[s])
        return out

    def set_state(self, key: int, per_server: list[tuple[dict[str, Any], torch.Tensor]]) -> None:
        """Give each holder its range's state (as :meth:`state` returned it)."""
        lay = self.layouts[key]
        for s, (meta, flat) in zip(lay.holders(), per_server, strict=True):
            m = encode_json(meta)
            self.link.request(
                Header(Op.SET_STATE, key, worker=self.worker, a=m.numel(), b=flat.numel()),
                self.servers[s],
            )
            self.link.send(m, self.servers[s], PAYLOAD)
            self.link.send(flat.contiguous(), self.servers[s], PAYLOAD)
        for s in lay.holders():  # applied everywhere before anything else is asked
            self._check(self.link.await_reply(key, self.servers[s]), s)

    # -- heartbeats and goodbye ----------------------------------------------------------------

    def _beat(self, every: float) -> None:
        # Sent from this thread on the parameter server's group, beside the main thread's
        # requests: the server's one receive-from-any must hear both ([Note: parameter server
        # liveness]); gloo serialises the sends of one pair.
        while not self._stop.wait(every):
            for server in self.servers:
                try:
                    self.link.request(Header(Op.BEAT, worker=self.worker), server)
                except Exception:  # a lost server, or the group torn down under this thread
                    return  # the main thread's next request says so

    def close(self, error: str | None = None) -> int:
        """Leave: say goodbye to every server and wait until the servers are done (every
        worker has left or died); returns the pushes the servers took in all. ``error``: why
        this worker leaves when it failed, told to the servers with its host, so that a job
        none of whose workers finished says so on the servers too ([Note: workers that
        fail])."""
        if self.closed:
            return 0
        self.closed = True
        try:
            return self._leave(error)
        finally:  # whatever leaving met, the heartbeats end with the connection
            self._stop.set()
            self._beats.join()

    def abandon(self) -> None:
        """Stop the heartbeats without leaving: for a worker whose engine was refused before it
        started (its servers may not be serving, and a goodbye would wait for their answer)."""
        self.closed = True
        self._stop.set()
        self._beats.join()

    def _leave(self, error: str | None) -> int:
        applied = 0
        gone: set[int] = set()  # a server already lost has nothing to say goodbye to
        note = encode_json({"host": socket.gethostname(), "error": error})
        for server in self.servers:
            try:
                self.link.request(Header(Op.BYE, worker=self.worker, a=note.numel()), server)
                self.link.send(note, server, PAYLOAD)
            except ServerLost:
                gone.add(server)
        # A server answers once every worker has left or died; the heartbeats go on until
        # then ([Note: parameter server liveness]).
        for server in self.servers:
            if server in gone:
                continue
            with contextlib.suppress(ServerLost):  # what was lost was said when it happened
                applied += int(self.link.await_reply(CONTROL_KEY, server).a)
        return applied


def uncaught_error() -> str | None:
    """The exception this process is failing with, as ``Type: message`` (None when none).

    Workers leave from ``close()``: in a ``finally`` while the exception propagates
    (``sys.exc_info``), or from the engine's exit handler once the interpreter has printed the
    script's uncaught exception and kept it as ``sys.last_value``."""
    exc = sys.exc_info()[1] or getattr(sys, "last_value", None)
    if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
        return None
    return f"{type(exc).__name__}: {exc}"


def _flat(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


class KVStore:
    """MXNet's KVStore on longboat's parameter servers: ``init``, ``push``, ``pull``,
    ``pushpull`` and ``barrier``, by key (any hashable; every worker must ``init`` the same
    keys in the same order). Create it with :func:`longboat.ps.connect`."""

    def __init__(self, connection: Connection, mode: str, workers: int, service: Any) -> None:
        self.connection = connection
        self._service = service
        self.type = {"sync": "dist_sync", "async": "dist_async", "ssp": "dist_ssp"}[mode]
        self.rank = connection.worker
        self.num_workers = workers
        self._ids: dict[Hashable, int] = {}
        self._shapes: dict[Hashable, torch.Size] = {}

    def init(self, key: Hashable, value: torch.Tensor) -> None:
        """Declare ``key``; worker 0's ``value`` is its initial value on the servers."""
        if key in self._ids:
            raise KeyError(f"KVStore key {key!r} is already initialised")
        self._ids[key] = self.connection.declare([value.detach().float()])
        self._shapes[key] = value.shape

    def _id(self, key: Hashable, t: torch.Tensor, what: str) -> int:
        if key not in self._ids:
            raise KeyError(
                f"KVStore key {key!r} was never initialised: call init({key!r}, value) first"
            )
        if t.shape != self._shapes[key]:
            raise ValueError(
                f"KVStore {what} of key {key!r}: shape {tuple(t.shape)} differs from "
                f"{tuple(self._shapes[key])} given to init"
            )
        return self._ids[key]

    def push(self, key: Hashable, value: torch.Tensor) -> None:
        """Send a gradient of ``key`` (applied as the mode says)."""
        self.connection.push(self._id(key, value, "push"), value.detach().reshape(-1).float())

    def pull(self, key: Hashable, out: torch.Tensor) -> None:
        """Fill ``out`` with the key's value (waiting as the mode says)."""
        i = self._id(key, out, "pull")
        flat = torch.empty(out.numel(), dtype=torch.float32)
        self.connection.pull(i, flat)
        with torch.no_grad():
            out.copy_(flat.view(out.shape))

    def pushpull(self, key: Hashable, value: torch.Tensor, out: torch.Tensor) -> None:
        """``push(key, value)`` then ``pull(key, out)``."""
        self.push(key, value)
        self.pull(key, out)

    def clocks(self) -> list[int]:
        """Every worker's clock (pushes the first server has taken from it)."""
        return self.connection.clocks()

    def barrier(self) -> None:
        """Wait for every live worker."""
        self.connection.barrier()

    def close(self) -> None:
        """Leave the servers (they stop when every worker has left)."""
        self.connection.close(uncaught_error())
        self._service.close()
