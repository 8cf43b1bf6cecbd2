"""Horovod's PyTorch API on ``torch.distributed``: a Horovod script runs with one import changed,
``import longboat.horovod.torch as hvd``, under ``longboat run`` (or torchrun, Slurm, mpirun).

[Note: Horovod API] Each function keeps Horovod's meaning and rides on the default process
group (gloo on CPU, NCCL on GPU), joined by :func:`init` from the launcher's environment as
``longboat.initialize`` joins it; the job's shape is read from that group and the environment
each time, so this module keeps no state of its own. ``DistributedOptimizer`` averages (or sums,
or Adasum-combines) each parameter's gradient across ranks in ``step()``: the gradients, in the
optimizer's parameter order, flattened into one buffer per dtype (as Horovod's fusion buffer
packs them) and reduced at once. Horovod launches each from a hook
during the backward and agrees on the order between ranks at run time; launched from hooks here,
a parameter that one rank's backward did not reach would put the ranks' collectives out of order,
so this first version gives up that overlap for an order every rank shares. ``hvd.elastic``
resumes from the last commit on longboat's restarts ([Note: elastic on restarts] in
elastic.py). ``hvd.join()`` lets ranks with fewer batches stop early ([Note: Horovod join] in
joining.py): each round of collectives here starts with a small vote for it. Not here: process
sets, the C++ timeline.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from longboat.horovod import (
    adasum,
    elastic,  # noqa: F401 (hvd.elastic, as in Horovod)
    joining,
)
from longboat.world import World, destroy_process_group, init_process_group

# Reduction ops, as Horovod names them.
Average, Sum, Adasum = "average", "sum", "adasum"


class Compression:
    """Gradient compression on the wire: ``none``, or ``fp16`` (cast for the reduction, the
    result cast back)."""

    class none:  # Horovod's names
        @staticmethod
        def compress(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
            return t, t.dtype

        @staticmethod
        def decompress(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t

    class fp16:
        @staticmethod
        def compress(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
            return (t.to(torch.float16) if t.is_floating_point() else t), t.dtype

        @staticmethod
        def decompress(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return t.to(dtype)


# -- the job -------------------------------------------------------------------------------------


def init(*_: Any, **__: Any) -> None:
    """Join the job (a world of one without a launcher). As Horovod does, leaving is registered
    for the interpreter's exit, so a script that never calls :func:`shutdown` still frees the
    group, and ends gloo's threads, before the interpreter shuts down ([Note: dynamo before the
    group] in world.py says why that matters). The exit leaves without :func:`shutdown`'s
    barrier: a rank that exits on an error must not wait there for ranks still training."""
    if init_process_group(World.from_env()):
        atexit.register(destroy_process_group)


def shutdown() -> None:
    """Leave the job cleanly (a gloo group torn down at interpreter exit can abort it)."""
    # Every rank at the end before any closes its connections: a rank that tore its gloo
    # pairs down while a peer still finished was seen to abort the peer (SIGABRT) at exit.
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    destroy_process_group()


def is_initialized() -> bool:
    return dist.is_initialized() or not World.from_env().distributed


def size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank() -> int:
    return World.from_env().local_rank


def local_size() -> int:
    return World.from_env().local_world_size


def cross_rank() -> int:
    """This node's index among the nodes."""
    return rank() // local_size()


def cross_size() -> int:
    """The number of nodes."""
    return size() // local_size()


def nccl_built() -> bool:
    return dist.is_nccl_available()


def gloo_built() -> bool:
    return dist.is_gloo_available()


def mpi_built() -> bool:
    return False


# -- collectives -----------------------------------------------------------------------------------


class _Pending(Protocol):
    """What a handle uses of the ``Work`` an ``async_op`` collective returns."""

    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class _Handle:
    """An asynchronous operation; :func:`synchronize` gives its result."""

    def __init__(self, work: _Pending | None, finish: Callable[[], torch.Tensor]) -> None:
        self.work, self.finish = work, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


def _op(average: bool | None, op: str | None) -> str:
    if op is None:
        return Sum if average is False else Average
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"op={op!r}: use hvd.Average, hvd.Sum or hvd.Adasum")
    return op


