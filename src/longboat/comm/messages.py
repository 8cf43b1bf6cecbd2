"""Point-to-point through the doorway: the pipeline's sends and receives between neighbouring
stages (:class:`~longboat.comm.protocol.Comm`'s ``send``/``recv``), and messages on numbered
channels, received from a named rank or from whichever rank speaks first
(:class:`~longboat.comm.protocol.Mailbox`: the parameter server's requests and replies).

Each is recorded (operation, tensor, peer, the user's line), counted in the comm log when it is
on, and bounded by the doorway's timeout; one that times out or loses its peer raises the hang
report, naming the peer ([Note: receives from any rank] says when not). Point-to-point is not
part of the desync check, which is a collective of the whole group: a send and its receive
involve two ranks.

[Note: receives from any rank] A receive from any rank waits for whichever rank speaks first.
A long wait there is idleness, not a hang of a peer it could name (a parameter server between
requests), and an error there names no peer either: it is logged and traced like any receive,
but its errors reach the caller unchanged, whose own liveness watch decides (a parameter
server's heartbeats, [Note: parameter server liveness] in ``ps/server.py``). A channel's
messages between two ranks whose liveness the caller watches the same way (``loss_reported``
false) report a timeout, and leave a lost peer to the caller to name.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from longboat.comm.works import Done, Timed

# [Note: gloo point-to-point on accelerators] gloo's collectives take CUDA tensors (they copy
# through host memory themselves), but its send and recv do not: given a CUDA tensor they hand
# its device pointer to the socket, and the process aborts ("writev ... Bad address", seen on a
# lent H100 with two pipeline stages on one GPU). So a point-to-point message over gloo goes
# through a host copy: a send sends a CPU copy, a recv receives into one and copies it to the
# device in ``wait``.


class Staged:
    """A gloo send or recv through a host copy ([Note: gloo point-to-point on accelerators]):
    ``wait`` keeps the copy alive until the work is over, and lands a recv on the device."""

    __slots__ = ("_done", "_host", "_target", "_work")

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor | None) -> None:
        self._work, self._host, self._target, self._done = work, host, target, False

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        out = self._work.wait(timeout) if timeout is not None else self._work.wait()
        if not self._done:
            self._done = True
            if self._target is not None:
                self._target.copy_(self._host)
        return bool(out) if out is not None else True


class PointToPoint:
    """The point-to-point half of :class:`~longboat.comm.collectives.Collectives`, which
    provides what is declared here."""

    active: bool
    rank: int
    world_size: int
    rules: Any
    commlog: Any
    log: bool
    blocked_seconds: float
    wait_timeout: datetime.timedelta
    _group_name: str

    def global_rank(self, group_rank: int) -> int:
        raise NotImplementedError

    def _live(self) -> Any:
        raise NotImplementedError

    def _record(
        self,
        op: str,
        tensor: torch.Tensor | None,
        out: torch.Tensor | None,
        reduce_op: str,
        tag: str,
    ) -> Any:
        raise NotImplementedError

    def _failed(self, err: RuntimeError, rec: Any, loss_reported: bool = True) -> None:
        raise NotImplementedError

    def _gloo_device(self, tensor: torch.Tensor) -> bool:
        raise NotImplementedError

    # -- the pipeline's: Comm.send and Comm.recv -----------------------------------------------

    def send(
        self, tensor: torch.Tensor, dst: int, async_op: bool = False, tag: str = ""
    ) -> Timed | Done:
        """Send ``tensor`` to group rank ``dst``, which must ``recv`` it; ``tag`` says what it
        is in a hang report."""
        return self._p2p("send", tensor, dst, async_op, tag)

    def recv(
        self, tensor: torch.Tensor, src: int, async_op: bool = False, tag: str = ""
    ) -> Timed | Done:
        """Receive into ``tensor`` what group rank ``src`` sends."""
        return self._p2p("recv", tensor, src, async_op, tag)

    # -- messages on channels: Mailbox ---------------------------------------------------------

    def send_message(
        self,
        tensor: torch.Tensor,
        dst: int,
        channel: int,
        tag: str = "",
        loss_reported: bool = True,
    ) -> None:
        """Send ``tensor`` to group rank ``dst`` on ``channel`` (its receive must name the same
        channel); returns once it is sent. ``loss_reported``: see [Note: receives from any
        rank]."""
        self._p2p("send", tensor, dst, False, tag, channel, loss_reported)

    def recv_message(
        self,
        tensor: torch.Tensor,
        src: int | None,
        channel: int,
        tag: str = "",
        loss_reported: bool = True,
    ) -> int:
        """Receive into ``tensor`` what group rank ``src`` sends on ``channel``; with ``src``
        None, what any rank sends first ([Note: receives from any rank]). Returns the sender's
        group rank."""
        if src is not None:
            self._p2p("recv", tensor, src, False, tag, channel, loss_reported)
            return src
        return self._recv_any(tensor, channel, tag)

    def _recv_any(self, tensor: torch.Tensor, channel: int, tag: str) -> int:
        if not self.active:
            raise RuntimeError("recv in a group of one rank: there is no peer")
        if self.rules is not None:
            self.rules.check("recv", (tensor,), self._group_name)
        rec = self._record("recv", tensor, None, "", f"{tag}, from any rank" if tag else "any")
        t0 = time.perf_counter()
        staged = self._gloo_device(tensor)  # [Note: gloo point-to-point on accelerators]
        wire = torch.empty_like(tensor, device="cpu") if staged else tensor
        # Blocking, bounded by the group's own timeout, and never waited for in shorter
        # slices: after a receive from any rank timed out on gloo, the next message sent to
        # this rank did not arrive (measured with two ranks and a 2 s timeout).
        sender = dist.recv(wire, src=None, group=self._live(), tag=channel)
        if staged:
            tensor.copy_(wire)
        t1 = time.perf_counter()
        self.blocked_seconds += t1 - t0
        if self.log and self.commlog is not None:
            self.commlog.add(rec, tensor.numel() * tensor.element_size(), t1 - t0)
        ranks = [self.global_rank(r) for r in range(self.world_size)]
        return ranks.index(sender)

    def _p2p(
        self,
        name: str,
        tensor: torch.Tensor,
        peer: int,
        async_op: bool,
        tag: str,
        channel: int = 0,
        loss_reported: bool = True,
    ) -> Timed | Done:
        if not self.active:
            raise RuntimeError(f"{name} in a group of one rank: there is no peer")
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"{name}: peer {peer} is not another rank of this group of {self.world_size}"
            )
        if self.rules is not None:
            self.rules.check(name, (tensor,), self._group_name)
        # Recorded (not counted in ``seq``: point-to-point traffic is not part of the desync
        # check's agreement) so that a timeout or a lost peer names the operation and the peer.
        where = f"{'to' if name == 'send' else 'from'} rank {self.global_rank(peer)}"
        rec = self._record(name, tensor, None, "", f"{tag}, {where}" if tag else where)
        t0 = time.perf_counter()
        # [Note: gloo point-to-point on accelerators]
        staged = self._gloo_device(tensor)
        wire = tensor.cpu() if staged else tensor  # a recv's value is not read: copied back
        fn = dist.isend if name == "send" else dist.irecv
        try:
            work = fn(wire, self.global_rank(peer), group=self._live(), tag=channel)
        except RuntimeError as e:
            self._failed(e, rec, loss_reported)
            raise
        t1 = time.perf_counter()
        self.blocked_seconds += t1 - t0
        waited = Staged(work, wire, tensor if name == "recv" else None) if staged else work
        nbytes = tensor.numel() * tensor.element_size()
        log = (self.commlog, nbytes, t1) if self.log and self.commlog is not None else None
        handle = Timed(self, waited, rec, log, loss_reported=loss_reported)
        if not async_op:
            handle.wait()
            return Done()
        return handle
