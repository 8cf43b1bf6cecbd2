"""Optimizers and LR schedulers named in the config.

``torch.optim`` and ``torch.optim.lr_scheduler`` names are used as they are; DeepSpeed's
``WarmupLR`` and ``WarmupDecayLR`` are provided too, so a DeepSpeed config keeps its schedule,
and so are ``Lamb`` (:mod:`longboat.optim.lamb`), DeepSpeed's FusedLamb, which torch lacks,
``OneBitAdam`` (:mod:`longboat.optim.onebit_adam`), DeepSpeed's 1-bit Adam, and ``OneBitLamb``
(:mod:`longboat.optim.onebit_lamb`), its 1-bit LAMB.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from longboat.config.errors import ConfigError
from longboat.config.sections import OWN_OPTIMIZERS, OptimizerConfig, SchedulerConfig
from longboat.optim.checks import (
    ELEMENTWISE_DECLARATION,
    ELEMENTWISE_OPTIMIZERS,
    check_parameters,
    describe_elementwise,
    has_step_hooks,
    is_elementwise,
    why_not_elementwise,
)
from longboat.optim.lamb import Lamb
from longboat.optim.onebit_adam import OneBitAdam
from longboat.optim.onebit_lamb import OneBitLamb

#: The optimizers longboat provides, by their config name (``OWN_OPTIMIZERS``).
OWN: dict[str, type[torch.optim.Optimizer]] = {
    "Lamb": Lamb,
    "OneBitAdam": OneBitAdam,
    "OneBitLamb": OneBitLamb,
}
assert set(OWN) == set(OWN_OPTIMIZERS)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimizerConfig
) -> torch.optim.Optimizer:
    """``torch.optim.<cfg.type>(params, **cfg.params)`` (or longboat's own of that name, see
    ``OWN``) with errors that name the key."""
    cls = OWN.get(cfg.type) or getattr(torch.optim, cfg.type, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = sorted(
            n
            for n in dir(torch.optim)
            if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
            and n != "Optimizer"
        )
        names = sorted([*names, *OWN])
        raise ConfigError(
            f"key 'optimizer.type' has unknown value {cfg.type!r}; choose one of {', '.join(names)}"
        )
    try:
        return cls(params, **cfg.params)
    except (TypeError, ValueError) as exc:
        where = "longboat.optim" if cfg.type in OWN else "torch.optim"
        raise ConfigError(
            f"key 'optimizer.params' = {cfg.params!r} does not fit {where}.{cfg.type}: {exc}"
        ) from None


def _warmup(iteration: int, warmup_steps: int, kind: str) -> float:
    """DeepSpeed's ``WarmupLR._get_gamma`` (deepspeed/runtime/lr_schedules.py) during warmup."""
    if iteration >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


_WARMUP_TYPES = ("log", "linear")


def _deepspeed_warmup(
    optimizer: torch.optim.Optimizer, p: dict[str, Any], decay: bool
) -> LRScheduler:
    lo = float(p.pop("warmup_min_lr", 0.0))
    hi = float(p.pop("warmup_max_lr", 0.001))
    n = max(int(p.pop("warmup_num_steps", 1000)), 2)
    kind = str(p.pop("warmup_type", "log"))
    total = int(p.pop("total_num_steps", 0)) if decay else 0
    p.pop("last_batch_iteration", None)
    if p:
        raise ConfigError(
            f"scheduler params {sorted(p)} are not known to "
            f"{'WarmupDecayLR' if decay else 'WarmupLR'}; remove them"
        )
    if kind not in _WARMUP_TYPES:
        # DeepSpeed's contract: a warning, and the logarithmic warm-up (lr_schedules.WarmupLR).
        logging.getLogger("longboat").warning(
            "scheduler.params.warmup_type = %r is neither 'log' nor 'linear': warming up "
            "logarithmically, as DeepSpeed does",
            kind,
        )
        kind = "log"
    if decay and total <= n:
        raise ConfigError(
            f"key 'scheduler.params.total_num_steps' = {total} must exceed warmup_num_steps = {n}"
        )
    for group in optimizer.param_groups:
        group["lr"] = hi  # LambdaLR scales the group's base lr

    # DeepSpeed's schedule starts at last_batch_iteration -1 (the optimizer at warmup_min_lr) and
    # its engine steps it after every optimizer step, so optimizer step k (from 1) runs at
    # iteration k - 2, the first two both at warmup_min_lr. LambdaLR counts from 0 at
    # construction: its count is DeepSpeed's iteration + 1.
    def factor(count: int) -> float:
        iteration = count - 1
        if iteration < 0:
            gamma = 0.0  # DeepSpeed's get_lr before the first step: the min lrs
        elif decay and iteration >= n:
            # WarmupDecayLR._get_gamma: linear from warmup_max_lr down to warmup_min_lr
            gamma = max(0.0, (total - iteration) / max(1.0, total - n))
        else:
            gamma = _warmup(iteration, n, kind)
        return (lo + (hi - lo) * gamma) / hi if hi else 0.0

    return LambdaLR(optimizer, factor)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig) -> LRScheduler:
    """A scheduler stepped once per optimizer step."""
    params = dict(cfg.params)
    if cfg.type in ("WarmupLR", "WarmupDecayLR"):
        return _deepspeed_warmup(optimizer, params, decay=cfg.type == "WarmupDecayLR")
    cls = getattr(torch.optim.lr_scheduler, cfg.type, None)
    if not (isinstance(cls, type) and issubclass(cls, LRScheduler)):
        raise ConfigError(
            f"key 'scheduler.type' has unknown value {cfg.type!r}; use a "
            "torch.optim.lr_scheduler class name, WarmupLR or WarmupDecayLR"
        )
    try:
        return cls(optimizer, **params)
    except TypeError as exc:
        raise ConfigError(
            f"key 'scheduler.params' = {cfg.params!r} does not fit "
            f"torch.optim.lr_scheduler.{cfg.type}: {exc}"
        ) from None


__all__ = [
    "ELEMENTWISE_DECLARATION",
    "ELEMENTWISE_OPTIMIZERS",
    "OWN",
    "Lamb",
    "OneBitAdam",
    "OneBitLamb",
    "build_optimizer",
    "build_scheduler",
    "check_parameters",
    "describe_elementwise",
    "has_step_hooks",
    "is_elementwise",
    "why_not_elementwise",
]
