"""Step events and the step profiler, as the engine sees them: hooks around its calls, one
small collective at the steps that emit an event, sinks on rank 0, a table at the end.

Everything here is decided by the config alone, so every rank takes the same collectives at the
same steps. With no sink and no profiling the hooks return at once (and ``phase`` hands back one
shared do-nothing context), so turning diagnostics off costs nothing measurable.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from longboat.comm.protocol import Comm, Handle
from longboat.config.sections import Config, SinkConfig
from longboat.observe.breakdown import COLUMNS, Blocked, Breakdown
from longboat.observe.events import Sink, StepEvent, count_tokens
from longboat.observe.flops import StepFlops, matmul_rate
from longboat.observe.report import RunRecord, gather_summary, render
from longboat.observe.step_budget import StepBudget

# A piped console (``longboat run``) prints a line about this often, not every step.
LINE_EVERY = 50
_NULL = contextlib.nullcontext()


def _job_dir(sink: SinkConfig) -> Path:
    return Path(sink.output_path) / sink.job_name


class Monitor:
    """The engine's diagnostics: monitors (``monitor`` config) and profiler (``profile``)."""

    def __init__(
        self,
        config: Config,
        comm: Comm,
        blocked: Blocked,
        *,
        is_main: bool,
        train_batch_size: int,
        optimizer: torch.optim.Optimizer,
        loss_scale: Any,
        device: torch.device,
        extra: Any = None,
        extra_columns: tuple[str, ...] = (),
    ) -> None:
        mon, prof = config.monitor, config.profile
        # [Note: step budget]: a run asked by the environment to stop after N steps
        self.budget = StepBudget.from_env(
            comm.rank, config=config.model_dump(mode="json", exclude_unset=True)
        )
        # The strategy's own values for each event (a callable run on rank 0 only) and their
        # names, for the CSV's fixed columns.
        self._extra = extra if is_main else None
        self._extra_columns = list(extra_columns)
        self.comm = comm
        self.is_main = is_main
        self.train_batch_size = train_batch_size
        self.optimizer = optimizer
        self._loss_scale = loss_scale  # a callable: the fp16 scale now, or None without fp16
        self.total_steps = mon.total_steps
        self.every = mon.every
        console = mon.console and config.log.progress
        files = mon.csv.enabled or mon.tensorboard.enabled or mon.wandb.enabled
        self.files_every = mon.every if files else 0
        self.console_every = 0
        if console:
            # A bar redraws every event; piped lines come every LINE_EVERY steps. Every rank
            # must agree, so rank 0 says whether its console is a terminal.
            tty = torch.tensor([float(_stderr_is_tty())])
            comm.broadcast(tty, src=0)
            self.console_every = (
                mon.every if tty.item() else math.ceil(LINE_EVERY / mon.every) * mon.every
            )
        if mon.tensorboard.enabled:
            _require_tensorboard()  # on every rank, so that none waits for a failed rank 0
        if mon.wandb.enabled:
            _require_wandb()
        # Events travel on ``comm`` (the world's control plane); the breakdown counts the time
        # blocked in every doorway (``blocked``: the topology).
        self.breakdown = (
            Breakdown(blocked, sync_cuda=device.type == "cuda")
            if prof.wall_clock_breakdown
            else None
        )
        self.flops = StepFlops() if prof.flops else None
        self.peak_flops = matmul_rate(device) if prof.flops else None
        self.active = bool(self.files_every or self.console_every or self.breakdown or self.flops)
        self.sinks: list[tuple[Sink, int]] = []
        if is_main:
            self._open_sinks(config, console)
        # Per-rank records since the last event, and of the whole run (for the end table).
        self._t_last: float | None = None
        self._n = 0
        self._time = 0.0
        self._tokens = 0
        self._tokens_step = 0
        self._phases = dict.fromkeys(COLUMNS, 0.0)
        self.step_times: list[float] = []
        self.phase_totals = dict.fromkeys(COLUMNS, 0.0)
        self.first_phases = dict.fromkeys(COLUMNS, 0.0)
        self.summary: dict[str, Any] | None = None
        self._pending: _Pending | None = None
        self._log = logging.getLogger("longboat")

    def _open_sinks(self, config: Config, console: bool) -> None:
        mon = config.monitor
        if console:
            from longboat.observe.progress import ConsoleSink

            self.sinks.append((ConsoleSink(self.total_steps), self.console_every))
        columns = ["loss", "lr", "loss_scale", "samples_per_s", "tokens_per_s", "step_ms"]
        if self.breakdown is not None:
            columns += [f"{c}_ms" for c in COLUMNS]
        if self.flops is not None:
            columns += ["flops_per_step", "achieved_tflops_per_rank"]
        columns += self._extra_columns
        if mon.csv.enabled:
            from longboat.observe.csv_sink import CsvSink

            self.sinks.append((CsvSink(_job_dir(mon.csv), columns), self.files_every))
        if mon.tensorboard.enabled:
            from longboat.observe.tensorboard_sink import TensorBoardSink

            self.sinks.append((TensorBoardSink(_job_dir(mon.tensorboard)), self.files_every))
        if mon.wandb.enabled:
            from longboat.observe.wandb_sink import WandbSink

            self.sinks.append((WandbSink(mon.wandb, config.model_dump()), self.files_every))

    def regroup(self, comm: Comm, blocked: Blocked, train_batch_size: int) -> None:
        """Go on over ``comm`` after in-job recovery (``longboat/recovery/``): an event in
        flight on the old group is dropped, the steps since the last event count on. Rank 0
        stays the launch's rank 0 when it survives; when it does not, no rank writes the
        sinks from here on (said in the recovery's log line)."""
        self.comm = comm
        self.train_batch_size = train_batch_size
        self._pending = None
        if self.breakdown is not None:
            self.breakdown.comm = blocked

    def set_total_steps(self, total: int) -> None:
        """The run's length in optimizer steps, for the console's ETA."""
        self.total_steps = total
        for sink, _ in self.sinks:
            if hasattr(sink, "total"):
                sink.total = total

    # -- hooks ---------------------------------------------------------------------------------

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Time the enclosed engine work as ``name`` when the breakdown is on."""
        return _NULL if self.breakdown is None else self.breakdown.phase(name)

    def forward_begin(
        self, step_index: int, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        """Before a forward of the step with 0-based index ``step_index``."""
        if not self.active:
            return
        if self._t_last is None:
            self._t_last = time.perf_counter()
        self._tokens_step += count_tokens(args, kwargs)
        if self.flops is not None:
            self.flops.forward_begin(step_index)

    def step_end(self, step: int, loss: torch.Tensor | float | None) -> None:
        """After optimizer step number ``step`` (1-based); emits an event when one is due.
        A loss still on the device is read only when something needs it (the step budget, an
        event), so a step without an event does not wait for the device."""
        if self.budget is not None:
            loss = _read(loss)
            self.budget.step_end(loss)  # ends the process at the budget
        if not self.active:
            return
        now = time.perf_counter()
        if self.flops is not None:
            self.flops.step_end()
        if self.breakdown is not None:
            times = self.breakdown.end_step(now)
            seconds = times.pop("step")
            first = not self.step_times  # warm-up: kept apart from the end table's means
            for k, v in times.items():
                self._phases[k] += v
                (self.first_phases if first else self.phase_totals)[k] += v
        else:
            seconds = now - (self._t_last if self._t_last is not None else now)
        self._t_last = now
        self.step_times.append(seconds)
        self._n += 1
        self._time += seconds
        self._tokens += self._tokens_step
        self._tokens_step = 0
        due = [s for s, every in self.sinks if every and step % every == 0]
        emit = any(every and step % every == 0 for every in (self.files_every, self.console_every))
        if not (emit or self._pending):
            return
        with (
            _NULL if self.breakdown is None else self.breakdown.phase("monitor", split_waits=False)
        ):
            self._finish()
            if emit:
                self._pending = self._start_reduce(step, _read(loss), due)
                self._n, self._time, self._tokens = 0, 0.0, 0
                self._phases = dict.fromkeys(COLUMNS, 0.0)

    def _start_reduce(self, step: int, loss: float | None, due: list[Sink]) -> _Pending:
        """Start one asynchronous all-gather of each rank's numbers since the last event (every
        rank calls it). It completes behind the next step's work, and :meth:`_finish` then
        writes the event: sinks see each event one step late, and the training never waits
        for the monitors' communication."""
        n = max(self._n, 1)
        local = torch.tensor(
            [
                0.0 if loss is None else loss,
                # A rank without a loss (one that ran out of batches and shadowed the step,
                # [Note: joining] in join.py) is left out of the mean.
                float(loss is not None),
                self._time / n,
                self._tokens / n,
                *(v / n for v in self._phases.values()),
            ],
            dtype=torch.float64,
        )
        table = torch.empty(self.comm.world_size * local.numel(), dtype=torch.float64)
        handle = self.comm.all_gather(table, local, async_op=True)
        return _Pending(
            handle,
            local,
            table,
            step,
            due,
            float(self.optimizer.param_groups[0]["lr"]),
            self._loss_scale(),
            self._extra() if self._extra is not None else {},
        )

    def _finish(self) -> None:
        """Complete the event in flight, if any, and hand it to its sinks."""
        p, self._pending = self._pending, None
        if p is None:
            return
        p.handle.wait()
        table = p.table.view(self.comm.world_size, -1)
        step_s = max(float(table[:, 2].max()), 1e-12)
        tokens = float(table[:, 3].sum())
        per_rank = self.flops.per_rank if self.flops is not None else None
        # The mean over the ranks that had a loss (a rank that ran out of batches has none),
        # without boolean indexing: its data-dependent shape fails under the planner's fake
        # tensors.
        had = table[:, 1] > 0
        count = float(had.sum())
        loss_sum = float(torch.where(had, table[:, 0], torch.zeros_like(table[:, 0])).sum())
        event = StepEvent(
            step=p.step,
            loss=loss_sum / count if count else None,
            lr=p.lr,
            step_ms=step_s * 1e3,
            samples_per_s=self.train_batch_size / step_s,
            tokens_per_s=tokens / step_s if tokens else None,
            loss_scale=p.loss_scale,
            phases_ms=(
                {k: float(v) * 1e3 for k, v in zip(COLUMNS, table[:, 4:].mean(0), strict=True)}
                if self.breakdown is not None
                else {}
            ),
            flops_per_step=None if per_rank is None else per_rank * self.comm.world_size,
            achieved_tflops_per_rank=None if per_rank is None else per_rank / step_s / 1e12,
            extra=p.extra,
        )
        for sink in p.sinks:
            sink.write(event)

    # -- the end -------------------------------------------------------------------------------

    def close(self, gather: bool = True) -> dict[str, Any] | None:
        """Write the last event and close the sinks; with the profiler on and ``gather``, gather
        every rank's totals (a collective), print the table on rank 0 and return the summary
        (also kept as ``summary``). Without ``gather`` (at exit, [Note: leaving at exit] in
        ``engine/core.py``) no collective is made and no table printed."""
        self._finish()
        for sink, _ in self.sinks:
            sink.close()
        self.sinks = []
        if self.flops is not None:
            self.flops.close()
        if self.breakdown is None and self.flops is None:
            return None
        if not gather:
            if self.is_main:
                self._log.warning(
                    "the step profile's table is printed by engine.close(); this engine was "
                    "not closed before exit"
                )
            return None
        flops = self.flops.per_rank if self.flops is not None and self.flops.per_rank else 0
        self.summary = gather_summary(
            self.comm,
            RunRecord(
                self.step_times,
                self.phase_totals,
                self.first_phases,
                breakdown=self.breakdown is not None,
                flops=self.flops is not None,
                flops_per_rank=float(flops),
                peak_flops=self.peak_flops or 0.0,
            ),
        )
        if self.is_main and self.summary["steps"]:  # no table for a run that took no step
            render(self.summary)
        return self.summary


@dataclass
class _Pending:
    """An event whose all-gather is in flight."""

    handle: Handle
    local: torch.Tensor  # kept alive until the collective completes
    table: torch.Tensor
    step: int
    sinks: list[Sink]
    lr: float
    loss_scale: float | None
    extra: dict[str, float]


def _require_tensorboard() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        from longboat.observe.tensorboard_sink import MISSING

        raise ImportError(MISSING)


def _require_wandb() -> None:
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        from longboat.observe.wandb_sink import MISSING

        raise ImportError(MISSING)


def _stderr_is_tty() -> bool:
    import sys

    return sys.stderr.isatty()


def _read(loss: torch.Tensor | float | None) -> float | None:
    """The loss as a number on the host (a tensor is copied, waiting for the device)."""
    return float(loss) if isinstance(loss, torch.Tensor) else loss
