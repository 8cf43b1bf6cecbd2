"""The one doorway to ``torch.distributed``.

Every collective longboat issues goes through a :class:`Collectives` object, so that logging,
timing and hang detection (later layers) can see all traffic in one place. A world of one has no
process group: every operation is then the identity and costs nothing.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
import torch.distributed as dist


class Handle(Protocol):
    """An in-flight asynchronous collective."""

    def wait(self) -> Any: ...


class _Done:
    """The handle of an operation that needed no communication."""

    def wait(self) -> bool:
        return True


class _Timed:
    """An in-flight collective whose ``wait`` adds the time it blocks to its doorway's count."""

    __slots__ = ("_owner", "_work")

    def __init__(self, owner: Collectives, work: Any) -> None:
        self._owner = owner
        self._work = work

    def wait(self) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait()
        finally:
            self._owner.blocked_seconds += time.perf_counter() - t0


# torch 2.13 renamed the tensor forms and deprecated the old names; torch>=2.4 has the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Collectives:
    """Collectives over one process group (the default group when ``group`` is None)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        if self.world_size == 1:
            self.active = False
        # Wall time this rank spent blocked in collectives: inside synchronous calls and in
        # waits on asynchronous ones (the profiler's "waiting for communication").
        self.blocked_seconds = 0.0

    def _issue(self, fn: Any, *args: Any, async_op: bool, **kwargs: Any) -> Handle:
        t0 = time.perf_counter()
        work = fn(*args, group=self.group, async_op=async_op, **kwargs)
        if async_op:
            return _Timed(self, work)
        self.blocked_seconds += time.perf_counter() - t0
        return _Done()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False
                   ) -> Handle:
        """Reduce ``tensor`` in place across ranks (``op``: sum, max or min)."""
        if not self.active:
            return _Done()
        return self._issue(dist.all_reduce, tensor, op=_OPS[op], async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                       ) -> Handle:
        """Sum ``input`` across ranks; rank r keeps chunk r of the result in ``output``."""
        if not self.active:
            output.copy_(input)
            return _Done()
        return self._issue(_reduce_scatter, output, input, op=dist.ReduceOp.SUM,
                           async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                   ) -> Handle:
        """Concatenate every rank's ``input`` (equal sizes, in rank order) into ``output``."""
        if not self.active:
            output.copy_(input)
            return _Done()
        return self._issue(_all_gather, output, input, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
        if self.active:
            self._issue(dist.broadcast, tensor, src=src, async_op=False)

    def barrier(self) -> None:
        """Wait until every rank arrives."""
        if self.active:
            self._issue(dist.barrier, async_op=False)
