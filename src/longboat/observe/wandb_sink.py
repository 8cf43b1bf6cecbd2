"""The Weights & Biases monitor: each event's values logged to a W&B run at the event's step,
under the same names as TensorBoard's (``train/loss``, ``throughput/samples_per_s``...).

Offline by default: the run is written under ``output_path`` (``wandb sync`` uploads it later),
so a job never waits on, or fails for, a network it was not asked to use. Needs the optional
``wandb`` package; a missing package is refused on every rank at ``initialize``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from longboat.config.sections import WandbConfig
from longboat.observe.events import StepEvent
from longboat.observe.tensorboard_sink import tag

MISSING = (
    "monitor.wandb.enabled = true needs the 'wandb' package, which is not installed: pip "
    "install 'longboat[wandb]' (or pip install wandb), or set monitor.wandb.enabled = false"
)


class WandbSink:
    """A W&B run, opened on rank 0; the run's config is longboat's config."""

    def __init__(self, cfg: WandbConfig, run_config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(MISSING) from exc
        self.directory = Path(cfg.output_path)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=cfg.project,
            name=cfg.job_name,
            group=cfg.group,
            entity=cfg.entity,
            dir=str(self.directory),
            mode=cfg.mode,
            config=run_config,
            # Our own console owns stdout; W&B's copy of it would double every line.
            settings=wandb.Settings(console="off", silent=True),
        )

    def write(self, event: StepEvent) -> None:
        self._run.log({tag(k): v for k, v in event.scalars().items()}, step=event.step)

    def close(self) -> None:
        self._run.finish()
