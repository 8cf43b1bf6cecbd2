"""What an optimizer lets a strategy do with it: step slices of tensors (element-wise
optimizers), step several times per step (no step hooks), and whether it trains exactly the
model's trainable parameters. Light on purpose: strategies import it without importing
longboat's own optimizers."""

from __future__ import annotations

import torch

from longboat.config.compositions.rule import Facts
from longboat.config.errors import ConfigError
from longboat.optim.self_reducing import ReducesItself

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


def facts_of(
    optimizer: torch.optim.Optimizer,
    *,
    strategy: str | None = None,
    device: str | None = None,
    meta: bool | None = None,
    deferred_init: bool | None = None,
) -> Facts:
    """What the table of compositions ([Note: compositions] in ``config/compositions.py``)
    asks of ``optimizer``, with what the caller knows of the strategy and the model."""
    return Facts(
        strategy=strategy,
        device=device,
        meta=meta,
        deferred_init=deferred_init,
        optimizer=type(optimizer).__name__,
        elementwise=is_elementwise(optimizer),
        not_elementwise_why=why_not_elementwise(optimizer),
        elementwise_ones=describe_elementwise(),
        reduces_itself=isinstance(optimizer, ReducesItself),
        step_hooks=has_step_hooks(optimizer),
    )
