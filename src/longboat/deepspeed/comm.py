"""DeepSpeed's ``deepspeed.comm``: the rank queries and collectives a DeepSpeed script calls,
on ``torch.distributed`` ([Note: DeepSpeed call sites] in ``deepspeed/__init__.py``).

[Note: DeepSpeed comm] DeepSpeed's ``deepspeed.comm`` is ``torch.distributed``'s functions with
the same names and arguments behind DeepSpeed's own backend object; here they are torch's
directly: these are the script's own collectives, which it would otherwise make through
``torch.distributed`` itself, so longboat's doorway (``comm/collectives.py``), which carries the
engine's traffic, does not stand between them. Two differences from calling torch directly, both
DeepSpeed's: before a process group exists, in a world of one (plain ``python train.py``, where
longboat makes no group), ``get_rank()`` is 0, ``get_world_size()`` 1 and every collective
leaves its tensors as one rank's collective would (a sum of one is itself); where the launcher
says the world is larger, calling one before ``deepspeed.init_distributed()`` or
``deepspeed.initialize()`` is an error that says so, as DeepSpeed's is, rather than torch's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from longboat.config.errors import ConfigError
from longboat.deepspeed.distributed import init_distributed
from longboat.world import World


def is_available() -> bool:
    """Whether ``torch.distributed`` is built in (it is wherever longboat runs)."""
    return dist.is_available()


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_initialized()


def _grouped() -> bool:
    """True when a process group exists; False in a world of one without one; an error where
    the launcher names a larger world and no group was joined yet."""
    if dist.is_initialized():
        return True
    world = World.from_env()
    if world.distributed:
        raise ConfigError(
            f"deepspeed.comm: the launcher says this is rank {world.rank} of {world.world_size} "
            "but no process group exists yet; call deepspeed.init_distributed() (or "
            "deepspeed.initialize(...)) before deepspeed.comm's functions"
        )
    return False


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    return dist.get_rank(group) if _grouped() else 0


def get_world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (default: the world)."""
    return dist.get_world_size(group) if _grouped() else 1


def get_local_rank() -> int:
    """This process's rank on its machine, as the launcher set it."""
    _grouped()
    return World.from_env().local_rank


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The world rank of ``group``'s rank ``group_rank``."""
    if not _grouped() or group is None:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_world_group() -> Any:
    """The default (world) group."""
    return dist.group.WORLD if _grouped() else None


def new_group(ranks: list[int]) -> Any:
    """A group of ``ranks``; every rank calls it."""
    return dist.new_group(ranks) if _grouped() else None


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    """Wait until every rank of ``group`` reaches it."""
    del device_ids  # NCCL's device choice; the group knows its device
    return dist.barrier(group, async_op=async_op) if _grouped() else None


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """Reduce ``tensor`` in place over ``group`` (sum by default), the result on every rank."""
    return dist.all_reduce(tensor, op, group, async_op) if _grouped() else None


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``tensor`` over ``group`` into rank ``dst``'s."""
    return dist.reduce(tensor, dst, op, group, async_op) if _grouped() else None


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    """Rank ``src``'s ``tensor`` into every rank's."""
    return dist.broadcast(tensor, src, group, async_op) if _grouped() else None


def all_gather(
    tensor_list: list[torch.Tensor],
    tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Every rank's ``tensor`` into ``tensor_list``, in rank order."""
    if _grouped():
        return dist.all_gather(tensor_list, tensor, group, async_op)
    tensor_list[0].copy_(tensor)
    return None


def all_gather_into_tensor(
    output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Every rank's ``tensor`` concatenated in rank order into ``output_tensor``."""
    if _grouped():
        return dist.all_gather_into_tensor(output_tensor, tensor, group, async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """``tensor`` reduced over ``group``, this rank's equal slice of it into ``output_tensor``."""
    if _grouped():
        return dist.reduce_scatter_tensor(output_tensor, tensor, op, group, async_op)
    output_tensor.copy_(tensor.reshape(output_tensor.shape))
    return None


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send ``tensor`` to rank ``dst``."""
    _grouped()
    dist.send(tensor, dst, group, tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into ``tensor`` from rank ``src``; returns the sender."""
    _grouped()
    return dist.recv(tensor, src, group, tag)


def destroy_process_group(group: Any = None) -> None:
    """Leave ``group`` (default: the world)."""
    if dist.is_initialized():
        dist.destroy_process_group(group)


__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "is_available",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "send",
]
