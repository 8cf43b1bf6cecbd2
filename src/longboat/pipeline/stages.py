"""Which layers each pipeline stage holds, for any model the pipeline can split: what
``Pipeline.prepare`` splits by, and what ``longboat config explain --model`` shows before a run."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import nn

from longboat.pipeline import layered, transformers_layers
from longboat.pipeline import partition as partitions
from longboat.pipeline.measure import LayerCosts
from longboat.pipeline.module import PipelineModule
from longboat.pipeline.partition import StageInfo

Method = str | Sequence[int] | None


def stageable(model: nn.Module) -> bool:
    """Whether :func:`as_layers` can split ``model`` into pipeline stages (asked without
    splitting it): what ``longboat tune`` asks before it searches ``mesh.pp``."""
    return isinstance(model, (nn.Sequential, PipelineModule)) or layered.lists_layers(model)


def as_layers(model: nn.Module, partition: Method) -> nn.Module:
    """``model`` as something with stages: an ``nn.Sequential`` becomes a
    :class:`PipelineModule` (``partition``, default: measured cost when measured, else
    parameters); a :class:`PipelineModule`, a model with ``pipeline_layers()`` or a
    transformers model whose layers are built in (:mod:`~longboat.pipeline.transformers_layers`)
    is returned as is."""
    if isinstance(model, nn.Sequential):
        return PipelineModule(list(model), partition=partition)
    if stageable(model):
        return model
    raise TypeError(
        "pipeline stages need a model made of layers in order: a "
        "longboat.pipeline.PipelineModule, an nn.Sequential, a model with a "
        "pipeline_layers() method, or a transformers model whose layers are built in "
        f"({', '.join(transformers_layers.FAMILIES)}); {type(model).__name__} is none of them"
    )


def requested(model: nn.Module, partition: Method) -> Method:
    """The method asked for: ``partition`` (the config's) if set, else the model's own
    (a :class:`PipelineModule`'s ``partition``), else None (the default)."""
    if partition is not None:
        return partition
    return model.partition if isinstance(model, PipelineModule) else None


def measures(method: Method) -> bool:
    """Whether ``method`` splits by measured cost (None, the default, does when it can)."""
    return method is None or (
        isinstance(method, str) and method.strip().lower() == partitions.MEASURED
    )


def layer_count(model: nn.Module) -> int:
    """How many layers ``model`` (from :func:`as_layers`) is split between stages."""
    if isinstance(model, PipelineModule):
        return len(model)
    return len(layered.runnable_layers(model))


def runnable(model: nn.Module) -> Iterable[Callable[[Any], Any]]:
    """``model``'s layers (from :func:`as_layers`, not yet split) as callables, for measuring."""
    if isinstance(model, PipelineModule):
        return model.runnable_layers()
    return layered.runnable_layers(model)


def plan(
    model: nn.Module,
    stages: int,
    partition: Method,
    costs: LayerCosts | None = None,
    score: partitions.Score | None = None,
) -> tuple[list[int], list[StageInfo]]:
    """The boundaries of ``stages`` stages and what each holds (``model`` from :func:`as_layers`;
    ``partition`` None: the model's own method, else by the measured ``costs`` if given, else
    by parameters; ``score``: a split's predicted step under the run's schedule, [Note: a split
    for the schedule] in ``partition.py``)."""
    if isinstance(model, PipelineModule):
        return model.plan(stages, partition, costs, score)
    return layered.plan(model, stages, partition, costs, score)
