"""Pipeline stages of a model that lists its own layers, keeping the model's parameter names.

A model opts in with one method, ``pipeline_layers()``: its forward as layers run in order, each
given as ``(submodule paths it uses, callable)``, e.g. the reference GPT's
``(("tok_emb", "pos_emb", "drop"), self._embed)``, then ``(("blocks.0",), block)``, ... No
longboat import is needed in the model's file. Splitting keeps the user's module itself: the
submodules of other stages' layers are replaced by a parameter-free placeholder, and its
forward runs this rank's layers, so ``state_dict()`` keys stay ``"blocks.2.attn.qkv.weight"``
whatever the number of stages, and checkpoints load across stage counts and strategies.
Some transformers models are listed without the method, by their class
(:mod:`longboat.pipeline.transformers_layers`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from longboat.pipeline import partition as partitions
from longboat.pipeline import transformers_layers
from longboat.pipeline.measure import LayerCosts
from longboat.pipeline.partition import StageInfo, describe_stages
from longboat.pipeline.tied import Tie, find_ties, place_ties

Entry = tuple[tuple[str, ...], Callable[[Any], Any]]


class Elsewhere(nn.Module):
    """Where a submodule held by another pipeline stage was: no parameters, not callable."""

    #: what tensor parallelism's plan skips (the stage holding the layer divides it)
    placeholder = True

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"this layer lives on pipeline stage {self.stage}, not on this rank")

    def extra_repr(self) -> str:
        return f"on stage {self.stage}"


def lists_layers(model: nn.Module) -> bool:
    """True for a model whose layers the pipeline knows: its own ``pipeline_layers()``, or a
    transformers family whose layers are built in (:mod:`longboat.pipeline.transformers_layers`)."""
    return callable(getattr(model, "pipeline_layers", None)) or transformers_layers.recognises(
        model
    )


def _entries(model: nn.Module) -> list[Entry]:
    listed = getattr(model, "pipeline_layers", None)
    entries = list(listed()) if callable(listed) else transformers_layers.layers(model)
    if not entries:
        raise ValueError(f"{type(model).__name__}.pipeline_layers() returned no layers")
    for i, (paths, fn) in enumerate(entries):
        if not callable(fn) or isinstance(paths, str):
            raise TypeError(
                f"{type(model).__name__}.pipeline_layers()[{i}] must be (tuple of submodule "
                "paths, callable)"
            )
        for path in paths:
            model.get_submodule(path)  # an unknown path fails here, naming it
    return entries


def layer_parameters(model: nn.Module, entries: Sequence[Entry]) -> list[int]:
    out = []
    for paths, _ in entries:
        params = {
            id(p): p.numel()
            for path in paths
            for p in model.get_submodule(path).parameters()
            if p.requires_grad
        }
        out.append(sum(params.values()))
    return out


def layer_classes(model: nn.Module, entries: Sequence[Entry]) -> list[str]:
    out = []
    for paths, fn in entries:
        name = type(model.get_submodule(paths[0])).__name__ if paths else ""
        out.append(name or getattr(fn, "__name__", type(fn).__name__))
    return out


def plan(
    model: nn.Module,
    stages: int,
    method: str | Sequence[int] | None,
    costs: LayerCosts | None = None,
) -> tuple[list[int], list[StageInfo]]:
    """The boundaries ``method`` chooses for ``model``'s layers (given their measured
    ``costs``, if any) and what each stage then holds (the layers counted once)."""
    entries = _entries(model)
    params, classes = layer_parameters(model, entries), layer_classes(model, entries)
    seconds = None if costs is None else costs.total_s
    bounds = partitions.partition(
        method, stages, parameters=params, class_names=classes, seconds=seconds
    )
    saved = None if costs is None else costs.activation_bytes
    return bounds, describe_stages(params, classes, bounds, seconds, saved)


def boundaries(model: nn.Module, stages: int, method: str | Sequence[int] | None) -> list[int]:
    return plan(model, stages, method)[0]


def runnable_layers(model: nn.Module) -> list[Callable[[Any], Any]]:
    """The model's layers as callables, in order, before :func:`split` (for measuring)."""
    return [fn for _, fn in _entries(model)]


def split(
    model: nn.Module, bounds: Sequence[int], held: Sequence[int]
) -> tuple[nn.Module, list[tuple[Tie, nn.Parameter | None]]]:
    """Keep the layers of stages ``held``: other stages' submodules become placeholders and the
    model's forward becomes ``forward(x, stage)`` over this rank's layers. Returns ``model``
    and every weight tied across stages ([Note: tied weights] in ``tied.py``), with this
    rank's parameter for those it holds (None for the others)."""
    entries = _entries(model)
    stage_of = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
    names = {id(p): n for n, p in model.named_parameters()}
    params = {id(p): p for p in model.parameters()}
    layer_params = [
        [p for path in paths for p in model.get_submodule(path).parameters()]
        for paths, _ in entries
    ]
    tied = find_ties(layer_params, stage_of, names)
    mine = {i for i in range(len(entries)) if stage_of[i] in held}
    kept = {path for i in mine for path in entries[i][0]}
    for i, (paths, _) in enumerate(entries):
        if i in mine:
            continue
        for path in paths:
            if path in kept:  # a submodule a held layer also uses (e.g. a shared dropout)
                continue
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, Elsewhere(stage_of[i]))
    out = place_ties(model, tied, params, list(names), held)
    layers = {s: [entries[i][1] for i in range(bounds[s], bounds[s + 1])] for s in held}

    def forward(self: nn.Module, x: Any, stage: int | None = None) -> Any:
        if stage is None or stage not in layers:
            raise RuntimeError(
                f"this rank holds pipeline stages {sorted(layers)} of {type(self).__name__}; "
                "train it with engine.train_step(batch, loss_fn)"
            )
        for fn in layers[stage]:
            x = fn(x)
        return x

    model.forward = types.MethodType(forward, model)
    return model, out