def _device(tensor: torch.Tensor | None = None) -> torch.device:
    if tensor is not None:
        return tensor.device
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _announce(kind: int, tensors: list[torch.Tensor], what: str) -> None:
    """This rank's vote before a round of collectives ([Note: Horovod join])."""
    if size() > 1:
        joining.announce(
            kind, joining.numels_of(tensors), _device(tensors[0] if tensors else None), what
        )


def join(device: int = -1) -> int:
    """This rank has no more data: take part in the other ranks' allreduces (direct ones and
    ``DistributedOptimizer``'s) with zeros until every rank has called ``join``, then return
    the rank that joined last, the same on every rank ([Note: Horovod join] in joining.py).

    While a rank has joined, ``op=Average`` still divides by ``hvd.size()``, all ranks, as
    Horovod does: the result is the sum over the ranks still active, divided by the number of
    all ranks. Other collectives (allgather, broadcast, alltoall, barrier, Adasum) raise on
    every rank while a rank has joined. ``device``: the CUDA device index for the zeros, or -1
    (the default) for CPU, as in Horovod.
    """
    if size() == 1:
        return rank()
    where = torch.device("cpu") if device < 0 else torch.device("cuda", device)
    return joining.join(where)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: Any = Compression.none,
) -> _Handle:
    """Start reducing ``tensor`` in place across ranks."""
    op = _op(average, op)
    if op == Adasum:
        _announce(joining.ADASUM, [tensor], "allreduce(op=Adasum)")
        return _Handle(None, lambda: tensor.copy_(_adasum(tensor)))
    wire, dtype = compression.compress(tensor * prescale_factor if prescale_factor != 1 else tensor)
    _announce(joining.ALLREDUCE, [wire], "allreduce")
    work = dist.all_reduce(wire, async_op=True) if size() > 1 else None

    def finish() -> torch.Tensor:
        out = compression.decompress(wire, dtype)
        scale = postscale_factor / (size() if op == Average else 1)
        return tensor.copy_(out * scale if scale != 1 else out)

    return _Handle(work, finish)


