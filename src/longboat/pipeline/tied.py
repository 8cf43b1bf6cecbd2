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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.mesh import Mesh
from longboat.pieces import Piece


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


def find_ties(
    layer_params: Sequence[Iterable[nn.Parameter]],
    stage_of: Sequence[int],
    names: Mapping[int, str],
) -> dict[int, Tie]:
    """The parameters used by layers of more than one stage, by ``id``: ``layer_params[i]``
    are layer ``i``'s parameters, ``stage_of[i]`` its stage, ``names`` the whole model's
    parameter names by ``id``."""
    stages: dict[int, set[int]] = {}
    for i, params in enumerate(layer_params):
        for p in params:
            stages.setdefault(id(p), set()).add(stage_of[i])
    return {pid: Tie(names[pid], tuple(sorted(s))) for pid, s in stages.items() if len(s) > 1}


class Holder(nn.Module):
    """Where another stage's module was, holding a weight tied to one of this rank's layers
    under its whole-model name."""


def keep_name(model: nn.Module, name: str, param: nn.Parameter) -> None:
    """Make ``param`` reachable as ``name`` in ``model`` (whose module at that path may have
    been replaced by a placeholder, or removed), so ``named_parameters`` calls it ``name``
    on every stage that holds it."""
    *path, leaf = name.split(".")
    module = model
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = Holder()
            module.add_module(part, child)
        module = child
    if module._parameters.get(leaf) is not param:
        module.register_parameter(leaf, param)


def place_ties(
    model: nn.Module,
    tied: Mapping[int, Tie],
    params: Mapping[int, nn.Parameter],
    order: Sequence[int],
    held: Sequence[int],
) -> list[tuple[Tie, nn.Parameter | None]]:
    """Every tie, in the whole model's parameter order ``order`` (ids; the same on every
    rank), with this rank's parameter when one of ``held`` stages uses it, which is then kept
    in ``model`` under its whole-model name; None otherwise."""
    position = {pid: i for i, pid in enumerate(order)}
    out: list[tuple[Tie, nn.Parameter | None]] = []
    for pid, tie in sorted(tied.items(), key=lambda kv: position[kv[0]]):
        holds = any(s in held for s in tie.stages)
        if holds:
            keep_name(model, tie.name, params[pid])
        out.append((tie, params[pid] if holds else None))
    return out
