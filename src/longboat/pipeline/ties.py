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


def keep_name(
    model: nn.Module, name: str, param: nn.Parameter, placeholder: type[nn.Module]
) -> None:
    """Make ``param`` reachable as ``name`` in ``model`` (whose module at that path may have
    been replaced by a ``placeholder``, or removed), so ``named_parameters`` calls it ``name``
    on every stage that holds it."""
    *path, leaf = name.split(".")
    module = model
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = placeholder()
            module.add_module(part, child)
        module = child
    if module._parameters.get(leaf) is not param:
        module.register_parameter(leaf, param)
