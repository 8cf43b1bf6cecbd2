"""Wall-clock breakdown of a training step: data loading, forward, backward, waiting for
communication, optimizer, checkpointing, the monitors' own events, and the rest (the user's own
code between them).

[Note: breakdown accounting] A phase's time is measured around the engine call that runs it.
Time the rank spent blocked in collectives meanwhile (the doorway's ``blocked_seconds``) is
moved from that phase to ``comm``, so that the phases add up: per step, the sum of all phases
plus ``other`` is the step's wall time. A step runs from the end of the previous optimizer step
(or from the first timed call of the run) to the end of this one, so a checkpoint saved right
after ``step()`` counts in the next step, and so does the event the monitors reduce and
write at the end of a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

PHASES = ("data", "forward", "backward", "comm", "optimizer", "checkpoint", "monitor")
COLUMNS = (*PHASES, "other")


class Blocked(Protocol):
    """Anything with a running count of seconds blocked in communication (the doorway)."""

    @property
    def blocked_seconds(self) -> float: ...


class Breakdown:
    """Accumulates phase times of the current step; :meth:`end_step` closes it."""

    def __init__(
        self, comm: Blocked, clock: Callable[[], float] = time.perf_counter, sync_cuda: bool = False
    ) -> None:
        self.comm = comm
        self.clock = clock
        self.sync_cuda = sync_cuda
        self.current = dict.fromkeys(PHASES, 0.0)
        self._depth = 0  # a phase inside a phase (a save inside a step) counts once, outside
        self.step_start: float | None = None

    def start(self) -> None:
        """Mark the start of the first step (later steps start where the previous ended)."""
        if self.step_start is None:
            self.step_start = self.clock()

    @contextmanager
    def phase(self, name: str, split_waits: bool = True) -> Iterator[None]:
        """Time the enclosed engine work as phase ``name`` ([Note: breakdown accounting]);
        ``split_waits=False`` keeps its communication waits in it (the monitors' own events,
        so that their whole cost shows in one column)."""
        if self._depth:
            yield
            return
        self.start()
        self._depth += 1
        self._sync()
        t0, b0 = self.clock(), self.comm.blocked_seconds
        try:
            yield
        finally:
            self._sync()
            waited = self.comm.blocked_seconds - b0 if split_waits else 0.0
            self.current[name] += self.clock() - t0 - waited
            self.current["comm"] += waited
            self._depth -= 1

    def _sync(self) -> None:
        # Kernels run asynchronously: without a sync the time would land in a later phase.
        if self.sync_cuda:
            torch.cuda.synchronize()

    def end_step(self, now: float) -> dict[str, float]:
        """Close the step at time ``now``: its phase seconds, ``other`` and ``step``."""
        self.start()
        assert self.step_start is not None
        out = dict(self.current)
        out["step"] = now - self.step_start
        out["other"] = out["step"] - sum(self.current.values())
        self.current = dict.fromkeys(PHASES, 0.0)
        self.step_start = now
        return out
