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

from typing import Any

import torch

from longboat.comm.protocol import Comm


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


def _chunk(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    return x.chunk(comm.world_size, dim=dim)[comm.rank].contiguous()


def _all_reduce(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out, tag=tag)
    return out


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
        ctx.comm, ctx.tag = comm, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(g, ctx.comm, ctx.tag), None, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
        return _all_reduce(x, comm, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return g, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.tag = comm, dim, tag
        return _gather(x, comm, dim, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _chunk(g, ctx.comm, ctx.dim), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.tag = comm, dim, tag
        return _chunk(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(g, ctx.comm, ctx.dim, ctx.tag), None, None, None


class _GatherScattered(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.tag = comm, dim, tag
        return _gather(x, comm, dim, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _reduce_scatter(g, ctx.comm, ctx.dim, ctx.tag), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int, tag: str) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.tag = comm, dim, tag
        return _reduce_scatter(x, comm, dim, tag)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(g, ctx.comm, ctx.dim, ctx.tag), None, None, None


def copy_to(x: torch.Tensor, comm: Comm, tag: str = "") -> torch.Tensor:
    """Enter a column-parallel layer: the input is whole on every rank; its gradient is the
    sum of every rank's part."""
    return _CopyTo.apply(x, comm, tag) if comm.world_size > 1 else x


def reduce_from(x: torch.Tensor, comm: Comm, tag: str = "") -> torch.Tensor:
    """Leave a row-parallel layer: sum the ranks' partial outputs."""
    return _ReduceFrom.apply(x, comm, tag) if comm.world_size > 1 else x


def gather(x: torch.Tensor, comm: Comm, dim: int, tag: str = "") -> torch.Tensor:
    """Every rank's chunk of ``dim``, concatenated (a column-parallel output made whole)."""
    return _Gather.apply(x, comm, dim, tag) if comm.world_size > 1 else x


def split(x: torch.Tensor, comm: Comm, dim: int, tag: str = "") -> torch.Tensor:
    """This rank's chunk of ``dim`` of a whole tensor (entering the sequence-parallel part)."""
    return _Split.apply(x, comm, dim, tag) if comm.world_size > 1 else x


def gather_scattered(x: torch.Tensor, comm: Comm, dim: int, tag: str = "") -> torch.Tensor:
    """A sequence-parallel activation made whole for a column-parallel layer; the backward
    sums the ranks' gradients and scatters them back along ``dim``."""
    return _GatherScattered.apply(x, comm, dim, tag) if comm.world_size > 1 else x


def reduce_scatter(x: torch.Tensor, comm: Comm, dim: int, tag: str = "") -> torch.Tensor:
    """Leave a row-parallel layer into the sequence-parallel part: sum the partial outputs and
    keep this rank's chunk of ``dim``."""
    return _ReduceScatter.apply(x, comm, dim, tag) if comm.world_size > 1 else x
