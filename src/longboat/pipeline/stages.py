"""Which layers each pipeline stage holds, for any model the pipeline can split: what
``Pipeline.prepare`` splits by, and what ``longboat config explain --model`` shows before a run."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from longboat.pipeline import layered, transformers_layers
from longboat.pipeline.module import PipelineModule
from longboat.pipeline.partition import StageInfo


def as_layers(model: nn.Module, partition: str | Sequence[int] | None) -> nn.Module:
    """``model`` as something with stages: an ``nn.Sequential`` becomes a
    :class:`PipelineModule` (``partition``, default ``"parameters"``); a
    :class:`PipelineModule`, a model with ``pipeline_layers()`` or a transformers model whose
    layers are built in (:mod:`~longboat.pipeline.transformers_layers`) is returned as is."""
    if isinstance(model, nn.Sequential):
        return PipelineModule(list(model), partition=partition or "parameters")
    if isinstance(model, PipelineModule) or layered.lists_layers(model):
        return model
    raise TypeError(
        "pipeline stages need a model made of layers in order: a "
        "longboat.pipeline.PipelineModule, an nn.Sequential, a model with a "
        "pipeline_layers() method, or a transformers model whose layers are built in "
        f"({', '.join(transformers_layers.FAMILIES)}); {type(model).__name__} is none of them"
    )


def plan(
    model: nn.Module, stages: int, partition: str | Sequence[int] | None
) -> tuple[list[int], list[StageInfo]]:
    """The boundaries of ``stages`` stages and what each holds (``model`` from :func:`as_layers`;
    ``partition`` None: the model's own method, else ``"parameters"``)."""
    if isinstance(model, PipelineModule):
        return model.plan(stages, partition)
    return layered.plan(model, stages, partition or "parameters")
