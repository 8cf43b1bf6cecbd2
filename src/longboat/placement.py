"""Which of a rank's tensors live in host memory beside an accelerator, for whoever counts the
accelerator's memory without one: the planner.

[Note: planning host offload] ``longboat plan --device cuda`` runs the engine on fake CPU
tensors ([Note: fake tensors] in ``plan/simulate.py``), where every tensor is on the CPU. With
``zero.offload_optimizer.device = "cpu"`` a GPU rank keeps its masters, optimizer state and
gradient copies in host memory ([Note: host offload] in ``strategies/zero/host.py``), and the
GPU's peak is what the rest holds. So, while planning for an accelerator (:func:`accelerator`),
ZeRO builds that home on the fake CPU rank (as on a GPU, with its copies), the home tells each
host buffer it makes to the planner's counter (:func:`host_made`), and the counter takes what
operators make from host buffers as host memory too (the optimizer's state and its step's
temporaries). Outside the planner nothing listens and nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

# Set only inside the planner's run, on its thread: None everywhere else.
_host_counter: ContextVar[Callable[[torch.Tensor], None] | None] = ContextVar(
    "longboat_host_counter", default=None
)


@contextlib.contextmanager
def accelerator(count_host: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Plan as on an accelerator: homes that keep state on the host are built, and each host
    buffer they make is handed to ``count_host``."""
    token = _host_counter.set(count_host)
    try:
        yield
    finally:
        _host_counter.reset(token)


def planning_for_accelerator() -> bool:
    """Whether the planner runs this rank as if it computed on an accelerator."""
    return _host_counter.get() is not None


def host_made(t: torch.Tensor) -> torch.Tensor:
    """``t`` is a host buffer beside the accelerator: tell the planner's counter, if any."""
    count = _host_counter.get()
    if count is not None:
        count(t)
    return t
