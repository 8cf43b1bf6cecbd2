"""Where each rank's part of a tensor-parallel parameter lies in the full one. Pure arithmetic.

[Note: tensor-parallel layouts] A parameter is split along one dimension ``dim`` across the
``tp`` ranks. A plain column- or row-parallel weight is cut into ``tp`` consecutive blocks, and
rank ``r`` keeps block ``r``. A *fused* weight (q, k and v stacked in one ``[3d, d]`` matrix)
has ``parts`` blocks along ``dim``, and each rank keeps its chunk of *every* block: rank ``r``
of 2 holds ``[q_r; k_r; v_r]``, so its local output is its own heads of q, k and v (cutting the
fused matrix into two consecutive halves instead would hand rank 0 all of q and half of k: it
runs, and it is silently wrong). The local tensor is therefore the concatenation of ``parts``
boxes of the full tensor along ``dim``: a :class:`~longboat.pieces.Slices`, which is
what checkpoints record, so a tensor-parallel checkpoint loads into any other layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longboat.pieces import Slices


class LayoutError(ValueError):
    """A width that does not divide among the ranks; the message names it."""


@dataclass(frozen=True)
class Split:
    """How one parameter is divided: along ``dim``, in ``parts`` fused blocks."""

    dim: int
    parts: int = 1

    def check(self, name: str, shape: tuple[int, ...], size: int) -> None:
        """Raise :class:`LayoutError` naming ``name`` when its width does not divide."""
        if not -len(shape) <= self.dim < len(shape):
            raise LayoutError(f"{name} of shape {list(shape)} has no dimension {self.dim}")
        width = shape[self.dim]
        if width % (self.parts * size):
            fused = (
                f" ({self.parts} fused blocks of {width // self.parts})" if self.parts > 1 else ""
            )
            raise LayoutError(
                f"{name}: dimension {self.dim} of shape {list(shape)} is {width}{fused}, which "
                f"does not divide among tp = {size} ranks; choose a tp that divides "
                f"{width // self.parts}"
            )

    def slices(self, shape: tuple[int, ...], rank: int, size: int) -> Slices:
        """The boxes of the full tensor (``shape``) that rank ``rank`` of ``size`` holds."""
        dim = self.dim % len(shape)
        block = shape[dim] // self.parts
        chunk = block // size
        boxes = []
        for c in range(self.parts):
            box = [(0, n) for n in shape]
            box[dim] = (c * block + rank * chunk, chunk)
            boxes.append(tuple(box))
        return Slices(dim, tuple(boxes))

    def local(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s part of ``full`` (a new, contiguous tensor)."""
        return self.slices(tuple(full.shape), rank, size).take(full).contiguous()

    def whole(self, parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """The full tensor from every rank's part, in rank order."""
        first = parts[0]
        full = first.new_empty(shape)
        for r, part in enumerate(parts):
            self.slices(shape, r, len(parts)).put(full, part)
        return full
