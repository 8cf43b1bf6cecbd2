"""What ``longboat plan`` traces: a model, one micro-batch of example input, and a loss.

A model is named by a built-in name or by ``package.module:callable`` (called with the JSON
``--model-args`` as keyword arguments). Built-ins:

- ``reference-gpt``: :func:`longboat.models.reference_gpt`, token batches ``[B, seq_len]`` and
  :func:`~longboat.models.gpt_loss`;
- ``gpt``: :class:`longboat.models.GPT` with ``--model-args`` (e.g. ``{"d_model": 1024}``);
- ``digits-cnn``: :class:`longboat.models.DigitsCNN`, images ``[B, 1, 8, 8]``, cross entropy.

[Note: example input] For a user model the module that holds the callable describes its input
with ``example_input(model, micro_batch: int)``, returning the positional arguments of
``model(...)`` (a tensor or a tuple of tensors), and may define ``example_loss(output)``
returning a scalar; without it the loss is the mean of the output's first floating-point
tensor (the output itself, or the first in a tuple, a dict or a transformers output object:
the logits), in fp32 (a cross entropy would add about one more logits-sized buffer). Both
run on fake tensors, so ``torch.randint`` and friends allocate nothing there. A model
without ``example_input`` is refused by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from longboat.models import GPT, DigitsCNN, gpt_loss, reference_gpt

BUILTINS = ("reference-gpt", "gpt", "digits-cnn")


class PlanInputError(ValueError):
    """A model, its arguments or its input description cannot be used (a usage error)."""


@dataclass(frozen=True)
class Target:
    """How to build the model and one micro-batch, and which loss to take."""

    name: str
    build: Callable[[], nn.Module]
    example_input: Callable[[nn.Module, int], tuple[Any, ...]]
    loss: Callable[[Any, tuple[Any, ...]], torch.Tensor]


def _as_args(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def _gpt_input(seq_len: int | None) -> Callable[[nn.Module, int], tuple[Any, ...]]:
    def make(model: nn.Module, b: int) -> tuple[Any, ...]:
        most = cast(int, model.seq_len)  # a longboat.models.GPT's
        t = seq_len or most
        if t > most:
            raise PlanInputError(
                f"--seq-len {t} exceeds the model's seq_len {most}; give --seq-len {most} or less"
            )
        return (torch.zeros(b, t, dtype=torch.long),)

    return make


def _gpt_loss(out: Any, args: tuple[Any, ...]) -> torch.Tensor:
    return gpt_loss(out, args[0])  # the targets' shape and dtype are those of the input


def _cnn_loss(out: Any, _args: tuple[Any, ...]) -> torch.Tensor:
    return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long))


def first_float(out: Any) -> torch.Tensor | None:
    """The first floating-point tensor in ``out``: itself, or the first found in a tuple, a
    list or a mapping (a transformers output object is one, of the fields set: the logits
    before the cache), depth first; None if there is none."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, Mapping):
        items: Iterable[Any] = out.values()
    elif isinstance(out, (tuple, list)):
        items = out
    else:
        return None
    for item in items:
        found = first_float(item)
        if found is not None:
            return found
    return None


def _user(spec: str, kwargs: dict[str, Any]) -> Target:
    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise PlanInputError(
            f"--model {spec!r} is neither a built-in ({', '.join(BUILTINS)}) "
            "nor 'package.module:callable'"
        )
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise PlanInputError(
            f"--model {spec!r}: cannot import {mod_name!r} ({e}); is it on PYTHONPATH?"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PlanInputError(f"--model {spec!r}: module {mod_name!r} has no callable {attr!r}")
    example = getattr(module, "example_input", None)
    if not callable(example):
        raise PlanInputError(
            f"--model {spec!r}: module {mod_name!r} must define example_input(model, "
            "micro_batch) returning the arguments of one forward (see docs/plan.md)"
        )
    user_loss = getattr(module, "example_loss", None)

    def loss(out: Any, _args: tuple[Any, ...]) -> torch.Tensor:
        if callable(user_loss):
            value: torch.Tensor = user_loss(out)
            return value
        first = first_float(out)
        if first is None:
            raise TypeError(
                f"the model's output (a {type(out).__name__}) holds no floating-point tensor "
                f"to take a loss of: define example_loss(output) in {mod_name!r}"
            )
        return first.float().mean()

    return Target(spec, lambda: fn(**kwargs), lambda m, b: _as_args(example(m, b)), loss)


def resolve(
    spec: str, model_args: dict[str, Any] | None = None, seq_len: int | None = None
) -> Target:
    """The :class:`Target` named by ``spec`` (a built-in or ``package.module:callable``)."""
    kwargs = dict(model_args or {})
    if spec == "reference-gpt":
        if kwargs:
            raise PlanInputError(
                "--model reference-gpt takes no --model-args; use --model gpt "
                "with --model-args to change its dimensions"
            )
        return Target(spec, reference_gpt, _gpt_input(seq_len), _gpt_loss)
    if spec == "gpt":
        return Target(spec, lambda: GPT(**kwargs), _gpt_input(seq_len), _gpt_loss)
    if spec == "digits-cnn":
        if kwargs:
            raise PlanInputError("--model digits-cnn takes no --model-args")
        return Target(spec, DigitsCNN, lambda _m, b: (torch.zeros(b, 1, 8, 8),), _cnn_loss)
    return _user(spec, kwargs)


def whole_model_params(target: Target) -> int:
    """The trainable parameters of the whole model (tied ones once), built on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = target.build()
        return sum(p.numel() for p in dict.fromkeys(model.parameters()) if p.requires_grad)
