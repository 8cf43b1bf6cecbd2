"""Progress on rank 0: a live bar on a terminal, a plain line every few steps otherwise.

Under ``longboat run`` the output is prefixed and piped, where a redrawn bar would print
garbage, so a non-terminal gets periodic lines instead.
"""

from __future__ import annotations

import logging
import sys
import time

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


class StepProgress:
    """Reports step, loss and samples/s. Silent on every rank but the main one."""

    def __init__(self, enabled: bool, total: int | None = None, every: int = 50) -> None:
        self.enabled = enabled
        self.every = every
        self.total = total
        self._bar: Progress | None = None
        self._task = None
        self._t0 = time.perf_counter()
        self._samples = 0
        self._log = logging.getLogger("longboat")

    def _start_bar(self) -> None:
        self._bar = Progress(TextColumn("step {task.completed}"), BarColumn(),
                             TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                             transient=False)
        self._task = self._bar.add_task("train", total=self.total, info="")
        self._bar.start()

    def update(self, step: int, loss: float | None, samples: int) -> None:
        """Record that ``step`` finished after ``samples`` more samples."""
        if not self.enabled:
            return
        self._samples += samples
        rate = self._samples / max(time.perf_counter() - self._t0, 1e-9)
        info = f"loss {loss:.4f}  {rate:,.0f} samples/s" if loss is not None else (
            f"{rate:,.0f} samples/s")
        if sys.stderr.isatty():
            if self._bar is None:
                self._start_bar()
            assert self._bar is not None and self._task is not None
            self._bar.update(self._task, completed=step, info=info)
        elif step % self.every == 0:
            self._log.info("step %d  %s", step, info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