def allreduce_async(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> _Handle:
    """Start reducing a copy of ``tensor``."""
    return allreduce_async_(tensor.detach().clone(), *args, **kwargs)


def allreduce_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return allreduce_async_(tensor, *args, **kwargs).wait()


def allreduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``tensor`` reduced across ranks (averaged by default), as a new tensor."""
    return allreduce_async(tensor, *args, **kwargs).wait()


def synchronize(handle: _Handle) -> torch.Tensor:
    return handle.wait()


def poll(handle: _Handle) -> bool:
    return handle.work is None or handle.work.is_completed()


def _adasum(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` combined by [Note: Adasum], the same on every rank."""
    if size() == 1:
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    return adasum.tree(parts)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (first dims may differ)."""
    if size() == 1:
        return tensor.clone()
    _announce(joining.OTHER, [], "allgather")
    rows = torch.tensor([tensor.shape[0] if tensor.dim() else 1], dtype=torch.int64)
    counts = [torch.empty_like(rows) for _ in range(size())]
    dist.all_gather(counts, rows)
    n = [int(c) for c in counts]
    padded = torch.zeros((max(n), *tensor.shape[1:]), dtype=tensor.dtype)
    padded[: n[rank()]] = tensor.reshape(n[rank()], *tensor.shape[1:])
    parts = [torch.empty_like(padded) for _ in range(size())]
    dist.all_gather(parts, padded)
    return torch.cat([p[:k] for p, k in zip(parts, n, strict=True)])


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    if size() > 1:
        _announce(joining.OTHER, [], "broadcast")
        dist.broadcast(tensor, src=root_rank)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor."""
    return broadcast_(tensor.detach().clone(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    box = [obj]
    if size() > 1:
        _announce(joining.OTHER, [], "broadcast_object")
        dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def alltoall(tensor: torch.Tensor, splits: torch.Tensor | None = None) -> torch.Tensor:
    """Rank r sends ``splits[j]`` rows (dim 0) of ``tensor`` to rank j (equal parts without
    ``splits``) and gets back the rows every rank sent it, in rank order."""
    k = size()
    send = [int(s) for s in splits] if splits is not None else [tensor.shape[0] // k] * k
    if sum(send) != tensor.shape[0]:
        raise ValueError(f"alltoall: splits {send} do not add up to {tensor.shape[0]} rows")
    if k == 1:
        return tensor.clone()
    _announce(joining.OTHER, [], "alltoall")
    recv_counts = torch.empty(k, dtype=torch.int64)
    dist.all_to_all_single(recv_counts, torch.tensor(send, dtype=torch.int64))
    recv = [int(c) for c in recv_counts]
    out = torch.empty((sum(recv), *tensor.shape[1:]), dtype=tensor.dtype)
    dist.all_to_all_single(out, tensor.contiguous(), recv, send)
    return out


def barrier() -> None:
    if size() > 1:
        _announce(joining.OTHER, [], "barrier")
        dist.barrier()


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """``root_rank``'s values of ``params`` (a ``state_dict``, ``named_parameters()`` or a list
    of tensors) on every rank, in place."""
    items = params.items() if isinstance(params, Mapping) else params
    for item in items:
        t = item[1] if isinstance(item, tuple) else item
        if isinstance(t, torch.Tensor):
            with torch.no_grad():
                broadcast_(t.data if isinstance(t, torch.nn.Parameter) else t, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """``root_rank``'s optimizer state (and hyper-parameters) on every rank."""
    state = broadcast_object(optimizer.state_dict(), root_rank)
    optimizer.load_state_dict(state)


# -- the optimizer ---------------------------------------------------------------------------------


class _DistributedOptimizer:
    """Wraps an optimizer: gradients reduced across ranks before each ``step()``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
        compression: Any,
        op: str,
        backward_passes_per_step: int,
        gradient_predivide_factor: float,
    ) -> None:
        self.optimizer = optimizer
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = {id(p): n for n, p in named}
            missing = [p for p in params if id(p) not in names]
            if missing:
                raise ValueError(
                    f"named_parameters does not name {len(missing)} of the optimizer's "
                    "parameters; pass model.named_parameters() of the model it optimizes"
                )
        self.compression = compression
        self.op = op
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step}: use 1 or more")
        self.predivide = gradient_predivide_factor
        if op == Adasum and gradient_predivide_factor != 1.0:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average or hvd.Sum")

    def synchronize(self) -> None:
        """Reduce every gradient in the optimizer's parameter order (a parameter this rank did
        not use contributes zeros). Average and Sum reduce the gradients flattened into one
        buffer per dtype, the buffers a joined rank contributes zeros to ([Note: Horovod
        join]); Adasum reduces each gradient by itself."""
        grads = []
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grads.append(p.grad)
        if self.op == Adasum:
            for grad in grads:
                allreduce_(grad, op=Adasum)
            return
        # Horovod's predivide: 1/f before the sum, f/size after (Average), so the average is
        # the same; with Sum, f is not applied.
        pre = 1.0 / self.predivide if self.op == Average else 1.0
        post = self.predivide / size() if self.op == Average else 1.0
        # Without prescaling or compression the wire is the gradient itself, reduced in place.
        wires = [self.compression.compress(g * pre if pre != 1 else g) for g in grads]
        _announce(joining.ALLREDUCE, [w for w, _ in wires], "allreduce")
        if size() > 1:
            joining.flat_allreduce([w for w, _ in wires])
        for grad, (wire, dtype) in zip(grads, wires, strict=True):
            out = self.compression.decompress(wire, dtype)
            if post != 1:
                grad.copy_(out * post)
            elif out is not grad:
                grad.copy_(out)

    def step(self, closure: Any = None) -> Any:
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:  # param_groups, state, state_dict, ...
        return getattr(self.optimizer, name)


def DistributedOptimizer(  # Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    **_: Any,
) -> Any:
    """``optimizer`` whose ``step()`` first reduces every gradient across ranks (see [Note:
    Horovod API]); gradients accumulated over ``backward_passes_per_step`` backward passes are
    reduced at the ``step()`` that follows them, summed over the passes as Horovod does."""
    return _DistributedOptimizer(
        optimizer,
        named_parameters,
        compression,
        _op(None, op),
        backward_passes_per_step,
        gradient_predivide_factor,
    )


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Sum",
    "allgather",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "gloo_built",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "nccl_built",
    "poll",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]
