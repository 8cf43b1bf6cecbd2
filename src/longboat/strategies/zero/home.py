"""What every home of ZeRO's unit state answers ([Note: homes] in ``homes.py``, where the homes
are). The reductions, the gathers and the step hold a :class:`Home` and call it; only the
strategy's set-up knows which one it built."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from longboat.pieces import RankState
from longboat.strategies.zero.flat import FlatUnit

if TYPE_CHECKING:  # gradients kept out of memory, named in a signature
    from longboat.grads import HeldGradients

StepUnit = Callable[[FlatUnit], None]


class Home(Protocol):
    """Where a rank's units keep their state between uses ([Note: homes])."""

    #: Gradient shards keep their memory between reductions: a reduction may land in one
    #: ([Note: reduce in place] in ``reduce.py``), and on one data-parallel rank gradients
    #: accumulate in it directly.
    grads_in_memory: bool
    #: Units step one by one, each with its state brought in around its step.
    steps_by_unit: bool
    #: Where the engine's close() hands the parameters back: None beside the compute (as they
    #: were given), else the device the home keeps them on (a model larger than the
    #: accelerator's memory comes back in host memory, [Note: host parameter offload]).
    hands_back_to: torch.device | None

    def adopt(self, u: FlatUnit) -> None:
        """Take a unit just built (setup goes one unit at a time)."""

    def start(self, optimizer: torch.optim.Optimizer) -> None:
        """Every unit built and the optimizer re-targeted at their pieces."""

    def bring_param(self, u: FlatUnit) -> None:
        """Stage 3: ``u``'s parameter shard into memory before its gather."""

    def param_ready(self, u: FlatUnit) -> None:
        """Stage 3: the compute stream reads ``u``'s parameter shard from here on (a copy
        :meth:`bring_param` started on a side stream is waited for here, not there, so that it
        runs under the compute queued before)."""

    def drop_param(self, u: FlatUnit) -> None:
        """Stage 3: out again once the gather is over."""

    def buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new flat buffer for one reduction of a unit (its full-size gradient, the shard it
        reduces into), contents undefined; the home takes it back when the reduction lands."""

    def launched(self, units: list[FlatUnit], index: int) -> None:
        """Unit ``index``'s reduction is on the wire."""

    def land(self, u: FlatUnit) -> None:
        """Wait for ``u``'s reduction; its result joins the gradient shard (stages 2-3, which
        then drop the full-size buffer) or becomes it (stage 1)."""

    def grad_pieces(self, u: FlatUnit) -> list[torch.Tensor]:
        """The optimizer's gradient views, one per piece of ``u``'s shard."""

    def local_gradients(self) -> list[torch.Tensor]:
        """The gradient shards in memory, for the norm."""

    def step(self, optimizer: torch.optim.Optimizer, step_unit: StepUnit) -> None:
        """``step_unit(u)`` for every unit, in order, its state brought in around it."""

    def stepped(self, u: FlatUnit, optimizer: torch.optim.Optimizer) -> None:
        """``u``'s pieces just stepped, before anything reads its parameter shard (stages 1-2
        all-gather it next)."""

    def step_over(self) -> None:
        """Every unit stepped: the gradient shards start the next step from zero."""

    def reading(
        self, optimizer: torch.optim.Optimizer
    ) -> contextlib.AbstractContextManager[Callable[[RankState], RankState]]:
        """Every unit's state where a checkpoint reads it; yields what makes the state read
        inside outlive the context."""

    def loading(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
        """Every unit's state where a checkpoint loads it, and home again after."""

    def held_gradients(self) -> HeldGradients | None:
        """Gradients kept out of device memory (on disk, or on the host beside an
        accelerator), for the engine's clipping."""

    @property
    def on_disk(self) -> dict[str, int]:
        """Bytes of model state on disk, per category."""

    @property
    def on_host(self) -> dict[str, int]:
        """Bytes of model state in host memory beside an accelerator ([Note: host offload]),
        by kind: a category of ``observe.memory.CATEGORIES`` held there instead of beside the
        parameters, or a host copy (``master_parameters``, ``gradient_copies``)."""

    @property
    def offloaded(self) -> dict[str, int] | None:
        """Bytes on disk, read and written so far; None without a disk."""

    def close(self) -> None:
        """Give back what the home holds (files, threads)."""
