"""Deferred initialisation for ZeRO-3: a model built on the meta device, made unit by unit.

[Note: deferred init] A model whose parameters alone exceed a rank's memory cannot be built
whole and then sharded. Built under ``torch.device("meta")`` it takes no memory; ZeRO-3 then
makes each unit's parameters just before flattening the unit: every module that directly owns
one of them gets real (CPU) tensors in place of its meta ones (the same ``Parameter`` objects, so
the user's optimizer and tied weights still refer to them) and its ``reset_parameters()`` run,
as FSDP does for a module on the meta device without a ``param_init_fn``; rank 0's values are
then broadcast over the data-parallel group, so every rank holds the same model whatever its
random state. The unit keeps its shard and frees the rest before the next unit is made: setup
needs one unit's full parameters at a time, not the model's.

The values are those of each module's own ``reset_parameters()``, not of an initialisation the
model's constructor applies afterwards (such as GPT-2's N(0, 0.02)); a model that needs its own
should define ``reset_parameters()`` on the modules that own parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from longboat.comm.protocol import Comm
from longboat.config import ConfigError


@torch.no_grad()
def materialize(params: list[nn.Parameter], model: nn.Module, dp: Comm) -> None:
    """Make every module owning one of ``params`` real, initialised, and alike on all ranks."""
    wanted = {id(p) for p in params if p.is_meta}
    if not wanted:
        return
    names = {id(m): n or "the model" for n, m in model.named_modules()}
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if not any(id(p) in wanted for p in own):
            continue
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise ConfigError(
                f"module {names[id(module)]!r} ({type(module).__name__}) has parameters on the "
                "meta device and no reset_parameters() to initialise them with; define one, or "
                "build the model on a device"
            )
        for p in own:
            if p.is_meta:
                real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
                torch.utils.swap_tensors(p, real)
        reset()
        for p in own:
            dp.broadcast(p.data, src=0)
        wanted -= {id(p) for p in own}


def left_on_meta(model: nn.Module) -> None:
    """Refuse what ZeRO-3 does not make: frozen parameters and buffers on the meta device."""
    left = [n for n, p in model.named_parameters() if p.is_meta]
    left += [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise ConfigError(
            f"{', '.join(left[:5])}{' ...' if len(left) > 5 else ''} stayed on the meta device: "
            "ZeRO-3 makes the trainable parameters only (see [Note: deferred init] in "
            "longboat/strategies/zero_init.py); build frozen parameters and buffers on a device"
        )


__all__ = ["left_on_meta", "materialize"]
