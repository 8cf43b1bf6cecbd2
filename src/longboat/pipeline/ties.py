"""Finding the weights tied across pipeline stages and keeping their names on every stage that
holds them ([Note: tied weights] in ``longboat/tied.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from longboat.tied import Tie


def find(
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


def place(
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
