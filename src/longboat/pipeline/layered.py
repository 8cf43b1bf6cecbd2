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

[Note: layers in parts] A layer may also list its parts, ``(paths, callable, parts)`` with
``parts`` a sequence of ``(paths, callable)`` that, run in order, compute what the layer does
(the reference GPT's block: its attention half, then its MLP half). Stage boundaries count
these pieces (a whole layer, or a part of one), and the ``measured`` partition may cut between
two parts of a layer where whole layers cannot balance the stages: a GPT's head over its
vocabulary costs more than a block, so with whole blocks two stages of the reference GPT differ
by a third. The other methods cut between whole layers, as DeepSpeed does. A stage that holds
all of a layer's parts runs the layer itself, once, so that hooks on the layer's module (ZeRO-3
gathers its unit on its forward) fire once per micro-batch as without pipeline stages; a part
runs alone only on a stage that holds some of its layer. A split that cuts a layer is chosen
only where it is predicted :data:`CUT_MARGIN` (5%) faster than the best split between whole
layers: measured alone before training, the reference GPT's heavier stages ran 12-18% under
their cost in a training step, the head's the most, so that under 1F1B the cut the simulator
preferred ran 5% slower than whole layers (paired over 4 repeats,
``benchmarks/results/pipeline_parts_1f1b.json``), while under interleaved, where the predicted
gain is larger, the cut ran 11% faster (``pipeline_parts_c70cc21.json``). The parts must use the
layer's parameters, every one, and no others, so that each parameter lands on the stage of the
part that uses it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from longboat.pipeline import partition as partitions
from longboat.pipeline import transformers_layers
from longboat.pipeline.measure import LayerCosts
from longboat.pipeline.partition import StageInfo, describe_stages
from longboat.pipeline.tied import Tie, find_ties, place_ties

#: one part of a layer: the submodules it uses and what runs it
Part = tuple[tuple[str, ...], Callable[[Any], Any]]
#: a layer as the pipeline keeps it: its submodules, what runs it, and its parts (maybe none)
Entry = tuple[tuple[str, ...], Callable[[Any], Any], tuple[Part, ...]]


@dataclass(frozen=True)
class Piece:
    """What a stage boundary may fall between: a whole layer, or one part of a layer that lists
    its parts ([Note: layers in parts])."""

    layer: int  # its index in pipeline_layers()
    part: int | None  # None: the whole layer
    parts: int  # how many parts its layer has (1: listed whole)
    paths: tuple[str, ...]
    fn: Callable[[Any], Any]

    def label(self, end: bool) -> str:
        """How a stage's first (``end`` False) or last piece is named: ``3`` for layer 3 (or,
        first, for its first part; last, for its last), ``3b`` for its second part."""
        if self.part is None or self.part == (self.parts - 1 if end else 0):
            return str(self.layer)
        return f"{self.layer}{chr(ord('a') + self.part) if self.part < 26 else f'.{self.part}'}"


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
    # Any: what a model lists is checked here, entry by entry
    entries: list[Any] = list(listed()) if callable(listed) else transformers_layers.layers(model)
    if not entries:
        raise ValueError(f"{type(model).__name__}.pipeline_layers() returned no layers")
    out: list[Entry] = []
    for i, entry in enumerate(entries):
        where = f"{type(model).__name__}.pipeline_layers()[{i}]"
        if not _pair_like(entry, (2, 3)):
            raise TypeError(
                f"{where} must be (tuple of submodule paths, callable) or (paths, callable, parts)"
            )
        paths, fn = entry[0], entry[1]
        _check_pair(model, where, paths, fn)
        parts: tuple[Part, ...] = ()
        for j, part in enumerate(entry[2] if len(entry) == 3 else ()):
            if not _pair_like(part, (2,)):
                raise TypeError(f"{where}: part {j} must be (tuple of submodule paths, callable)")
            _check_pair(model, f"{where}, part {j}", *part)
            parts += ((tuple(part[0]), part[1]),)
        if parts:
            _check_parts_cover(model, where, paths, parts)
        out.append((tuple(paths), fn, parts))
    return out


def _pair_like(entry: Any, lengths: tuple[int, ...]) -> bool:
    """A tuple or list of one of ``lengths`` (a layer listed as a list works as before)."""
    return isinstance(entry, (tuple, list)) and len(entry) in lengths


def _check_pair(model: nn.Module, where: str, paths: Any, fn: Any) -> None:
    if not callable(fn) or isinstance(paths, str):
        raise TypeError(f"{where} must be (tuple of submodule paths, callable)")
    for path in paths:
        model.get_submodule(path)  # an unknown path fails here, naming it


def _params_of(model: nn.Module, paths: Sequence[str], names: dict[int, str]) -> dict[int, str]:
    return {id(p): names[id(p)] for path in paths for p in model.get_submodule(path).parameters()}


def _check_parts_cover(
    model: nn.Module, where: str, paths: Sequence[str], parts: Sequence[Part]
) -> None:
    # A stage that holds some of the parts keeps only their submodules: a parameter the whole
    # layer uses and no part lists would be on no stage.
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    whole = _params_of(model, paths, names)
    listed: dict[int, str] = {}
    for part_paths, _ in parts:
        listed.update(_params_of(model, part_paths, names))
    if set(whole) != set(listed):
        missing = sorted(whole[k] for k in set(whole) - set(listed))
        extra = sorted(listed[k] for k in set(listed) - set(whole))
        raise TypeError(
            f"{where}: its parts must use the layer's parameters, all of them and no others; "
            f"no part uses {missing}" + (f", and the parts also use {extra}" if extra else "")
        )


def pieces(model: nn.Module, entries: Sequence[Entry] | None = None) -> list[Piece]:
    """What a stage boundary may fall between, in order: each layer, or each of its parts where
    it lists them ([Note: layers in parts]); ``entries``: the model's, already checked."""
    return [
        piece
        for i, (paths, fn, parts) in enumerate(_entries(model) if entries is None else entries)
        for piece in (
            [Piece(i, j, len(parts), tuple(pp), pf) for j, (pp, pf) in enumerate(parts)]
            if parts
            else [Piece(i, None, 1, paths, fn)]
        )
    ]


def _trainable(model: nn.Module, paths: Sequence[str]) -> int:
    params = {
        id(p): p.numel()
        for path in paths
        for p in model.get_submodule(path).parameters()
        if p.requires_grad
    }
    return sum(params.values())


def _class_of(model: nn.Module, paths: Sequence[str], fn: Callable[[Any], Any]) -> str:
    name = type(model.get_submodule(paths[0])).__name__ if paths else ""
    return name or getattr(fn, "__name__", type(fn).__name__)


def plan(
    model: nn.Module,
    stages: int,
    method: str | Sequence[int] | None,
    costs: LayerCosts | None = None,
    score: partitions.Score | None = None,
) -> tuple[list[int], list[StageInfo]]:
    """The boundaries ``method`` chooses for ``model``'s pieces (given their measured
    ``costs``, if any, and a split's ``score`` under the run's schedule) and what each stage
    then holds (the layers counted once). Boundaries count pieces: a layer, or a part of one
    ([Note: layers in parts]); every method but ``measured`` splits between whole layers."""
    entries = _entries(model)
    split_pieces = pieces(model, entries)
    params = [_trainable(model, p.paths) for p in split_pieces]
    classes = [_class_of(model, *entries[p.layer][:2]) for p in split_pieces]
    timed = costs is not None and (
        method is None
        or (isinstance(method, str) and method.strip().lower() == partitions.MEASURED)
    )
    first = [i for i, p in enumerate(split_pieces) if p.part in (None, 0)] + [len(split_pieces)]
    if timed:
        assert costs is not None
        bounds = partitions.partition(
            method,
            stages,
            parameters=params,
            class_names=classes,
            seconds=costs.total_s,
            score=score,
        )
        bounds = _cut_only_if_worth_it(bounds, first, costs.total_s, stages, score)
    else:
        layer_bounds = partitions.partition(
            method,
            stages,
            parameters=[_trainable(model, paths) for paths, _, _ in entries],
            class_names=[_class_of(model, paths, fn) for paths, fn, _ in entries],
            seconds=None if costs is None else costs.total_s,
        )
        bounds = [first[b] for b in layer_bounds]
    seconds = None if costs is None else costs.total_s
    saved = None if costs is None else costs.activation_bytes
    named = [(p.layer, p.label(end=False), p.label(end=True)) for p in split_pieces]
    return bounds, describe_stages(params, classes, bounds, seconds, saved, named)


def boundaries(model: nn.Module, stages: int, method: str | Sequence[int] | None) -> list[int]:
    return plan(model, stages, method)[0]


def runnable_layers(model: nn.Module) -> list[Callable[[Any], Any]]:
    """The model's pieces as callables, in order, before :func:`split` (for measuring)."""
    return [p.fn for p in pieces(model)]


#: how much faster a split that cuts inside a layer must be predicted than the best split
#: between whole layers to be chosen ([Note: layers in parts])
CUT_MARGIN = 0.05


def _cut_only_if_worth_it(
    bounds: list[int],
    first: list[int],
    seconds: Sequence[float],
    stages: int,
    score: partitions.Score | None,
) -> list[int]:
    """``bounds`` (over pieces) where it cuts no layer or is predicted at least
    :data:`CUT_MARGIN` faster than the best split between whole layers (``first``: each layer's
    first piece, then the piece count), else that split."""
    layers = len(first) - 1
    if set(bounds) <= set(first) or layers < stages:
        return bounds

    def metric(b: list[int]) -> float:  # the predicted step, else the slowest stage
        if score is not None:
            return score(b)
        return max(sum(seconds[b[s] : b[s + 1]]) for s in range(len(b) - 1))

    per_layer = [sum(seconds[first[i] : first[i + 1]]) for i in range(layers)]
    whole = [
        first[b]
        for b in partitions.measured(per_layer, stages, lambda lb: metric([first[b] for b in lb]))
    ]
    return bounds if metric(bounds) < (1 - CUT_MARGIN) * metric(whole) else whole


def split(
    model: nn.Module, bounds: Sequence[int], held: Sequence[int]
) -> tuple[nn.Module, list[tuple[Tie, nn.Parameter | None]]]:
    """Keep the pieces of stages ``held`` (``bounds`` count pieces, :func:`plan`): other
    stages' submodules become placeholders and the model's forward becomes
    ``forward(x, stage)`` over this rank's layers, a layer whose parts are all on the stage
    run whole ([Note: layers in parts]). Returns ``model`` and every weight tied across stages
    ([Note: tied weights] in ``tied.py``), with this rank's parameter for those it holds (None
    for the others)."""
    entries = _entries(model)
    split_pieces = pieces(model, entries)
    stage_of = [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]
    names = {id(p): n for n, p in model.named_parameters()}
    params = {id(p): p for p in model.parameters()}
    piece_params = [
        [p for path in piece.paths for p in model.get_submodule(path).parameters()]
        for piece in split_pieces
    ]
    tied = find_ties(piece_params, stage_of, names)
    mine = {i for i in range(len(split_pieces)) if stage_of[i] in held}
    # What another stage holds: a layer none of whose pieces is here goes whole (its own
    # paths), as without parts; of a layer cut here, the parts held elsewhere.
    away: list[tuple[tuple[str, ...], int]] = []
    of_layer: list[list[int]] = [[] for _ in entries]  # each layer's pieces
    for i, piece in enumerate(split_pieces):
        of_layer[piece.layer].append(i)
    for (paths, _, _), at in zip(entries, of_layer, strict=True):
        if not mine & set(at):
            away.append((paths, stage_of[at[0]]))
        else:
            away.extend((split_pieces[i].paths, stage_of[i]) for i in at if i not in mine)
    kept = {path for i in mine for path in split_pieces[i].paths}
    kept |= {
        path
        for (paths, _, _), at in zip(entries, of_layer, strict=True)
        if all(i in mine for i in at)
        for path in paths
    }
    for paths, stage in away:
        for path in paths:
            if path in kept:  # a submodule a held layer also uses (e.g. a shared dropout)
                continue
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, Elsewhere(stage))
    out = place_ties(model, tied, params, list(names), held)
    layers = {
        s: _runs(split_pieces[bounds[s] : bounds[s + 1]], [fn for _, fn, _ in entries])
        for s in held
    }

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


def _runs(
    held: Sequence[Piece], whole: Sequence[Callable[[Any], Any]]
) -> list[Callable[[Any], Any]]:
    """A stage's callables: each of its pieces, the parts of a layer the stage holds all of
    replaced by the layer itself ([Note: layers in parts])."""
    out: list[Callable[[Any], Any]] = []
    i = 0
    while i < len(held):
        piece = held[i]
        if (
            piece.part == 0
            and i + piece.parts <= len(held)
            and all(held[i + j].layer == piece.layer for j in range(piece.parts))
        ):
            out.append(whole[piece.layer])
            i += piece.parts
        else:
            out.append(piece.fn)
            i += 1
    return out
