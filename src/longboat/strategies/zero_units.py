"""Which parameters form each flat unit of the ZeRO strategy.

Stages 1 and 2 cut the parameters into buckets of about ``zero.bucket_mb`` in reverse
registration order (as :mod:`longboat.comm.buckets` does), so gradient reductions start while
backward still runs. Stage 3 cuts along module boundaries: a unit is a module whose forward
gathers its parameters; the root module's unit holds everything no smaller unit claims.

[Note: shared parameters] A parameter used by modules of two different units (tied weights) is
given to the root unit, which stays gathered for the whole forward and backward, so every user of
the parameter sees its full value.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from longboat.comm.buckets import group_params
from longboat.config import ConfigError

_MIB = 1024 * 1024


def bucket_units(
    params: list[nn.Parameter], group_of: dict[int, int], bucket_mb: float
) -> list[list[nn.Parameter]]:
    """Stages 1-2: reverse-order buckets (:func:`~longboat.comm.buckets.group_params`), one
    param group, dtype and device each."""
    return group_params(
        params, int(bucket_mb * _MIB), key=lambda p: (group_of[id(p)], p.dtype, p.device)
    )


def _choose_modules(model: nn.Module, classes: Iterable[str], min_params: int) -> list[nn.Module]:
    classes = set(classes)
    names = {type(m).__name__ for m in model.modules()}
    unknown = classes - names
    if unknown:
        raise ConfigError(
            f"key 'zero.unit_classes' names {sorted(unknown)}, which the model does not have; "
            f"its module classes are {sorted(names)}"
        )
    chosen: list[nn.Module] = []

    def visit(m: nn.Module) -> int:
        # Post-order: a module's size counts only parameters not already claimed by a unit below.
        size = sum(visit(c) for c in m.children())
        size += sum(p.numel() for p in m.parameters(recurse=False))
        if m is model:
            return size
        if (type(m).__name__ in classes) if classes else size >= min_params:
            chosen.append(m)
            return 0
        return size

    visit(model)
    return chosen


def module_units(
    model: nn.Module, trainable: set[int], classes: Iterable[str], min_params: int
) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Stage 3: (module, its parameters) per unit, in forward registration order, root last."""
    modules = _choose_modules(model, classes, min_params)
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
