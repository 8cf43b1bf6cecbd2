"""What every collectives doorway offers: the real one (:class:`~longboat.comm.collectives.
Collectives`, over one process group) and the planner's meta one (``plan.simulate``), so the
two cannot drift apart.

Ranks are group ranks: ``rank`` is this process's position in the doorway's group, and every
``src``/``dst`` names a position in that group, never a global rank (``global_rank`` converts).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from longboat.comm.trace import CallRecord
from longboat.comm.works import Done

__all__ = ["Comm", "Done", "Handle", "Mailbox"]


@runtime_checkable
class Handle(Protocol):
    """An operation in flight."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


@runtime_checkable
class Comm(Protocol):
    """Collectives and point-to-point operations over one group of ranks."""

    rank: int  # this process's rank in the group
    world_size: int  # the group's size
    active: bool  # False when the group is one rank (every operation is then the identity)
    seq: int  # collectives issued through this doorway
    last: CallRecord | None  # the last collective issued
    blocked_seconds: float  # wall time spent blocked in this doorway's operations
    timeout_s: float
    desync_check: bool
    log: bool

    def global_rank(self, group_rank: int) -> int:
        """The global rank of position ``group_rank`` of this group."""
        ...

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, tag: str = ""
    ) -> Handle:
        """Reduce ``tensor`` in place across the group (``op``: sum, avg, max or min);
        ``tag`` names what it is."""
        ...

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        tag: str = "",
        scratch: bool = False,
    ) -> Handle:
        """Sum ``input`` across the group; rank r keeps chunk r of the result in ``output``.
        ``scratch``: ``input`` is of no further use to the caller and may be overwritten."""
        ...

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""
    ) -> Handle:
        """Concatenate every rank's ``input`` (equal sizes, in rank order) into ``output``."""
        ...

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""
    ) -> Handle:
        """Split ``input`` into ``world_size`` equal chunks and send chunk j to rank j;
        ``output`` receives every rank's chunk for this rank, in rank order
        (``all_to_all_single`` with equal splits)."""
        ...

    def count_replaced(self, op: str, nbytes: int) -> None:
        """Tell the comm log that compressed collectives stood in for an exact ``op`` of
        ``nbytes`` (which was not sent), so that it can show the bytes compression saved."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with group rank ``src``'s copy."""
        ...

    def barrier(self) -> None:
        """Wait until every rank of the group arrives."""
        ...

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False, tag: str = "") -> Handle:
        """Send ``tensor`` to group rank ``dst`` (which must ``recv`` it); ``tag`` names what
        it is (hang reports show it)."""
        ...

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False, tag: str = "") -> Handle:
        """Receive into ``tensor`` what group rank ``src`` sends."""
        ...

    def log_summary(self) -> list[dict[str, Any]]:
        """The comm log's rows; empty when the log is off."""
        ...

    def close(self) -> None:
        """Release what the doorway created (every rank of the group calls it)."""
        ...


@runtime_checkable
class Mailbox(Protocol):
    """Point-to-point messages on numbered channels, received from a named rank or from any
    (a server's requests): an ability of some doorways beside :class:`Comm`. Ranks are group
    ranks, as in :class:`Comm`; ``tag`` names the message in logs and hang reports."""

    rank: int
    world_size: int

    def global_rank(self, group_rank: int) -> int:
        """The global rank of position ``group_rank`` of this group."""
        ...

    def send_message(
        self,
        tensor: torch.Tensor,
        dst: int,
        channel: int,
        tag: str = "",
        loss_reported: bool = True,
    ) -> None:
        """Send ``tensor`` to group rank ``dst`` on ``channel``; returns once it is sent.
        ``loss_reported`` false: a lost peer raises the backend's error, for the caller to
        name, instead of a hang report ([Note: receives from any rank] in
        ``comm/messages.py``)."""
        ...

    def recv_message(
        self,
        tensor: torch.Tensor,
        src: int | None,
        channel: int,
        tag: str = "",
        loss_reported: bool = True,
    ) -> int:
        """Receive into ``tensor`` what group rank ``src`` (None: any rank) sends on
        ``channel``; returns the sender's group rank."""
        ...

    def log_summary(self) -> list[dict[str, Any]]:
        """The comm log's rows; empty when the log is off."""
        ...
