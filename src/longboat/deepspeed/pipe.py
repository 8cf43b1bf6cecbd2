"""DeepSpeed's ``deepspeed.pipe`` on longboat: ``from deepspeed.pipe import PipelineModule,
LayerSpec, TiedLayerSpec`` works under ``import longboat.deepspeed as deepspeed``.

[Note: DeepSpeed PipelineModule] :class:`PipelineModule` takes DeepSpeed's arguments and is
longboat's :class:`~longboat.pipeline.PipelineModule`: ``num_stages`` becomes the mesh's ``pp``
axis when ``deepspeed.initialize`` reads the config (the config's ``pipeline.stages``, if set,
must agree), ``partition_method`` is longboat's ``partition`` (``parameters``, ``uniform``,
``type:REGEX``, with DeepSpeed's meanings), ``activation_checkpoint_interval`` recomputes runs
of that many layers ([Note: checkpoint interval] in ``longboat/pipeline/module.py``) and
``loss_fn`` is what ``engine.train_batch()`` computes the loss with. As DeepSpeed's, it builds
this rank's stage's layers in its constructor ([Note: DeepSpeed layer initialisation]), but it
may be made before the process group exists: the rank and world are then the launcher's
environment's, and where that world is not a multiple of ``num_stages`` (a script started
without a launcher) the layers are built in ``initialize`` instead, ``model.parameters()`` being
empty until then (the optimizer the config describes is built after). Arguments whose DeepSpeed
meaning longboat cannot give (``topology``, ``seed_layers``, ``partition_method='profile'``) are
refused by name.

[Note: DeepSpeed layer initialisation] DeepSpeed's ``PipelineModule`` builds its stage's
``LayerSpec`` layers in its constructor, from the random state the script left, so a layer's
starting weights depend on which other layers that rank built before it. With
``partition_method='parameters'`` it first builds every spec once to count its parameters
(dropped after), which draws from the random state too; ``uniform`` and ``type:`` build nothing
to partition. This module does the same, on the stage this rank holds (its rank over the
world's ranks per stage, the pipeline being the outermost axis in both), and keeps what it built
for ``bind`` (:meth:`PipelineModule.build_layer`): the same script starts from DeepSpeed's
weights, layer for layer, and draws from the same random state afterwards. Where the rank's
stage cannot be known yet (a world that ``num_stages`` does not divide, which DeepSpeed refuses)
or ``bind`` is given another layout, the layers are built in ``bind`` instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from longboat.config.errors import ConfigError
from longboat.deepspeed.partition import deepspeed_balanced
from longboat.pipeline import module as _module
from longboat.pipeline.measure import LayerCosts
from longboat.pipeline.module import LayerSpec
from longboat.pipeline.partition import Score, StageInfo, describe_stages
from longboat.world import World


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
        self._built: dict[int, nn.Module] = {}  # layer index -> built as DeepSpeed builds it
        self._built_for: tuple[list[int], list[int]] | None = None  # (bounds, held)
        self._build_as_deepspeed(method)

    def _build_as_deepspeed(self, method: str) -> None:
        """Draw from the random state as DeepSpeed's constructor does, building this rank's
        stage's specs now (see [Note: DeepSpeed layer initialisation])."""
        if dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            found = World.from_env()
            rank, world = found.rank, found.world_size
        if world % self.num_stages:
            return
        if method == "parameters":  # DeepSpeed builds each spec once to count its parameters
            for spec in self._specs:
                if isinstance(spec, LayerSpec):
                    spec.build()
        stage = rank // (world // self.num_stages)
        bounds = self.boundaries(self.num_stages)
        for i in range(bounds[stage], bounds[stage + 1]):
            spec = self._specs[i]
            if isinstance(spec, _module.TiedLayerSpec):
                if spec.key not in self.tied:  # a tied key's module at its first use, once
                    self.tied[spec.key] = spec.build()
            elif isinstance(spec, LayerSpec):
                # a child now, as in DeepSpeed: model.parameters() holds this stage's
                self._built[i] = spec.build()
                self.add_module(str(i), self._built[i])
        self._built_for = (bounds, [stage])

    def _unbuild(self) -> None:
        """Drop what the constructor built (``bind`` was given another layout)."""
        for i in self._built:
            del self._modules[str(i)]
        self._built.clear()
        if self._tied_keys:
            self.tied = nn.ModuleDict()

    def build_layer(self, index: int, spec: LayerSpec) -> nn.Module:
        """The module built in the constructor for this layer, where it was (see [Note:
        DeepSpeed layer initialisation]; a tied key's is found in ``tied`` by ``bind``); else
        built now."""
        built = self._built.pop(index, None)
        return spec.build() if built is None else built

    def plan(
        self,
        stages: int,
        method: str | Sequence[int] | None = None,
        costs: LayerCosts | None = None,
        score: Score | None = None,
    ) -> tuple[list[int], list[StageInfo]]:
        """As longboat's, except that ``parameters`` and ``type:REGEX`` split as DeepSpeed's
        ``partition_balanced`` does ([Note: DeepSpeed's balanced partition] in
        ``deepspeed/partition.py``)."""
        chosen = self.partition if method is None else method
        if not isinstance(chosen, str):
            return super().plan(stages, method, costs, score)
        params, classes = self.layer_parameters(), self.layer_classes()
        name = chosen.strip().lower()
        if name == "parameters":
            weights = params
        elif name.startswith("type:"):
            try:
                found = re.compile(chosen.strip()[len("type:") :], re.IGNORECASE)
            except re.error:  # longboat's error, naming the pattern
                return super().plan(stages, method, costs, score)
            weights = [1 if found.search(c) else 0 for c in classes]
            if not any(weights):  # longboat's error, naming the classes there are
                return super().plan(stages, method, costs, score)
        else:
            return super().plan(stages, method, costs, score)
        bounds = deepspeed_balanced(weights, stages)
        return bounds, describe_stages(params, classes, bounds)

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
        if self._built_for is not None and self._built_for != (list(bounds), sorted(held)):
            self._unbuild()  # another layout than DeepSpeed's: built in bind instead
        try:
            return super().bind(bounds, held)
        finally:
            self._built.clear()


__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
