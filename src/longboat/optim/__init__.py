"""Optimizers and LR schedulers named in the config.

``torch.optim`` and ``torch.optim.lr_scheduler`` names are used as they are; DeepSpeed's
``WarmupLR`` and ``WarmupDecayLR`` are provided too, so a DeepSpeed config keeps its schedule,
and so are ``Lamb`` (:mod:`longboat.optim.lamb`), DeepSpeed's FusedLamb, which torch lacks,
``OneBitAdam`` (:mod:`longboat.optim.onebit_adam`), DeepSpeed's 1-bit Adam, and ``OneBitLamb``
(:mod:`longboat.optim.onebit_lamb`), its 1-bit LAMB.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from longboat.config.errors import ConfigError
from longboat.config.sections import OWN_OPTIMIZERS, OptimizerConfig, SchedulerConfig
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

# Optimizers whose update of each element depends on that element's own state alone: they can be
# applied to any slice of a parameter (ZeRO's shards) or to any subset of parameters
# (replicate's bucket-by-bucket overlap) and give exactly the unsharded update. Matched by exact
# class (see :func:`is_elementwise`): a subclass may add logic across elements or tensors.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
)

#: The class attribute by which an optimizer class declares itself element-wise.
ELEMENTWISE_DECLARATION = "longboat_elementwise"


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """True for an optimizer whose update of an element reads only that element's state and
    the tensor's own scalars (Adam's ``step``).

    Accepted: the exact classes of ``ELEMENTWISE_OPTIMIZERS``, or a class that declares
    ``longboat_elementwise = True`` (its author vouches for it). A subclass of ``AdamW`` is not
    accepted by inheritance, because it may add a global step (a norm over all tensors, say).
    """
    cls = type(optimizer)
    return cls in ELEMENTWISE_OPTIMIZERS or getattr(cls, ELEMENTWISE_DECLARATION, False) is True


def why_not_elementwise(optimizer: torch.optim.Optimizer) -> str:
    """Why ``optimizer`` is not element-wise: its class's own reason
    (``longboat_not_elementwise``) where it gives one."""
    reason = getattr(type(optimizer), "longboat_not_elementwise", None)
    return reason if isinstance(reason, str) else "it may couple elements of a tensor"


def describe_elementwise() -> str:
    """The accepted optimizers, for error messages."""
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    return f"{names} (exact classes), or a class that declares `{ELEMENTWISE_DECLARATION} = True`"


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """True when step pre- or post-hooks are registered on ``optimizer`` or globally.

    Such hooks must fire once per optimizer step, so a strategy that would call ``step()``
    several times per step (replicate's bucket-by-bucket overlap) steps once instead.
    """
    from torch.optim import optimizer as torch_optimizer

    registries = [
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_pre_hooks", None),
        getattr(torch_optimizer, "_global_optimizer_post_hooks", None),
    ]
    # Where a torch version keeps them elsewhere, assume there are some: stepping once is
    # always exact.
    return any(r is None or bool(r) for r in registries)


def check_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer and a model that disagree about what is trained.

    Every trainable parameter of the model must be in the optimizer, and every tensor in the
    optimizer must be a parameter of the model: strategies place gradients and optimizer state
    by the model's parameters, so either mismatch would train something other than what plain
    PyTorch trains. Raises :class:`ConfigError` naming the parameters.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    in_optim = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_optim]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ConfigError(
            f"{len(missing)} trainable parameter(s) of the model are not in the optimizer: "
            f"{shown}. Freeze them with p.requires_grad_(False), or build the optimizer from "
            "model.parameters() (or param groups that cover them)"
        )
    strangers = [
        tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in names
    ]
    if strangers:
        shown = ", ".join(str(s) for s in strangers[:8]) + (", ..." if len(strangers) > 8 else "")
        raise ConfigError(
            f"the optimizer holds {len(strangers)} tensor(s) that are not parameters of the "
            f"model (shapes {shown}); every rank places gradients and optimizer state by the "
            "model's parameters, so build the optimizer from model.parameters()"
        )


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


def _warmup(step: int, warmup_steps: int, kind: str) -> float:
    if step >= warmup_steps:
        return 1.0
    if kind == "log":
        return math.log(step + 1) / math.log(warmup_steps)
    return step / warmup_steps


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
    if decay and total <= n:
        raise ConfigError(
            f"key 'scheduler.params.total_num_steps' = {total} must exceed warmup_num_steps = {n}"
        )
    for group in optimizer.param_groups:
        group["lr"] = hi  # LambdaLR scales the group's base lr

    def factor(step: int) -> float:
        lr = lo + (hi - lo) * _warmup(step, n, kind)
        if decay and step >= n:
            lr = hi * max(0.0, (total - step) / (total - n))
        return lr / hi if hi else 0.0

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
