"""The console monitor on rank 0: a live bar with an ETA on a terminal, a plain line every few
steps otherwise.

Under ``longboat run`` the output is prefixed and piped, where a redrawn bar would print
garbage, so a non-terminal gets periodic lines instead.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from longboat.observe.events import StepEvent


def describe(event: StepEvent) -> str:
    """The event as one short line of text."""
    parts = [] if event.loss is None else [f"loss {event.loss:.4f}"]
    parts.append(f"lr {event.lr:.3g}")
    if event.loss_scale is not None:
        parts.append(f"scale {event.loss_scale:g}")
    parts.append(f"{event.samples_per_s:,.0f} samples/s")
    if event.tokens_per_s is not None:
        parts.append(f"{event.tokens_per_s:,.0f} tokens/s")
    parts.append(f"{event.step_ms:.1f} ms/step")
    return "  ".join(parts)


class ConsoleSink:
    """Shows events on rank 0 (the monitor only creates it there)."""

    def __init__(self, total: int | None = None, tty: bool | None = None) -> None:
        self.total = total
        self.tty = sys.stderr.isatty() if tty is None else tty
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._log = logging.getLogger("longboat")

    def _start_bar(self) -> None:
        self._bar = Progress(
            TextColumn("step {task.completed}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._task = self._bar.add_task("train", total=self.total, info="")
        self._bar.start()

    def write(self, event: StepEvent) -> None:
        info = describe(event)
        if self.tty:
            if self._bar is None:
                self._start_bar()
            assert self._bar is not None and self._task is not None
            self._bar.update(self._task, completed=event.step, total=self.total, info=info)
            return
        if self.total:
            left = max(self.total - event.step, 0) * event.step_ms / 1000
            info += f"  ETA {timedelta(seconds=round(left))}"
        self._log.info("step %d%s  %s", event.step, f"/{self.total}" if self.total else "", info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def task_progress(console: Console) -> Progress:
    """A transient bar for a tool's phases (``longboat bench``, ``longboat tune``): what it does,
    how far, and the time so far."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
