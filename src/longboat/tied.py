"""Weights tied across pipeline stages, such as a language model's embedding and output head.

[Note: tied weights] A parameter that layers of two stages use is held by every rank whose
stages use it, under one name: its name in the whole model (the first ``named_parameters``
gives), so checkpoints do not depend on the number of stages. The copies start equal (broadcast
from the first holder) and stay equal: after the data-parallel reduction of each step, the
holders sum their gradients of it (each stage's part of the whole model's gradient), so every
holder steps the same parameter with the same gradient and the same optimizer state, as
DeepSpeed's ``TiedLayerSpec`` does. The gradient norm counts it once (on its first holder).

A sharding strategy keeps each tied parameter in a flat unit of its own, so the holders' shards
of it line up rank for rank and their gradient shards are summed the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.mesh import Mesh
from longboat.strategies.pieces import Piece


@dataclass(frozen=True)
class Tie:
    """A parameter named ``name`` in the whole model, used by layers of ``stages``."""

    name: str
    stages: tuple[int, ...]


@dataclass
class TiedWeights:
    """This rank's tied parameters and, for each, the doorway over the ranks that hold it
    (a doorway of one when this rank's stages hold every copy)."""

    held: list[tuple[Tie, nn.Parameter, Comm]] = field(default_factory=list)
    #: per held tie's name, the pipeline ranks holding it (when more than one)
    holders: dict[str, list[int]] = field(default_factory=dict)

    def write_once(self, pieces: list[Piece], mesh: Mesh, rank: int) -> None:
        """Widen the ``replicas`` of this rank's checkpoint pieces of tied weights to the
        ranks holding the same piece on the other holding stages (the same data-parallel and
        tensor-parallel coordinates), so that a checkpoint writes each once."""
        for i, p in enumerate(pieces):
            stages = self.holders.get(p.name)
            if stages is None:
                continue
            mine = p.replicas or (rank,)
            wide = set()
            for r in mine:
                at = {a: c for a, c in mesh.coords(r).items() if a != "dp"}
                wide |= {mesh.rank_of(**{**at, "pp": q}) for q in stages}
            pieces[i] = dataclasses.replace(p, replicas=tuple(sorted(wide)))

    def parameters(self) -> list[nn.Parameter]:
        """Tied parameters whose copies live on other ranks too."""
        return [p for _, p, comm in self.held if comm.world_size > 1]

    def broadcast_initial(self) -> None:
        """Every holder starts from the first holder's values."""
        for _, p, comm in self.held:
            if comm.world_size > 1:
                with torch.no_grad():
                    comm.broadcast(p.data, src=0)

    def reduce(self, gradient_of: Callable[[nn.Parameter], torch.Tensor]) -> None:
        """Sum each tied parameter's gradient (``gradient_of(p)``: the strategy's reduced
        gradient of it on this rank) over its holders."""
        for _, p, comm in self.held:
            if comm.world_size > 1:
                comm.all_reduce(gradient_of(p), op="sum")

    def counted_elsewhere(
        self, gradient_of: Callable[[nn.Parameter], torch.Tensor]
    ) -> list[torch.Tensor]:
        """Gradients the global norm must not count on this rank: its copies of tied
        parameters whose first holder is another rank."""
        return [gradient_of(p) for _, p, comm in self.held if comm.world_size > 1 and comm.rank > 0]
