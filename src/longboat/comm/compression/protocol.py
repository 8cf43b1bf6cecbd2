"""What a gradient compressor is: one object per strategy that turns "sum these flat gradients
over this doorway" into compressed collectives, keeping its error-feedback state per tensor.

[Note: compressed reduction] A strategy hands a compressor a flat buffer (a replicate bucket, a
ZeRO unit's full gradient) already divided by the data-parallel size, and the *spans* of the
parameters laid out in it (offset and shape, in order, end to end from offset 0). Elements no
span covers (replicate's usage flags, ZeRO's padding) are reduced exactly. On return the buffer
holds an approximation of the sum over the doorway's ranks, identical on every rank. The state a
method keeps (residuals, PowerSGD's warm-started factors) is keyed by the strategy's name for the
buffer (``"bucket 3"``, ``"unit 5"``) and the parameter's place in it, which every rank derives
alike. For the first ``warmup_steps`` optimizer steps :attr:`Compressor.compressing` is False and
the strategy reduces exactly, by its usual path. Every collective a compressor sends is tagged
``compressed: ...`` and reported as replacing one exact all-reduce of the whole buffer
([Note: bytes saved] in ``comm/commlog.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # named in signatures only
    from longboat.comm.protocol import Comm

#: A parameter's place in a flat buffer: its offset and its shape.
Span = tuple[int, torch.Size]


class Compressor(Protocol):
    """One compression method ([Note: compressed reduction])."""

    warmup_steps: int
    steps: int  # optimizer steps taken so far

    @property
    def compressing(self) -> bool:
        """Whether this step's reductions are compressed (the warm-up is over)."""
        ...

    def all_reduce(self, key: str, flat: torch.Tensor, spans: Sequence[Span], comm: Comm) -> None:
        """Make ``flat`` (in place) the compressed sum over ``comm``'s ranks; blocks until
        done."""
        ...

    def step_done(self) -> None:
        """An optimizer step is over (the warm-up counts these)."""
        ...


class Warmup:
    """The warm-up every method shares: exact reductions for the first ``warmup_steps``."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.steps = 0

    @property
    def compressing(self) -> bool:
        return self.steps >= self.warmup_steps

    def step_done(self) -> None:
        self.steps += 1


def covered(spans: Sequence[Span]) -> int:
    """Where the parameters' elements end in the flat buffer (they start at 0, end to end)."""
    end = 0
    for off, shape in spans:
        assert off == end, "spans lie end to end from offset 0"
        end = off + shape.numel()
    return end


def replaced(comm: Comm, flat: torch.Tensor) -> None:
    """Tell the comm log which exact all-reduce the compressed collectives stood in for."""
    comm.count_replaced("all_reduce", flat.numel() * flat.element_size())
