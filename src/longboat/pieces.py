"""The training state a rank owns, as pieces of whole tensors: what checkpoints save and load.

[Note: pieces] A strategy describes its share of the state as :class:`Piece` objects: a flat
``[start, end)`` slice of one full tensor, named by the model's own parameter (or buffer) name
and a *key*: ``"model"`` for the tensor itself, ``"optim.<state>"`` for an element-wise optimizer
state such as ``optim.exp_avg``. ``replicate`` and ``single`` hold whole tensors (``start = 0``,
``end = numel``); ZeRO holds, per flat unit, its shard intersected with each parameter's range.
Because every piece says which elements of which full tensor it holds, a checkpoint written by any
strategy at any world size can fill any other layout: loading asks a :class:`PieceSource` for
exactly the slices the new layout owns. Optimizer state that is not element-wise (Adam's
``step``) travels as JSON scalars per parameter.

Tied parameters appear once, under their first name in ``model.named_parameters()``.

A parameter that tensor parallelism split is not one flat range of its full tensor: its pieces
carry :class:`Slices`, the n-dimensional slices of the full tensor the rank's local tensor is made
of, and ``[start, end)`` then counts elements of that local tensor (see [Note: tensor-parallel
layouts] in ``tensor/layout.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

MODEL = "model"
OPTIM = "optim."

#: One n-dimensional slice of a full tensor: ``(offset, length)`` in each of its dimensions.
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Slices:
    """A tensor made of slices of a full tensor: ``boxes``, concatenated along ``dim``.

    A column-parallel weight is one box; the rank's part of a fused q|k|v weight is three (its
    rows of q, of k and of v). ``take`` cuts the tensor out of the full one, ``put`` writes it
    back, so a checkpoint can move elements between any two layouts.
    """

    dim: int
    boxes: tuple[Box, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.boxes[0]
        return tuple(
            sum(b[d][1] for b in self.boxes) if d == self.dim else first[d][1]
            for d in range(len(first))
        )

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @staticmethod
    def _index(box: Box) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in box)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The local tensor (a new one) cut out of ``full``."""
        return torch.cat([full[self._index(b)] for b in self.boxes], dim=self.dim)

    def put(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Write ``local`` (shaped :attr:`shape`) into its places in ``full``."""
        sizes = [b[self.dim][1] for b in self.boxes]
        for b, part in zip(self.boxes, torch.split(local, sizes, dim=self.dim), strict=True):
            full[self._index(b)].copy_(part)

    def to_json(self) -> dict[str, Any]:
        return {"dim": self.dim, "boxes": [[list(r) for r in b] for b in self.boxes]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Slices:
        boxes = tuple(tuple((int(o), int(n)) for o, n in b) for b in raw["boxes"])
        if not boxes or len({len(b) for b in boxes}) != 1:
            raise ValueError(f"slices {raw!r}: boxes of one rank each, at least one")
        return cls(int(raw["dim"]), boxes)


@dataclass
class Piece:
    """Elements ``[start, end)`` of the flattened full tensor ``name``/``key``."""

    name: str
    key: str
    shape: tuple[int, ...]  # the full tensor's shape
    start: int
    end: int
    tensor: torch.Tensor  # 1-D, ``end - start`` elements (a view where possible)
    #: Global ranks holding this very piece (this one included): a checkpoint writes it once,
    #: from one of them. Empty: only this rank holds it.
    replicas: tuple[int, ...] = ()
    #: The slices of the full tensor this rank's tensor is made of (tensor parallelism);
    #: ``[start, end)`` then counts elements of that tensor. None: of the full tensor itself.
    slices: Slices | None = None

    @property
    def replicated(self) -> bool:
        return len(self.replicas) > 1


@dataclass
class RankState:
    """What one rank contributes to a checkpoint (see [Note: pieces])."""

    pieces: list[Piece] = field(default_factory=list)
    #: parameter name -> optimizer scalar state (e.g. {"step": {...}}), JSON-ready
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: optimizer param groups: the names of the parameters in each, in group order
    groups: list[list[str]] = field(default_factory=list)


class PieceSource(Protocol):
    """Saved state, read back slice by slice whatever layout wrote it."""

    def state_keys(self, name: str) -> list[str]:
        """The ``optim.*`` keys saved for parameter ``name`` (empty: no optimizer state)."""
        ...

    def scalars(self, name: str) -> dict[str, Any]:
        """The optimizer scalar state saved for ``name`` (encoded; see :func:`decode_scalar`)."""
        ...

    def read(
        self,
        name: str,
        key: str,
        start: int,
        end: int,
        out: torch.Tensor,
        slices: Slices | None = None,
    ) -> None:
        """Copy elements ``[start, end)`` of the saved flat tensor into 1-D ``out`` (with
        ``slices``: of the tensor those slices of the saved one make)."""
        ...


def members(comm: Any) -> tuple[int, ...]:
    """The global ranks of a doorway's group, in group order (the ``replicas`` of what every
    rank of the group holds alike)."""
    return tuple(comm.global_rank(i) for i in range(comm.world_size))


def canonical_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``, tied parameters under their first name."""
    return {id(p): n for n, p in model.named_parameters()}


def encode_scalar(value: Any, where: str, device: torch.device) -> Any:
    """A JSON-ready form of an optimizer scalar: numbers and None as they are, 0-d tensors with
    their dtype and whether they live on the parameter's ``device`` (torch keeps Adam's ``step``
    on the CPU unless the optimizer is capturable or fused), so they come back the same."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return {
            "tensor": str(value.dtype).removeprefix("torch."),
            "value": value.item(),
            "on_param_device": value.device == device and device.type != "cpu",
        }
    raise ValueError(
        f"optimizer state {where} is a {type(value).__name__}, which a checkpoint "
        "cannot hold without pickle; only element-wise tensors and scalars are "
        "supported"
    )


def decode_scalar(value: Any, device: torch.device) -> Any:
    """The inverse of :func:`encode_scalar`; ``device`` is the parameter's."""
    if isinstance(value, dict):
        where = device if value.get("on_param_device") else torch.device("cpu")
        return torch.tensor(value["value"], dtype=getattr(torch, value["tensor"]), device=where)
    return value


def split_state(
    state: dict[str, Any], numel: int, device: torch.device, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's per-parameter state as (element-wise tensors by ``optim.*`` key, encoded
    scalars)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if v.numel() != numel:
                raise ValueError(
                    f"optimizer state {k!r} of {where} has {v.numel()} elements, not the "
                    f"parameter's {numel}: checkpoints support element-wise optimizer state "
                    "(SGD, Adam, AdamW, ...) only"
                )
            tensors[OPTIM + k] = v
        else:
            scalars[k] = encode_scalar(v, f"{k!r} of {where}", device)
    return tensors, scalars
