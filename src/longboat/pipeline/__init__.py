"""Pipeline parallelism: a model's layers split into stages over the mesh's ``pp`` axis, and the
schedules (GPipe, 1F1B, interleaved, zero-bubble ZB-H1 and its interleaved form) that run a step's
micro-batches through them."""

from __future__ import annotations

import torch

from longboat.config.sections import PipelineConfig
from longboat.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec
from longboat.pipeline.partition import PartitionError, StageInfo
from longboat.pipeline.runtime import Pipeline
from longboat.pipeline.schedule import Schedule, Sequential
from longboat.pipeline.schedules import (
    Action,
    PipelineSchedule,
    ScheduleError,
    bubble_theory,
    zero_bubble_theory,
)
from longboat.pipeline.schedules import build as build_pipeline_schedule
from longboat.topology import Topology


def build_schedule(
    config: PipelineConfig,
    topology: Topology,
    device: torch.device,
    micro_batches: int | None = None,
) -> Schedule:
    """The engine's schedule: :class:`~.schedule.Sequential` without pipeline stages,
    else a :class:`Pipeline` over the ``pp`` axis, told the step's ``micro_batches`` if known
    (its measured split is then the one its schedule runs fastest). Schedule errors name the
    config keys."""
    if topology.mesh.pp == 1:  # virtual stages without stages are refused by the config
        return Sequential()
    pipe = Pipeline(
        config.schedule,
        config.virtual_stages,
        config.partition,
        topology,
        device,
        micro_batches,
    )
    return pipe


__all__ = [
    "Action",
    "LayerSpec",
    "PartitionError",
    "Pipeline",
    "PipelineModule",
    "PipelineSchedule",
    "ScheduleError",
    "StageInfo",
    "TiedLayerSpec",
    "bubble_theory",
    "build_pipeline_schedule",
    "build_schedule",
    "zero_bubble_theory",
]
