"""The communication of tensor-parallel layers, as autograd functions over the ``tp`` doorway.

Each moves activations one way in the forward and their gradients the conjugate way in the
backward (Megatron-LM's "regions"):

============================  =============================  ==============================
function                      forward                        backward
============================  =============================  ==============================
:func:`copy_to`               identity                       all-reduce
:func:`reduce_from`           all-reduce                     identity
:func:`gather` (dim)          all-gather along ``dim``       this rank's chunk of ``dim``
:func:`split` (dim)           this rank's chunk of ``dim``   all-gather along ``dim``
:func:`gather_scattered` (d)  all-gather along ``d``         reduce-scatter along ``d``
:func:`reduce_scatter` (d)    reduce-scatter along ``d``     all-gather along ``d``
============================  =============================  ==============================

Over a group of one they are the identity. ``tag`` names the layer (hang reports, the plan's
bytes per layer). They go through longboat's doorway (not DTensor's own
collectives), so the comm log, the hang watchdog and the NCCL rules see every tensor-parallel
transfer like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from longboat.comm.protocol import Comm

#: A move of a tensor across the ranks: (tensor, doorway, dimension, tag) -> tensor.
Move = Callable[[torch.Tensor, Comm, int, str], torch.Tensor]


def _identity(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    return x.view_as(x)


def _all_reduce(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, tag=tag)
    return out


def _gather(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    # The doorway concatenates along dim 0: move ``dim`` there and back.
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * comm.world_size, *moved.shape[1:]))
    comm.all_gather(out, moved, tag=tag)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // comm.world_size, *moved.shape[1:]))
    comm.reduce_scatter(out, moved, tag=tag)
    return out.movedim(0, dim)


def _chunk(x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
    return x.chunk(comm.world_size, dim=dim)[comm.rank].contiguous()


class _Region(torch.autograd.Function):
    """``forward`` moves the activation one way, and the backward moves its gradient by
    ``backward``, the move conjugate to it (the table above)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, comm: Comm, dim: int, tag: str, forward: Move, backward: Move
    ) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.tag, ctx.move_back = comm, dim, tag, backward
        return forward(x, comm, dim, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.move_back(g, ctx.comm, ctx.dim, ctx.tag), None, None, None, None, None


_F = TypeVar("_F", bound=Callable[..., Any])


def _between_graphs(fn: _F) -> _F:
    """``torch.compiler.disable(fn)``, keeping ``fn``'s type (torch's is unannotated)."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


# Under torch.compile each move runs as Python between graphs: the doorway counts, checks and
# logs every transfer ([Note: compiling under a strategy] in longboat/compile.py).
@_between_graphs
def _region(
    x: torch.Tensor, comm: Comm, dim: int, tag: str, forward: Move, backward: Move
) -> torch.Tensor:
    if comm.world_size == 1:
        return x
    # torch's Function.apply is unannotated; _Region.forward returns a tensor
    out: torch.Tensor = _Region.apply(x, comm, dim, tag, forward, backward)  # type: ignore[no-untyped-call]
    return out


def copy_to(x: torch.Tensor, comm: Comm, tag: str = "") -> torch.Tensor:
    """Enter a column-parallel layer: the input is whole on every rank; its gradient is the
    sum of every rank's part."""
    return _region(x, comm, -1, tag, _identity, _all_reduce)


def reduce_from(x: torch.Tensor, comm: Comm, tag: str = "") -> torch.Tensor:
    """Leave a row-parallel layer: sum the ranks' partial outputs."""
    return _region(x, comm, -1, tag, _all_reduce, _identity)


def gather(x: torch.Tensor, comm: Comm, dim: int, tag: str = "") -> torch.Tensor:
    """Every rank's chunk of ``dim``, concatenated (a column-parallel output made whole)."""
    return _region(x, comm, dim, tag, _gather, _chunk)


def split(x: torch.Tensor, comm: Comm, dim: int, tag: str = "") -> torch.Tensor:
    """This rank's chunk of ``dim`` of a whole tensor (entering the sequence-parallel part)."""
    return _region(x, comm, dim, tag, _chunk, _gather)


def gather_scattered(x: torch.Tensor, comm: Comm, dim: int, tag: str = "") -> torch.Tensor:
    """A sequence-parallel activation made whole for a column-parallel layer; the backward
    sums the ranks' gradients and scatters them back along ``dim``."""
    return _region(x, comm, dim, tag, _gather, _reduce_scatter)


def reduce_scatter(x: torch.Tensor, comm: Comm, dim: int, tag: str = "") -> torch.Tensor:
    """Leave a row-parallel layer into the sequence-parallel part: sum the partial outputs and
    keep this rank's chunk of ``dim``."""
    return _region(x, comm, dim, tag, _reduce_scatter, _gather)
