"""A model as a list of layers that pipeline stages split between them.

:class:`PipelineModule` holds layers (modules, :class:`LayerSpec` to build later, or plain
functions without parameters) run one after another. Its children are named by layer index, as
an ``nn.Sequential``'s are, so parameter names (``"3.weight"``) do not depend on the number of
stages, and a checkpoint's names are the same whether one rank or four wrote it.

Until :meth:`PipelineModule.bind` it is an ordinary model of all its built layers. ``bind``
(called by ``longboat.initialize`` from the ``[mesh]`` and ``[pipeline]`` config) chooses the
stages' boundaries (:mod:`longboat.pipeline.partition`), keeps only this rank's layers and
builds only the specs among them: a rank never builds another stage's layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longboat.pipeline import partition as partitions
from longboat.pipeline.measure import LayerCosts
from longboat.pipeline.partition import StageInfo, describe_stages
from longboat.pipeline.tied import Holder, Tie, find_ties, place_ties


class LayerSpec:
    """A layer to build later, on the stage that holds it: ``LayerSpec(nn.Linear, 512, 512)``."""

    def __init__(self, cls: type[nn.Module], *args: Any, **kwargs: Any) -> None:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module class, got {cls!r}")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs

    @property
    def class_name(self) -> str:
        return self.cls.__name__

    def build(self) -> nn.Module:
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.class_name})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module every layer of the same ``key`` shares, on any stage (DeepSpeed's
    ``TiedLayerSpec``): built once on each rank that holds one of them, named
    ``tied.<key>.<parameter>`` there, and kept equal across stages ([Note: tied weights] in
    ``tied.py``). ``forward_fn(module, x)`` runs it where ``module(x)`` is not what
    the layer does, e.g. an output head ``lambda emb, x: x @ emb.weight.T``. Every parameter of
    the module is tied (DeepSpeed ties only ``tied_weight_attr`` and lets the others drift)."""

    def __init__(
        self,
        key: str,
        cls: type[nn.Module],
        *args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(cls, *args, **kwargs)
        self.key = key
        self.forward_fn = forward_fn

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.class_name})"


Layer = nn.Module | LayerSpec | Callable[[Any], Any]


