"""The server side: one loop that takes requests from any worker, in the order they come.

[Note: parameter server modes] A server holds its range of every key (see ``layout.py``) and,
with ``update_on_server``, an optimizer over it. The modes differ only in when a push is applied
and when a pull is answered:

- ``async``: each push is applied when it arrives (one optimizer step per push); a pull is
  answered at once. The loop handles one request at a time, so two updates of one key never
  run together.
- ``sync`` and ``ssp``: pushes of one clock (a worker's clock is the number of pushes it made)
  are summed; when every live worker pushed clock c, their mean is applied as one optimizer
  step, clocks strictly in order. In ``sync`` a worker's pull at clock c waits until clock
  c - 1 is applied, so each step sees every worker's gradient: the update ``replicate`` makes.
  In ``ssp`` with staleness s it waits only until clock c - 1 - s is applied: a worker runs
  ahead of the slowest by at most s clocks, and every update it reads is at most s clocks old.
  s = 0 is ``sync``.
- Without ``update_on_server`` (``sync`` only) the server only averages: a pull returns the mean
  gradient and each worker runs the optimizer itself.

[Note: parameter server liveness] Every worker sends a heartbeat to each server every
``heartbeat_s`` (a thread of its own, see ``client.py``), and the server notes when it last heard
from each. A worker silent for ``dead_after_s`` is dead: in ``async`` and ``ssp`` it is dropped
(logged with its clock; what it had pushed stays applied) and the others go on without waiting
for it; in ``sync`` nothing can go on, so every waiting worker gets an abort naming it. A
receive-from-any cannot time out and be posted again (gloo drops it), so the server only looks
at the clocks when a message wakes it: the live workers' heartbeats guarantee one comes. With
none left to send one (every worker died), a watch thread ends the server with status 1
(:meth:`Server._watch`). Every message goes through the comm doorway (``wire.py``), which logs
it and reports a receive that times out; the receive-from-any it leaves to this watch
([Note: receives from any rank] in ``comm/messages.py``): a server waiting between requests is
idle, not hung, and a worker lost mid-message is dropped or named here, not by the doorway.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from longboat.observe.memory import optimizer_state_tensors
from longboat.ps.layout import Planner
from longboat.ps.records import (
    Held,
    OptimizerFactory,
    Settings,
    WorkerRecord,
    held_pushes,
    restore,
    state_of,
)
from longboat.ps.wire import (
    CONTROL_KEY,
    PAYLOAD,
    Header,
    Link,
    Op,
    decode_json,
    empty_header,
    encode_json,
    reply_tag,
)

log = logging.getLogger("longboat")

__all__ = [
    "CONTROL_KEY",
    "Held",
    "OptimizerFactory",
    "Server",
    "Settings",
    "WorkerRecord",
    "held_pushes",
]


class Server:
    """Server ``index`` of a job whose workers are the global ranks ``workers``."""

    def __init__(
        self,
        link: Link,
        index: int,
        servers: int,
        workers: list[int],
        make_optimizer: OptimizerFactory,
        settings: Settings,
    ) -> None:
        self.link = link
        self.index = index
        self.settings = settings
        now = time.monotonic()
        self.workers = [WorkerRecord(rank=r, last_seen=now) for r in workers]
        self.planner = Planner(servers)
        self.held: dict[int, Held] = {}
        self._make_optimizer = make_optimizer
        self._pulls: list[Header] = []
        self._barrier: set[int] = set()
        self._leaving: set[int] = set()
        self.aborted: str | None = None
        self.started = now
        # Workers heard from at least once: one still building its model has not started its
        # heartbeats yet, and its silence says nothing (see _watch).
        self._heard: set[int] = set()

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Serve until every worker has left or died; returns :meth:`summary`."""
        buf = empty_header()
        done = threading.Event()
        watch = threading.Thread(
            target=self._watch, args=(done,), name="longboat-ps-watch", daemon=True
        )
        watch.start()
        try:
            return self._serve(buf)
        finally:
            done.set()
            watch.join()  # no thread of ours left running into the process's exit

    def _watch(self, done: threading.Event) -> None:
        """End the process when no worker can wake the loop any more.

        The loop notices deaths only when a message wakes it ([Note: parameter server
        liveness]); a worker that left keeps sending heartbeats until it is answered. With
        every worker heard from once and silent since for ``dead_after_s``, none is left to
        send one, so every one died
        and the receive would wait for the group's timeout (30 minutes by default): the job
        failed, and this server says so and exits 1 (its state serves no one)."""
        limit = self.settings.dead_after_s
        while not done.wait(min(limit / 4, 1.0)):
            silent = time.monotonic() - max(w.last_seen for w in self.workers)
            if len(self._heard) == len(self.workers) and silent > limit:
                names = ", ".join(f"worker {i} (rank {w.rank})" for i, w in enumerate(self.workers))
                log.error(
                    "parameter server %d: every worker died (%s), none finished its training: "
                    "the job failed; restart it from the last checkpoint (longboat run "
                    "--max-restarts N restarts it for you)",
                    self.index,
                    names,
                )
                for handler in [*log.handlers, *logging.getLogger().handlers]:
                    handler.flush()
                os._exit(1)  # the main thread waits in a receive nothing will answer

    def _serve(self, buf: torch.Tensor) -> dict[str, Any]:
        broken_since: float | None = None
        while any(w.live() for w in self.workers):
            try:
                self.link.recv(buf, None, 0)
            except RuntimeError:
                # A worker killed mid-message breaks the receive-from-any ("Connection reset
                # by peer", no rank named). Post it again: the live workers' messages still
                # come; when none is left, the watch ends the process naming them all. Only
                # an error that persists past dead_after_s is the server's own.
                now = time.monotonic()
                if broken_since is None:
                    log.warning("parameter server %d: a worker's connection broke", self.index)
                broken_since = now if broken_since is None else broken_since
                if now - broken_since > self.settings.dead_after_s:
                    raise
                time.sleep(0.05)
                continue
            broken_since = None
            h = Header.of(buf)
            self._heard.add(h.worker)
            w = self.workers[h.worker]
            w.last_seen = time.monotonic()
            try:
                self._handle(h, w)
            except RuntimeError as e:  # the worker died between a header and its payload
                if w.dead:
                    raise
                log.warning("parameter server %d: worker %d: %s", self.index, h.worker, e)
                self._drop(h.worker, w, time.monotonic() - w.last_seen)
            self._check_liveness()
        # Everyone has left or died: a worker's goodbye is answered only now, so that until
        # then its heartbeats keep waking this loop to notice the others.
        total = sum(x.pushes for x in self.workers)
        for i in sorted(self._leaving):
            self.link.reply(Header(Op.REPLY, CONTROL_KEY, a=total), self.workers[i].rank)
        return self.summary()

    def _handle(self, h: Header, w: WorkerRecord) -> None:
        if h.op == Op.BEAT:
            return
        if h.op == Op.INIT:
            self._init(h, w.rank)
        elif h.op == Op.PUSH:
            self._push(h, w)
        elif h.op == Op.PULL:
            w.pulls += 1
            self._pulls.append(h)
        elif h.op == Op.BARRIER:
            self._barrier.add(h.worker)
        elif h.op == Op.BYE:
            if h.a:  # where it ran and, when it left by failing, its error
                said = torch.empty(int(h.a), dtype=torch.uint8)
                self.link.recv(said, w.rank, PAYLOAD)
                note = decode_json(said)
                w.host, w.error = str(note.get("host", "")), note.get("error")
            w.finished = True
            self._leaving.add(h.worker)
            for held in self.held.values():  # clocks that waited for it complete without it
                self._advance(held)
        elif h.op == Op.STATE:
            self._send_state(self.held[h.key], w.rank)
        elif h.op == Op.STATS:
            clocks = encode_json([x.clock for x in self.workers])
            self.link.reply(Header(Op.REPLY, CONTROL_KEY, a=clocks.numel()), w.rank, clocks)
        elif h.op == Op.SET_STATE:
            self._set_state(self.held[h.key], h, w.rank)
            self.link.reply(Header(Op.REPLY, h.key), w.rank)  # applied: the worker may go on
        else:
            raise RuntimeError(f"parameter server {self.index}: unknown request {h}")
        self._answer()

    def _init(self, h: Header, src: int) -> None:
        """A key declared: ``a`` bytes of JSON (its tensors' sizes, dtype and group) follow,
        then, from the worker whose values count (``b`` = 1), this server's range of them."""
        meta_t = torch.empty(int(h.a), dtype=torch.uint8)
        self.link.recv(meta_t, src, PAYLOAD)
        meta = decode_json(meta_t)
        if h.key == len(self.planner.layouts):  # the first worker to declare it
            lay = self.planner.add(tuple(meta["sizes"]))
            segs = lay.segments(self.index)
            if segs:
                dtype = getattr(torch, meta["dtype"])
                values = [torch.zeros(x.numel, dtype=dtype) for x in segs]
                optimizer = (
                    self._make_optimizer(h.key, int(meta["group"]), values)
                    if self.settings.update_on_server
                    else None
                )
                self.held[h.key] = Held(lay, segs, values, optimizer)
        elif h.key > len(self.planner.layouts):
            raise RuntimeError(
                f"parameter server {self.index}: key {h.key} declared before key "
                f"{len(self.planner.layouts)}; every worker must declare keys in one order"
            )
        if not h.b or h.key not in self.held:
            return
        held = self.held[h.key]
        flat = torch.empty(held.span, dtype=held.values[0].dtype)
        self.link.recv(flat, src, PAYLOAD)
        self.link.count("init", flat.numel() * flat.element_size())
        for v, x in zip(
            held.values, torch.split(flat, [s.numel for s in held.segments]), strict=True
        ):
            v.copy_(x)
        held.initialized = True

    # -- pushes --------------------------------------------------------------------------------

    def _push(self, h: Header, w: WorkerRecord) -> None:
        held = self.held[h.key]
        n_seg = len(held.segments)
        payload = torch.empty(held.span + n_seg, dtype=held.values[0].dtype)
        self.link.recv(payload, w.rank, PAYLOAD)
        self.link.count("push", payload.numel() * payload.element_size())
        w.pushes += 1
        w.clock = max(w.clock, h.clock + 1)
        lr = h.a if h.b else None
        if self.settings.mode == "async":
            self._apply(held, payload, 1, lr)
            return
        acc = held.acc.get(h.clock)
        if acc is None:
            held.acc[h.clock] = payload
            held.who[h.clock] = {h.worker}
        else:
            acc += payload
            held.who[h.clock].add(h.worker)
        held.lr = lr
        self._advance(held)

    def _advance(self, held: Held) -> None:
        """Apply every complete clock, in order (sync and ssp)."""
        while held.version in held.acc:
            c = held.version
            waiting = {i for i, w in enumerate(self.workers) if w.live()} - held.who[c]
            if waiting:
                return
            self._apply(held, held.acc.pop(c), len(held.who.pop(c)), held.lr)

    def _apply(self, held: Held, payload: torch.Tensor, n: int, lr: float | None) -> None:
        """Apply the mean of ``n`` summed pushes: an optimizer step, or kept for the pulls."""
        if n > 1:
            payload /= n
        held.version += 1
        if not self.settings.update_on_server:
            held.mean = payload
            return
        assert held.optimizer is not None
        grads = torch.split(payload[: held.span], [s.numel for s in held.segments])
        flags = payload[held.span :]
        for v, g, f in zip(held.values, grads, flags.tolist(), strict=True):
            v.grad = g if f > 0 else None  # a segment no worker used is not stepped
        if lr is not None:
            for group in held.optimizer.param_groups:
                group["lr"] = lr
        held.optimizer.step()
        for v in held.values:
            v.grad = None

    # -- answers -------------------------------------------------------------------------------

    def _min_clock(self) -> int:
        live = [w.clock for w in self.workers if w.live()]
        return min(live) if live else max((w.clock for w in self.workers), default=0)

    def _ready(self, h: Header) -> bool:
        held = self.held[h.key]
        if not held.initialized:
            return False
        mode = self.settings.mode
        if mode == "async":
            return True
        bound = 0 if mode == "sync" else self.settings.staleness
        return held.version >= h.clock - bound

    def _answer(self) -> None:
        if self.aborted is not None:
            for h in self._pulls:
                self._abort(self.workers[h.worker].rank, h.key)
            for i in self._barrier:
                self._abort(self.workers[i].rank, CONTROL_KEY)
            self._pulls, self._barrier = [], set()
            return
        waiting = []
        for h in self._pulls:
            if self._ready(h):
                self._send_pull(h)
            else:
                waiting.append(h)
        self._pulls = waiting
        live = {i for i, w in enumerate(self.workers) if w.live()}
        if self._barrier and live <= self._barrier:
            for i in self._barrier:
                self.link.reply(Header(Op.REPLY, CONTROL_KEY), self.workers[i].rank)
            self._barrier = set()

    def _send_pull(self, h: Header) -> None:
        held = self.held[h.key]
        w = self.workers[h.worker]
        if held.mean is not None and not self.settings.update_on_server:
            payload = held.mean
        else:
            ones = torch.ones(len(held.segments), dtype=held.values[0].dtype)
            payload = torch.cat([*held.values, ones])
        lag = max(h.clock - held.version, 0)
        w.max_staleness = max(w.max_staleness, lag)
        self.link.count("pull", payload.numel() * payload.element_size())
        dead = sum(x.dead for x in self.workers)
        self.link.reply(
            Header(Op.REPLY, h.key, held.version, h.worker, a=self._min_clock(), b=lag, c=dead),
            w.rank,
            payload,
        )

    def _abort(self, rank: int, key: int) -> None:
        dead = [i for i, w in enumerate(self.workers) if w.dead]
        self.link.reply(Header(Op.ABORT, key, a=dead[0] if dead else -1), rank)

    # -- liveness ------------------------------------------------------------------------------

    def _check_liveness(self) -> None:
        now = time.monotonic()
        for i, w in enumerate(self.workers):
            if w.live() and now - w.last_seen > self.settings.dead_after_s:
                self._drop(i, w, now - w.last_seen)

    def _drop(self, i: int, w: WorkerRecord, silent_s: float) -> None:
        w.dead = True
        others = max((x.clock for x in self.workers if not x.dead), default=w.clock)
        if self.settings.mode == "sync":
            self.aborted = f"worker {i} (rank {w.rank})"
            log.error(
                "parameter server %d: worker %d (rank %d) sent nothing for %.1f s; sync mode "
                "needs every worker's gradient each step: stopping the job",
                self.index,
                i,
                w.rank,
                silent_s,
            )
        else:
            log.warning(
                "parameter server %d: worker %d (rank %d) sent nothing for %.1f s: dropped at "
                "clock %d (the others are at %d); the %d live workers go on",
                self.index,
                i,
                w.rank,
                silent_s,
                w.clock,
                others,
                sum(x.live() for x in self.workers),
            )
        for held in self.held.values():
            self._advance(held)
        self._answer()

    # -- state ---------------------------------------------------------------------------------

    def _send_state(self, held: Held, rank: int) -> None:
        meta, flat = state_of(held, [w.clock for w in self.workers])
        m = encode_json(meta)
        self.link.reply(Header(Op.REPLY, held.layout.key, a=m.numel(), b=flat.numel()), rank)
        self.link.send(m, rank, reply_tag(held.layout.key) + 1)
        self.link.send(flat, rank, reply_tag(held.layout.key) + 1)

    def _set_state(self, held: Held, h: Header, rank: int) -> None:
        meta_t = torch.empty(int(h.a), dtype=torch.uint8)
        self.link.recv(meta_t, rank, PAYLOAD)
        flat = torch.empty(int(h.b), dtype=held.values[0].dtype)
        self.link.recv(flat, rank, PAYLOAD)
        clocks = restore(held, decode_json(meta_t), flat)
        for w, c in zip(self.workers, clocks, strict=True):
            w.clock = c

    # -- the end -------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Per worker: pushes, pulls, clock, whether it died and the updates it lost (how many
        clocks behind the furthest worker it stopped); per kind, messages and bytes."""
        top = max((w.clock for w in self.workers), default=0)
        return {
            "server": self.index,
            "mode": self.settings.mode,
            "aborted": self.aborted,
            "seconds": time.monotonic() - self.started,
            "workers": [
                {
                    "rank": w.rank,
                    "pushes": w.pushes,
                    "pulls": w.pulls,
                    "clock": w.clock,
                    "dead": w.dead,
                    "host": w.host,
                    "error": w.error,
                    "lost_updates": top - w.clock if w.dead else 0,
                    "max_staleness": w.max_staleness,
                }
                for w in self.workers
            ],
            "traffic": {k: {"messages": c, "bytes": b} for k, (c, b) in self.link.counts.items()},
            "comm_log": self.link.comm.log_summary(),  # each message (comm.log)
            "memory": self.memory(),
        }

    def memory(self) -> dict[str, int]:
        """Bytes this server holds for its keys: values and optimizer state."""
        values = [v for held in self.held.values() for v in held.values]
        state = [
            t
            for held in self.held.values()
            if held.optimizer is not None
            for t in optimizer_state_tensors(held.optimizer)
        ]
        return {
            "parameters": sum(v.numel() * v.element_size() for v in values),
            "optimizer_state": sum(t.numel() * t.element_size() for t in state),
        }
