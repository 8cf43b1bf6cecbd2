"""The sections that say what a run reports: console output, step events and where they go (CSV,
TensorBoard, W&B), and the step profiler."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from longboat.config.sections_base import _Section


class LogConfig(_Section):
    """Console output."""

    progress: bool = True
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class SinkConfig(_Section):
    """A file monitor: it writes under ``output_path/job_name/`` on rank 0."""

    enabled: bool = False
    output_path: str = Field("runs", description="directory the job's folder is created in")
    job_name: str = Field("longboat", description="folder under output_path for this run")


class WandbConfig(_Section):
    """Weights & Biases: the step events as a W&B run (needs the optional ``wandb`` package)."""

    enabled: bool = False
    project: str = Field("longboat", description="the W&B project")
    job_name: str = Field("longboat", description="the run's name")
    group: str | None = Field(None, description="W&B group of runs")
    entity: str | None = Field(None, description="W&B team or user (DeepSpeed's 'team')")
    output_path: str = Field("runs", description="directory W&B writes its run folder under")
    mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: written to output_path only (`wandb sync` uploads it later); "
        "online: sent to the W&B server as well",
    )


class MonitorConfig(_Section):
    """Step events (loss, lr, loss scale, samples/s, tokens/s, step time) reduced across ranks
    and sent to the console, a CSV file, TensorBoard and W&B (see ``docs/monitoring.md``)."""

    every: int = Field(1, gt=0, description="optimizer steps between events")
    console: bool = Field(
        True,
        description="rank-0 progress bar (lines when piped); "
        "log.progress = false also turns it off",
    )
    total_steps: int | None = Field(
        None, gt=0, description="steps of the run, for the ETA; also engine.set_total_steps(n)"
    )
    csv: SinkConfig = Field(default_factory=SinkConfig)
    tensorboard: SinkConfig = Field(default_factory=SinkConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)


class ProfileConfig(_Section):
    """The step profiler: where a step's wall-clock time goes, and its flops."""

    wall_clock_breakdown: bool = Field(
        False,
        description="time data loading, forward, backward, communication wait, "
        "optimizer and checkpointing per step; a table at close()",
    )
    flops: bool = Field(
        False,
        description="count one step's flops (after a warm-up step) and "
        "report achieved flop/s beside a measured matmul rate",
    )
