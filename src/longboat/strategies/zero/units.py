"""Which parameters form each flat unit of the ZeRO strategy.

Stages 1 and 2 cut the parameters into buckets of about ``zero.bucket_mb`` in reverse
registration order (as :mod:`longboat.comm.buckets` does), so gradient reductions start while
backward still runs. Stage 3 cuts along module boundaries: a unit is a module whose forward
gathers its parameters; the root module's unit holds everything no smaller unit claims.

[Note: units run forward] A stage-3 unit's parameters are gathered by hooks on its module's
forward, so a unit must be a module whose forward is called. Containers (``nn.ModuleList``,
``nn.ModuleDict``) have no forward: their parent calls the children, so a container made a unit
would never be gathered (transformers' GPT-2 keeps its blocks in ``transformer.h``, a
``ModuleList``). The policy therefore never chooses a container and, like FSDP's size-based
policy, counts its parameters towards the unit around it; a ``Sequential`` whose children are
units has nothing left to hold and is not one either. By default the units are the repeated
blocks a model declares (transformers' ``_no_split_modules``, as Accelerate uses them), else
modules by size. A chosen module whose forward did not run in the first training forward (its
parameters read directly by another module, say) is named in an error at that forward
(``zero_gather``), rather than failing deep in torch on a parameter of shape [0].

[Note: shared parameters] A parameter used by modules of two different units (tied weights) is
given to the root unit, which stays gathered for the whole forward and backward, so every user of
the parameter sees its full value.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from longboat.comm.buckets import group_params
from longboat.config.errors import ConfigError

_MIB = 1024 * 1024


def bucket_units(
    params: list[nn.Parameter], group_of: dict[int, int], bucket_mb: float
) -> list[list[nn.Parameter]]:
    """Stages 1-2: reverse-order buckets (:func:`~longboat.comm.buckets.group_params`), one
    param group, dtype and device each."""
    return group_params(
        params, int(bucket_mb * _MIB), key=lambda p: (group_of[id(p)], p.dtype, p.device)
    )


def runs_forward(module: nn.Module) -> bool:
    """Whether ``module`` has a ``forward`` of its own. Containers (``ModuleList``,
    ``ModuleDict``, ``ParameterList``) have none: their parent calls their children (or reads
    their parameters) directly, so their own forward hooks never fire ([Note: units run
    forward])."""
    return type(module).forward is not nn.Module.forward


def declared_blocks(model: nn.Module) -> list[str]:
    """The repeated block classes a model declares and has: transformers' ``_no_split_modules``
    (``GPT2Block``, ``LlamaDecoderLayer``, ``BertLayer``, ...), from the model or any module in
    it (a user's model may wrap a transformers one)."""
    names = {type(m).__name__ for m in model.modules()}
    out: list[str] = []
    for m in model.modules():
        for c in getattr(m, "_no_split_modules", None) or ():
            if isinstance(c, str) and c in names and c not in out:
                out.append(c)
    return out


def choose_modules(
    model: nn.Module, classes: Iterable[str], min_params: int, by_size: bool = False
) -> list[nn.Module]:
    """The modules made stage-3 units, by the first of: the classes named in
    ``zero.unit_classes``; unless ``by_size`` (the user set ``zero.unit_min_params``), the block
    classes the model declares (:func:`declared_blocks`); size (each module with at least
    ``min_params`` parameters not claimed by a unit below it). Only modules that run forward are
    units ([Note: units run forward])."""
    classes = set(classes)
    names = {type(m).__name__ for m in model.modules()}
    unknown = classes - names
    if unknown:
        raise ConfigError(
            f"key 'zero.unit_classes' names {sorted(unknown)}, which the model does not have; "
            f"its module classes are {sorted(names)}"
        )
    containers = sorted(
        {type(m).__name__ for m in model.modules() if not runs_forward(m)} & classes
    )
    if containers:
        raise ConfigError(
            f"key 'zero.unit_classes' names {containers}, containers whose forward never runs "
            "(their parent calls each child), so their parameters would never be gathered; "
            "name the class of the blocks inside them instead"
        )
    if not classes and not by_size:
        classes = set(declared_blocks(model))
    chosen: list[nn.Module] = []

    def visit(m: nn.Module) -> int:
        # Post-order: a module's size counts only parameters not already claimed by a unit below.
        size = sum(visit(c) for c in m.children())
        size += sum(p.numel() for p in m.parameters(recurse=False))
        if m is model or not runs_forward(m):
            return size  # a container's parameters go up to the unit around it
        if (type(m).__name__ in classes) if classes else size >= min_params:
            chosen.append(m)
            return 0
        return size

    visit(model)
    return chosen


def module_units(
    model: nn.Module,
    trainable: set[int],
    classes: Iterable[str],
    min_params: int,
    by_size: bool = False,
) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Stage 3: (module, its parameters) per unit, in forward registration order, root last
    (units chosen by :func:`choose_modules`)."""
    modules = choose_modules(model, classes, min_params, by_size)
    unit_of: dict[int, int] = {id(m): i for i, m in enumerate(modules)}
    root = len(modules)
    owner: dict[int, int] = {}
    params: dict[int, nn.Parameter] = {}

    def visit(m: nn.Module, current: int) -> None:
        current = unit_of.get(id(m), current)
        for p in m.parameters(recurse=False):
            if id(p) not in trainable:
                continue
            params[id(p)] = p
            prev = owner.get(id(p))
            # See [Note: shared parameters].
            owner[id(p)] = current if prev in (None, current) else root
        for c in m.children():
            visit(c, current)

    visit(model, root)
    groups: list[list[nn.Parameter]] = [[] for _ in range(root + 1)]
    for pid, u in owner.items():
        groups[u].append(params[pid])
    return [(m, g) for m, g in zip([*modules, model], groups, strict=True) if g]
