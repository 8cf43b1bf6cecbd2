"""The configuration's sections: one frozen pydantic model per component, and :class:`Config`,
the whole configuration of a run.

The sections of the batch, the optimizer, the data and the checkpoints are here; the others are
grouped by what they say (:mod:`~longboat.config.sections_parallel`,
:mod:`~longboat.config.sections_compute`, :mod:`~longboat.config.sections_observe`) and are
importable from here too."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from longboat.config.sections_base import _Section
from longboat.config.sections_compute import (
    ActivationCheckpointingConfig,
    CompileConfig,
    PrecisionConfig,
)
from longboat.config.sections_observe import (
    LogConfig,
    MonitorConfig,
    ProfileConfig,
    SinkConfig,
    WandbConfig,
)
from longboat.config.sections_parallel import (
    CommConfig,
    CompressionConfig,
    MeshConfig,
    OffloadConfig,
    OffloadParamConfig,
    ParameterServerConfig,
    PipelineConfig,
    ReplicateConfig,
    TensorParallelConfig,
    ZeroConfig,
)

StrategyName = Literal["auto", "single", "replicate", "zero", "parameter_server"]


class BatchConfig(_Section):
    """The batch triple: give any two of the three (or only the micro-batch)."""

    train_batch_size: int | None = Field(None, gt=0, description="global samples per step")
    micro_batch_size: int | None = Field(None, gt=0, description="samples per rank per forward")
    gradient_accumulation_steps: int | None = Field(None, gt=0, description="micro-batches/step")


#: Optimizers longboat provides itself (``longboat.optim``), by the name a config gives them.
OWN_OPTIMIZERS = ("Lamb", "OneBitAdam", "OneBitLamb")
# Those that all-reduce their own momentum after a warm-up ([Note: self-reducing optimizer]).
SELF_REDUCING_OPTIMIZERS = ("OneBitAdam", "OneBitLamb")


class OptimizerConfig(_Section):
    """An optimizer for the engine to build when the user passes none (a ``torch.optim`` name,
    or one of ``OWN_OPTIMIZERS``)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(_Section):
    """An LR scheduler for the engine to build (``torch.optim.lr_scheduler`` name)."""

    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class DataConfig(_Section):
    """How :meth:`Engine.loader` shards and orders data."""

    shuffle: bool = True
    remainder: Literal["drop", "pad", "join"] = Field(
        "drop",
        description="samples that do not fill every rank in an epoch's last step: drop them, "
        "pad by repeating samples so every rank has as many batches, or join: each rank keeps "
        "the samples that fall to it, and a rank that runs out of batches first (here, or in "
        "your own iterable through engine.join) shadows the others' collectives with zero "
        "contributions until all are done, each micro-batch's gradient averaged over the ranks "
        "that had one ([Note: joining] in longboat/join.py)",
    )
    num_workers: int = Field(
        0, ge=0, description="worker processes loading batches (0: in the training process)"
    )
    prefetch_factor: int | None = Field(
        None, ge=1, description="batches each worker loads ahead (torch's default: 2)"
    )
    persistent_workers: bool = Field(
        False, description="keep the worker processes from one epoch to the next"
    )

    @model_validator(mode="after")
    def _workers_for_worker_options(self) -> DataConfig:
        for key in ("prefetch_factor", "persistent_workers"):
            if getattr(self, key) not in (None, False) and self.num_workers == 0:
                raise ValueError(
                    f"data.{key} needs worker processes: set data.num_workers to 1 or more, or "
                    f"remove data.{key}"
                )
        return self


class CheckpointConfig(_Section):
    """Checkpoints written by ``engine.save_checkpoint`` (see :mod:`longboat.checkpoint`)."""

    keep_last: int = Field(
        0,
        ge=0,
        description="keep only the newest K complete checkpoints of a directory "
        "(older ones are deleted after each save); 0 = keep all",
    )


class RecoveryConfig(_Section):
    """What a job does when one of its ranks dies (``docs/recovery.md``)."""

    in_job: bool = Field(
        False,
        description="under strategy 'replicate', the surviving ranks agree on a new membership "
        "through the launcher's store, rebuild their process groups and redo the failed step "
        "without the lost rank, from their in-memory state (no restart, no checkpoint read); "
        "under `longboat run --max-restarts K`, up to K replacements are started and taken in "
        "at a step boundary with a live replica's state (docs/recovery.md)",
    )
    wait_s: float = Field(
        30.0,
        gt=0,
        description="how long the survivors wait for each other before closing the new "
        "membership without the ranks that did not arrive (a rank the launcher saw die on "
        "this node is not waited for)",
    )


class Config(_Section):
    """The whole configuration of a run."""

    strategy: StrategyName = Field(
        "auto", description="auto = single for one process, replicate otherwise"
    )
    seed: int = 0
    gradient_clipping: float = Field(0.0, ge=0, description="max global grad norm; 0 = off")
    sync_batchnorm: bool = Field(
        False,
        description="batch norm statistics over every data-parallel rank's samples, on any "
        "device and under every strategy (longboat/sync_batchnorm.py)",
    )
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    replicate: ReplicateConfig = Field(default_factory=ReplicateConfig)
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    parameter_server: ParameterServerConfig = Field(default_factory=ParameterServerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig
    )
    compile: CompileConfig = Field(default_factory=CompileConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_switch(cls, value: Any) -> Any:
        """``compile = true`` (or false): the switch alone, the rest as default."""
        return {"enabled": value} if isinstance(value, bool) else value

    def service_ranks(self) -> int:
        """Ranks at the end of the world that serve instead of training (parameter servers,
        see ``longboat.ps.service``); the mesh covers the others."""
        return self.parameter_server.servers if self.strategy == "parameter_server" else 0

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel ranks at ``world_size``: ``mesh.dp``, or what ``mesh.pp`` and
        ``mesh.tp`` leave of the ranks that train (the full check of the mesh is
        ``longboat.mesh.Mesh.resolve``)."""
        m = self.mesh
        workers = world_size - self.service_ranks()
        return m.dp if m.dp is not None else max(workers // (m.pp * m.tp), 1)

    def resolved_strategy(self, world_size: int) -> str:
        """The strategy actually used at this world size."""
        if self.strategy == "auto":
            return "single" if world_size == 1 else "replicate"
        return self.strategy


__all__ = [
    "OWN_OPTIMIZERS",
    "SELF_REDUCING_OPTIMIZERS",
    "ActivationCheckpointingConfig",
    "BatchConfig",
    "CheckpointConfig",
    "CommConfig",
    "CompileConfig",
    "CompressionConfig",
    "Config",
    "DataConfig",
    "LogConfig",
    "MeshConfig",
    "MonitorConfig",
    "OffloadConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "ParameterServerConfig",
    "PipelineConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "RecoveryConfig",
    "ReplicateConfig",
    "SchedulerConfig",
    "SinkConfig",
    "StrategyName",
    "TensorParallelConfig",
    "WandbConfig",
    "ZeroConfig",
]
