"""The TensorBoard monitor: scalars under ``output_path/job_name/`` through
``torch.utils.tensorboard.SummaryWriter`` (needs the optional ``tensorboard`` package)."""

from __future__ import annotations

from pathlib import Path

from longboat.observe.events import StepEvent

# Grouped the way TensorBoard shows them: training values, then time per phase, then flops.
_GROUP = {
    "loss": "train",
    "lr": "train",
    "loss_scale": "train",
    "samples_per_s": "throughput",
    "tokens_per_s": "throughput",
    "step_ms": "time",
    "flops_per_step": "flops",
    "achieved_tflops_per_rank": "flops",
}


MISSING = (
    "monitor.tensorboard.enabled = true needs the 'tensorboard' package, which is not "
    "installed: pip install 'longboat[tensorboard]' (or pip install tensorboard), or set "
    "monitor.tensorboard.enabled = false"
)


def tag(name: str) -> str:
    """The TensorBoard tag of an event value (``loss`` -> ``train/loss``)."""
    return f"{_GROUP.get(name, 'time')}/{name}"


class TensorBoardSink:
    """Writes every value of each event as a scalar at the event's step."""

    def __init__(self, directory: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(MISSING) from exc
        self.directory = Path(directory)
        self._writer = SummaryWriter(log_dir=str(self.directory))

    def write(self, event: StepEvent) -> None:
        for name, value in event.scalars().items():
            self._writer.add_scalar(tag(name), value, event.step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()
