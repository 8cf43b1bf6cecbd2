"""Where a rank's tensors live beside an accelerator: the model moved to the device (but what a
strategy places itself), and which tensors are in host memory, for whoever counts the
accelerator's memory without one (the planner).

[Note: planning host offload] ``longboat plan --device cuda`` runs the engine on fake CPU
tensors ([Note: fake tensors] in ``plan/simulate.py``), where every tensor is on the CPU. With
``zero.offload_optimizer.device = "cpu"`` a GPU rank keeps its masters, optimizer state and
gradient copies in host memory ([Note: host offload] in ``strategies/zero/host.py``), and the
GPU's peak is what the rest holds. So, while planning for an accelerator (:func:`accelerator`),
the model as built is counted in host memory (a model built on the CPU, which the engine then
moves: :func:`to_device` tells the counter what it would move, :func:`device_made`), ZeRO builds
the home a GPU rank would on the fake CPU rank (with its copies), the home tells each host
buffer it makes to the counter (:func:`host_made`), and the counter takes what operators make
from host buffers as host memory too (the optimizer's state and its step's temporaries). Outside
the planner nothing listens and nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Protocol

import torch
from torch import nn


class Counter(Protocol):
    """What counts a rank's memory by where it lives (the planner's
    :class:`~longboat.plan.tracker.LiveBytes`)."""

    def mark_host(self, t: torch.Tensor) -> None: ...

    def mark_device(self, t: torch.Tensor) -> None: ...


# Set only inside the planner's run, on its thread: None everywhere else.
_counter: ContextVar[Counter | None] = ContextVar("longboat_placement_counter", default=None)


@contextlib.contextmanager
def accelerator(counter: Counter) -> Iterator[None]:
    """Plan as on an accelerator: homes that keep state on the host are built, and ``counter``
    is told what is in host memory and what goes to the device."""
    token = _counter.set(counter)
    try:
        yield
    finally:
        _counter.reset(token)


def planning_for_accelerator() -> bool:
    """Whether the planner runs this rank as if it computed on an accelerator."""
    return _counter.get() is not None


def host_made(t: torch.Tensor) -> torch.Tensor:
    """``t`` is a host buffer beside the accelerator: tell the planner's counter, if any."""
    counter = _counter.get()
    if counter is not None:
        counter.mark_host(t)
    return t


def device_made(t: torch.Tensor) -> torch.Tensor:
    """``t`` went to the accelerator: tell the planner's counter, if any."""
    counter = _counter.get()
    if counter is not None:
        counter.mark_device(t)
    return t


def built_on_host(model: nn.Module) -> None:
    """The model as the user built it is in host memory (planning for an accelerator)."""
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            host_made(t)


def to_device(model: nn.Module, device: torch.device, keep_parameters: bool) -> None:
    """The model onto ``device``. Tensors on the meta device stay there (ZeRO-3 makes them
    where this rank computes, unit by unit: [Note: deferred init] in ``strategies/zero/init.py``;
    Module.to cannot copy them), and with ``keep_parameters`` the trainable parameters stay where
    the user built them, for the strategy to bring ([Note: placing parameters] in
    ``strategies/zero/init.py``). Planning for an accelerator on the CPU, what would move is
    counted on the device ([Note: planning host offload])."""

    def stays(t: torch.Tensor) -> bool:
        return t.is_meta or (keep_parameters and isinstance(t, nn.Parameter) and t.requires_grad)

    if device.type == "cpu":  # nothing moves; the planner's run counts what would
        if planning_for_accelerator():
            for t in [*model.parameters(), *model.buffers()]:
                if not stays(t):
                    device_made(t)
        return
    model._apply(lambda t: t if stays(t) else t.to(device))  # type: ignore[no-untyped-call]
