"""DeepSpeed's ``deepspeed.pipe`` on longboat: ``from deepspeed.pipe import PipelineModule,
LayerSpec, TiedLayerSpec`` works under ``import longboat.deepspeed as deepspeed``.

[Note: DeepSpeed PipelineModule] :class:`PipelineModule` takes DeepSpeed's arguments and is
longboat's :class:`~longboat.pipeline.PipelineModule`: ``num_stages`` becomes the mesh's ``pp``
axis when ``deepspeed.initialize`` reads the config (the config's ``pipeline.stages``, if set,
must agree), ``partition_method`` is longboat's ``partition`` (``parameters``, ``uniform``,
``type:REGEX``, with DeepSpeed's meanings), ``activation_checkpoint_interval`` recomputes runs
of that many layers ([Note: checkpoint interval] in ``longboat/pipeline/module.py``) and
``loss_fn`` is what ``engine.train_batch()`` computes the loss with. Unlike DeepSpeed's, the
module builds its layers in ``initialize``, not in its constructor, so it may be made before
the process group exists and ``model.parameters()`` is empty until then (the optimizer the
config describes is built after). Arguments whose DeepSpeed meaning longboat cannot give
(``topology``, ``seed_layers``, ``partition_method='profile'``) are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from longboat.config.errors import ConfigError
from longboat.pipeline import module as _module
from longboat.pipeline.module import LayerSpec


class TiedLayerSpec(_module.TiedLayerSpec):
    """DeepSpeed's ``TiedLayerSpec(key, cls, *args, forward_fn=None, tied_weight_attr=["weight"],
    **kwargs)``. longboat ties every parameter of the module, so ``tied_weight_attr`` must name
    them all (an embedding's ``weight``, the default); naming fewer, which in DeepSpeed lets the
    others differ from stage to stage, is refused."""

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | list[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(key, typename, *module_args, forward_fn=forward_fn, **module_kwargs)
        attrs = {tied_weight_attr} if isinstance(tied_weight_attr, str) else set(tied_weight_attr)
        with torch.device("meta"):  # only the names: nothing is allocated
            names = {n for n, _ in self.build().named_parameters()}
        if not names <= attrs:
            raise ConfigError(
                f"TiedLayerSpec({key!r}, {typename.__name__}, tied_weight_attr="
                f"{sorted(attrs)}): longboat ties every parameter of a tied module, and "
                f"{sorted(names - attrs)} would stay untied in DeepSpeed; name them all in "
                "tied_weight_attr, or keep them in a layer of their own"
            )


class PipelineModule(_module.PipelineModule):
    """DeepSpeed's ``PipelineModule(layers, num_stages=..., loss_fn=...,
    partition_method=..., activation_checkpoint_interval=...)`` (see [Note: DeepSpeed
    PipelineModule]). ``seed_fn`` and ``base_seed`` matter only with ``seed_layers``, which is
    refused; ``dynamic_shape`` is how longboat always sends activations (each message carries
    its shape)."""

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., Any] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], Any] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        del seed_fn, base_seed, dynamic_shape  # see the class docstring
        if topology is not None:
            raise ConfigError(
                "PipelineModule(topology=...) is not supported: give num_stages=N; the other "
                "axes (data and tensor parallel) come from the config's mesh section"
            )
        if num_stages is None:
            raise ConfigError("PipelineModule needs num_stages=N (the pipeline's stages)")
        if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
            raise ConfigError(f"PipelineModule(num_stages={num_stages!r}) must be 1 or more")
        if seed_layers:
            raise ConfigError(
                "PipelineModule(seed_layers=True) is not supported (it re-seeds each layer's "
                "initialisation by its index); seed once before building the model instead"
            )
        if not isinstance(partition_method, str):
            raise ConfigError(
                f"PipelineModule(partition_method={partition_method!r}) must be 'parameters', "
                "'uniform' or 'type:REGEX'"
            )
        method = partition_method.lower()  # DeepSpeed's are case-blind, its regex too
        if method == "profile":
            raise ConfigError(
                "PipelineModule(partition_method='profile') is not supported (DeepSpeed does "
                "not implement it either); use 'parameters', 'uniform' or 'type:REGEX'"
            )
        super().__init__(
            list(layers),
            method,
            activation_checkpoint_interval=activation_checkpoint_interval,
            checkpointable_layers=checkpointable_layers,
            activation_checkpoint_func=activation_checkpoint_func,
        )
        self.num_stages = num_stages
        # Kept outside the module tree: a loss module (CrossEntropyLoss) would otherwise be a
        # child named "loss_fn", beside the layers named by index, and its buffers (a class
        # weight) would join the checkpoint of every stage.
        self.__dict__["loss_fn"] = loss_fn

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def bind(self, bounds: Sequence[int], held: Sequence[int]) -> Any:
        """As longboat's, once the stages are those ``num_stages`` asked for: a run whose mesh
        has another number (``longboat.initialize`` given a config without it; only
        ``deepspeed.initialize`` sets ``mesh.pp`` from the module) would otherwise train a
        layout the script did not ask for."""
        if len(bounds) - 1 != self.num_stages:
            raise ConfigError(
                f"PipelineModule(num_stages={self.num_stages}) is split into "
                f"{len(bounds) - 1} stage(s) here (mesh.pp x pipeline.virtual_stages): build "
                f"the engine with deepspeed.initialize, or set mesh.pp = {self.num_stages}"
            )
        return super().bind(bounds, held)


__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
