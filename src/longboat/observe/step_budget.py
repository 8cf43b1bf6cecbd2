"""Stopping a run after a number of optimizer steps and reporting their times, when asked by
the environment: how ``longboat tune SCRIPT`` measures a user's script.

[Note: step budget] With ``LONGBOAT_MAX_STEPS=N`` set, every rank's engine ends the process
(``SystemExit(0)``, so the engine's exit handler closes it and leaves the group) right after its
``N``-th optimizer step; every rank counts the same steps, so all stop at the same one and no
collective is left waiting. With ``LONGBOAT_STEP_REPORT_DIR`` set too, each rank first writes
``rank<R>.json`` there: the wall time of each step (from the engine's construction to the first
step's end, then from step end to step end: the data loading, forward, backward and optimizer of
the script's own loop), each step's loss where the engine has one, the process's peak RSS, and
the config the engine ran (its keys set, as JSON), so that the caller can check that the run
took the config it was meant to.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MAX_STEPS_VAR = "LONGBOAT_MAX_STEPS"
REPORT_DIR_VAR = "LONGBOAT_STEP_REPORT_DIR"


class StepBudget:
    """Counts optimizer steps and their times; ends the process at the budget."""

    def __init__(
        self, steps: int, rank: int, report_dir: str | None, config: dict[str, Any] | None = None
    ) -> None:
        if steps < 1:
            raise ValueError(f"{MAX_STEPS_VAR}={steps}: give 1 or more steps, or unset it")
        self.steps, self.rank, self.report_dir = steps, rank, report_dir
        self.config = config or {}
        self.times: list[float] = []
        self.losses: list[float | None] = []
        self._last = time.perf_counter()

    @classmethod
    def from_env(
        cls,
        rank: int,
        environ: Mapping[str, str] = os.environ,
        config: dict[str, Any] | None = None,
    ) -> StepBudget | None:
        """The budget ``$LONGBOAT_MAX_STEPS`` asks for ([Note: step budget]), or None;
        ``config``: the run's, for the report."""
        text = environ.get(MAX_STEPS_VAR)
        if not text:
            return None
        try:
            steps = int(text)
        except ValueError:
            raise ValueError(f"{MAX_STEPS_VAR}={text!r} is not a whole number of steps") from None
        return cls(steps, rank, environ.get(REPORT_DIR_VAR) or None, config)

    def step_end(self, loss: float | None) -> None:
        """After an optimizer step: record it; at the budget, report and end the process."""
        now = time.perf_counter()
        self.times.append(now - self._last)
        self.losses.append(loss)
        self._last = now
        if len(self.times) < self.steps:
            return
        if self.report_dir:
            report = {
                "rank": self.rank,
                "step_times_s": self.times,
                "losses": self.losses,
                # ru_maxrss is in KiB on Linux
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "config": self.config,
            }
            path = Path(self.report_dir) / f"rank{self.rank}.json"
            path.write_text(json.dumps(report))
        raise SystemExit(0)