class PipelineModule(nn.Module):
    """Layers run in order, split into pipeline stages by ``partition`` (``"measured"``,
    ``"parameters"``, ``"uniform"``, ``"type:REGEX"`` or a list of boundaries; see
    :mod:`longboat.pipeline.partition`).

    Args:
        layers: modules, :class:`LayerSpec` s, or functions without parameters
            (``lambda x: x.flatten(1)``), applied in order.
        partition: how to split them (DeepSpeed's ``partition_method``); the config's
            ``pipeline.partition`` overrides it when set. None: by measured cost when the
            layers can be measured, else by parameters.
        activation_checkpoint_interval: DeepSpeed's: each stage's layers, from its first, in
            runs of this many, each run recomputed in the backward as one checkpoint
            ([Note: checkpoint interval]); 0: none.
        checkpointable_layers: class names; a run is recomputed only when all its layers are
            of these classes (default: when one of its layers is a module with parameters).
        activation_checkpoint_func: ``func(run, *inputs)`` checkpoints a run (DeepSpeed's
            convention); default: ``torch.utils.checkpoint.checkpoint``, non-reentrant.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        partition: str | Sequence[int] | None = None,
        *,
        activation_checkpoint_interval: int = 0,
        checkpointable_layers: Sequence[str] | None = None,
        activation_checkpoint_func: Callable[..., Any] | None = None,
    ):
        super().__init__()
        interval = activation_checkpoint_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 0:
            raise ValueError(
                f"PipelineModule(activation_checkpoint_interval={interval!r}) must be a whole "
                "number of layers, 0 for none"
            )
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError(
                "PipelineModule(checkpointable_layers=...) must be a list of class names, got "
                f"{type(checkpointable_layers).__name__}"
            )
        self.activation_checkpoint_interval = interval
        self.checkpointable_layers = checkpointable_layers
        self.activation_checkpoint_func = activation_checkpoint_func
        if not layers:
            raise ValueError("PipelineModule needs at least one layer")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (nn.Module, LayerSpec)) or callable(layer)):
                raise TypeError(
                    f"PipelineModule layer {i} is a {type(layer).__name__}; give an nn.Module, "
                    "a LayerSpec or a function"
                )
        self._layers: list[Layer] = list(layers)
        self._specs: list[Layer] = list(layers)  # as given (bind replaces specs by modules)
        self.partition = partition
        self.bounds: list[int] = [0, len(layers)]
        self.held: list[int] = [0]  # stages this rank holds, in model order
        self._bound = False
        self._tied_keys = list(
            dict.fromkeys(x.key for x in self._layers if isinstance(x, TiedLayerSpec))
        )
        if self._tied_keys:  # first, so its weights take their names from it on every stage
            self.tied = nn.ModuleDict()
        for i, layer in enumerate(self._layers):
            if isinstance(layer, nn.Module):
                self.add_module(str(i), layer)

    def __len__(self) -> int:
        return len(self._layers)

    # -- partitioning --------------------------------------------------------------------------

    def layer_parameters(self) -> list[int]:
        """Trainable parameters of each layer (specs built on the meta device to count)."""
        out = []
        for layer in self._layers:
            if isinstance(layer, LayerSpec):
                with torch.device("meta"):
                    layer = layer.build()
            if isinstance(layer, nn.Module):
                out.append(sum(p.numel() for p in layer.parameters() if p.requires_grad))
            else:
                out.append(0)
        return out

    def layer_classes(self) -> list[str]:
        return [
            layer.class_name
            if isinstance(layer, LayerSpec)
            else type(layer).__name__
            if isinstance(layer, nn.Module)
            else getattr(layer, "__name__", type(layer).__name__)
            for layer in self._layers
        ]

    def boundaries(self, stages: int, method: str | Sequence[int] | None = None) -> list[int]:
        """The ``stages + 1`` boundaries ``method`` (default: this module's) chooses."""
        return self.plan(stages, method)[0]

    def stage_info(self, bounds: Sequence[int]) -> list[StageInfo]:
        return describe_stages(self.layer_parameters(), self.layer_classes(), bounds)

    def plan(
        self,
        stages: int,
        method: str | Sequence[int] | None = None,
        costs: LayerCosts | None = None,
        score: partitions.Score | None = None,
    ) -> tuple[list[int], list[StageInfo]]:
        """The boundaries ``method`` chooses (None: this module's) given the layers' measured
        ``costs`` if any (and a split's ``score`` under the run's schedule), and what each
        stage then holds (the layers counted once)."""
        params, classes = self.layer_parameters(), self.layer_classes()
        seconds = None if costs is None else costs.total_s
        bounds = partitions.partition(
            self.partition if method is None else method,
            stages,
            parameters=params,
            class_names=classes,
            seconds=seconds,
            score=score,
        )
        saved = None if costs is None else costs.activation_bytes
        return bounds, describe_stages(params, classes, bounds, seconds, saved)

    def runnable_layers(self) -> Iterator[Callable[[Any], Any]]:
        """Every layer as a callable, in order, before :meth:`bind`, for measuring: each spec
        is built as it is reached and dropped after (a tied key's module once, shared)."""
        if self._bound:
            raise RuntimeError("PipelineModule.runnable_layers() is for the unsplit module")
        tied: dict[str, nn.Module] = {}
        for layer in self._layers:
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in tied:
                    tied[layer.key] = layer.build()
                fn = layer.forward_fn
                module = tied[layer.key]
                yield module if fn is None else functools.partial(fn, module)
            elif isinstance(layer, LayerSpec):
                yield layer.build()
            else:
                yield layer

    def bind(
        self, bounds: Sequence[int], held: Sequence[int]
    ) -> list[tuple[Tie, nn.Parameter | None]]:
        """Keep the layers of stages ``held`` (of those ``bounds`` delimit), build their
        specs, and drop every other layer. Once only. Returns the weights tied across stages
        ([Note: tied weights] in ``tied.py``), with this rank's parameter for those
        it holds."""
        if self._bound:
            raise RuntimeError("PipelineModule.bind() was already called")
        self._bound = True
        self.bounds = list(bounds)
        self.held = sorted(held)
        stage_of = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
        names = {id(p): n for n, p in self.named_parameters()}
        params = {id(p): p for p in self.parameters()}
        tied = find_ties(
            [
                list(layer.parameters()) if isinstance(layer, nn.Module) else []
                for layer in self._layers
            ],
            stage_of,
            names,
        )
        mine = {i for s in self.held for i in range(self.bounds[s], self.bounds[s + 1])}
        # where a tied weight this rank holds is named: kept in place (names follow order)
        homes = {
            tie.name.split(".")[0]
            for tie in tied.values()
            if any(s in self.held for s in tie.stages)
        }
        for i, layer in enumerate(self._layers):
            if i not in mine:
                if str(i) in homes:
                    self._modules[str(i)] = Holder()
                elif str(i) in self._modules:
                    del self._modules[str(i)]
                continue
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied:
                    self.tied[layer.key] = self.build_layer(i, layer)
                module = self.tied[layer.key]
                fn = layer.forward_fn
                self._layers[i] = module if fn is None else functools.partial(fn, module)
            elif isinstance(layer, LayerSpec):
                built = self.build_layer(i, layer)
                self._layers[i] = built
                self.add_module(str(i), built)
        return self._spec_ties(stage_of) + place_ties(self, tied, params, list(names), self.held)

    def build_layer(self, index: int, spec: LayerSpec) -> nn.Module:
        """The module for layer ``index`` (a tied key's at its first use on this rank), made by
        :meth:`bind`: ``spec.build()``. A subclass may hand back one it made earlier."""
        del index  # which layer, for subclasses
        return spec.build()

    def build_all(self) -> None:
        """Build every spec: the whole model as one stage (without pipeline stages)."""
        if not self._bound:
            self.bind([0, len(self._layers)], [0])

    def _spec_ties(self, stage_of: Sequence[int]) -> list[tuple[Tie, nn.Parameter | None]]:
        """The ties of :class:`TiedLayerSpec` keys used on several stages: every parameter of
        the key's module, on every rank alike (a rank that holds none builds it on the meta
        device for the names)."""
        out: list[tuple[Tie, nn.Parameter | None]] = []
        for key in self._tied_keys:
            uses = [i for i, x in enumerate(self._specs) if getattr(x, "key", None) == key]
            stages = tuple(sorted({stage_of[i] for i in uses}))
            if len(stages) < 2:
                continue
            if key in self.tied:
                params = dict(self.tied[key].named_parameters())
                names = list(params)
            else:
                spec = self._specs[uses[0]]
                assert isinstance(spec, TiedLayerSpec)
                with torch.device("meta"):
                    names = [n for n, _ in spec.build().named_parameters()]
                params = {}
            for n in names:
                out.append((Tie(f"tied.{key}.{n}", stages), params.get(n)))
        return out

    # -- running -------------------------------------------------------------------------------

    def stage_layers(self, stage: int) -> list[Layer]:
        if stage not in self.held:
            raise ValueError(f"this rank holds stages {self.held}, not stage {stage}")
        return self._layers[self.bounds[stage] : self.bounds[stage + 1]]

    def forward(self, x: Any, stage: int | None = None) -> Any:
        """Run stage ``stage``'s layers on ``x`` (all layers when the module is not split)."""
        if stage is None:
            if len(self.held) != 1 or self.bounds != [0, len(self._layers)]:
                raise RuntimeError(
                    "this PipelineModule is split into stages: name the stage to run"
                )
            stage = self.held[0]
        layers = self.stage_layers(stage)
        for layer in layers:
            if isinstance(layer, LayerSpec):
                raise RuntimeError(f"{layer!r} is not built: call bind() first")
        n = self.activation_checkpoint_interval
        if n == 0 or not torch.is_grad_enabled():  # nothing to keep for a backward
            return _run(layers, x)
        for start in range(0, len(layers), n):
            run = layers[start : start + n]
            if not self._checkpointable(run):
                x = _run(run, x)
            elif self.activation_checkpoint_func is not None:
                fn = self.activation_checkpoint_func
                x = fn(
                    functools.partial(_run_unpacked, run), *(x if isinstance(x, tuple) else (x,))
                )
            else:
                x = checkpoint(functools.partial(_run, run), x, use_reentrant=False)
        return x

    # [Note: checkpoint interval] DeepSpeed's activation_checkpoint_interval = k cuts each
    # stage's layers, from the stage's first, into runs of k and checkpoints each run whose
    # layers qualify: only its input is kept from the forward, and the backward runs it again.
    # The runs start at each stage's first layer, so they depend on the partition, as in
    # DeepSpeed. Functions and tied layers with a forward_fn hold no parameters of their own
    # and alone do not make a run worth recomputing. A run holding BatchNorm is refused: the
    # recomputation would update its running statistics a second time (as recompute.py says).
    def _checkpointable(self, run: Sequence[Layer]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in run)
        mods = [f for f in run if isinstance(f, nn.Module)]
        if any(isinstance(s, nn.modules.batchnorm._BatchNorm) for m in mods for s in m.modules()):
            raise ValueError(
                "PipelineModule(activation_checkpoint_interval=...): a checkpointed run of layers "
                "holds BatchNorm, whose running statistics the recomputation would update twice; "
                "name the layers to checkpoint with checkpointable_layers=[...]"
            )
        return any(len(list(m.parameters())) > 0 for m in mods)


def _run(layers: Sequence[Layer], x: Any) -> Any:
    for layer in layers:
        assert not isinstance(layer, LayerSpec)  # forward() refuses unbuilt layers
        x = layer(x)
    return x


def _run_unpacked(layers: Sequence[Layer], *inputs: Any) -> Any:
    """A run called as DeepSpeed's checkpoint functions call it: one input unpacked."""
    return _run(layers, inputs[0] if len(inputs) == 1 else inputs)
