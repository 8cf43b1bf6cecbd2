"""Flat units: the shared piece of the ZeRO stages.

A unit is a list of parameters of one optimizer param group and one dtype, laid end to end in a
flat buffer padded to a multiple of the world size, so that rank r owns the contiguous slice
``[r*S, (r+1)*S)`` of it (its *shard*). Parameters keep their objects and names; only where their
data lives changes:

- stages 1 and 2: the full flat parameter stays allocated and every parameter's ``.data`` is a
  view into it; the shard is a view too, so the optimizer updates the flat parameter in place and
  an all-gather fills in the other ranks' slices;
- stage 3: only the shard is kept; the full flat parameter is gathered before the unit runs and
  freed after (parameters then point at empty tensors).

[Note: shard pieces] The optimizer does not see the shard as one tensor: it sees one *piece* per
parameter the shard overlaps, a view of the shard holding this rank's elements of that parameter
(FSDP2's per-parameter sharding, on a flat buffer). Each piece is an optimizer parameter of its
own, so everything an optimizer keeps per tensor stays per parameter as in plain PyTorch: a
parameter that no rank used in a step gets ``grad = None`` and is skipped (no weight decay, no
momentum, Adam's ``step`` not advanced), and a scalar like ``step`` belongs to one parameter
(the same on every rank that holds a piece of it, since every rank decides from the same usage).
Padding belongs to no piece and is never stepped.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn

from longboat.comm.protocol import Handle


class UnitState(enum.Enum):
    """Where a unit's full flat parameter is (FSDP2's ``ShardedState``, for a flat unit)."""

    SHARDED = "sharded"  # only this rank's shard; the parameters point at empty tensors
    GATHERING = "gathering"  # an all-gather of the full flat parameter is in flight
    UNSHARDED = "unsharded"  # the full flat parameter is here; parameters are views into it


@dataclass
class FlatUnit:
    """Parameters flattened into one padded buffer, sharded evenly over ``world_size`` ranks."""

    index: int
    params: list[nn.Parameter]
    group: int
    world_size: int
    rank: int
    module: nn.Module | None = None  # stage 3: the module whose forward gathers this unit
    state: UnitState = UnitState.UNSHARDED
    tag: str = ""  # what reports call it, e.g. "unit 3: blocks.1"
    offsets: list[int] = field(default_factory=list)
    shard: torch.Tensor | None = None
    flat_param: torch.Tensor | None = None
    #: stage 3: the buffer this unit is gathered into, its memory freed between uses ([Note:
    #: storage resize] in ``storage.py``)
    full: torch.Tensor | None = None
    flat_grad: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    shard_empty: bool = True  # no gradient reduced into grad_shard since the last step
    arrived: set[int] = field(default_factory=set)
    gather_handle: Handle | None = None  # stage 3: an all-gather (prefetch) in flight
    reduce_handle: Handle | None = None  # a reduce-scatter of this unit's gradients in flight
    reduced: torch.Tensor | None = None
    #: [Note: shard pieces]: (parameter index, start, end within the shard, the optimizer's view)
    pieces: list[tuple[int, int, int, nn.Parameter]] = field(default_factory=list)
    used: set[int] = field(default_factory=set)  # parameters this rank used since the last step
    calls: int = 0  # stage 3: forwards of its module whose backward is still to come
    #: stage 3: a forward of its module in this micro-batch had no input needing a gradient,
    #: so nothing reports that call's backward over: the unit is done when backward is
    #: ([Note: reused units] in ``zero/gather.py``)
    blind: bool = False
    backward_done: bool = False  # stage 3: its backward in this micro-batch is over
    #: with ``precision.param_dtype``: the dtype the unit is gathered and computed in, its
    #: shard (the masters) staying in the parameters' own ([Note: parameter dtype] in
    #: ``gather.py``)
    compute_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        off = 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.shard_numel = -(-off // self.world_size)  # ceil
        self.padded = self.shard_numel * self.world_size
        self.lo = self.rank * self.shard_numel
        self.hi = self.lo + self.shard_numel
        self.dtype = self.params[0].dtype
        self.device = self.params[0].device
        self.shapes = [p.shape for p in self.params]

    def overlaps(self) -> list[tuple[int, int, int]]:
        """(parameter index, start, end) of every parameter this rank's shard holds elements
        of; start and end are flat positions in the unit, within ``[lo, hi)``."""
        out = []
        for i, (off, shape) in enumerate(zip(self.offsets, self.shapes, strict=True)):
            a, b = max(self.lo, off), min(self.hi, off + shape.numel())
            if a < b:
                out.append((i, a, b))
        return out

    def make_pieces(self, shard: torch.Tensor) -> None:
        """Cut the optimizer's per-parameter views out of ``shard`` ([Note: shard pieces])."""
        self.pieces = [
            (i, a - self.lo, b - self.lo, nn.Parameter(shard[a - self.lo : b - self.lo]))
            for i, a, b in self.overlaps()
        ]

    def flatten(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """A new copy of elements ``[lo, hi)`` of the padded flat parameters (all by default),
        made without materialising the rest (stage 3 copies only its shard)."""
        hi = self.padded if hi is None else hi
        flat = torch.zeros(hi - lo, dtype=self.dtype, device=self.device)
        for p, off in zip(self.params, self.offsets, strict=True):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                flat[a - lo : b - lo].copy_(p.detach().reshape(-1)[a - off : b - off])
        return flat

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s slice of a full flat buffer, shaped like the parameter."""
        return flat[self.offsets[i] : self.offsets[i] + self.shapes[i].numel()].view(self.shapes[i])

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter's data a view into ``flat`` (no copy)."""
        for i, p in enumerate(self.params):
            p.data = self.view(flat, i)

    @property
    def gathered_dtype(self) -> torch.dtype:
        """The dtype of the gathered unit (and of its parameters and gradients while gathered)."""
        return self.compute_dtype or self.dtype

    def release_params(self) -> None:
        """Point every parameter at an empty tensor, so the full flat buffer can be freed."""
        empty = torch.empty(0, dtype=self.gathered_dtype, device=self.device)
        for p in self.params:
            p.data = empty

    def grad_view(self) -> torch.Tensor:
        """This rank's averaged gradient shard (after reduction)."""
        if self.grad_shard is not None:
            return self.grad_shard
        assert self.flat_grad is not None
        return self.flat_grad[self.lo : self.hi]

    @property
    def complete(self) -> bool:
        return len(self.arrived) == len(self.params)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
