"""A ``state_dict`` of whole tensors as a :class:`~longboat.pieces.PieceSource`, so
``engine.load_state_dict`` fills any layout the way a checkpoint does: a ZeRO-3 rank its shards,
a tensor-parallel rank its slices. The optimizer's state is read back from the rank's own current
pieces, so loading model weights leaves it as it was (as ``model.load_state_dict`` would)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from longboat.checkpoint.errors import CheckpointError
from longboat.pieces import MODEL, Piece, RankState, Slices


class StateDictSource:
    """Model tensors from ``state``; optimizer state from ``current`` (this rank's pieces)."""

    def __init__(self, state: Mapping[str, Any], current: RankState) -> None:
        self.state = state
        self.current = current
        self._pieces: dict[tuple[str, str], list[Piece]] = {}
        for p in current.pieces:
            if p.key != MODEL:
                self._pieces.setdefault((p.name, p.key), []).append(p)

    def state_keys(self, name: str) -> list[str]:
        return sorted(k for n, k in self._pieces if n == name)

    def scalars(self, name: str) -> dict[str, Any]:
        return self.current.scalars.get(name, {})

    def read(
        self,
        name: str,
        key: str,
        start: int,
        end: int,
        out: torch.Tensor,
        slices: Slices | None = None,
    ) -> None:
        if key == MODEL:
            if name not in self.state:
                raise CheckpointError(
                    f"load_state_dict: the state has no {name!r}; give every key of "
                    "engine.state_dict()"
                )
            full = self.state[name].detach()
            local = full if slices is None else slices.take(full)
            if end > local.numel():
                raise CheckpointError(
                    f"load_state_dict: {name!r} has shape {list(full.shape)}, smaller than the "
                    "model's; give whole tensors, as engine.state_dict() does"
                )
            out.copy_(local.reshape(-1)[start:end])
            return
        for p in self._pieces.get((name, key), []):
            if p.start == start and p.end == end and p.slices == slices:
                out.copy_(p.tensor)
                return
        raise CheckpointError(f"load_state_dict: no current {key} for {name!r} [{start}, {end})")
