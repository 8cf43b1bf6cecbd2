"""DeepSpeed's ``deepspeed.checkpointing``: activation checkpointing called from a model's own
forward, ``deepspeed.checkpointing.checkpoint(layer, x)`` ([Note: DeepSpeed call sites] in
``deepspeed/__init__.py``).

[Note: DeepSpeed checkpointing] ``checkpoint(function, *args, **kwargs)`` runs ``function`` keeping
only its inputs and runs it again in the backward (``torch.utils.checkpoint``, non-reentrant,
random state preserved, so dropout draws the same mask twice): the gradients are those of the
plain call. ``configure(...)`` is process-wide in DeepSpeed (a Megatron model calls it once, then
``checkpoint`` from anywhere), so its settings live in this module too. What they mean here:
``checkpoint_in_cpu`` keeps the saved inputs in CPU memory until the backward
(``torch.autograd.graph.save_on_cpu``, as ``activation_checkpointing.cpu_checkpointing`` does,
[Note: cpu checkpointing] in ``longboat/recompute.py``); ``partition_activations`` splits them
over the model-parallel ranks of an ``mpu``, and without one (``mpu_`` is refused: longboat's
layout is the config's mesh) there is one such rank, so, as in DeepSpeed without an ``mpu``,
nothing is split; ``synchronize`` and ``profile`` time the calls and change no value. DeepSpeed's
rule that ``contiguous_checkpointing`` needs ``partition_activations`` and ``num_checkpoints`` is
kept, as a clear error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from longboat.config.errors import ConfigError
from longboat.config.loading import read_mapping


@dataclass
class _Settings:
    """What ``configure`` set (DeepSpeed's defaults until then)."""

    configured: bool = False
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


_settings = _Settings()  # process-wide, as DeepSpeed's configure() is: see the Note

# DeepSpeed config keys of ``activation_checkpointing`` and configure()'s names for them
_CONFIG_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}


def configure(
    mpu_: Any,
    deepspeed_config: str | Path | Mapping[str, Any] | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: settings from the config's
    ``activation_checkpointing`` block, then from the arguments given (they win), as DeepSpeed
    reads them; see [Note: DeepSpeed checkpointing] for their meaning here."""
    if mpu_ is not None:
        raise ConfigError(
            "deepspeed.checkpointing.configure(mpu_=...) is not supported: longboat lays out "
            "the ranks from the config's mesh section; pass None"
        )
    new = _Settings(configured=True)
    if deepspeed_config is not None:
        data = (
            read_mapping(deepspeed_config)
            if isinstance(deepspeed_config, (str, Path))
            else deepspeed_config
        )
        for key, value in dict(data.get("activation_checkpointing") or {}).items():
            if key in _CONFIG_KEYS:
                setattr(new, _CONFIG_KEYS[key], value)
    given = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    for name, value in given.items():
        if value is not None:
            setattr(new, name, value)
    if new.contiguous_checkpointing and not new.partition_activations:
        raise ConfigError(
            "deepspeed.checkpointing.configure(contiguous_checkpointing=True) needs "
            "partition_activations=True (activation_checkpointing.partition_activations), as "
            "in DeepSpeed"
        )
    if new.contiguous_checkpointing and new.num_checkpoints is None:
        raise ConfigError(
            "deepspeed.checkpointing.configure(contiguous_checkpointing=True) needs "
            "num_checkpoints=... (activation_checkpointing.number_checkpoints), as in DeepSpeed"
        )
    vars(_settings).update(vars(new))


def is_configured() -> bool:
    """Whether :func:`configure` was called (and not :func:`reset` since)."""
    return _settings.configured


def reset() -> None:
    """Back to DeepSpeed's defaults, unconfigured."""
    vars(_settings).update(vars(_Settings()))


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, its activations recomputed in the backward instead of
    kept (see [Note: DeepSpeed checkpointing])."""
    offload = (
        save_on_cpu(pin_memory=torch.cuda.is_available())
        if _settings.checkpoint_in_cpu
        else contextlib.nullcontext()
    )
    with offload:
        return _torch_checkpoint(function, *args, use_reentrant=False, **kwargs)


__all__ = ["checkpoint", "configure", "is_configured", "reset"]
