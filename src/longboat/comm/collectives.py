"""The one doorway to ``torch.distributed``.

Every collective longboat issues goes through a :class:`Collectives` object, so that logging,
timing and hang detection (later layers) can see all traffic in one place. A world of one has no
process group: every operation is then the identity and costs nothing.
"""

from __future__ import annotations

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

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False
                   ) -> Handle:
        """Reduce ``tensor`` in place across ranks (``op``: sum, max or min)."""
        if not self.active:
            return _Done()
        work = dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                       ) -> Handle:
        """Sum ``input`` across ranks; rank r keeps chunk r of the result in ``output``."""
        if not self.active:
            output.copy_(input)
            return _Done()
        work = _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=self.group,
                               async_op=async_op)
        return work if async_op else _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
                   ) -> Handle:
        """Concatenate every rank's ``input`` (equal sizes, in rank order) into ``output``."""
        if not self.active:
            output.copy_(input)
            return _Done()
        work = _all_gather(output, input, group=self.group, async_op=async_op)
        return work if async_op else _Done()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s copy."""
        if self.active:
            dist.broadcast(tensor, src=src, group=self.group)

    def barrier(self) -> None:
        """Wait until every rank arrives."""
        if self.active:
            dist.barrier(group=self.group)
